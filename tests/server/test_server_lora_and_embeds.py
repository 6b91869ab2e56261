"""LoRA adapters and prompt embeddings over HTTP: `model` selects an adapter, /v1/models lists
each with its parent, the operator loads and unloads adapters at run time (tenants may not),
caches stay apart per adapter, and `prompt_embeds` (base64 torch.save bytes) give the token ids'
output while every malformed tensor is a 400 that leaves the engine serving."""

from __future__ import annotations

import base64
import io
import json
import threading
import zipfile
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from prefixserve import cli
from prefixserve.bench.lora_adapters import write_random_adapter
from prefixserve.config import CacheConfig, EngineConfig, LoRAConfig
from prefixserve.engine.async_llm import AsyncLLMEngine
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.auth import ApiKeys
from tests.helpers import random_tokens
from tests.helpers.server import (
    KEY_ADMIN,
    KEY_ALPHA,
    KEY_BETA,
    MODEL_NAME,
    LiveServer,
    serve_in_thread,
)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, default_model_fp32):
    root = tmp_path_factory.mktemp("adapters")
    config = default_model_fp32.config
    return {
        "sql": write_random_adapter(root / "sql", config, rank=4, seed=1),
        "poet": write_random_adapter(
            root / "poet", config, rank=8, targets=("o_proj", "down_proj"), seed=2, std=0.1
        ),
        "late": write_random_adapter(root / "late", config, rank=2, seed=3),
    }


@pytest.fixture(scope="module")
def live(adapters, default_model_fp32):
    config = EngineConfig(
        dtype="float32",
        max_model_len=512,
        cache=CacheConfig(num_kv_blocks=160),
        lora=LoRAConfig(max_loras=3, max_lora_rank=8),
        enable_prompt_embeds=True,
    )
    engine = LLMEngine(config, loaded_model=default_model_fp32)
    modules = {name: str(adapters[name]) for name in ("sql", "poet")}
    for name, path in modules.items():
        engine.load_lora_adapter(name, path)
    async_engine = AsyncLLMEngine(engine, log_stats_interval_s=None)
    async_engine.start()
    keys = ApiKeys()
    keys.add(KEY_ALPHA, "alpha")
    keys.add(KEY_BETA, "beta")
    keys.add_admin(KEY_ADMIN, "ops")
    app = build_app(async_engine, [MODEL_NAME], api_keys=keys, lora_modules=modules)
    server, thread, url = serve_in_thread(app)
    yield LiveServer(url=url, api_key=KEY_ALPHA, engine=async_engine)
    server.should_exit = True
    thread.join(timeout=30)
    async_engine.shutdown()


def complete(
    live: LiveServer, model: str, prompt, max_tokens: int = 8, key: str | None = None, **extra
) -> httpx.Response:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body.update(prompt if isinstance(prompt, dict) else {"prompt": prompt})
    body.update(extra)
    with live.http(key) as http:
        return http.post("/v1/completions", json=body)


def cached(response: httpx.Response) -> int:
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_models_lists_adapters_with_their_parent_and_no_path(live, adapters):
    with live.http() as http:
        cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert cards[MODEL_NAME]["parent"] is None
    assert cards["sql"]["parent"] == MODEL_NAME and cards["poet"]["parent"] == MODEL_NAME
    assert str(adapters["sql"]) not in str(cards)


def test_model_selects_the_adapter_and_caches_stay_apart(live):
    prompt = random_tokens(40, seed=301)  # 2 full blocks of 16
    texts = {}
    for model in ("sql", "poet", MODEL_NAME):
        response = complete(live, model, prompt)
        assert cached(response) == 0, model
        texts[model] = response.json()["choices"][0]["text"]
    assert len(set(texts.values())) == 3
    again = complete(live, "sql", prompt)
    assert cached(again) == 32 and again.json()["choices"][0]["text"] == texts["sql"]
    live.check_no_leaks()


def test_tenants_under_one_adapter_never_share_blocks(live, default_model_fp32):
    """An adapter is served to every tenant, its cache to none but the one that filled it: the
    tenant's salt stays a key beside the adapter's name (prompts and embeddings alike)."""
    prompt = random_tokens(40, seed=303)
    with torch.no_grad():
        embeds = {"prompt_embeds": encode(default_model_fp32.model.embed(torch.tensor(prompt)))}
    for body in (prompt, embeds):
        assert cached(complete(live, "sql", body, key=KEY_ALPHA)) == 0
        assert cached(complete(live, "sql", body, key=KEY_BETA)) == 0
        assert cached(complete(live, "sql", body, key=KEY_ALPHA)) == 32
    live.check_no_leaks()


def test_unknown_model_is_404(live):
    response = complete(live, "nope", [1, 2, 3])
    assert response.status_code == 404 and "sql" in response.json()["error"]["message"]


def test_operator_loads_and_unloads_adapters_tenants_may_not(live, adapters):
    body = {"lora_name": "late", "lora_path": str(adapters["late"])}
    with live.http() as tenant:
        assert tenant.post("/v1/load_lora_adapter", json=body).status_code == 403
        assert tenant.post("/v1/unload_lora_adapter", json=body).status_code == 403
    with live.http(KEY_ADMIN) as ops:
        response = ops.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == 200, response.text
        assert complete(live, "late", [5, 6, 7]).status_code == 200
        assert ops.post("/v1/unload_lora_adapter", json={"lora_name": "late"}).status_code == 200
        gone = ops.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert gone.status_code == 404
        missing = ops.post(
            "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/dir"}
        )
        assert missing.status_code == 400 and "does not exist" in missing.text
        clash = ops.post(
            "/v1/load_lora_adapter", json={"lora_name": MODEL_NAME, "lora_path": body["lora_path"]}
        )
        assert clash.status_code == 400
    assert complete(live, "late", [5, 6, 7]).status_code == 404
    live.check_no_leaks()


def test_a_name_loaded_again_from_another_path_serves_the_new_files(
    live, adapters, default_model_fp32, tmp_path
):
    other = write_random_adapter(tmp_path / "v2", default_model_fp32.config, rank=2, seed=9)
    with live.http(KEY_ADMIN) as ops:
        for path in (adapters["late"], other):
            body = {"lora_name": "again", "lora_path": str(path)}
            assert ops.post("/v1/load_lora_adapter", json=body).status_code == 200
            response = complete(live, "again", [5, 6, 7])
            assert response.status_code == 200, response.text
            assert ops.post("/v1/unload_lora_adapter", json=body).status_code == 200
    live.check_no_leaks()


def _int8_a(path: Path) -> None:
    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = sorted(k for k in tensors if "lora_A" in k)[0]
    tensors[key] = tensors[key].mul(1000).to(torch.int8)
    save_file(tensors, str(path / "adapter_model.safetensors"))


@pytest.mark.parametrize(
    "config,weights,match",
    [
        ({"lora_alpha": 1e300}, None, "lora_B times the scaling 5e+299 overflows float32"),
        ({"alora_invocation_tokens": [7, 8]}, None, "alora_invocation_tokens=[7, 8] is not"),
        ({"layer_replication": [[0, 2], [1, 3]]}, None, "layer_replication=[[0, 2], [1, 3]] is"),
        ({}, _int8_a, "has dtype int8: LoRA weights must be float16, bfloat16"),
    ],
)
def test_adapters_that_overflow_or_change_peft_meaning_are_400_at_load(
    live, default_model_fp32, tmp_path, config, weights, match
):
    path = write_random_adapter(tmp_path / "bad", default_model_fp32.config, rank=2, seed=5)
    settings = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**settings, **config}))
    if weights is not None:
        weights(path)
    with live.http(KEY_ADMIN) as ops:
        response = ops.post(
            "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(path)}
        )
    assert response.status_code == 400, response.text
    assert match in response.json()["error"]["message"]
    assert complete(live, "bad", [5, 6, 7]).status_code == 404
    live.check_no_leaks()


def test_adapters_are_read_off_the_step_thread(live, adapters, monkeypatch, tmp_path):
    from prefixserve.lora import manager

    threads: list[str] = []
    real = manager.load_adapter

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(manager, "load_adapter", recording)
    with live.http(KEY_ADMIN) as ops:
        # Two more adapters in 3 slots: "sql" or "poet" (idle, least recently used) goes.
        for name in ("x1", "x2"):
            body = {"lora_name": name, "lora_path": str(adapters["late"])}
            assert ops.post("/v1/load_lora_adapter", json=body).status_code == 200
        for name in ("sql", "poet"):  # whichever went is read again for its request
            assert complete(live, name, [3, 4, 5]).status_code == 200
        for name in ("x1", "x2"):
            assert ops.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    assert len(threads) >= 3 and "prefixserve-engine" not in threads
    live.check_no_leaks()


def test_unloading_an_adapter_in_use_is_refused(live):
    started = threading.Event()
    done: list[int] = []

    def stream() -> None:
        body = {
            "model": "poet",
            "prompt": [7] * 8,
            # The unload is sent once the first token has streamed: 99 more decode steps leave
            # it ample time to meet the request in flight.
            "max_tokens": 100,
            "ignore_eos": True,
            "stream": True,
        }
        with live.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
            for _ in response.iter_lines():
                started.set()
            done.append(response.status_code)

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(60)
    with live.http(KEY_ADMIN) as ops:
        response = ops.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
    thread.join(120)
    assert response.status_code == 409 and "unfinished request" in response.text
    assert done == [200]
    assert complete(live, "poet", [1, 2]).status_code == 200
    live.check_no_leaks()


def encode(tensor, legacy: bool = False, tail: bytes = b"") -> str:
    buffer = io.BytesIO()
    torch.save(tensor, buffer, _use_new_zipfile_serialization=not legacy)
    return base64.b64encode(buffer.getvalue() + tail).decode()


def test_prompt_embeds_give_the_token_ids_output(live, default_model_fp32):
    ids = random_tokens(24, seed=302)
    with torch.no_grad():
        embeds = default_model_fp32.model.embed(torch.tensor(ids))
    by_ids = complete(live, MODEL_NAME, ids)
    by_embeds = complete(live, MODEL_NAME, {"prompt_embeds": encode(embeds)})
    assert by_embeds.status_code == 200, by_embeds.text
    assert by_embeds.json()["choices"][0]["text"] == by_ids.json()["choices"][0]["text"]
    assert by_embeds.json()["usage"]["prompt_tokens"] == 24
    # Embeddings and an adapter together.
    assert complete(live, "sql", {"prompt_embeds": [encode(embeds)]}).status_code == 200
    live.check_no_leaks()


def _compressed() -> str:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("data.pkl", b"\0" * 100_000)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    "value,match",
    [
        (encode(torch.zeros(3, 7)), "shape [num_tokens, 576]"),
        (encode(torch.full((3, 576), float("nan"))), "NaN or infinite"),
        (encode(torch.zeros(3, 576, dtype=torch.int32)), "float32, bfloat16 or float16"),
        (encode(torch.zeros(600, 576)), "max_model_len=512"),
        (encode({"x": torch.zeros(2, 576)}), "must hold one tensor"),
        ("%%%not base64", "not valid base64"),
        (base64.b64encode(b"plain bytes").decode(), "torch.save"),
        (_compressed(), "compressed archive entries"),
        # 4 bytes of storage that would become 75 MB when the engine copies it
        (encode(torch.zeros(1, 1).expand(32768, 576)), "exactly its own storage"),
        # the old pickle format, with an empty zip directory appended to pass for a zip
        (encode(torch.zeros(2, 576), legacy=True, tail=b"PK\x05\x06" + bytes(18)), "torch.save"),
        (encode(torch.tensor(1.0)), "must be a 2-D tensor"),
        # sparse and nested tensors load, but have no storage: refused by layout before it
        (encode(torch.eye(3, 576).to_sparse()), "got layout torch.sparse_coo"),
        (encode(torch.eye(3, 576).to_sparse_csr()), "got layout torch.sparse_csr"),
        (encode(torch.nested.as_nested_tensor([torch.zeros(2, 576)])), "got a nested tensor"),
    ],
)
def test_bad_prompt_embeds_are_400_naming_the_field(live, value, match):
    response = complete(live, MODEL_NAME, {"prompt_embeds": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert match in error["message"] and error["param"] == "prompt_embeds"
    assert complete(live, MODEL_NAME, [1, 2, 3]).status_code == 200
    live.check_no_leaks()


def test_prompt_and_prompt_embeds_together_or_neither_are_400(live):
    embeds = encode(torch.zeros(2, 576))
    both = complete(live, MODEL_NAME, {"prompt": [1, 2], "prompt_embeds": embeds})
    assert both.status_code == 400 and "exactly one" in both.text
    with live.http() as http:
        neither = http.post("/v1/completions", json={"model": MODEL_NAME, "max_tokens": 2})
    assert neither.status_code == 400


def test_prompt_embeds_refused_when_not_enabled(open_server):
    with open_server.http() as http:
        response = http.post(
            "/v1/completions",
            json={"max_tokens": 2, "prompt_embeds": encode(torch.zeros(2, 576))},
        )
    assert response.status_code == 400 and "--enable-prompt-embeds" in response.text


def test_lora_flags_are_parsed_and_bad_ones_exit_2(tmp_path, capsys):
    parser = cli.build_parser()
    args = parser.parse_args(
        ["serve", "--lora-modules", "a=/x", '{"name": "b", "path": "/y"}', "--max-loras", "2"]
    )
    from prefixserve.engine_args import engine_config_from_args, lora_modules_from_args

    assert lora_modules_from_args(args) == {"a": "/x", "b": "/y"}
    assert engine_config_from_args(args).lora == LoRAConfig(max_loras=2, max_lora_rank=16)
    for bad in (["a"], ["a=/x", "a=/y"], ["bad name=/x"], ["{not json"]):
        args = parser.parse_args(["serve", "--lora-modules", *bad])
        with pytest.raises(ValueError, match="--lora-modules|LoRA adapter name"):
            lora_modules_from_args(args)
    code = cli.main(["serve", "--lora-modules", f"a={tmp_path / 'missing'}", "--port", "0"])
    assert code == 2 and "does not exist" in capsys.readouterr().err
