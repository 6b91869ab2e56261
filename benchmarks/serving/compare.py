"""`prefixserve bench compare`: the chosen engines, one after another, on the same workloads.

For each engine: start its server, send warm-up requests (their own random tokens, sharing no
prefix with any workload), run each workload, write ``<out>/<workload>/<engine>.json``, stop the
server. W6 (restart) runs on a server lineage of its own: a fresh server on an empty disk tier
(pass ``cold``), the same server again (``warm``), then the server is stopped (gracefully: its
writer's queue is written) and started again on the same store (``restart``); the passes are
written as engines ``<engine>@cold``, ``<engine>@warm`` and ``<engine>@restart`` of W6. Engines
with a disk tier get a store directory under ``<out>/kv-store/`` emptied before each lineage and
removed after it. The ``+ngram`` engines are their base engine speculating with n-gram drafts
(``--speculative-config``, the same JSON for each); around every workload the harness scrapes the
server's /metrics, and the speculative-decoding counters over the run (drafts, draft tokens,
accepted tokens, where the server exports them) go into the result as ``spec_decode``, with the
acceptance rate and the mean accepted length. Then, for each workload, a markdown table
(``<out>/<workload>.md``) and a figure (``<out>/<workload>.png``; with speculation, also
``<out>/<workload>-spec.png``: output tokens/s and acceptance rate by engine) are made from every
engine result found in ``<out>/<workload>/``, so runs of different engines into the same
directory add up.

W9 (agents, prefixserve/bench/agent_workload.py) is not a list of requests but sessions that build
each turn from the server's answers: on each engine it runs after the other workloads, after one
more warm-up (a forced tool call under another system prompt), and its result
(``<out>/W9/<engine>.json``: per request TTFT, latency, prompt and cached tokens, the calls and
whether they parse; whether the server was still alive) has its own table and no figure. It needs
engines that serve tools: prefixserve's, ``vllm-hermes`` and ``llama-server``; the peers get
prefixserve's packaged tool template (``servers.peer_tool_template``), written under
``<out>/templates/``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.serving.plots import plot_workload
from benchmarks.serving.servers import (
    ENGINES,
    SPEC_SUFFIX,
    VLLM_DTYPES,
    EngineSpec,
    ServerContext,
    ServerError,
    ServerProcess,
    get_engine,
    parse_speculative_config,
    peer_tool_template,
    speculative_config_json,
)
from prefixserve.bench import results
from prefixserve.bench.agent_summary import result_payload
from prefixserve.bench.agent_workload import (
    AGENT_WORKLOADS,
    AgentConfig,
    run_agent_workload,
    warm_up,
)
from prefixserve.bench.client import EndpointConfig, RequestRecord, RunResult, run_workload
from prefixserve.bench.server_counters import (
    cluster_delta,
    scrape_cluster,
    scrape_spec_decode,
    spec_decode_delta,
)
from prefixserve.bench.summary import Summary, summarize
from prefixserve.bench.workloads import (
    RESTART_WORKLOADS,
    TEXT_WORKLOADS,
    WORKLOAD_NAMES,
    BenchRequest,
    Workload,
    load_text_encoder,
    load_token_pool,
    make_warmup,
    make_workload,
    prepend_tokens,
)


@dataclass(slots=True)
class CompareConfig:
    engines: list[str]
    workloads: list[str]
    model_dir: Path
    out_dir: Path
    gguf_path: Path | None = None
    concurrency: int | None = 8
    request_rate: float | None = None
    seed: int = 0
    scale: float = 1.0
    num_warmup: int = 4
    threads: int = 2
    port: int = 8765
    max_model_len: int = 4096
    kv_cache_gib: float = 2.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    kv_pool_tokens: int | None = None
    # `--speculative-config` JSON of the `+ngram` engines (None: servers.DEFAULT_NGRAM_CONFIG).
    speculative_config: str | None = None
    # Random LoRA adapters served by every engine, one per prompt group in turn (0: none).
    lora_adapters: int = 0
    lora_rank: int = 16
    # W9: agent sessions side by side, and tool turns per session.
    sessions: int = 8
    turns: int = 6
    strict_tools: bool = True
    # vLLM's --dtype (ServerContext.vllm_dtype).
    vllm_dtype: str = "bfloat16"

    @property
    def agent_workloads(self) -> list[str]:
        return [w for w in self.workloads if w.upper() in AGENT_WORKLOADS]

    def agent_config(self) -> AgentConfig:
        return AgentConfig(
            sessions=max(1, round(self.sessions * self.scale)),
            turns=self.turns,
            seed=self.seed,
            strict=self.strict_tools,
        )

    def __post_init__(self) -> None:
        for name in self.engines:
            get_engine(name)
        known = (*WORKLOAD_NAMES, *AGENT_WORKLOADS)
        bad = [w for w in self.workloads if w.upper() not in known]
        if bad:
            raise ValueError(f"unknown workload(s) {bad}; choose from {', '.join(known)}")
        self.workloads = [w.upper() for w in self.workloads]
        no_tools = [e for e in self.engines if not get_engine(e).serves_tools]
        if self.agent_workloads and no_tools:
            raise ValueError(
                f"W9 calls tools, which {', '.join(no_tools)} is not started to serve: use "
                "prefixserve's engines, vllm-hermes and llama-server"
            )
        if not self.engines:
            raise ValueError("choose at least one engine")
        if self.vllm_dtype not in VLLM_DTYPES:
            raise ValueError(f"vllm_dtype must be one of {VLLM_DTYPES}, got {self.vllm_dtype!r}")
        pool = self.kv_pool_tokens
        if pool is not None and (pool < 32 or pool % 32):
            # a multiple of both engines' block sizes (16 and vLLM's 32): the same tokens for each
            raise ValueError(f"kv_pool_tokens must be a positive multiple of 32, got {pool}")
        if self.speculative_config is not None:
            parse_speculative_config(self.speculative_config)
            if not any(get_engine(name).speculative for name in self.engines):
                raise ValueError(
                    "--speculative-config is for the engines that speculate: add "
                    f"{', '.join(n for n in ENGINES if n.endswith(SPEC_SUFFIX))} to --engines"
                )


def _machine() -> dict[str, Any]:
    import os

    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": sys.version.split()[0],
        # other work on the machine skews every number: recorded so a reader can tell
        "loadavg_1_5_15": list(os.getloadavg()),
    }


def _write_result(
    cfg: CompareConfig,
    workload: Workload,
    engine: str,
    server: ServerProcess,
    run: RunResult,
    label: str | None = None,
    spec_decode: dict[str, Any] | None = None,
    cluster: dict[str, Any] | None = None,
) -> Summary:
    """Write one run as `<out>/<workload>/<label or engine>.json`; `spec_decode` is the server's
    speculative-decoding counters over the run (`server_counters.spec_decode_delta`), `cluster`
    its replicas' and router's (`server_counters.cluster_delta`)."""
    label = label or engine
    summary = summarize(run.records, run.duration).with_spec_decode(spec_decode)
    speculative = server.spec.speculative
    payload = {
        "engine": label,
        "workload": workload.name,
        "description": workload.description,
        "seed": cfg.seed,
        "scale": cfg.scale,
        "command": server.command,
        "speculative_config": (
            json.loads(speculative_config_json(server.ctx)) if speculative else None
        ),
        "spec_decode": spec_decode,
        "cluster": cluster,
        "lora_group_models": dict(server.ctx.group_models),
        "startup_s": server.startup_s,
        "machine": _machine(),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "summary": summary.to_dict(),
        "run": run.to_dict(),
    }
    path = results.result_path(cfg.out_dir, workload.name, label)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    return summary


def report(out_dir: Path, workloads: Sequence[str]) -> str:
    """Write `<workload>.md` and `<workload>.png` for each workload, and `summary.json` (every
    engine's summary per workload); return all tables. Engines are in the registry's order."""
    order = [*ENGINES, *(f"{e}@{p}" for e in ENGINES for p in RESTART_PASSES)]
    return results.report(out_dir, workloads, order=order, plot=plot_workload)


def _run(
    endpoint: EndpointConfig, requests: list[BenchRequest], cfg: CompareConfig, bar: tqdm | None
) -> RunResult:
    def tick(_: RequestRecord) -> None:
        if bar is not None:
            bar.update(1)

    return asyncio.run(
        run_workload(
            requests,
            endpoint,
            concurrency=cfg.concurrency,
            request_rate=cfg.request_rate,
            seed=cfg.seed,
            on_done=tick,
        )
    )


def run_compare(cfg: CompareConfig, progress: bool = True) -> dict[str, str]:
    """Run every engine on every workload; return {engine: "ok" | error message}."""
    pool, decode, special_prefix = load_token_pool(cfg.model_dir)
    text = (
        load_text_encoder(cfg.model_dir)
        if any(n in TEXT_WORKLOADS for n in cfg.workloads)
        else None
    )
    workloads = [
        make_workload(n, pool, seed=cfg.seed, scale=cfg.scale, decode=decode, text=text)
        for n in cfg.workloads
        if n not in AGENT_WORKLOADS
    ]
    warmup = make_warmup(pool, n=cfg.num_warmup, seed=cfg.seed)
    for req in warmup:
        req.prompt_text = decode(req.prompt_token_ids)
    for reqs in [warmup, *(w.requests for w in workloads)]:
        prepend_tokens(reqs, special_prefix)
    agent_requests = cfg.agent_config().num_requests * len(cfg.agent_workloads)
    total = len(cfg.engines) * (_num_requests(workloads) + agent_requests)
    bar = tqdm(total=total, unit="req", disable=not progress, dynamic_ncols=True)
    status: dict[str, str] = {}
    ctx = ServerContext(
        model_dir=cfg.model_dir,
        gguf_path=cfg.gguf_path,
        port=cfg.port,
        threads=cfg.threads,
        max_model_len=cfg.max_model_len,
        kv_cache_gib=cfg.kv_cache_gib,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        kv_pool_tokens=cfg.kv_pool_tokens,
        speculative_config=cfg.speculative_config,
        vllm_dtype=cfg.vllm_dtype,
        chat_template=peer_tool_template(cfg.out_dir / "templates"),
        parallel=max(
            cfg.concurrency or 8, cfg.agent_config().sessions if cfg.agent_workloads else 1
        ),
    )
    if cfg.lora_adapters:
        ctx.lora_modules, ctx.group_models = _lora_setup(cfg, workloads)
        ctx.max_lora_rank = cfg.lora_rank
    try:
        for engine in cfg.engines:
            bar.set_description(f"{engine}: starting")
            done_before = bar.n
            try:
                _run_engine(engine, cfg, ctx, warmup, workloads, bar)
                status[engine] = "ok"
            except (ServerError, ValueError) as exc:
                status[engine] = str(exc)
                bar.write(f"{engine} failed: {exc}")
                bar.update(_num_requests(workloads) + agent_requests - (bar.n - done_before))
    finally:
        bar.close()
    return status


def _lora_setup(
    cfg: CompareConfig, workloads: Sequence[Workload]
) -> tuple[dict[str, str], dict[str, str]]:
    """Write `cfg.lora_adapters` random adapters for the model under the output directory; map
    each prompt group of the workloads to one of them, in turn."""
    from prefixserve.bench.lora_adapters import ALL_MODULES, write_random_adapter
    from prefixserve.model.loader.hf_config import model_config_from_hf
    from prefixserve.model.loader.hf_dir import read_hf_config

    config = model_config_from_hf(read_hf_config(cfg.model_dir), "bfloat16")
    modules = {
        f"lora{i}": str(
            write_random_adapter(
                cfg.out_dir / "lora-adapters" / f"lora{i}",
                config,
                rank=cfg.lora_rank,
                targets=ALL_MODULES,
                seed=i,
                base_model=cfg.model_dir.name,
            )
        )
        for i in range(cfg.lora_adapters)
    }
    names = list(modules)
    groups = sorted({r.group for w in workloads for r in w.requests if r.group is not None})
    return modules, {g: names[i % len(names)] for i, g in enumerate(groups)}


RESTART_PASSES = ("cold", "warm", "restart")


def _num_requests(workloads: Sequence[Workload]) -> int:
    """Requests one engine sends (a restart workload's in each of its passes)."""
    return sum(
        len(w.requests) * (len(RESTART_PASSES) if w.name in RESTART_WORKLOADS else 1)
        for w in workloads
    )


def _fresh_store(cfg: CompareConfig, ctx: ServerContext, engine: str, lineage: str) -> None:
    """Point `ctx` at an empty store directory for `engine`'s servers of `lineage` (or at none,
    for an engine without a disk tier)."""
    if not get_engine(engine).uses_store:
        ctx.kv_store_dir = None
        return
    root = cfg.out_dir / "kv-store"
    path = root / f"{engine}-{lineage}"
    if root.is_symlink() or path.is_symlink():
        raise ValueError(f"{path}: a symlink; the harness only empties directories of its own")
    if path.exists():
        shutil.rmtree(path)
    ctx.kv_store_dir = path


def _drop_store(ctx: ServerContext) -> None:
    if ctx.kv_store_dir is not None:
        shutil.rmtree(ctx.kv_store_dir, ignore_errors=True)
        ctx.kv_store_dir = None


@contextlib.contextmanager
def _shared_tier(spec: EngineSpec, ctx: ServerContext) -> Iterator[None]:
    """A fresh Valkey server for an engine with a shared tier (its URL in `ctx` while the engine
    runs), stopped by its PID after; nothing for the others."""
    if not spec.uses_remote:
        yield
        return
    from prefixserve.bench.valkey import ValkeyServer

    directory = Path(tempfile.mkdtemp(prefix="psvk-"))  # short: a unix socket's path is bounded
    server = ValkeyServer(directory)
    server.start("--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru")
    ctx.kv_remote_url = server.url
    ctx.kv_remote_key_file = server.key_file
    try:
        yield
    finally:
        ctx.kv_remote_url = None
        ctx.kv_remote_key_file = None
        server.stop()
        shutil.rmtree(directory, ignore_errors=True)


def _serve_and_run(
    engine: str,
    cfg: CompareConfig,
    ctx: ServerContext,
    warmup: list[BenchRequest],
    runs: Sequence[tuple[Workload, str]],
    log_name: str,
    bar: tqdm,
    agents: Sequence[str] = (),
) -> ServerProcess:
    """Start one server of `engine`, send the warm-up, then run each (workload, result label)
    in order on it and write its result, then each agent workload (`agents`); the server is
    stopped at the end (SIGINT, then SIGKILL past the engine's stop timeout) and returned."""
    spec = get_engine(engine)
    with (
        _shared_tier(spec, ctx),
        ServerProcess(spec, ctx, cfg.out_dir / "logs" / f"{log_name}.log") as server,
    ):
        endpoint = server.endpoint()
        bar.set_description(f"{engine}: warm-up")
        _run(endpoint, warmup, cfg, None)
        for workload, label in runs:
            bar.set_description(f"{label}: {workload.name}")
            # The server's counters are cumulative (warm-up, earlier workloads): the run's are
            # the difference of a scrape before it and one after it.
            before = scrape_spec_decode(server.base_url)
            cluster_before = scrape_cluster(server.base_url)
            run = _run(endpoint, workload.requests, cfg, bar)
            # A crashed server's "results" are not kept. Failed requests may be the crash
            # itself: then wait a moment for the process to be gone.
            failed = any(r.error for r in run.records)
            server.check_alive(grace_s=5.0 if failed else 0.0)
            spec_decode = spec_decode_delta(before, scrape_spec_decode(server.base_url))
            cluster = cluster_delta(cluster_before, scrape_cluster(server.base_url))
            _write_result(
                cfg,
                workload,
                engine,
                server,
                run,
                label=label,
                spec_decode=spec_decode,
                cluster=cluster,
            )
        for name in agents:
            _run_agent(engine, name, cfg, server, bar)
    return server


def _run_agent(
    engine: str, name: str, cfg: CompareConfig, server: ServerProcess, bar: tqdm
) -> None:
    """Run agent workload `name` on the started `server` and write its result; the server's
    death is a result too (`alive` false, with its log's last lines)."""
    config = cfg.agent_config()
    assert server.model_id is not None
    bar.set_description(f"{engine}: {name} warm-up")
    asyncio.run(warm_up(server.base_url, server.model_id))
    bar.set_description(f"{engine}: {name}")
    before = scrape_spec_decode(server.base_url)
    run = asyncio.run(
        run_agent_workload(
            server.base_url, server.model_id, config, on_done=lambda _: bar.update(1)
        )
    )
    spec_decode = spec_decode_delta(before, scrape_spec_decode(server.base_url))
    failed = any(r.error for r in run.records)
    try:
        server.check_alive(grace_s=5.0 if failed else 0.0)
        alive, death = True, None
    except ServerError as exc:
        alive, death = False, str(exc)
    payload = result_payload(
        engine,
        config,
        run,
        alive,
        command=server.command,
        server_died=death,
        startup_s=server.startup_s,
        machine=_machine(),
        finished_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        spec_decode=spec_decode,
    )
    path = results.result_path(cfg.out_dir, name, engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    if death is not None:
        raise ServerError(death)


def _run_engine(
    engine: str,
    cfg: CompareConfig,
    ctx: ServerContext,
    warmup: list[BenchRequest],
    workloads: Sequence[Workload],
    bar: tqdm,
) -> None:
    """Every workload on `engine`: the plain ones on one server, each restart workload on a
    lineage of two servers sharing one store."""
    plain = [w for w in workloads if w.name not in RESTART_WORKLOADS]
    try:
        if plain or cfg.agent_workloads:
            _fresh_store(cfg, ctx, engine, "main")
            _serve_and_run(
                engine,
                cfg,
                ctx,
                warmup,
                [(w, engine) for w in plain],
                engine,
                bar,
                agents=cfg.agent_workloads,
            )
            _drop_store(ctx)
        for w in workloads:
            if w.name not in RESTART_WORKLOADS:
                continue
            _fresh_store(cfg, ctx, engine, w.name)
            first = [(w, f"{engine}@cold"), (w, f"{engine}@warm")]
            server = _serve_and_run(engine, cfg, ctx, warmup, first, f"{engine}-{w.name}-1", bar)
            if server.killed:
                raise ServerError(
                    f"{engine} did not stop within {server.spec.stop_timeout_s:.0f} s of SIGINT "
                    f"and was killed: its store may be partly written, so no {w.name} restart "
                    f"pass (log {server.log_path})"
                )
            again = [(w, f"{engine}@restart")]
            _serve_and_run(engine, cfg, ctx, warmup, again, f"{engine}-{w.name}-2", bar)
            _drop_store(ctx)
    finally:
        _drop_store(ctx)
