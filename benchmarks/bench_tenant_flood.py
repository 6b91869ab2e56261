"""One tenant floods, another sends a request at a time: the second's time to first token.

Starts `prefixserve serve` (the default model) with two tenant keys once per configuration,
then for `--seconds`: tenant A keeps `--flood` streaming requests in flight (long prompts,
`--flood-tokens` out each, retrying after a 429's Retry-After), tenant B sends one short streaming
request after another. Prints B's TTFT p50/p90/max, B's gaps between tokens (p50/max) and A's
completed and refused counts per configuration, side by side in one run:

    python benchmarks/bench_tenant_flood.py --seconds 60 --flood 64
    python benchmarks/bench_tenant_flood.py --configs fcfs,fair --extra-flags="--max-num-seqs 16"
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import free_port  # noqa: E402

_NO_LIMITS = [
    "--max-requests", "0", "--max-requests-per-tenant", "0", "--max-tokens-per-tenant", "0"
]  # fmt: skip
CONFIGS = {
    "no admission limits": _NO_LIMITS,
    "default limits": [],
    "per-tenant share 8": ["--max-requests-per-tenant", "8"],
    # The engine's scheduling policies alone (no admission limits in front of them).
    "fcfs": ["--scheduling-policy", "fcfs", *_NO_LIMITS],
    "fair": ["--scheduling-policy", "fair", *_NO_LIMITS],
}


_UNIQUE = itertools.count()


async def _flood(url: str, key: str, args: argparse.Namespace, stop: float, tally: dict) -> None:
    body = {
        "model": "m",
        "max_tokens": args.flood_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    if args.flood_prompt_logprobs:
        body["prompt_logprobs"] = args.flood_prompt_logprobs
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
        while time.monotonic() < stop:
            # A distinct first word per request (--flood-unique) leaves nothing to hit in cache.
            head = f"{next(_UNIQUE)} " if args.flood_unique else ""
            body["prompt"] = head + "word " * args.flood_prompt
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code == 429:
                    tally["refused"] += 1
                    await response.aread()
                    await asyncio.sleep(float(response.headers.get("Retry-After", "1")))
                    continue
                async for _ in response.aiter_lines():
                    if time.monotonic() > stop:
                        break
                tally["done"] += 1


async def _probe(
    url: str, key: str, args: argparse.Namespace, stop: float, ttfts: list[float], gaps: list
) -> None:
    body = {
        "model": "m",
        "prompt": "Hello, how are",
        "max_tokens": args.probe_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
        while time.monotonic() < stop:
            start = last = time.monotonic()
            async with http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:  # refused (429): counts as no first token
                    await response.aread()
                    ttfts.append(float("inf"))
                    await asyncio.sleep(0.5)
                    continue
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        now = time.monotonic()
                        (gaps if last > start else ttfts).append(now - last)
                        last = now
            await asyncio.sleep(0.5)


def _run(name: str, flags: list[str], args: argparse.Namespace) -> str:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.txt"
        keys.write_text("sk-a tenant-a\nsk-b tenant-b\n")
        cmd = [
            sys.executable, "-m", "prefixserve.cli", "serve", "--port", str(port),
            "--api-key-file", str(keys), "--served-model-name", "m", "--disable-log-stats",
            *flags, *shlex.split(args.extra_flags),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start ({name})")
                time.sleep(0.5)
            tally = {"done": 0, "refused": 0}
            ttfts: list[float] = []
            gaps: list[float] = []

            async def main() -> None:
                stop = time.monotonic() + args.seconds
                flood = [_flood(url, "sk-a", args, stop, tally) for _ in range(args.flood)]
                await asyncio.gather(*flood, _probe(url, "sk-b", args, stop, ttfts, gaps))

            asyncio.run(main())
        finally:
            proc.terminate()
            proc.wait(30)
    ttfts.sort()
    p90 = ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan")
    gap_p50 = statistics.median(gaps) if gaps else float("nan")
    gap_max = max(gaps) if gaps else float("nan")
    return (
        f"| {name} | {len(ttfts)} | {statistics.median(ttfts):.2f} | {p90:.2f} | "
        f"{max(ttfts):.2f} | {gap_p50:.2f} | {gap_max:.2f} | {tally['done']} | "
        f"{tally['refused']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--flood", type=int, default=64, help="tenant A's requests in flight")
    parser.add_argument("--flood-prompt", type=int, default=400, help="words in A's prompts")
    parser.add_argument("--flood-tokens", type=int, default=64, help="tokens A asks for")
    parser.add_argument(
        "--flood-unique", action="store_true", help="no cache hits between A's prompts"
    )
    parser.add_argument(
        "--flood-prompt-logprobs", type=int, default=0, help="prompt_logprobs A asks for"
    )
    parser.add_argument("--probe-tokens", type=int, default=8, help="tokens B asks for")
    parser.add_argument("--extra-flags", default="", help="more serve flags for every config")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    args = parser.parse_args()
    print(
        "| config | B requests | B TTFT p50 s | p90 s | max s | B gap p50 s | B gap max s "
        "| A completed | A refused (429) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.configs.split(","):
        print(_run(name, CONFIGS[name], args), flush=True)


if __name__ == "__main__":
    main()
