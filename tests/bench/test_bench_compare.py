"""`bench compare` end to end with stub servers started as subprocesses, plus the engines'
command lines."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from benchmarks.serving import servers
from benchmarks.serving.compare import RESTART_PASSES as PASSES
from benchmarks.serving.compare import CompareConfig, report, run_compare
from benchmarks.serving.servers import EngineSpec, ServerContext, ServerError, ServerProcess
from prefixserve.bench import cli as bench_cli
from prefixserve.bench.cli import main as bench_main
from prefixserve.bench.results import load_results
from tests.helpers import free_port
from tests.helpers.bench import byte_level_bpe
from tests.helpers.stub_openai import StubServer

STUB = Path(__file__).parents[1] / "helpers" / "stub_openai.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A directory holding only a tokenizer.json: all the harness reads from a model dir."""
    tok = byte_level_bpe(1)
    path = tmp_path_factory.mktemp("model")
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture
def stub_engines(monkeypatch):
    def stub_cmd(ctx: ServerContext) -> list[str]:
        return [sys.executable, str(STUB), "--port", str(ctx.port)]

    monkeypatch.setitem(
        servers.ENGINES,
        "stub",
        EngineSpec(
            "stub", stub_cmd, "tokens", extra_body={"ignore_eos": True}, startup_timeout_s=60
        ),
    )

    def store_cmd(ctx: ServerContext) -> list[str]:
        assert ctx.kv_store_dir is not None
        return [*stub_cmd(ctx), "--store", str(ctx.kv_store_dir)]

    monkeypatch.setitem(
        servers.ENGINES,
        "stub-store",
        EngineSpec("stub-store", store_cmd, "tokens", startup_timeout_s=60, uses_store=True),
    )
    monkeypatch.setitem(
        servers.ENGINES,
        "stub-hangs",
        EngineSpec(
            "stub-hangs",
            lambda ctx: [*store_cmd(ctx), "--ignore-sigint"],
            "tokens",
            startup_timeout_s=60,
            uses_store=True,
            stop_timeout_s=1.0,
        ),
    )
    monkeypatch.setitem(
        servers.ENGINES,
        "stub-text",
        EngineSpec("stub-text", stub_cmd, "text", min_tokens_equal_max=True, startup_timeout_s=60),
    )
    monkeypatch.setitem(
        servers.ENGINES,
        "dies",
        EngineSpec(
            "dies", lambda ctx: [*stub_cmd(ctx), "--die-after", "3"], "tokens", startup_timeout_s=60
        ),
    )
    for style in ("vllm", "prefixserve"):
        # a speculating engine: its command gets --speculative-config (which the stub, not
        # knowing it, is not given), and its /metrics has that engine's counters
        monkeypatch.setitem(
            servers.ENGINES,
            f"stub-{style}+ngram",
            EngineSpec(
                f"stub-{style}+ngram",
                lambda ctx, style=style: [*stub_cmd(ctx), "--spec-metrics", style],
                "tokens",
                startup_timeout_s=60,
                speculative=True,
            ),
        )
    monkeypatch.setitem(
        servers.ENGINES,
        "broken",
        EngineSpec(
            "broken",
            lambda ctx: [sys.executable, "-c", "print('boom'); raise SystemExit(3)"],
            "tokens",
            startup_timeout_s=60,
        ),
    )


def _config(tmp_path, model_dir, engines, workloads, concurrency, warmup) -> CompareConfig:
    """A comparison at scale 1/8 on a free port."""
    return CompareConfig(
        engines=engines,
        workloads=workloads,
        model_dir=model_dir,
        out_dir=tmp_path,
        concurrency=concurrency,
        scale=0.125,
        num_warmup=warmup,
        port=free_port(),
    )


def test_compare_runs_each_engine_and_writes_results_tables_and_figures(
    tmp_path, model_dir, stub_engines
):
    cfg = _config(tmp_path, model_dir, ["stub", "broken", "stub-text"], ["w1", "W2"], 4, 1)
    status = run_compare(cfg, progress=False)
    assert status["stub"] == "ok" and status["stub-text"] == "ok"
    assert "exited with 3" in status["broken"] and "boom" in status["broken"]
    for workload in ("W1", "W2"):
        for engine in ("stub", "stub-text"):
            data = json.loads((tmp_path / workload / f"{engine}.json").read_text())
            assert data["engine"] == engine and data["summary"]["num_failed"] == 0
            assert data["summary"]["num_requests"] == len(data["run"]["records"])
        assert not (tmp_path / workload / "broken.json").exists()
    assert (tmp_path / "logs" / "stub.log").read_text().startswith("$ ")
    text = report(tmp_path, ["W1", "W2", "W3"])
    assert "### W1" in text and "### W3" not in text
    assert (tmp_path / "W1.md").read_text().count("| stub") == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert sorted(summary) == ["W1", "W2"] and sorted(summary["W2"]) == ["stub", "stub-text"]
    png = (tmp_path / "W2.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) < 300_000
    results = load_results(tmp_path, "W1")
    assert [name for name, _, _ in results] == ["stub", "stub-text"]
    # W1 at this scale: 4 requests on 4 different prefixes, so the stub reports no hits
    assert results[0][1].hit_rate == 0.0


def test_a_server_that_dies_while_serving_fails_its_engine_and_keeps_no_results(
    tmp_path, model_dir, stub_engines
):
    cfg = CompareConfig(
        engines=["dies"],
        workloads=["W0"],
        model_dir=model_dir,
        out_dir=tmp_path,
        scale=0.125,
        num_warmup=0,
        port=free_port(),
    )
    status = run_compare(cfg, progress=False)
    assert "exited" in status["dies"] and "while serving" in status["dies"]
    assert not (tmp_path / "W0" / "dies.json").exists()


def test_bench_cli_report_rebuilds_tables_from_a_results_dir(
    tmp_path, model_dir, stub_engines, capsys
):
    cfg = CompareConfig(
        engines=["stub"],
        workloads=["W0"],
        model_dir=model_dir,
        out_dir=tmp_path,
        scale=0.0625,
        num_warmup=0,
        port=free_port(),
    )
    assert run_compare(cfg, progress=False) == {"stub": "ok"}
    (tmp_path / "W0.md").unlink(missing_ok=True)
    assert bench_main(["report", "--out", str(tmp_path), "--workloads", "W0"]) == 0
    assert "| stub |" in capsys.readouterr().out
    assert (tmp_path / "W0.md").exists() and (tmp_path / "W0.png").exists()


def test_bench_cli_run_drives_a_running_server_and_draws_figures_from_a_checkout(
    tmp_path, model_dir, monkeypatch, capsys
):
    with StubServer() as stub:
        argv = ["run", "--base-url", stub.base_url, "--model", str(model_dir), "--name", "stub"]
        argv += ["--workloads", "w1", "--scale", "0.125", "--concurrency", "2"]
        assert bench_main([*argv, "--out", str(tmp_path / "checkout")]) == 0
        # a plain install: no harness next to the package, so tables without figures
        monkeypatch.setattr(bench_cli, "checkout_root", lambda: None)
        assert bench_main([*argv, "--out", str(tmp_path / "plain")]) == 0
    out, err = capsys.readouterr()
    assert out.count("| stub |") == 2 and "no figures" in err
    for kind in ("checkout", "plain"):
        data = json.loads((tmp_path / kind / "W1" / "stub.json").read_text())
        assert data["engine"] == "stub" and data["summary"]["num_failed"] == 0
        assert data["summary"]["num_requests"] == 4
        assert (tmp_path / kind / "W1.md").exists() and (tmp_path / kind / "summary.json").exists()
    assert (tmp_path / "checkout" / "W1.png").exists()
    assert not (tmp_path / "plain" / "W1.png").exists()


def test_compare_config_names_bad_engines_and_workloads(tmp_path):
    with pytest.raises(ValueError, match="unknown engine 'tgi'"):
        CompareConfig(engines=["tgi"], workloads=["W0"], model_dir=tmp_path, out_dir=tmp_path)
    with pytest.raises(ValueError, match="W9"):
        CompareConfig(engines=["vllm"], workloads=["W9"], model_dir=tmp_path, out_dir=tmp_path)


def _ctx(tmp_path) -> ServerContext:
    return ServerContext(
        model_dir=tmp_path / "SmolLM2",
        gguf_path=tmp_path / "m.gguf",
        port=8123,
        threads=2,
        max_model_len=4096,
        kv_cache_gib=4,
    )


def test_vllm_serves_the_same_dir_with_prefix_caching_block_32_and_two_threads(tmp_path):
    spec = servers.get_engine("vllm")
    cmd = spec.command(_ctx(tmp_path))
    assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd
    assert cmd[cmd.index("--block-size") + 1] == "32"
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "SmolLM2")
    assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
    assert spec.env(_ctx(tmp_path))["OMP_NUM_THREADS"] == "2"


def test_vllm_dtype_is_passed_to_both_vllm_engines_and_a_bad_one_is_refused(tmp_path):
    ctx = _ctx(tmp_path)
    ctx.vllm_dtype = "float32"
    ctx.chat_template = servers.peer_tool_template(tmp_path)
    for name in ("vllm", "vllm-hermes+ngram"):
        cmd = servers.get_engine(name).command(ctx)
        assert cmd[cmd.index("--dtype") + 1] == "float32"
    with pytest.raises(ValueError, match="vllm_dtype"):
        CompareConfig(
            engines=["vllm"], workloads=["W1"], model_dir=tmp_path, out_dir=tmp_path,
            vllm_dtype="float16",
        )  # fmt: skip


def test_llama_cpp_keeps_streams_alive_and_ignores_eos_by_min_tokens(tmp_path):
    spec = servers.get_engine("llama.cpp")
    cmd = spec.command(_ctx(tmp_path))
    assert cmd[cmd.index("--interrupt_requests") + 1] == "False"
    assert cmd[cmd.index("--model") + 1] == str(tmp_path / "m.gguf")
    assert spec.prompt_format == "text" and spec.min_tokens_equal_max
    no_gguf = _ctx(tmp_path)
    no_gguf.gguf_path = None
    with pytest.raises(ValueError, match="GGUF"):
        spec.command(no_gguf)


def test_prefixserve_nocache_turns_prefix_caching_off(tmp_path):
    ram = servers.get_engine("prefixserve-ram").command(_ctx(tmp_path))
    off = servers.get_engine("prefixserve-nocache").command(_ctx(tmp_path))
    assert ram[-1] == "--no-kv-store" and "--no-enable-prefix-caching" not in ram
    assert off == [*ram[:-1], "--no-enable-prefix-caching", "--no-kv-store"]
    assert ram[ram.index("serve") + 1] == str(tmp_path / "SmolLM2")
    assert ram[ram.index("--block-size") + 1] == "16"


def test_prefixserve_keeps_its_disk_tier_where_the_harness_says(tmp_path):
    ctx = _ctx(tmp_path)
    ctx.kv_store_dir = tmp_path / "store"
    cmd = servers.get_engine("prefixserve").command(ctx)
    assert cmd[cmd.index("--kv-store-dir") + 1] == str(tmp_path / "store")
    assert "--no-kv-store" not in cmd
    assert servers.get_engine("prefixserve").uses_store
    # one client is one tenant: queued like vLLM queues, not refused past half the pool
    assert cmd[cmd.index("--max-tokens-per-tenant") + 1] == "0"
    assert not servers.get_engine("prefixserve-ram").uses_store


def test_kv_pool_tokens_gives_every_engine_the_same_tokens_in_its_own_blocks(tmp_path):
    ctx = _ctx(tmp_path)
    ctx.kv_pool_tokens = 6400
    ours = servers.get_engine("prefixserve").command(ctx)
    vllm = servers.get_engine("vllm").command(ctx)
    assert ours[ours.index("--num-kv-blocks") + 1] == "400" and "--kv-cache-memory-gb" not in ours
    assert vllm[vllm.index("--num-gpu-blocks-override") + 1] == "200"
    assert "--num-gpu-blocks-override" not in servers.get_engine("vllm").command(_ctx(tmp_path))
    with pytest.raises(ValueError, match="kv_pool_tokens"):
        CompareConfig(
            engines=["vllm"], workloads=["W4"], model_dir=tmp_path, out_dir=tmp_path,
            kv_pool_tokens=8,
        )  # fmt: skip


def test_w6_runs_cold_warm_and_after_a_restart_on_the_same_emptied_store(
    tmp_path, model_dir, stub_engines
):
    stale = tmp_path / "kv-store" / "stub-store-W6"
    stale.mkdir(parents=True)
    # what an earlier run left: the harness must empty it, or the cold pass would hit
    cfg = _config(tmp_path, model_dir, ["stub-store", "stub"], ["W6", "W1"], 2, 0)
    from prefixserve.bench.workloads import load_token_pool, make_workload

    pool, _, _ = load_token_pool(model_dir)
    w6 = make_workload("W6", pool, scale=0.125)
    lines = [json.dumps(r.prompt_token_ids[:end]) for r in w6.requests for end in (16, 32)]
    (stale / "blocks.jsonl").write_text("\n".join(lines) + "\n")
    assert run_compare(cfg, progress=False) == {"stub-store": "ok", "stub": "ok"}
    hits = {name: s.hit_rate for name, s, _ in load_results(tmp_path, "W6")}
    assert sorted(hits) == sorted(f"{e}@{p}" for e in ("stub", "stub-store") for p in PASSES)
    # 4 requests on 4 prefixes: nothing to hit on a cold cache; everything but each prompt's
    # last partial block on the same server; after a restart only what the store kept
    assert hits["stub-store@cold"] == 0.0 and hits["stub@cold"] == 0.0
    assert hits["stub-store@warm"] > 0.9 and hits["stub@warm"] > 0.9
    assert hits["stub-store@restart"] == hits["stub-store@warm"]
    assert hits["stub@restart"] == 0.0
    assert (tmp_path / "W1" / "stub-store.json").exists()
    assert not (tmp_path / "kv-store" / "stub-store-W6").exists()
    assert not (tmp_path / "kv-store" / "stub-store-main").exists()
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert "stub-store-W6-1.log" in logs and "stub-store-W6-2.log" in logs
    table = report(tmp_path, ["W6"])
    rows = [line.split(" |")[0].strip("| ") for line in table.splitlines() if "@" in line]
    assert rows == [f"{e}@{p}" for e in ("stub", "stub-store") for p in PASSES]


def test_no_restart_pass_after_a_server_that_had_to_be_killed(tmp_path, model_dir, stub_engines):
    cfg = _config(tmp_path, model_dir, ["stub-hangs"], ["W6"], 2, 0)
    status = run_compare(cfg, progress=False)
    assert "was killed" in status["stub-hangs"] and "partly written" in status["stub-hangs"]
    assert (tmp_path / "W6" / "stub-hangs@warm.json").exists()
    assert not (tmp_path / "W6" / "stub-hangs@restart.json").exists()
    assert not (tmp_path / "kv-store" / "stub-hangs-W6").exists()


def test_the_harness_empties_no_store_behind_a_symlink(tmp_path, model_dir, stub_engines):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "stub-store-W6").mkdir(parents=True)
    (elsewhere / "stub-store-W6" / "keep").write_text("x")
    out = tmp_path / "out"
    out.mkdir()
    (out / "kv-store").symlink_to(elsewhere)
    status = run_compare(_config(out, model_dir, ["stub-store"], ["W6"], 2, 0), progress=False)
    assert "symlink" in status["stub-store"]
    assert (elsewhere / "stub-store-W6" / "keep").exists()


def test_bench_run_refuses_the_restart_workload(tmp_path, model_dir, capsys):
    argv = ["run", "--base-url", "http://127.0.0.1:9", "--model", str(model_dir)]
    assert bench_main([*argv, "--workloads", "W1,W6", "--out", str(tmp_path)]) == 2
    assert "bench compare" in capsys.readouterr().err


def test_prefixserve_and_vllm_plan_steps_of_the_same_size(tmp_path):
    ours = servers.get_engine("prefixserve").command(_ctx(tmp_path))
    vllm = servers.get_engine("vllm").command(_ctx(tmp_path))
    for flag in ("--max-num-batched-tokens", "--max-num-seqs", "--max-model-len"):
        assert ours[ours.index(flag) + 1] == vllm[vllm.index(flag) + 1]


def test_a_missing_peer_install_says_which_script_makes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_PEERS_DIR", str(tmp_path / "nowhere"))
    spec = servers.get_engine("vllm")
    with pytest.raises(ServerError, match="setup_vllm_cpu.sh"):
        ServerProcess(spec, _ctx(tmp_path), tmp_path / "v.log").start()


def test_ngram_engines_are_their_base_engine_with_speculative_config(tmp_path):
    ctx = _ctx(tmp_path)
    for base in ("prefixserve", "prefixserve-ram", "prefixserve-nocache", "vllm"):
        spec = servers.get_engine(f"{base}+ngram")
        plain = servers.get_engine(base)
        assert spec.speculative and not plain.speculative
        assert spec.command(ctx) == [
            *plain.command(ctx),
            "--speculative-config",
            servers.DEFAULT_NGRAM_CONFIG,
        ]
        assert spec.env(ctx) == plain.env(ctx) and spec.prompt_format == plain.prompt_format
    assert json.loads(servers.DEFAULT_NGRAM_CONFIG) == {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_min": 2,
        "prompt_lookup_max": 5,
    }
    ctx.speculative_config = '{"method":"ngram","num_speculative_tokens":3}'
    for name in ("prefixserve+ngram", "vllm+ngram"):
        cmd = servers.get_engine(name).command(ctx)
        assert cmd[-2:] == ["--speculative-config", ctx.speculative_config]  # verbatim
    assert "llama.cpp+ngram" not in servers.ENGINES
    # the report lists each variant right after its engine
    names = list(servers.ENGINES)
    assert names.index("vllm+ngram") == names.index("vllm") + 1


def test_a_speculative_config_is_checked_and_wants_an_engine_that_speculates(tmp_path, capsys):
    def config(engines, text):
        return CompareConfig(
            engines=engines,
            workloads=["W7"],
            model_dir=tmp_path,
            out_dir=tmp_path,
            speculative_config=text,
        )

    good = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    assert config(["vllm", "vllm+ngram"], good).speculative_config == good
    with pytest.raises(ValueError, match="not valid JSON"):
        config(["vllm+ngram"], "{method: ngram}")
    with pytest.raises(ValueError, match="JSON object"):
        config(["vllm+ngram"], "[4]")
    with pytest.raises(ValueError, match="method must be one of ngram"):
        config(["vllm+ngram"], '{"method": "eagle", "num_speculative_tokens": 2}')
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        config(["vllm+ngram"], '{"method": "ngram", "num_speculative_tokens": 0}')
    with pytest.raises(ValueError, match=r"add .*prefixserve\+ngram.*vllm\+ngram"):
        config(["prefixserve", "vllm"], good)
    # the CLI says so and exits with 2, before starting anything
    argv = ["--engines", "vllm", "--model", str(tmp_path), "--out", str(tmp_path)]
    assert bench_main(["compare", *argv, "--speculative-config", good]) == 2
    assert "--speculative-config is for the engines that speculate" in capsys.readouterr().err


def test_compare_records_each_runs_acceptance_from_the_servers_metrics(
    tmp_path, model_dir, stub_engines
):
    engines = ["stub", "stub-vllm+ngram", "stub-prefixserve+ngram"]
    cfg = _config(tmp_path, model_dir, engines, ["W0", "W1"], 2, 1)
    cfg.scale = 0.0625  # W0: 4 requests x 16 tokens; W1: 4 requests x 16 tokens
    assert run_compare(cfg, progress=False) == dict.fromkeys(engines, "ok")
    for workload in ("W0", "W1"):
        plain = json.loads((tmp_path / workload / "stub.json").read_text())
        assert plain["spec_decode"] is None and plain["speculative_config"] is None
        for engine in engines[1:]:
            data = json.loads((tmp_path / workload / f"{engine}.json").read_text())
            assert data["speculative_config"] == json.loads(servers.DEFAULT_NGRAM_CONFIG)
            # this run's 64 tokens only: not the warm-up's, nor the workload's before it
            assert data["spec_decode"] == {
                "num_drafts": 64.0,
                "num_draft_tokens": 256.0,
                "num_accepted_tokens": 128.0,
                "acceptance_rate": 0.5,
                "mean_accepted_length": 3.0,
            }
            assert data["summary"]["acceptance_rate"] == 0.5
    table = report(tmp_path, ["W0", "W1"])
    assert "| accept rate | mean acc len |" in table
    rows = {
        line.split(" |")[0].strip("| "): line
        for line in (tmp_path / "W0.md").read_text().splitlines()
    }
    assert rows["stub"].endswith("| n/a | n/a |")
    assert rows["stub-vllm+ngram"].endswith("| 50.0% | 3.00 |")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["W1"]["stub-prefixserve+ngram"]["mean_accepted_length"] == 3.0
    for name in ("W0.png", "W0-spec.png", "W1-spec.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_speculation_figure_or_columns_without_acceptance(tmp_path, model_dir, stub_engines):
    cfg = _config(tmp_path, model_dir, ["stub"], ["W0"], 2, 0)
    cfg.scale = 0.0625
    assert run_compare(cfg, progress=False) == {"stub": "ok"}
    assert "accept rate" not in report(tmp_path, ["W0"])
    assert (tmp_path / "W0.png").exists() and not (tmp_path / "W0-spec.png").exists()


def test_bench_run_records_the_servers_acceptance_too(tmp_path, model_dir):
    with StubServer(spec_metrics="prefixserve") as stub:
        argv = ["run", "--base-url", stub.base_url, "--model", str(model_dir), "--name", "s"]
        argv += ["--workloads", "W0", "--scale", "0.0625", "--out", str(tmp_path)]
        assert bench_main(argv) == 0
    data = json.loads((tmp_path / "W0" / "s.json").read_text())
    assert data["spec_decode"]["num_draft_tokens"] == 4 * 64
    assert data["summary"]["mean_accepted_length"] == 3.0
    assert (tmp_path / "W0-spec.png").exists()


def test_figures_dir_gets_the_speculation_figure_too(tmp_path):
    from benchmarks.serving import cli

    out, figures = tmp_path / "out", tmp_path / "docs"
    out.mkdir()
    for name in ("W7.png", "W7-spec.png", "W0.png"):
        (out / name).write_bytes(b"png")
    cli._copy_figures(out, ["W0", "W7"], figures)
    assert sorted(p.name for p in figures.iterdir()) == [
        "serving_W0.png",
        "serving_W7.png",
        "serving_W7_spec.png",
    ]


def test_lora_adapters_are_served_alike_and_named_per_prompt_group(tmp_path):
    from benchmarks.serving.compare import _lora_setup
    from prefixserve.bench.client import EndpointConfig, build_body
    from prefixserve.bench.workload_types import BenchRequest, Workload
    from prefixserve.lora.adapter import load_adapter
    from prefixserve.model.loader.hf_config import model_config_from_hf
    from tests.helpers.models import hf_config

    model = tmp_path / "SmolLM2"
    model.mkdir()
    hf_config("llama").to_json_file(model / "config.json")
    cfg = CompareConfig(["prefixserve", "vllm"], ["W1"], model, tmp_path / "out", lora_adapters=2)
    workload = Workload(
        "W1", "", [BenchRequest(f"r{g}", [1, 2], 4, group=f"p{g}") for g in range(3)]
    )
    modules, group_models = _lora_setup(cfg, [workload])
    assert group_models == {"p0": "lora0", "p1": "lora1", "p2": "lora0"}
    config = model_config_from_hf(json.loads((model / "config.json").read_text()), "bfloat16")
    for name, path in modules.items():  # prefixserve's own loader takes them
        assert load_adapter(name, path, config, max_rank=16).rank == 16
    ctx = _ctx(tmp_path)
    ctx.lora_modules, ctx.group_models = modules, group_models
    flags = ["--lora-modules", *(f"{n}={p}" for n, p in modules.items()), "--max-loras", "2"]
    for engine in ("prefixserve", "vllm"):
        cmd = servers.get_engine(engine).command(ctx)
        start = cmd.index("--lora-modules")
        assert cmd[start : start + len(flags)] == flags
        assert ("--enable-lora" in cmd) == (engine == "vllm")
    with pytest.raises(ValueError, match="no LoRA adapters"):
        servers.get_engine("llama.cpp").command(ctx)
    endpoint = EndpointConfig("http://x", "base", group_models=group_models)
    assert [build_body(r, endpoint)["model"] for r in workload.requests] == [
        "lora0",
        "lora1",
        "lora0",
    ]
    assert build_body(BenchRequest("w", [1], 1), endpoint)["model"] == "base"
