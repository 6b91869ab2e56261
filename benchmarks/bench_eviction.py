"""Model-free hit-rate simulator of the eviction policies over the serving workloads W0-W5.

    .venv/bin/python benchmarks/bench_eviction.py [--policies lru,slru,cost]
        [--workloads W0,W1,W2,W3,W4,W5] [--concurrency 4] [--seed 0] [--pool-blocks W4=784,...]

Drives the real Scheduler and KVCacheManager with a stub runner that "samples" a deterministic
token per request and step (no model, no K/V), over the token-id traces of
`prefixserve.bench.workloads` built from a synthetic token pool (ids 1000-8999). Closed loop like
`prefixserve bench run`: `--concurrency` requests in flight, the next one sent as one finishes (a
W2 turn only after the previous turn of its conversation), 16-token blocks, the engine's default
step budget (4,096 tokens), EOS ignored. Pool sizes (allocatable blocks): W0-W3 1,500 (no pressure
but W0's, which shares nothing); W4 4 x 96 + 16 (about 4 of its 12 documents with their question
and answer); W5 16 x 68 + 16 (about 16 of its 64 system prompts). `--pool-blocks` overrides them.
Note that W4's 4 running requests hold 4 x 97 of its 400 blocks: the pool that leaves about 4
documents cached beside them is 8 x 96 + 16 = 784.

Prints one row per workload and policy: the prompt-token hit rate of fresh admissions
(`PrefixCacheStats`: hit tokens over prompt tokens looked up), the prompt tokens actually
computed (preempted requests recompute), the preemptions and the seconds the run took.
"""

from __future__ import annotations

import argparse
import time
import zlib
from collections import deque

from prefixserve.batch import ModelRunnerOutput, SchedulerOutput
from prefixserve.bench.workloads import WORKLOAD_NAMES, BenchRequest, make_workload
from prefixserve.config import SchedulerConfig
from prefixserve.kv_cache.eviction import EVICTION_POLICIES
from prefixserve.kv_cache.hashing import get_request_block_hasher
from prefixserve.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.kv_cache.spec import KVCacheConfig
from prefixserve.request import Request
from prefixserve.sampling_params import SamplingParams
from prefixserve.scheduler import Scheduler

BLOCK_SIZE = 16
TOKEN_POOL = list(range(1000, 9000))
# W4: 4 documents of 96 blocks (prompt and answer) + 16; W5: 16 system prompts of 68 + 16.
POOL_BLOCKS = {"W0": 1500, "W1": 1500, "W2": 1500, "W3": 1500, "W4": 400, "W5": 1104}


class StubRunner:
    """The model's place: one deterministic token per sampling request, from its id and length."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        for s in out.scheduled:
            if s.samples:
                request = s.request
                seed = zlib.crc32(request.request_id.encode()) + request.num_tokens * 7919
                result.sampled_token_ids[request.request_id] = TOKEN_POOL[seed % len(TOKEN_POOL)]
        return result


def simulate(
    requests: list[BenchRequest], policy: str, num_blocks: int, concurrency: int
) -> dict[str, float]:
    """Run `requests` closed loop over a pool of `num_blocks` allocatable blocks."""
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=num_blocks + 1, block_size=BLOCK_SIZE, hash_algo="xxhash"),
        eviction_policy=policy,
    )
    scheduler = Scheduler(SchedulerConfig(), manager, max_model_len=1 << 20)
    runner = StubRunner()
    hasher = get_request_block_hasher(BLOCK_SIZE, "xxhash")
    dependents: dict[str, list[BenchRequest]] = {}
    for r in requests:
        if r.after is not None:
            dependents.setdefault(r.after, []).append(r)
    ready = deque(r for r in requests if r.after is None)
    in_flight = finished = 0
    start = time.perf_counter()
    while finished < len(requests):
        while ready and in_flight < concurrency:
            r = ready.popleft()
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            scheduler.add_request(Request(r.request_id, r.prompt_token_ids, params, None, hasher))
            in_flight += 1
        out = scheduler.schedule()
        if not out.scheduled:
            raise RuntimeError(f"{policy}: nothing scheduled with {in_flight} requests in flight")
        for update in scheduler.update_from_output(out, runner.execute(out)):
            if update.finished:
                in_flight -= 1
                finished += 1
                ready.extend(dependents.get(update.request.request_id, ()))
    manager.check_no_leaks()
    stats = manager.make_prefix_cache_stats()
    return {
        "hit_rate": stats.hit_rate,
        "computed": scheduler.stats.num_computed_prompt_tokens,
        "prompt": sum(r.num_prompt_tokens for r in requests),
        "preemptions": scheduler.stats.num_preemptions,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(EVICTION_POLICIES))
    parser.add_argument("--workloads", default=",".join(WORKLOAD_NAMES))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--pool-blocks",
        default="",
        help="allocatable blocks per workload, e.g. W4=784,W5=700 (default: "
        + str(POOL_BLOCKS)
        + ")",
    )
    args = parser.parse_args()
    pool_blocks = dict(POOL_BLOCKS)
    for item in filter(None, args.pool_blocks.split(",")):
        name, _, value = item.partition("=")
        if name.upper() not in pool_blocks or not value.isdigit() or int(value) < 1:
            parser.error(f"--pool-blocks wants NAME=N items with N >= 1, got {item!r}")
        pool_blocks[name.upper()] = int(value)
    policies = args.policies.split(",")
    workloads = [w.upper() for w in args.workloads.split(",")]
    for name in set(policies) - set(EVICTION_POLICIES):
        parser.error(f"unknown policy {name!r}; choose from {', '.join(EVICTION_POLICIES)}")
    for name in set(workloads) - set(WORKLOAD_NAMES):
        parser.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    print(
        f"concurrency {args.concurrency}, seed {args.seed}, block size {BLOCK_SIZE}; "
        "hit rate = hit prompt tokens / prompt tokens of fresh admissions"
    )
    print(
        "| workload | pool (blocks) | policy | hit rate | prompt tokens computed | preempted | s |"
    )
    print("|---|--:|---|--:|--:|--:|--:|")
    for workload_name in workloads:
        requests = make_workload(workload_name, TOKEN_POOL, args.seed).requests
        for policy in policies:
            r = simulate(requests, policy, pool_blocks[workload_name], args.concurrency)
            print(
                f"| {workload_name} | {pool_blocks[workload_name]} | {policy} | "
                f"{100 * r['hit_rate']:.1f}% | {r['computed']:,} of {r['prompt']:,} | "
                f"{r['preemptions']} | {r['seconds']:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
