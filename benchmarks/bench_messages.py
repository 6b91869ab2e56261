"""An agent loop on the Messages API with `cache_control` breakpoints, through Anthropic's SDK.

A `prefixserve serve` process (the default model) answers 8 turns of one conversation: a system
prompt of ~2,000 tokens (instructions and tool descriptions in text: the packaged models' chat
templates render no tools) with a breakpoint, and the breakpoint on the newest user turn, as
agents place it. Each turn streams (`client.messages.stream`); its time to first token is the time
to the first text delta. Repeated `--repeats` times, each conversation with a system prompt of its
own. In the same run, the same loops on a server with prefix caching off (every turn computes its
whole prompt), the baseline a cache has to beat.

Prints per turn: TTFT p50 (and spread) with breakpoints, without a cache, the ratio to turn 1, and
`cache_read_input_tokens` as a share of the previous turn's prompt.

    .venv/bin/python benchmarks/bench_messages.py [--repeats 3] [--turns 8]
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import anthropic
import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL = "default"
EPHEMERAL = {"type": "ephemeral"}


def cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next(
        (line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")),
        [],
    )
    keep = [f for f in flags if f.startswith(("avx", "amx")) or f == "fma"]
    return " ".join(sorted(set(keep)))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [sys.executable, "-m", "prefixserve.cli", "serve", "--port", str(port)]
    args += ["--served-model-name", MODEL, "--max-model-len", "4096", *extra]
    process = subprocess.Popen(
        args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        time.sleep(0.5)
    os.killpg(process.pid, signal.SIGKILL)
    raise SystemExit("the server did not start in 600 s")


def stop_server(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)


def system_prompt(words: int) -> str:
    """Instructions and tools in text, unique per conversation (a tag up front)."""
    tag = uuid.uuid4().hex[:12]
    tools = [
        f"Tool {i} `tool_{i}`: looks up record {i} by id and returns its fields as JSON; "
        f"arguments: id (string), fields (list of strings)."
        for i in range(words // 40)
    ]
    rules = " ".join(
        f"Rule {i}: answer step {i} briefly and cite the record." for i in range(words // 10)
    )
    return f"[{tag}] You are an operations agent.\n" + "\n".join(tools) + "\n" + rules


def run_conversation(client: anthropic.Anthropic, system: str, turns: int, breakpoints: bool):
    """[(ttft_s, usage)] per turn."""
    history: list[dict] = []
    results = []
    for turn in range(turns):
        for message in history:
            if message["role"] == "user":
                message["content"] = [{"type": "text", "text": message["content"][0]["text"]}]
        block = {"type": "text", "text": f"Turn {turn}: check record {turn * 7} and report."}
        if breakpoints:
            block["cache_control"] = EPHEMERAL
        history.append({"role": "user", "content": [block]})
        sys_block = {"type": "text", "text": system}
        if breakpoints:
            sys_block["cache_control"] = EPHEMERAL
        start = time.perf_counter()
        ttft = None
        with client.messages.stream(
            model=MODEL,
            max_tokens=24,
            system=[sys_block],
            messages=history,
            extra_body={"temperature": 0.0},
        ) as stream:
            for _ in stream.text_stream:
                if ttft is None:
                    ttft = time.perf_counter() - start
            final = stream.get_final_message()
        results.append((ttft if ttft is not None else time.perf_counter() - start, final.usage))
        history.append({"role": "assistant", "content": final.content[0].text or "ok"})
    return results


def prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def measure(url: str, args, breakpoints: bool) -> list[list[tuple[float, object]]]:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=600)
    runs = []
    for _ in range(args.repeats):
        runs.append(
            run_conversation(client, system_prompt(args.system_words), args.turns, breakpoints)
        )
    return runs


def spread(values: list[float]) -> str:
    low, high = min(values) * 1000, max(values) * 1000
    return f"{statistics.median(values) * 1000:7.0f} ms [{low:.0f}-{high:.0f}]"


def report(cached, uncached, turns: int) -> None:
    print(f"host: {platform.processor() or platform.machine()}, flags: {cpu_flags()}")
    first = statistics.median(run[0][0] for run in cached)
    print(
        "turn | prompt | TTFT breakpoints [range]   | TTFT no cache [range]      | "
        "ratio to turn 1 | read / previous prompt"
    )
    for turn in range(turns):
        ttfts = [run[turn][0] for run in cached]
        base = [run[turn][0] for run in uncached]
        usage = cached[0][turn][1]
        shares = []
        for run in cached:
            if turn:
                shares.append(
                    run[turn][1].cache_read_input_tokens / prompt_tokens(run[turn - 1][1])
                )
        share = f"{min(shares):.3f}-{max(shares):.3f}" if shares else "-"
        print(
            f"{turn + 1:4d} | {prompt_tokens(usage):6d} | {spread(ttfts)} | {spread(base)} | "
            f"{statistics.median(ttfts) / first:15.3f} | {share}"
        )
    later = [run[t][0] for run in cached for t in range(1, turns)]
    print(f"later turns' TTFT p50 / turn 1's: {statistics.median(later) / first:.3f}")
    later_base = [run[t][0] for run in uncached for t in range(1, turns)]
    ratio = statistics.median(later) / statistics.median(later_base)
    print(f"later turns' TTFT p50, breakpoints / no cache: {ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system-words", type=int, default=1000, help="about 2,000 tokens")
    args = parser.parse_args()
    process, url = start_server([])
    try:
        cached = measure(url, args, breakpoints=True)
    finally:
        stop_server(process)
    process, url = start_server(["--no-enable-prefix-caching"])
    try:
        uncached = measure(url, args, breakpoints=False)
    finally:
        stop_server(process)
    report(cached, uncached, args.turns)


if __name__ == "__main__":
    main()
