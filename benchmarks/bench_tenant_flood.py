"""One tenant floods, another sends a request at a time: the second's time to first token.

Starts `prefixserve serve` (the default model) with two tenant keys once per configuration,
then for `--seconds`: tenant A keeps `--flood` streaming requests in flight (long prompts,
`--flood-tokens` out each, retrying after a 429's Retry-After), tenant B sends one short streaming
request after another. Prints B's TTFT p50/p90/max and A's completed and refused counts per
configuration, side by side in one run:

    python benchmarks/bench_tenant_flood.py --seconds 60 --flood 64
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import free_port  # noqa: E402

CONFIGS = {
    "no admission limits": ["--max-requests-per-tenant", "0", "--max-tokens-per-tenant", "0"],
    "default limits": [],
    "per-tenant share 8": ["--max-requests-per-tenant", "8"],
}


async def _flood(url: str, key: str, args: argparse.Namespace, stop: float, tally: dict) -> None:
    body = {
        "model": "m",
        "prompt": "word " * args.flood_prompt,
        "max_tokens": args.flood_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
        while time.monotonic() < stop:
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


async def _probe(url: str, key: str, stop: float, ttfts: list[float]) -> None:
    body = {"model": "m", "prompt": "Hello, how are", "max_tokens": 4, "stream": True}
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
        while time.monotonic() < stop:
            start = time.monotonic()
            async with http.stream("POST", "/v1/completions", json=body) as response:
                assert response.status_code == 200, response.status_code
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        ttfts.append(time.monotonic() - start)
                        break
            await asyncio.sleep(0.5)


def _run(name: str, flags: list[str], args: argparse.Namespace) -> str:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        keys = Path(tmp) / "keys.txt"
        keys.write_text("sk-a tenant-a\nsk-b tenant-b\n")
        cmd = [
            sys.executable, "-m", "prefixserve.cli", "serve", "--port", str(port),
            "--api-key-file", str(keys), "--served-model-name", "m", "--disable-log-stats",
            *flags,
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

            async def main() -> None:
                stop = time.monotonic() + args.seconds
                flood = [_flood(url, "sk-a", args, stop, tally) for _ in range(args.flood)]
                await asyncio.gather(*flood, _probe(url, "sk-b", stop, ttfts))

            asyncio.run(main())
        finally:
            proc.terminate()
            proc.wait(30)
    ttfts.sort()
    p90 = ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else float("nan")
    return (
        f"| {name} | {len(ttfts)} | {statistics.median(ttfts):.2f} | {p90:.2f} | "
        f"{max(ttfts):.2f} | {tally['done']} | {tally['refused']} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--flood", type=int, default=64, help="tenant A's requests in flight")
    parser.add_argument("--flood-prompt", type=int, default=400, help="words in A's prompts")
    parser.add_argument("--flood-tokens", type=int, default=64, help="tokens A asks for")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names")
    args = parser.parse_args()
    print("| config | B requests | B TTFT p50 s | p90 s | max s | A completed | A refused (429) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.configs.split(","):
        print(_run(name, CONFIGS[name], args), flush=True)


if __name__ == "__main__":
    main()
