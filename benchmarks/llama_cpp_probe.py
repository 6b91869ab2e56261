"""llama.cpp's prefill and batch-1 decode, for bench_model.py --llama-cpp (run in the peer's venv).

    $PEERS_DIR/llama_cpp/bin/python benchmarks/llama_cpp_probe.py GGUF --threads 2 \
        [--prefill-len 512] [--context 128] [--decode-steps 16] [--repeats 3] [--vocab 49152]

Prints one JSON object: per repeat, (wall tok/s, cpu tok/s) of a prefill of --prefill-len random
tokens and of --decode-steps greedy decode steps after a --context-token prompt (the same random
prompts as bench_model.py). It runs in its own process: ggml's worker threads poll for work
after each call, which would take the cores from the engines measured in bench_model's process.
"""

from __future__ import annotations

import argparse
import json
import random
import time


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def timed(fn, threads: int) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, (time.process_time() - c0) / threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    import llama_cpp

    model = llama_cpp.Llama(
        args.gguf,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=max(2048, args.prefill_len + 1, args.context + args.decode_steps + 1),
        n_batch=512,
        verbose=False,
    )
    prompt = random_prompt(args.prefill_len, args.vocab, 0)
    context = random_prompt(args.context, args.vocab, 1)

    def prefill() -> None:
        model.reset()
        model.eval(prompt)

    def decode() -> None:
        tok = int(model.scores[model.n_tokens - 1].argmax())
        for _ in range(args.decode_steps):
            model.eval([tok])
            tok = int(model.scores[model.n_tokens - 1].argmax())

    prefill()  # warm-up
    out: dict[str, list[tuple[float, float]]] = {"prefill": [], "decode_b1": []}
    for _ in range(args.repeats):
        wall, cpu = timed(prefill, args.threads)
        out["prefill"].append((args.prefill_len / wall, args.prefill_len / cpu))
        model.reset()
        model.eval(context)
        wall, cpu = timed(decode, args.threads)
        out["decode_b1"].append((args.decode_steps / wall, args.decode_steps / cpu))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
