"""Does a prefix-cache hit change bf16 outputs? Greedy answers served cold (prefix caching off)
and from a warm cache, each request alone, in the default mode (batch-invariant wherever the
native kernels run) and with --no-batch-invariant, same run.

    .venv/bin/python benchmarks/bench_batch_invariance.py [--model PATH] [--docs 4]
        [--questions 8] [--tokens 32] [--words 300]

Counts the requests whose tokens (and whose logprobs) differ between the two runs of a mode,
and times each run (a side note: the serving benchmarks measure speed).
"""

from __future__ import annotations

import argparse
import random
import time

from prefixserve.llm import LLM
from prefixserve.model.kernels.calibration import describe_calibration
from prefixserve.model.kernels.cpu_paths import describe_cpu
from prefixserve.sampling_params import SamplingParams

WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which "
    "river stone market winter engine letter garden signal copper island"
).split()


def prompts(docs: int, questions: int, words: int) -> list[str]:
    """`docs` made-up documents of `words` words, each with `questions` questions after it."""
    out = []
    for d in range(docs):
        rng = random.Random(d)
        document = " ".join(rng.choice(WORDS) for _ in range(words))
        for q in range(questions):
            word = WORDS[(7 * q + d) % len(WORDS)]
            out.append(f"{document}\n\nQuestion {q}: what does the text say about {word}?")
    return out


def run(model: str | None, texts: list[str], tokens: int, caching: bool, invariant: bool | None):
    llm = LLM(
        model,
        dtype="bfloat16",
        enable_prefix_caching=caching,
        enable_kv_store=False,
        batch_invariant=invariant,
    )
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    answers = []
    started = time.perf_counter()
    for text in texts:  # each request alone
        completion = llm.generate([text], params, use_tqdm=False)[0].outputs[0]
        logprobs = tuple(
            tuple(sorted((t, lp.logprob) for t, lp in step.items())) for step in completion.logprobs
        )
        answers.append((tuple(completion.token_ids), logprobs))
    return answers, time.perf_counter() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--words", type=int, default=300)
    args = ap.parse_args()
    texts = prompts(args.docs, args.questions, args.words)
    print(describe_cpu())
    print(describe_calibration())
    print("| mode | requests | tokens differ | logprobs differ | cold s | warm s |")
    print("|---|---:|---:|---:|---:|---:|")
    for invariant in (None, False):
        cold, cold_s = run(args.model, texts, args.tokens, False, invariant)
        warm, warm_s = run(args.model, texts, args.tokens, True, invariant)
        tokens = sum(a[0] != b[0] for a, b in zip(cold, warm, strict=True))
        logprobs = sum(a[1] != b[1] for a, b in zip(cold, warm, strict=True))
        mode = "default" if invariant is None else "--no-batch-invariant"
        print(f"| {mode} | {len(texts)} | {tokens} | {logprobs} | {cold_s:.1f} | {warm_s:.1f} |")


if __name__ == "__main__":
    main()
