"""A model-free simulator of the eviction policies and admission orders: the real Scheduler and
KVCacheManager driven by a stub runner that "samples" a deterministic token per request and step
(no model, no K/V), over a list of `BenchRequest`s (benchmarks/bench_eviction.py runs it over the
serving workloads W0-W5; tests/test_bench_admission.py over crafted bursts).

`simulate` runs closed loop like `prefixserve bench run` (`concurrency` requests in flight, the
next one sent as one finishes, a request with `after` only once that one has finished) or, with
`arrival="burst"`, adds every request at step 0 and lets `max_num_seqs = concurrency` bound the
running ones, so the admission order decides who goes next. 16-token blocks, the engine's default
step budget, EOS ignored. It returns the prompt-token hit rate of fresh admissions, the prompt
tokens computed, the preemptions, each request's wait in scheduler steps from its arrival to its
first scheduled step, completion times, the most times a request was passed over, the steps and
the seconds of the run.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import deque
from typing import Any

from prefixserve.bench.workload_types import BenchRequest
from prefixserve.config import SchedulerConfig
from prefixserve.core.kv_cache.hashing import get_request_block_hasher
from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.core.kv_cache.spec import KVCacheConfig
from prefixserve.core.request import Request
from prefixserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from prefixserve.core.sched.scheduler import Scheduler
from prefixserve.sampling_params import SamplingParams

BLOCK_SIZE = 16
# The synthetic token pool the workloads are drawn from, and the stub runner's tokens.
TOKEN_POOL = list(range(1000, 9000))


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


def spread(values: list[int]) -> tuple[float, int, int]:
    """(mean, p99 by nearest rank, max) of `values`."""
    ordered = sorted(values)
    p99 = ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]
    return sum(ordered) / len(ordered), p99, ordered[-1]


def simulate(
    requests: list[BenchRequest],
    policy: str,
    num_blocks: int,
    concurrency: int,
    admission_order: str = "fcfs",
    arrival: str = "closed",
) -> dict[str, Any]:
    """Run `requests` over a pool of `num_blocks` allocatable blocks: closed loop at
    `concurrency` in flight, or (`arrival="burst"`) all at once with `concurrency` running."""
    if arrival not in ("closed", "burst"):
        raise ValueError(f"arrival must be closed or burst, got {arrival!r}")
    burst = arrival == "burst"
    manager = KVCacheManager(
        KVCacheConfig(num_blocks=num_blocks + 1, block_size=BLOCK_SIZE, hash_algo="xxhash"),
        eviction_policy=policy,
    )
    config = SchedulerConfig(admission_order=admission_order)
    if burst:
        config = SchedulerConfig(admission_order=admission_order, max_num_seqs=concurrency)
    scheduler = Scheduler(config, manager, max_model_len=1 << 20)
    runner = StubRunner()
    hasher = get_request_block_hasher(BLOCK_SIZE, "xxhash")
    dependents: dict[str, list[BenchRequest]] = {}
    for r in requests:
        if r.after is not None:
            dependents.setdefault(r.after, []).append(r)
    ready = deque(r for r in requests if r.after is None)
    in_flight = finished = step = 0
    added: list[Request] = []
    arrived: dict[str, int] = {}  # request id -> the step it was added before
    first: dict[str, int] = {}  # request id -> the step it was first scheduled in
    done: dict[str, int] = {}  # request id -> the step that finished it
    start = time.perf_counter()
    while finished < len(requests):
        while ready and (burst or in_flight < concurrency):
            r = ready.popleft()
            params = SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True)
            request = Request(r.request_id, r.prompt_token_ids, params, block_hasher=hasher)
            scheduler.add_request(request)
            added.append(request)
            arrived[r.request_id] = step
            in_flight += 1
        out = scheduler.schedule()
        if not out.scheduled:
            raise RuntimeError(f"{policy}: nothing scheduled with {in_flight} requests in flight")
        for s in out.scheduled:
            first.setdefault(s.request.request_id, step)
        for update in scheduler.update_from_output(out, runner.execute(out)):
            if update.finished:
                in_flight -= 1
                finished += 1
                done[update.request.request_id] = step
                ready.extend(dependents.get(update.request.request_id, ()))
        step += 1
    manager.check_no_leaks()
    stats = manager.make_prefix_cache_stats()
    waits = {i: first[i] - arrived[i] for i in arrived}
    wait = spread(list(waits.values()))
    completion = spread([done[i] - arrived[i] + 1 for i in arrived])
    return {
        "waits": waits,
        "wait_mean": wait[0],
        "wait_p99": wait[1],
        "wait_max": wait[2],
        "done_mean": completion[0],
        "done_p99": completion[1],
        "done_max": completion[2],
        "max_passed_over": max(r.cache.num_passed_over for r in added),
        "steps": step,
        "hit_rate": stats.hit_rate,
        "computed": scheduler.stats.num_computed_prompt_tokens,
        "prompt": sum(r.num_prompt_tokens for r in requests),
        "preemptions": scheduler.stats.num_preemptions,
        "seconds": time.perf_counter() - start,
    }
