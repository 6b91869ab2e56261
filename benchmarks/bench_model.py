"""Model speed: our paged-KV model vs transformers' own model on the same weights, same run.

    .venv/bin/python benchmarks/bench_model.py [--repeats 5] [--skip-transformers]

Measures (bf16, default model unless --model): prefill of one 512-token chunk (tok/s), decode
at batch 1 and batch 16 (tok/s, total over the batch) on a 128-token context. Each figure is the
median over --repeats runs (this machine is shared and noisy). Sampling is a plain argmax so
that the figures are the model's; transformers' prefill uses logits_to_keep=1, as its
`generate` does.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from prefixserve.batch import ScheduledRequest, SchedulerOutput
from prefixserve.model.loader import load_model
from prefixserve.request import Request
from prefixserve.runner import ModelRunner
from prefixserve.sampling_params import SamplingParams


class ArgmaxSampler:
    def __call__(self, logits, requests, generators):
        return [(int(i), None) for i in logits.argmax(dim=-1).tolist()]


def median_rate(fn, tokens: int, repeats: int) -> tuple[float, list[float]]:
    fn()  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        rates.append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates), rates


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


class Ours:
    def __init__(self, loaded, block_size: int = 16, num_blocks: int = 1024) -> None:
        self.bs = block_size
        self.runner = ModelRunner(
            loaded.model, loaded.config, num_blocks, block_size, sampler=ArgmaxSampler()
        )
        self.vocab = loaded.config.vocab_size
        self.next_block = 1
        self.num_blocks = num_blocks

    def _blocks(self, n_tokens: int) -> tuple[list[int], ...]:
        count = -(-n_tokens // self.bs)
        if self.next_block + count > self.num_blocks:
            self.next_block = 1
        ids = list(range(self.next_block, self.next_block + count))
        self.next_block += count
        return tuple(ids for _ in self.runner.group_windows)

    def prefill(self, n: int) -> None:
        req = Request("p", random_prompt(n, self.vocab, 0), SamplingParams(temperature=0))
        entry = ScheduledRequest(req, 0, n, self._blocks(n))
        self.runner.execute(SchedulerOutput([entry]))

    def decode_setup(self, batch: int, context: int, steps: int) -> None:
        self.entries = []
        for i in range(batch):
            req = Request(f"d{i}", random_prompt(context, self.vocab, i + 1), SamplingParams())
            self.entries.append(ScheduledRequest(req, 0, context, self._blocks(context + steps)))
        out = self.runner.execute(SchedulerOutput(self.entries))
        for e in self.entries:
            e.request.append_output_token_ids(out.sampled_token_ids[e.request.request_id])
            e.num_computed_tokens = context
            e.num_new_tokens = 1

    def decode_steps(self, steps: int) -> None:
        for _ in range(steps):
            out = self.runner.execute(SchedulerOutput(self.entries))
            for e in self.entries:
                e.request.append_output_token_ids(out.sampled_token_ids[e.request.request_id])
                e.num_computed_tokens += 1


class Transformers:
    def __init__(self, path, vocab: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16).eval()
        self.vocab = vocab

    @torch.inference_mode()
    def prefill(self, n: int) -> None:
        ids = torch.tensor([random_prompt(n, self.vocab, 0)])
        self.model(ids, use_cache=True, logits_to_keep=1)

    @torch.inference_mode()
    def decode_setup(self, batch: int, context: int, steps: int) -> None:
        ids = torch.tensor([random_prompt(context, self.vocab, i + 1) for i in range(batch)])
        out = self.model(ids, use_cache=True, logits_to_keep=1)
        self.cache = out.past_key_values
        self.tok = out.logits[:, -1].argmax(-1, keepdim=True)

    @torch.inference_mode()
    def decode_steps(self, steps: int) -> None:
        for _ in range(steps):
            out = self.model(self.tok, past_key_values=self.cache, use_cache=True)
            self.cache = out.past_key_values
            self.tok = out.logits[:, -1].argmax(-1, keepdim=True)


def run(engine, name: str, args) -> dict[str, float]:
    res = {}
    rate, _ = median_rate(lambda: engine.prefill(args.prefill_len), args.prefill_len, args.repeats)
    res["prefill"] = rate
    print(f"{name:14s} prefill {args.prefill_len}: {rate:8.1f} tok/s", flush=True)
    for batch in (1, 16):
        engine.decode_setup(batch, args.context, args.decode_steps * (args.repeats + 1))
        rate, _ = median_rate(
            lambda: engine.decode_steps(args.decode_steps),
            batch * args.decode_steps,
            args.repeats,
        )
        res[f"decode_b{batch}"] = rate
        print(f"{name:14s} decode batch {batch:2d}: {rate:8.1f} tok/s", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the default model)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()

    loaded = load_model(args.model, dtype="bfloat16")
    print(f"model {loaded.path} | torch {torch.__version__} | threads {torch.get_num_threads()}")
    results = {"prefixserve": run(Ours(loaded), "prefixserve", args)}
    if not args.skip_transformers:
        hf = Transformers(loaded.path, loaded.config.vocab_size)
        results["transformers"] = run(hf, "transformers", args)

    print()
    print(f"| {'engine':14s} | prefill 512 tok/s | decode b1 tok/s | decode b16 tok/s |")
    print("|----------------|------------------:|----------------:|-----------------:|")
    for name, r in results.items():
        print(
            f"| {name:14s} | {r['prefill']:17.0f} | {r['decode_b1']:15.1f} "
            f"| {r['decode_b16']:16.1f} |"
        )


if __name__ == "__main__":
    main()
