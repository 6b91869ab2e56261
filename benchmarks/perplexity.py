"""Perplexity of the model over a fixed text, by model file, weight quantization and KV-cache
dtype (the cost in accuracy of 8-bit weights and of an 8-bit KV cache), same run.

    .venv/bin/python benchmarks/perplexity.py [--model M[,M2...]] [--dtype bfloat16]
        [--quantizations none,int8] [--kv-cache-dtypes auto,int8,fp8_e4m3] [--window 512]
        [--text FILE]

The text ships with the repository (`benchmarks/data/perplexity_text.txt`, written for it: no
download). It is tokenized once and cut into windows of `--window` tokens; each window is one
prompt whose prompt logprobs give the negative log-likelihood of every token after its first.
Every token is scored against K/V as the cache stores them (an 8-bit cache's chunk attends to its
own rows read back). Perplexity = exp(mean NLL); each row is printed with its ratio to the first
(e.g. the bf16 file with --quantization none and the model's own KV dtype).
"""

from __future__ import annotations

import argparse
import math
import platform
from pathlib import Path

from prefixserve import LLM, SamplingParams
from prefixserve.model.loader.loading import load_model

TEXT = Path(__file__).parent / "data" / "perplexity_text.txt"


def windows(token_ids: list[int], size: int) -> list[list[int]]:
    """Consecutive windows of `size` tokens (the last may be shorter; one of < 2 is dropped)."""
    parts = [token_ids[i : i + size] for i in range(0, len(token_ids), size)]
    return [p for p in parts if len(p) >= 2]


def mean_nll(llm: LLM, prompts: list[list[int]]) -> tuple[float, int]:
    """The mean negative log-likelihood of every scored token, and how many were scored."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    total, count = 0.0, 0
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        for position, entry in enumerate(out.prompt_logprobs or []):
            if entry is None:  # the first token has no logprob
                continue
            total -= entry[prompt[position]].logprob
            count += 1
    return total / count, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="comma-separated models (default: the default)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantizations", default="none", help="comma-separated --quantization")
    ap.add_argument("--kv-cache-dtypes", default="auto,int8,fp8_e4m3")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--text", type=Path, default=TEXT)
    args = ap.parse_args()
    cpuinfo = open("/proc/cpuinfo").read() if Path("/proc/cpuinfo").exists() else ""
    flags = " ".join(
        f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in cpuinfo
    )
    base = None
    print(f"# {platform.machine()} ({flags}); compute {args.dtype}")
    print("| model | weights | KV cache | tokens scored | mean NLL | perplexity | vs first |")
    print("|---|---|---|---:|---:|---:|---:|")
    for model in (args.model or "").split(","):
        for quantization in args.quantizations.split(","):
            loaded = load_model(model or None, dtype=args.dtype, quantization=quantization)
            weights = loaded.config.quantization or args.dtype
            for kv in args.kv_cache_dtypes.split(","):
                llm = LLM(loaded_model=loaded, dtype=args.dtype, kv_cache_dtype=kv)
                token_ids = llm.get_tokenizer().encode(args.text.read_text())
                nll, count = mean_nll(llm, windows(token_ids, args.window))
                ppl = math.exp(nll)
                base = base if base is not None else ppl
                print(
                    f"| {Path(model).name if model else 'default'} | {weights} | {kv} | {count} "
                    f"| {nll:.4f} | {ppl:.3f} | {ppl / base - 1:+.2%} |",
                    flush=True,
                )
                llm.llm_engine.close()


if __name__ == "__main__":
    main()
