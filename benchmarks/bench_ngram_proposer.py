"""The n-gram proposer's cost per engine step: 64 decoding requests with 4,096-token contexts.

    python benchmarks/bench_ngram_proposer.py [--requests 64] [--context 4096] [--steps 200]

Prints the one-off cost of indexing each request's context (its first proposal) and the steady
per-step cost over all requests (each step appends 1-3 tokens per request, then proposes), with
the spread over repeats. Pure Python: no model.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from prefixserve.core.request import Request
from prefixserve.sampling_params import SamplingParams
from prefixserve.spec_decode import SpeculativeConfig
from prefixserve.spec_decode.ngram import NgramProposer


def run(num_requests: int, context: int, steps: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5)
    proposer = NgramProposer(config)
    requests = []
    for i in range(num_requests):
        # Text-like: tokens from a small vocabulary so that n-grams repeat and lookups hit.
        tokens = [rng.randint(0, 2000) for _ in range(context)]
        request = Request(f"r{i}", tokens, SamplingParams(max_tokens=steps * 4))
        request.num_computed_tokens = context - 1
        requests.append(request)
    start = time.perf_counter()
    for request in requests:
        proposer.propose_within(request, 1000)
    first = (time.perf_counter() - start) / num_requests
    per_step = []
    for _ in range(steps):
        for request in requests:
            request.append_output_token_ids(
                [rng.randint(0, 2000) for _ in range(rng.randint(1, 3))]
            )
            request.num_computed_tokens = request.num_tokens - 1
        start = time.perf_counter()
        for request in requests:
            drafts = proposer.propose_within(request, 1000)
            proposer.record(request.request_id, len(drafts), len(drafts) // 2)
        per_step.append(time.perf_counter() - start)
    return first, statistics.median(per_step)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    firsts, steps = [], []
    for repeat in range(args.repeats):
        first, step = run(args.requests, args.context, args.steps, repeat)
        firsts.append(first * 1e3)
        steps.append(step * 1e3)
    print(
        f"{args.requests} requests x {args.context} tokens: first proposal (indexing the "
        f"context) {statistics.median(firsts):.2f} ms per request "
        f"[{min(firsts):.2f}-{max(firsts):.2f}]; per step over all requests "
        f"{statistics.median(steps):.3f} ms [{min(steps):.3f}-{max(steps):.3f}]"
    )


if __name__ == "__main__":
    main()
