"""Offline prefix-caching benchmark on workload W1, with the `LLM` API.

W1: 4 prefixes of 1,024 random tokens x 8 requests, each with its own 64-token suffix; 16 greedy
output tokens with EOS ignored; block size 16. Prints wall time, cached prompt tokens and hit rate
with prefix caching on and off, then the time to first token of a 1,088-token prompt whose
1,024-token prefix is cached against one whose prefix is not.

    .venv/bin/python benchmarks/bench_prefix_caching.py [--dtype bfloat16] [--repeats 3]
    .venv/bin/python benchmarks/bench_prefix_caching.py --divergence 20   # bf16 study only

`--divergence N` instead measures how often greedy outputs of N random prompts differ from the
same prompt run alone with caching off: when cold, on a prefix hit, and batched without caching.

OMP_WAIT_POLICY defaults to PASSIVE (set before torch is imported): on a CPU shared with other
work, OpenMP's spinning wait makes small matmuls 10-50x slower (see "Model speed").
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.bench.workloads import make_w1, token_pool_from_tokenizer  # noqa: E402
from prefixserve.model.loader.loading import load_model  # noqa: E402


def run_w1(loaded, prompts, enable_prefix_caching: bool, args) -> dict:
    llm = LLM(
        dtype=args.dtype,
        block_size=16,
        enable_prefix_caching=enable_prefix_caching,
        max_num_batched_tokens=args.max_num_batched_tokens,
        loaded_model=loaded,
    )
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    llm.llm_engine.check_no_leaks()
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(o.num_cached_tokens for o in outputs)
    metrics = llm.get_metrics()
    return {
        "wall": wall,
        "cpu": cpu,
        "prompt_tokens": prompt_tokens,
        "cached": cached,
        "hit_rate": cached / prompt_tokens,
        "computed_prompt_tokens": metrics["computed_prompt_tokens"],
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "outputs": [o.outputs[0].token_ids for o in outputs],
    }


def time_to_first_token(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    start = time.perf_counter()
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start, out.num_cached_tokens


def divergence_study(loaded, num_prompts: int, seed: int) -> None:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(1000, 20000) for _ in range(rng.randrange(20, 300))]
        for _ in range(num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    dtype = loaded.config.dtype

    def alone(llm: LLM) -> list:
        return [
            llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
            for p in prompts
        ]

    off = LLM(dtype=dtype, loaded_model=loaded, enable_prefix_caching=False)
    reference = alone(off)
    batched = [
        o.outputs[0]
        for o in off.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]
    on = LLM(dtype=dtype, loaded_model=loaded)
    cold = alone(on)
    hit = alone(on)
    print(
        f"# greedy divergence from the same prompt alone with caching off, {dtype}, "
        f"{num_prompts} prompts of 20-300 tokens, 16 tokens"
    )
    print("| run | outputs that differ | first differing token | reference top1-top2 gap there |")
    print("|---|---:|---|---|")
    for name, outs in (
        ("caching on, cold", cold),
        ("caching on, prefix hit", hit),
        ("caching off, all batched", batched),
    ):
        firsts, gaps = [], []
        for ref, out in zip(reference, outs, strict=True):
            a, b = ref.token_ids, out.token_ids
            if a != b:
                k = next(i for i in range(len(a)) if a[i] != b[i])
                top = sorted((lp.logprob for lp in ref.logprobs[k].values()), reverse=True)
                firsts.append(k)
                gaps.append(round(top[0] - top[1], 4) if len(top) > 1 else None)
        print(f"| {name} | {len(firsts)} / {num_prompts} | {firsts} | {gaps} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3, help="TTFT repeats (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument(
        "--divergence",
        type=int,
        default=0,
        metavar="N",
        help="only run the greedy-divergence study over N prompts",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(None, dtype=args.dtype)
    if args.divergence:
        divergence_study(loaded, args.divergence, args.seed)
        return
    pool = token_pool_from_tokenizer(loaded.tokenizer.hf_tokenizer.backend_tokenizer)
    workload = make_w1(pool, seed=args.seed)
    prompts = [r.prompt_token_ids for r in workload.requests]
    assert len(prompts) == 32 and all(len(p) == 1088 for p in prompts)

    # Warm up torch's kernels once, outside the timings.
    warm = LLM(dtype=args.dtype, loaded_model=loaded, enable_prefix_caching=False)
    warm.generate(
        [{"prompt_token_ids": prompts[0][:300]}], SamplingParams(max_tokens=4), use_tqdm=False
    )

    on = run_w1(loaded, prompts, True, args)
    off = run_w1(loaded, prompts, False, args)
    same = sum(a == b for a, b in zip(on["outputs"], off["outputs"], strict=True))

    # TTFT: a fresh 1,024-token prefix each repeat; first a cold prompt, then the same prefix
    # with another 64-token suffix.
    rng = random.Random(args.seed + 1)
    llm = LLM(
        dtype=args.dtype, loaded_model=loaded, max_num_batched_tokens=args.max_num_batched_tokens
    )
    cold, hot = [], []
    for _ in range(args.repeats):
        prefix = [rng.choice(pool) for _ in range(1024)]
        t_cold, c_cold = time_to_first_token(llm, prefix + [rng.choice(pool) for _ in range(64)])
        t_hot, c_hot = time_to_first_token(llm, prefix + [rng.choice(pool) for _ in range(64)])
        assert c_cold == 0 and c_hot == 1024, (c_cold, c_hot)
        cold.append(t_cold)
        hot.append(t_hot)
    llm.llm_engine.check_no_leaks()

    print(
        f"# prefixserve W1, model default (SmolLM2-135M-Instruct), dtype {args.dtype}, "
        f"block 16, max_num_batched_tokens {args.max_num_batched_tokens}"
    )
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{platform.processor() or platform.machine()}, "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, load average at the end "
        f"{os.getloadavg()[0]:.1f}"
    )
    print()
    print(
        "| prefix caching | wall (s) | process CPU (s) | prompt tokens | cached tokens | "
        "hit rate | computed prompt tokens | output tokens |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in (("on", on), ("off", off)):
        print(
            f"| {name} | {r['wall']:.2f} | {r['cpu']:.2f} | {r['prompt_tokens']:,} | "
            f"{r['cached']:,} | "
            f"{r['hit_rate']:.1%} | {r['computed_prompt_tokens']:,} | {r['output_tokens']} |"
        )
    print()
    print(
        f"speed-up from caching: {off['wall'] / on['wall']:.1f}x; greedy outputs identical "
        f"on vs off: {same}/{len(prompts)}"
    )
    print()
    print("| time to first token, 1,088-token prompt | median (s) | runs (s) |")
    print("|---|---:|---|")
    print(
        f"| cold (nothing cached) | {statistics.median(cold):.3f} | "
        f"{', '.join(f'{t:.3f}' for t in cold)} |"
    )
    print(
        f"| 1,024-token prefix cached | {statistics.median(hot):.3f} | "
        f"{', '.join(f'{t:.3f}' for t in hot)} |"
    )


if __name__ == "__main__":
    main()
