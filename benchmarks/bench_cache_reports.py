"""What cache reports cost the engine: W1's requests run offline (default model, bf16, no disk
tier) with the report machinery on (the block recorder and the explainer, as always) and patched
out, alternating, from a reset pool each run; and with `cache_report=True` on every request (the
reports also turned into dicts for every output).

    .venv/bin/python benchmarks/bench_cache_reports.py [--scale 0.5] [--repeats 3]

Prints each run's wall time, the explainer's own time, and the ratios (the server-level W1 A/B
is in BENCHMARKS.md, with `prefixserve bench run --extra-body '{"cache_report": true}'`).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.bench.workloads import load_token_pool, make_workload  # noqa: E402
from prefixserve.model.loader.default_model import default_model_dir  # noqa: E402


class Timed:
    """Wraps the explainer's `explain`, adding up its seconds."""

    def __init__(self, explain):
        self.explain, self.seconds = explain, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.explain(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def run(llm: LLM, prompts, max_tokens: list[int], mode: str) -> tuple[float, float]:
    engine = llm.llm_engine
    manager = engine.kv_cache_manager
    assert llm.reset_prefix_cache(ram_only=True)
    explainer = engine.explainer
    timed = Timed(explainer.explain)
    explainer.explain = timed
    engine.scheduler.explainer = explainer if mode != "off" else None
    manager.block_pool.recorder = manager.recorder if mode != "off" else None
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=n, ignore_eos=True, cache_report=(mode == "report")
        )
        for n in max_tokens
    ]
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - start
    del explainer.explain  # back to the class's method
    return wall, timed.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=float, default=0.5)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    pool, _, special = load_token_pool(default_model_dir())
    workload = make_workload("W1", pool, seed=0, scale=args.scale)
    prompts = [special + list(r.prompt_token_ids) for r in workload.requests]
    max_tokens = [r.max_tokens for r in workload.requests]
    llm = LLM(enable_kv_store=False, max_model_len=4096)
    print(f"W1 x{args.scale}: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens")
    walls: dict[str, list[float]] = {"off": [], "on": [], "report": []}
    for repeat in range(args.repeats):
        for mode in ("off", "on", "report") if repeat % 2 == 0 else ("report", "on", "off"):
            wall, explain_s = run(llm, prompts, max_tokens, mode)
            walls[mode].append(wall)
            print(f"repeat {repeat} {mode:>6}: {wall:7.2f} s (explainer {explain_s * 1e3:.1f} ms)")
    for mode in ("on", "report"):
        ratios = [off / w for off, w in zip(walls["off"], walls[mode], strict=True)]
        print(
            f"{mode} vs off: req/s ratio {statistics.mean(ratios):.3f} "
            f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {len(ratios)} pairs"
        )


if __name__ == "__main__":
    main()
