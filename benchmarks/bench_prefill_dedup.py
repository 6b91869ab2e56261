"""Never computing one prefix twice at once: requests sharing a long prefix arrive together and
are prefilled in chunks; with the rule the later ones wait for the first's blocks and hit them,
without it (the rule patched out) they compute the same blocks in parallel.

    .venv/bin/python benchmarks/bench_prefill_dedup.py [--requests 4] [--prefix 2048] [--chunk 256]

Prints the prompt tokens computed and the wall time of each run (offline `LLM`, default model).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402

import prefixserve.core.sched.scheduler as scheduler_module  # noqa: E402
from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.model.loader.loading import load_model  # noqa: E402


def run(loaded, prompts, args, dedup: bool) -> tuple[int, float]:
    saved = scheduler_module.waits_for_prefill
    if not dedup:
        scheduler_module.waits_for_prefill = lambda *a: False
    try:
        llm = LLM(
            loaded_model=loaded,
            enable_kv_store=False,
            max_num_batched_tokens=args.budget,
            long_prefill_token_threshold=args.chunk,
        )
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
        return llm.llm_engine.get_metrics()["computed_prompt_tokens"], wall
    finally:
        scheduler_module.waits_for_prefill = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prefix", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    loaded = load_model(None, dtype="bfloat16")
    rng = random.Random(0)
    prefix = [rng.randrange(1000, 40000) for _ in range(args.prefix)]
    prompts = [
        prefix + [rng.randrange(1000, 40000) for _ in range(32)] for _ in range(args.requests)
    ]
    for repeat in range(args.repeats):
        for dedup in (True, False):
            tokens, wall = run(loaded, prompts, args, dedup)
            label = "with the rule" if dedup else "without it"
            print(
                f"run {repeat}, {label}: {tokens} prompt tokens computed, {wall:.1f} s", flush=True
            )


if __name__ == "__main__":
    main()
