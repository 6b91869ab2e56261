"""Micro-benchmarks of the prefix-cache core: µs per block to hash, allocate+free, look up, touch.

    .venv/bin/python benchmarks/bench_kv_cache.py [--repeats 7] [--block-size 16] [--only pool,...]
        [--eviction-policy lru]

Every figure is the median over `--repeats` runs (the machine is shared and noisy), each run timing
enough work to last a few milliseconds. Pure Python, no torch. To compare two checkouts, run this
script against each in turn with PYTHONPATH=<checkout>, alternating, in one session.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time

from prefixserve.core.kv_cache.block_pool import BlockPool
from prefixserve.core.kv_cache.eviction.policies import EVICTION_POLICIES
from prefixserve.core.kv_cache.hashing import get_request_block_hasher
from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.core.kv_cache.spec import KVCacheConfig
from prefixserve.core.request import Request
from prefixserve.sampling_params import SamplingParams

# CPU time of this process: on a shared, oversubscribed machine wall time mostly measures the
# other tenants (--wall switches to it).
_clock = time.process_time_ns
# The free queue's policy of every pool built here (--eviction-policy).
_policy = "lru"

# --only names, in the order the sections run: hashing, BlockPool alloc+free, the same through
# KVCacheManager, lookup and touch.
SECTIONS = ("hash", "pool", "manager", "lookup")

TARGETS = {"hash sha256": 1.0, "hash xxhash": 0.3, "alloc+free": 0.3, "lookup": 0.5}


def median_us_per_block(fn, num_blocks: int, repeats: int, min_ns: int = 5_000_000) -> float:
    """Median over `repeats` runs of fn()'s time per block; each run loops fn for >= min_ns."""
    fn()  # warm up
    loops = 1
    while True:
        start = _clock()
        for _ in range(loops):
            fn()
        elapsed = _clock() - start
        if elapsed >= min_ns:
            break
        loops *= 2
    samples = []
    gc.disable()
    try:
        for _ in range(repeats):
            start = _clock()
            for _ in range(loops):
                fn()
            samples.append((_clock() - start) / loops / num_blocks / 1000)
    finally:
        gc.enable()
    return statistics.median(samples)


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(150_000) for _ in range(n)]


def bench_hashing(block_size: int, repeats: int) -> list[tuple[str, str, float]]:
    rows = []
    params = SamplingParams()
    for algo in ("sha256", "xxhash"):
        hasher = get_request_block_hasher(block_size, algo)
        num_blocks = 1024
        request = Request("h", random_tokens(num_blocks * block_size, 1), params)

        def hash_prompt(request=request, hasher=hasher):
            request.block_hashes.clear()
            hasher(request)

        us = median_us_per_block(hash_prompt, num_blocks, repeats)
        rows.append((f"hash {algo}", f"prompt of {num_blocks} blocks", us))

        decode = Request("d", random_tokens(block_size, 2), params)
        decode.block_hashes.extend(hasher(decode))

        def hash_one_more(request=decode, hasher=hasher):
            # As after a decode step completes a block: exactly one new block to hash.
            del request.block_hashes[1:]
            hasher(request)

        decode.all_token_ids.extend(random_tokens(block_size, 3))
        us = median_us_per_block(hash_one_more, 1, repeats)
        rows.append((f"hash {algo}", "1 block per call (decode)", us))
    return rows


def bench_alloc_free(repeats: int) -> list[tuple[str, str, float]]:
    rows = []
    pool = BlockPool(100_001, eviction_policy=_policy)
    for n in (10, 100, 1000):

        def round_trip(pool=pool, n=n):
            blocks = pool.get_new_blocks(n)
            blocks.reverse()
            pool.free_blocks(blocks)

        us = median_us_per_block(round_trip, n, repeats)
        rows.append(("alloc+free", f"BlockPool(100k), n={n}", us))
    return rows


def cached_manager(num_chain_blocks: int, block_size: int) -> tuple[KVCacheManager, Request]:
    config = KVCacheConfig(num_blocks=num_chain_blocks + 64, block_size=block_size)
    mgr = KVCacheManager(config, eviction_policy=_policy)
    hasher = get_request_block_hasher(block_size, "sha256")
    tokens = random_tokens(num_chain_blocks * block_size + 1, num_chain_blocks)
    writer = Request("w", tokens, SamplingParams(), block_hasher=hasher)
    mgr.allocate_slots(writer, writer.num_tokens)
    mgr.free(writer)
    reader = Request("r", tokens, SamplingParams(), block_hasher=hasher)
    return mgr, reader


def timed_touch(pool: BlockPool, blocks: list, reverse: list, repeats: int) -> float:
    """Median µs per block of pool.touch(blocks); the untimed free after each call restores."""
    samples = []
    for _ in range(repeats):
        total = 0
        for _ in range(max(1, 20_000 // len(blocks))):
            start = _clock()
            pool.touch(blocks)
            total += _clock() - start
            pool.free_blocks(reverse)
        samples.append(total / max(1, 20_000 // len(blocks)) / len(blocks) / 1000)
    return statistics.median(samples)


def bench_lookup_and_touch(block_size: int, repeats: int) -> list[tuple[str, str, float]]:
    rows = []
    touch_rows = []
    for chain in (64, 256, 1024, 2048):
        mgr, reader = cached_manager(chain, block_size)
        blocks, num_computed = mgr.get_computed_blocks(reader)
        assert num_computed == chain * block_size, num_computed

        def lookup(mgr=mgr, reader=reader):
            mgr.get_computed_blocks(reader)

        rows.append(
            ("lookup", f"all-hit chain of {chain}", median_us_per_block(lookup, chain, repeats))
        )

        pool = mgr.block_pool
        hit = blocks.blocks[0]
        reverse = hit[::-1]
        touch_rows.append(
            (
                "touch",
                f"{chain} free cached blocks (ref 0 -> 1)",
                timed_touch(pool, hit, reverse, repeats),
            )
        )
        pool.touch(hit)  # now held: a second touch only bumps ref counts
        touch_rows.append(
            (
                "touch",
                f"{chain} blocks in use (ref 1 -> 2)",
                timed_touch(pool, hit, reverse, repeats),
            )
        )
        pool.free_blocks(reverse)
    return rows + touch_rows


def bench_manager_round_trip(block_size: int, repeats: int) -> list[tuple[str, str, float]]:
    """allocate_slots + free through the manager, pool of 100k blocks.

    caching off: block bookkeeping only. caching on: distinct pre-hashed prompts in rotation, so
    in the steady state every fresh block evicts an old cached one and gets cached itself (a full
    cache serving misses). The hashing itself is not timed.
    """
    rows = []
    params = SamplingParams()
    hasher = get_request_block_hasher(block_size, "xxhash")
    for caching in (False, True):
        config = KVCacheConfig(num_blocks=100_001, block_size=block_size)
        mgr = KVCacheManager(config, enable_caching=caching, eviction_policy=_policy)
        for n in (10, 100, 1000):
            num_requests = 2 * 100_000 // n if caching else 1
            base = random_tokens(n * block_size, n)
            requests = [
                Request(f"m{i}", [i, *base[1:]], params, block_hasher=hasher)
                for i in range(num_requests)
            ]
            position = [0]

            def round_trip(mgr=mgr, requests=requests, position=position, n=n):
                request = requests[position[0]]
                position[0] = (position[0] + 1) % len(requests)
                mgr.allocate_slots(request, n * block_size)
                mgr.free(request)

            for _ in range(num_requests):  # fill the cache: steady state from here
                round_trip()
            us = median_us_per_block(round_trip, n, repeats)
            label = "caching on, misses" if caching else "caching off"
            rows.append(("alloc+free", f"allocate_slots+free ({label}), n={n}", us))
            del requests
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--wall", action="store_true", help="time wall clock, not CPU time")
    parser.add_argument(
        "--eviction-policy",
        default="lru",
        choices=EVICTION_POLICIES,
        help="the free queue's eviction policy (default: lru)",
    )
    parser.add_argument(
        "--only",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run, of {', '.join(SECTIONS)} (default: all)",
    )
    args = parser.parse_args()
    sections = args.only.split(",")
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    global _clock, _policy
    if args.wall:
        _clock = time.perf_counter_ns
    _policy = args.eviction_policy
    rows = []
    if "hash" in sections:
        rows += bench_hashing(args.block_size, args.repeats)
    if "pool" in sections:
        rows += bench_alloc_free(args.repeats)
    if "manager" in sections:
        rows += bench_manager_round_trip(args.block_size, args.repeats)
    if "lookup" in sections:
        rows += bench_lookup_and_touch(args.block_size, args.repeats)
    print(
        f"Python {sys.version.split()[0]}, block_size={args.block_size}, "
        f"eviction policy {_policy}, "
        f"median of {args.repeats} runs, µs per block "
        f"({'wall clock' if args.wall else 'process CPU time'})"
    )
    print(f"| {'operation':<12} | {'case':<50} | {'µs/block':>8} | {'target':>6} |")
    print(f"|{'-' * 14}|{'-' * 52}|{'-' * 10}:|{'-' * 7}:|")
    for op, case, us in rows:
        target = TARGETS.get(op)
        target_s = f"≤ {target}" if target is not None else ""
        print(f"| {op:<12} | {case:<50} | {us:>8.3f} | {target_s:>6} |")


if __name__ == "__main__":
    main()
