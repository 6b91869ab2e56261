"""Model-free hit-rate simulator of the eviction policies over the serving workloads W0-W5
(the simulator itself is `prefixserve.bench.eviction_sim`).

    .venv/bin/python benchmarks/bench_eviction.py [--policies lru,slru,cost]
        [--workloads W0,W1,W2,W3,W4,W5] [--concurrency 4] [--seed 0] [--pool-blocks W4=784,...]
        [--admission-orders fcfs,longest_prefix] [--arrival closed|burst]

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

`--arrival burst` instead adds every request at step 0 (a W2 turn still only once the previous
turn of its conversation has finished, at the next step) and lets `max_num_seqs = --concurrency`
bound the running ones, so the waiting queue is long and the admission order
(`SchedulerConfig.admission_order`, `--admission-orders`; default fcfs only) decides who goes next.

Prints one row per workload, policy and admission order: the prompt-token hit rate of fresh
admissions (`PrefixCacheStats`: hit tokens over prompt tokens looked up), the prompt tokens
actually computed (preempted requests recompute), the preemptions; in scheduler steps
(`schedule()` calls), each request's wait from its arrival to its first scheduled step (0: it ran
in the step it arrived in) and its completion time (arrival to the step that finished it, that
step counted), as mean / p99 (nearest rank) / max; the most times a request was passed over by
longest-prefix admission (its aging bound is 16), the steps of the whole run and its seconds.
"""

from __future__ import annotations

import argparse

from prefixserve.bench.eviction_sim import BLOCK_SIZE, TOKEN_POOL, simulate
from prefixserve.bench.workloads import WORKLOAD_NAMES, make_workload
from prefixserve.config import ADMISSION_ORDERS
from prefixserve.core.kv_cache.eviction.policies import EVICTION_POLICIES

# W4: 4 documents of 96 blocks (prompt and answer) + 16; W5: 16 system prompts of 68 + 16.
POOL_BLOCKS = {"W0": 1500, "W1": 1500, "W2": 1500, "W3": 1500, "W4": 400, "W5": 1104}


def longer_than(waits: dict[str, int], fcfs_waits: dict[str, int] | None) -> str:
    """How many requests wait longer than in the fcfs run of the same workload and policy, and
    the most extra steps one of them waits ("-" without such a run, or for fcfs itself)."""
    if fcfs_waits is None or waits is fcfs_waits:
        return "-"
    extra = [waits[i] - fcfs_waits[i] for i in waits if waits[i] > fcfs_waits[i]]
    return f"{len(extra)} / {max(extra, default=0)}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=",".join(EVICTION_POLICIES))
    # the workloads it has a pool size for (W6 restarts and W7 is text: not for this simulator)
    parser.add_argument("--workloads", default=",".join(POOL_BLOCKS))
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--admission-orders",
        default="fcfs",
        help="comma-separated SchedulerConfig.admission_order values: fcfs, longest_prefix",
    )
    parser.add_argument(
        "--arrival",
        choices=("closed", "burst"),
        default="closed",
        help="closed: --concurrency in flight; burst: all at step 0, --concurrency running",
    )
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
    orders = sorted(args.admission_orders.split(","), key=lambda order: order != "fcfs")
    for name in set(orders) - set(ADMISSION_ORDERS):
        parser.error(f"unknown admission order {name!r}; choose from {', '.join(ADMISSION_ORDERS)}")
    print(
        f"concurrency {args.concurrency}, arrival {args.arrival}, seed {args.seed}, "
        f"block size {BLOCK_SIZE}; hit rate = hit prompt tokens / prompt tokens of fresh "
        "admissions; wait (arrival to first scheduled) and done (arrival to finished) in steps"
    )
    print(
        "| workload | pool (blocks) | policy | order | hit rate | prompt tokens computed "
        "| preempted | wait mean / p99 / max | done mean / p99 / max | max passed over "
        "| waits longer than at fcfs: n / max extra | steps | s |"
    )
    print("|---|--:|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|")
    for workload_name in workloads:
        requests = make_workload(workload_name, TOKEN_POOL, args.seed).requests
        for policy in policies:
            fcfs_waits: dict[str, int] | None = None
            for order in orders:
                r = simulate(
                    requests,
                    policy,
                    pool_blocks[workload_name],
                    args.concurrency,
                    order,
                    args.arrival,
                )
                print(
                    f"| {workload_name} | {pool_blocks[workload_name]} | {policy} | {order} | "
                    f"{100 * r['hit_rate']:.1f}% | {r['computed']:,} of {r['prompt']:,} | "
                    f"{r['preemptions']} | {r['wait_mean']:.1f} / {r['wait_p99']} / "
                    f"{r['wait_max']} | {r['done_mean']:.1f} / {r['done_p99']} / "
                    f"{r['done_max']} | {r['max_passed_over']} | "
                    f"{longer_than(r['waits'], fcfs_waits)} | {r['steps']} | "
                    f"{r['seconds']:.2f} |",
                    flush=True,
                )
                if order == "fcfs":
                    fcfs_waits = r["waits"]


if __name__ == "__main__":
    main()
