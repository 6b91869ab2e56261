"""Do the packaged models' bf16 greedy answers equal their fp32 path's? (issue 56)

    .venv/bin/python benchmarks/greedy_fp32_agreement.py [--models default gemma3]
        [--tokens 24] [--bf16-logits] [--limit 50]

Each of the 50 short factual questions of benchmarks/data/factual_prompts.json is answered
greedily, alone, by the model in the default bf16 mode and in float32 (the fp32 path), `--tokens`
new tokens each (the default model through its chat template; Gemma 3 270M, a base model, as
"Question: ...\\nAnswer:"). Counts the answers whose tokens are equal, and the steps of each run
whose two best logprobs are exactly equal (a tie: rounding the logits to bf16 made them). With
`--bf16-logits` the bf16 run rounds the LM head's output to bf16 as before issue 56 (the old
behaviour, to compare in the same run).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from prefixserve.llm import LLM
from prefixserve.model.kernels.cpu_paths import describe_cpu
from prefixserve.model.loader.loading import load_model
from prefixserve.sampling_params import SamplingParams

PROMPTS_FILE = Path(__file__).parent / "data" / "factual_prompts.json"


def questions(limit: int) -> list[str]:
    return json.loads(PROMPTS_FILE.read_text())["questions"][:limit]


def model_dir(name: str) -> str | None:
    """None for the packaged default model; Gemma 3 270M's converted directory."""
    if name == "default":
        return None
    from prefixserve.model.loader.default_model import ensure_gemma3_270m

    return str(ensure_gemma3_270m())


def prompt_ids(tokenizer, name: str, question: str) -> list[int]:
    if name == "default":
        return tokenizer.apply_chat_template([{"role": "user", "content": question}])
    return tokenizer.encode(f"Question: {question}\nAnswer:")


def round_logits_to_bf16(loaded) -> None:
    """The head as it was before issue 56: its output rounded to bf16, then widened."""
    head = loaded.model.lm_head
    head.forward_fp32 = lambda x: head.forward(x).float()


def answer_all(name: str, dtype: str, texts: list[str], tokens: int, bf16_logits: bool):
    """Each question answered alone: [(token ids, tied steps)], and the run's seconds."""
    loaded = load_model(model_dir(name), dtype=dtype)
    if bf16_logits:
        round_logits_to_bf16(loaded)
    llm = LLM(model_dir(name), loaded_model=loaded, dtype=dtype, enable_kv_store=False)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=2)
    out = []
    started = time.perf_counter()
    for text in texts:
        ids = prompt_ids(loaded.tokenizer, name, text)
        completion = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        steps = completion.outputs[0].logprobs or []
        ties = sum(_top_two_tied(step) for step in steps)
        out.append((tuple(completion.outputs[0].token_ids), ties))
    return out, time.perf_counter() - started


def _top_two_tied(step: dict) -> bool:
    best = sorted((lp.logprob for lp in step.values()), reverse=True)
    return len(best) >= 2 and best[0] == best[1]


def compare(name: str, texts: list[str], tokens: int, bf16_logits: bool) -> dict:
    bf16, bf16_s = answer_all(name, "bfloat16", texts, tokens, bf16_logits)
    fp32, fp32_s = answer_all(name, "float32", texts, tokens, False)
    return {
        "model": name,
        "logits": "bf16-rounded (old)" if bf16_logits else "fp32",
        "prompts": len(texts),
        "equal": sum(a[0] == b[0] for a, b in zip(bf16, fp32, strict=True)),
        "first_token_equal": sum(a[0][:1] == b[0][:1] for a, b in zip(bf16, fp32, strict=True)),
        "bf16_tied_steps": sum(a[1] for a in bf16),
        "fp32_tied_steps": sum(b[1] for b in fp32),
        "different": [i for i, (a, b) in enumerate(zip(bf16, fp32, strict=True)) if a[0] != b[0]],
        "seconds": (round(bf16_s, 1), round(fp32_s, 1)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["default", "gemma3"])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--limit", type=int, default=50)
    parser.add_argument("--bf16-logits", action="store_true")
    args = parser.parse_args()
    texts = questions(args.limit)
    print(describe_cpu())
    print("| model | logits | equal answers | equal first tokens | tied steps bf16 / fp32 |")
    print("|---|---|---|---|---|")
    for name in args.models:
        row = compare(name, texts, args.tokens, args.bf16_logits)
        print(
            f"| {row['model']} | {row['logits']} | {row['equal']}/{row['prompts']} | "
            f"{row['first_token_equal']}/{row['prompts']} | "
            f"{row['bf16_tied_steps']} / {row['fp32_tied_steps']} |"
        )
        print(f"  differing prompts: {row['different']}; seconds bf16/fp32: {row['seconds']}")


if __name__ == "__main__":
    main()
