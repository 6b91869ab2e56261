"""LoRA's cost per engine step: the base model against 1, 2 and 4 adapters mixed in one batch.

    .venv/bin/python benchmarks/bench_lora.py [--repeats 5] [--batches 1,16] [--rank 16]
        [--targets all|qv] [--steps 24] [--context 128]

The default model in bf16 through the whole engine (scheduler, runner, sampler), `--max-loras 4`.
Each configuration adds `batch` requests of `--context` random tokens, request i under adapter
i mod k (none for the base model), steps until every request has decoded once, then times
`--steps` decode steps one by one (the median of those is the configuration's step time).
Requests of one adapter are interleaved with the others' on purpose (the runner groups them).
Configurations alternate within each repeat; the table gives the median over repeats and each
configuration's ratio to the base model at the same batch, with the spread over repeats.
Adapters are random (`prefixserve.bench.lora_adapters`), of rank --rank on all seven
projections (or q and v only), the shape vLLM's LoRA benchmarks use.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

from prefixserve.bench.lora_adapters import ALL_MODULES, write_random_adapter  # noqa: E402
from prefixserve.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig  # noqa: E402
from prefixserve.engine.llm_engine import LLMEngine  # noqa: E402
from prefixserve.lora.config import LoRARequest  # noqa: E402
from prefixserve.model.kernels.cpu_paths import describe_cpu  # noqa: E402
from prefixserve.model.loader.loading import load_model  # noqa: E402
from prefixserve.sampling_params import SamplingParams  # noqa: E402


def step_time(engine: LLMEngine, batch: int, adapters: list[LoRARequest], args, tag: str) -> float:
    rng = random.Random(hash((tag, batch, len(adapters))) & 0xFFFF)
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 4, ignore_eos=True)
    ids = []
    for i in range(batch):
        rid = f"{tag}-{i}"
        prompt = [rng.randrange(1000, 20000) for _ in range(args.context)]
        lora = adapters[i % len(adapters)] if adapters else None
        engine.add_request(rid, prompt, params, lora_request=lora)
        ids.append(rid)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.abort_request(ids)
    engine.check_no_leaks()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", choices=("all", "qv"), default="all")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--context", type=int, default=128)
    args = parser.parse_args()
    print(describe_cpu())
    loaded = load_model(None, dtype="bfloat16")
    targets = ALL_MODULES if args.targets == "all" else ("q_proj", "v_proj")
    root = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    adapters = [
        LoRARequest(
            f"a{i}",
            i + 1,
            str(write_random_adapter(root / f"a{i}", loaded.config, args.rank, targets, seed=i)),
        )
        for i in range(4)
    ]
    config = EngineConfig(
        dtype="bfloat16",
        cache=CacheConfig(num_kv_blocks=2048, enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096),
        lora=LoRAConfig(max_loras=4, max_lora_rank=max(16, args.rank)),
    )
    engine = LLMEngine(config, loaded_model=loaded)
    batches = [int(b) for b in args.batches.split(",")]
    counts = [0, 1, 2, 4]
    results: dict[tuple[int, int], list[float]] = {}
    for repeat in range(args.repeats):
        for batch in batches:
            for k in counts if repeat % 2 == 0 else reversed(counts):
                t = step_time(engine, batch, adapters[:k], args, f"r{repeat}")
                results.setdefault((batch, k), []).append(t)
    print(
        f"\nrank {args.rank}, targets {args.targets}, context {args.context}, "
        f"{args.repeats} repeats; step ms median (min-max), ratio to base median (min-max)"
    )
    print("| batch | adapters | step ms | vs base |")
    print("|---:|---:|---:|---:|")
    for batch in batches:
        base = results[(batch, 0)]
        for k in counts:
            ts = results[(batch, k)]
            ratios = [t / b for t, b in zip(ts, base, strict=True)]
            print(
                f"| {batch} | {k or 'base'} | {statistics.median(ts) * 1e3:.1f} "
                f"({min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f}) | {statistics.median(ratios):.2f}x "
                f"({min(ratios):.2f}-{max(ratios):.2f}) |"
            )


if __name__ == "__main__":
    main()
