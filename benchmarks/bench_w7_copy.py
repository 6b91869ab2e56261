"""Does the default model copy W7's prompts? Greedy outputs offline (`LLM` API) and what n-gram
drafts would make of them.

W7 (copy-heavy, prefixserve/bench/workloads.py) is meant for speculative decoding with n-gram
drafts: it is only worth running if greedy outputs really copy text from their prompts. This
runs the first `--requests` W7 prompts greedily (256 tokens, EOS ignored, as the benchmark does)
and prints per request, then over all:

- copy4: the share of the output's 4-grams that occur in the prompt;
- accept / tok/step: vLLM's `ngram` proposer replayed over prompt + output (the longest suffix
  match of `--lookup-min`..`--lookup-max` tokens, its earliest occurrence, up to `--k` drafts;
  greedy verification accepts drafts while they equal the output): accepted / proposed draft
  tokens, and output tokens per verification step (1 + accepted per step).

With `--speculative-config JSON` the engine itself speculates (`LLM(speculative_config=...)`)
and the engine's own spec-decode counters are printed as well.

    .venv/bin/python benchmarks/bench_w7_copy.py --requests 8
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import dataclass  # noqa: E402


def copy_fraction(prompt: Sequence[int], output: Sequence[int], n: int = 4) -> float:
    """The share of `output`'s n-grams that also occur in `prompt` (0.0 for a short output)."""
    seen = {tuple(prompt[i : i + n]) for i in range(len(prompt) - n + 1)}
    grams = [tuple(output[i : i + n]) for i in range(len(output) - n + 1)]
    return sum(g in seen for g in grams) / len(grams) if grams else 0.0


def propose(context: Sequence[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """vLLM's `ngram` proposal for `context`: the longest suffix of `lookup_min`..`lookup_max`
    tokens that occurs earlier in it, at its earliest occurrence, and up to `k` tokens after it."""
    total = len(context)
    for n in range(min(lookup_max, total - 1), lookup_min - 1, -1):
        suffix = list(context[total - n :])
        for start in range(total - n):
            if list(context[start : start + n]) == suffix:
                return list(context[start + n : start + n + k])
    return []


@dataclass(slots=True)
class Replay:
    steps: int = 0
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    output_tokens: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None

    @property
    def tokens_per_step(self) -> float | None:
        return self.output_tokens / self.steps if self.steps else None

    def add(self, other: Replay) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))


def replay_ngram(
    prompt: Sequence[int],
    output: Sequence[int],
    k: int = 4,
    lookup_min: int = 2,
    lookup_max: int = 5,
) -> Replay:
    """Replay greedy n-gram speculation over a finished greedy `output`: each step proposes from
    prompt + the output so far, accepts the drafts that equal the next output tokens, and emits
    them plus one token of its own."""
    context = list(prompt)
    out = list(output)
    r = Replay(output_tokens=len(out))
    i = 0
    while i < len(out):
        draft = propose(context, k, lookup_min, lookup_max)
        accepted = 0
        if draft:
            r.drafts += 1
            r.draft_tokens += len(draft)
            while accepted < len(draft) and i + accepted < len(out):
                if out[i + accepted] != draft[accepted]:
                    break
                accepted += 1
            r.accepted += accepted
        step = min(accepted + 1, len(out) - i)
        context += out[i : i + step]
        i += step
        r.steps += 1
    return r


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=8, help="the first N W7 requests")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--k", type=int, default=4, help="draft tokens per step (replay)")
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--lookup-max", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--speculative-config", default=None, help="JSON, as vLLM's flag")
    parser.add_argument("--show", action="store_true", help="print each output's text")
    args = parser.parse_args()

    from prefixserve.bench.workloads import load_text_encoder, load_token_pool, make_workload
    from prefixserve.llm import LLM
    from prefixserve.model.loader.default_model import ensure_default_model
    from prefixserve.sampling_params import SamplingParams

    model_dir = ensure_default_model()
    pool, decode, special_prefix = load_token_pool(model_dir)
    workload = make_workload(
        "W7", pool, seed=args.seed, scale=args.requests / 32, text=load_text_encoder(model_dir)
    )
    prompts = [[*special_prefix, *r.prompt_token_ids] for r in workload.requests]
    extra = {}
    if args.speculative_config:
        extra["speculative_config"] = json.loads(args.speculative_config)
    llm = LLM(None, dtype=args.dtype, enable_kv_store=False, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    total = Replay()
    copies = []
    print("| request | prompt tokens | copy4 | accept | tok/step |")
    print("|---|--:|--:|--:|--:|")
    for req, prompt, out in zip(workload.requests, prompts, outputs, strict=True):
        ids = list(out.outputs[0].token_ids)
        copy = copy_fraction(prompt, ids)
        replay = replay_ngram(prompt, ids, args.k, args.lookup_min, args.lookup_max)
        copies.append(copy)
        total.add(replay)
        print(
            f"| {req.request_id} | {len(prompt)} | {copy:.2f} | {_fmt(replay.acceptance_rate)} "
            f"| {_fmt(replay.tokens_per_step)} |"
        )
        if args.show:
            print(repr(decode(ids)))
    print(
        f"\nW7 seed {args.seed}, {len(prompts)} requests, {args.dtype}, "
        f"generated in {seconds:.1f} s: "
        f"copy4 {sum(copies) / len(copies):.3f}; replayed ngram k={args.k} "
        f"[{args.lookup_min}, {args.lookup_max}]: acceptance {_fmt(total.acceptance_rate)}, "
        f"{_fmt(total.tokens_per_step)} tokens per step"
    )
    if args.speculative_config:
        metrics = llm.get_metrics()
        print({k: v for k, v in metrics.items() if k.startswith("spec_decode")})


if __name__ == "__main__":
    main()
