"""Model speed: our paged-KV model vs transformers' own model on the same weights, same run.

    .venv/bin/python benchmarks/bench_model.py [--repeats 7] [--skip-transformers] [--baseline]
        [--llama-cpp] [--decode-batches 1,16,64] [--batch-invariant] [--no-native-gemm-baseline]
        [--python-layers-baseline] [--portable-attention-baseline] [--before-baseline]
        [--no-batch-invariant] [--tiles-baseline avx2,avx512] [--kv-cache-dtypes int8,fp8_e4m3]

Measures (bf16, the default model unless --model): prefill of one 512-token chunk (tok/s), and
decode at batch 1 and batch 16 (tok/s, summed over the batch) on a 128-token context (all three
settable). `--baseline` adds prefixserve without its CPU fast paths (the compiled attention
and RMSNorm kernels, fp32 GEMMs for prefill) to the same run. The
engines alternate repeat by repeat and each figure is the median over --repeats runs (this
machine is shared and noisy). Each figure comes twice: by wall time, and by process CPU time
divided by the thread count (an estimate of the wall time on an otherwise idle machine; it
excludes time the threads spent descheduled by other tenants). Sampling is a plain argmax so
that the figures are the model's; transformers' prefill uses logits_to_keep=1, as its
`generate` does.

OMP_WAIT_POLICY defaults to PASSIVE here (set before torch is imported): on a CPU shared with
other busy processes, spinning OpenMP threads make small matmuls up to 50x slower.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from prefixserve.core.request import Request  # noqa: E402
from prefixserve.core.sched.output import ScheduledRequest, SchedulerOutput  # noqa: E402
from prefixserve.model.kernels.build import (  # noqa: E402
    _module,
    paged_attention_portable_kernel,
    rms_norm_kernel,
)
from prefixserve.model.kernels.calibration import describe_calibration  # noqa: E402
from prefixserve.model.kernels.cpu_paths import describe_cpu  # noqa: E402
from prefixserve.model.layers import kernel_table  # noqa: E402
from prefixserve.model.layers import linear as layers  # noqa: E402
from prefixserve.model.loader.loading import load_model  # noqa: E402
from prefixserve.sampling_params import SamplingParams  # noqa: E402
from prefixserve.worker.model_runner import ModelRunner  # noqa: E402


class ArgmaxSampler:
    def __call__(self, logits, requests, generators):
        return [(int(i), None) for i in logits.argmax(dim=-1).tolist()]


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n,), generator=g).tolist()


def portable_attention(engine: Ours) -> Ours:
    """`engine` with attention routed as before the keys-in-lanes kernels (the paged kernel's
    portable path under KERNEL_MAX_QUERIES, then SDPA or the prefill kernel)."""
    engine.runner.attention_kernel = paged_attention_portable_kernel()
    engine.runner.kernel_max_queries = None
    return engine


class Ours:
    name = "prefixserve"

    def __init__(
        self,
        loaded,
        block_size: int = 16,
        num_blocks: int = 1024,
        name: str = "prefixserve",
        batch_invariant: bool | None = None,
        tiles: str | None = None,
        kv_cache_dtype: str = "auto",
    ) -> None:
        self.name = name
        self.bs = block_size
        self.runner = ModelRunner(
            loaded.model,
            loaded.config,
            num_blocks,
            block_size,
            sampler=ArgmaxSampler(),
            batch_invariant=batch_invariant,
            kv_cache_dtype=kv_cache_dtype,
        )
        self.vocab = loaded.config.vocab_size
        self.next_block = 1
        self.num_blocks = num_blocks
        self.native = True  # the compiled kernels (attention, RMSNorm); False for --baseline
        self.tiles = tiles  # the GEMM's tile family for every call (--tiles-baseline), or None

    def _execute(self, scheduler_output: SchedulerOutput):
        # The RMSNorm kernel is looked up process-wide; switch it per engine for --baseline.
        kernel_table._kernels["rms_norm"] = rms_norm_kernel() if self.native else None
        if self.tiles is None:
            return self.runner.execute(scheduler_output)
        module = _module()
        selected = module.gemm_bf16_selected()
        module.gemm_bf16_select(self.tiles, self.tiles)
        try:
            return self.runner.execute(scheduler_output)
        finally:
            module.gemm_bf16_select(selected[0], selected[1])

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
        self._execute(SchedulerOutput([entry]))

    def decode_setup(self, batch: int, context: int, steps: int) -> None:
        self.entries = []
        for i in range(batch):
            req = Request(f"d{i}", random_prompt(context, self.vocab, i + 1), SamplingParams())
            self.entries.append(ScheduledRequest(req, 0, context, self._blocks(context + steps)))
        out = self._execute(SchedulerOutput(self.entries))
        for e in self.entries:
            e.request.append_output_token_ids(out.sampled_token_ids[e.request.request_id])
            e.num_computed_tokens = context
            e.num_new_tokens = 1

    def decode_steps(self, steps: int) -> None:
        for _ in range(steps):
            out = self._execute(SchedulerOutput(self.entries))
            for e in self.entries:
                e.request.append_output_token_ids(out.sampled_token_ids[e.request.request_id])
                e.num_computed_tokens += 1


class FixedRows(Ours):
    """prefixserve on the same weights with another fp32 row threshold and the LM head in bf16
    (`--fp32-rows-baseline`): each of its steps swaps the two in, and back out after."""

    def __init__(self, loaded, rows: int, **kwargs) -> None:
        super().__init__(loaded, **kwargs)
        self.rows = rows
        self.head = loaded.model.lm_head

    def _execute(self, scheduler_output: SchedulerOutput):
        rows, head_fp32 = layers.FP32_MIN_ROWS, self.head._fp32
        layers.FP32_MIN_ROWS, self.head._fp32 = self.rows, None
        try:
            return super()._execute(scheduler_output)
        finally:
            layers.FP32_MIN_ROWS, self.head._fp32 = rows, head_fp32


def llama_cpp_rates(model_path, vocab: int, args) -> dict[str, list[tuple[float, float]]]:
    """llama.cpp's (wall, cpu) tok/s samples: prefill and decode batch 1, measured by
    llama_cpp_probe.py in the peer's venv (scripts/peers/setup_llama_cpp.sh) on the bf16 GGUF of
    the same weights, with as many threads as torch has, after the in-process engines."""
    import json
    import subprocess
    from pathlib import Path

    from prefixserve.settings import peers_dir

    python = peers_dir() / "llama_cpp" / "bin" / "python"
    gguf = peers_dir() / "gguf" / f"{Path(model_path).name}-bf16.gguf"
    if args.model and str(args.model).endswith(".gguf"):  # the very file our engines run
        gguf = Path(args.model)
    if not python.exists() or not gguf.exists():
        raise SystemExit(f"--llama-cpp needs scripts/peers/setup_llama_cpp.sh first ({gguf})")
    probe = Path(__file__).with_name("llama_cpp_probe.py")
    command = [str(python), str(probe), str(gguf), "--threads", str(torch.get_num_threads())]
    for flag in ("prefill_len", "context", "decode_steps", "repeats"):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    command += ["--vocab", str(vocab)]
    # llama.cpp with its own defaults: this process's OMP_WAIT_POLICY=PASSIVE would make ggml's
    # OpenMP threads sleep between its ops (decode batch 1: 39 against 115 tok/s here).
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env.update(item.split("=", 1) for item in args.llama_cpp_env)
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return {k: [tuple(x) for x in v] for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


class Transformers:
    name = "transformers"

    def __init__(self, path, vocab: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
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


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds / torch threads) of one call."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    cpu = (time.process_time() - c0) / torch.get_num_threads()
    return time.perf_counter() - t0, cpu


Rates = dict[str, dict[str, list[tuple[float, float]]]]


def measure(engines: list, args) -> Rates:
    """(wall, cpu) tok/s samples per engine and metric; engines alternate within each repeat."""
    rates: Rates = {e.name: {} for e in engines}

    def record(e, metric: str, tokens: int, fn) -> None:
        wall, cpu = timed(fn)
        rates[e.name].setdefault(metric, []).append((tokens / wall, tokens / cpu))

    n = args.prefill_len
    for e in engines:
        e.prefill(n)  # warm-up
    for _ in range(args.repeats):
        for e in engines:
            record(e, "prefill", n, lambda e=e: e.prefill(n))
    for batch in args.batches:
        steps = args.decode_steps
        for e in engines:
            e.decode_setup(batch, args.context, steps * (args.repeats + 1))
            e.decode_steps(steps)  # warm-up
        for _ in range(args.repeats):
            for e in engines:
                record(e, f"decode_b{batch}", batch * steps, lambda e=e, s=steps: e.decode_steps(s))
    return rates


def decode_ratio(rates: Rates, ours: str, peer: str) -> float:
    """The median wall decode-batch-1 rate of `ours` over `peer`'s, within one round."""
    return statistics.median(x[0] for x in rates[ours]["decode_b1"]) / statistics.median(
        x[0] for x in rates[peer]["decode_b1"]
    )


def print_decode_limits(engines: list, args) -> None:
    """Each of our models' weight bytes per decode token at batch 1 (the K/V of the context
    beside them) and the tok/s that reading them at this machine's measured read bandwidth
    allows (benchmarks/bench_bandwidth.py): the physical limit of decode at batch 1."""
    from bench_bandwidth import decode_bytes_per_token, read_bandwidth

    bandwidth = read_bandwidth(0.5)["sum (read)"]
    print(f"\nread bandwidth: {bandwidth:.1f} GB/s (bench_bandwidth.py, 0.5 GiB sum)")
    seen = set()
    for engine in engines:
        runner = getattr(engine, "runner", None)
        if runner is None or id(runner.model) in seen:
            continue
        seen.add(id(runner.model))
        weights, kv = decode_bytes_per_token(runner.model, runner.config, args.context)
        limit = bandwidth * 1e9 / (weights + kv)
        print(
            f"{engine.name}: {weights / 1e6:.1f} MB weights + {kv / 1e6:.1f} MB K/V a decode "
            f"token -> at most {limit:.0f} tok/s at batch 1"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: the default model)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the engines (and llama.cpp after them) this many times over, pooling the "
        "samples and printing each round's decode-batch-1 ratio to llama.cpp: on a noisy "
        "machine a ratio within a round holds better than one across the whole run",
    )
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also llama.cpp on the bf16 GGUF of the same weights (prefill, decode batch 1), "
        "in its own process after the others (benchmarks/llama_cpp_probe.py)",
    )
    ap.add_argument(
        "--llama-cpp-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for llama.cpp's process only (repeatable): e.g. "
        "LD_PRELOAD of a shim where ggml's AMX path crashes (BENCHMARKS.md)",
    )
    ap.add_argument("--decode-batches", default="1,16", help="comma-separated decode batch sizes")
    ap.add_argument(
        "--quantizations",
        default="",
        help="comma-separated --quantization values (e.g. int8,none): also prefixserve on a "
        "load of the same model with each, same run",
    )
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="also run prefixserve without its CPU fast paths (PyTorch attention and RMSNorm "
        "instead of the compiled kernels, bf16 GEMMs for prefill), same run",
    )
    ap.add_argument(
        "--fp32-rows-baseline",
        type=int,
        default=None,
        metavar="ROWS",
        help="also run prefixserve with bf16 linears switching to their fp32 copy from ROWS "
        "rows (not layers.FP32_MIN_ROWS) and an LM head without an fp32 copy, same weights, "
        "same run: e.g. 64, the threshold before it was chosen per CPU",
    )
    ap.add_argument(
        "--no-native-gemm-baseline",
        action="store_true",
        help="also run prefixserve with the linears it takes without the native GEMM (oneDNN, "
        "the streaming kernel for few rows, the CPU table's fp32 copy for many) on a second "
        "load of the weights, same run",
    )
    ap.add_argument(
        "--python-layers-baseline",
        action="store_true",
        help="also run prefixserve with its decoder layers in Python (a call per kernel) "
        "instead of one native call per layer, same weights, same run",
    )
    ap.add_argument(
        "--portable-attention-baseline",
        action="store_true",
        help="also run prefixserve with attention as before the keys-in-lanes kernels: the paged "
        "kernel's portable path for chunks under the CPU table's threshold, SDPA or the prefill "
        "kernel (over a gathered prefix) above it; same weights, same run",
    )
    ap.add_argument(
        "--before-baseline",
        action="store_true",
        help="also run prefixserve as it was before issue 28's kernels: no native GEMM and the "
        "portable attention, on a second load of the weights, same run",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also run prefixserve with batch_invariant=True (the default already is, for bf16 "
        "wherever the native kernels run) on the same weights, same run",
    )
    ap.add_argument(
        "--kv-cache-dtypes",
        default="",
        help="also run prefixserve with its KV cache in these dtypes (int8, fp8_e4m3, "
        "comma-separated) on the same weights, same run",
    )
    ap.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="also run prefixserve with batch_invariant=False on the same weights, same run",
    )
    ap.add_argument(
        "--tiles-baseline",
        default="",
        help="comma-separated GEMM tile families (avx512, avx512_bf16, avx2) to also run "
        "prefixserve on, each selected for every call of its steps (avx2 on an AVX-512 host: "
        "the AVX2 tiles, with the host's attention and norms), same weights, same run",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_model(args.model, dtype="bfloat16")
    print(describe_cpu())
    print(describe_calibration())
    print(
        f"model {loaded.path} | torch {torch.__version__} | threads {torch.get_num_threads()} "
        f"| OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} | load avg "
        f"{os.getloadavg()[0]:.1f} | repeats {args.repeats}"
    )
    args.batches = [int(b) for b in args.decode_batches.split(",")]
    # Enough blocks for the largest decode batch at once (each sequence: context + every step).
    per_seq = -(-(args.context + args.decode_steps * (args.repeats + 1)) // 16)
    blocks = 2 + max(max(args.batches) * per_seq, -(-args.prefill_len // 16))
    engines: list = [Ours(loaded, num_blocks=blocks)]
    if args.baseline:
        os.environ["PREFIXSERVE_FP32_PREFILL"] = "0"
        base = Ours(load_model(args.model, dtype="bfloat16"), num_blocks=blocks, name="baseline")
        del os.environ["PREFIXSERVE_FP32_PREFILL"]
        base.runner.attention_kernel = None
        base.native = False
        engines.append(base)
    if args.no_native_gemm_baseline or args.before_baseline:
        gemm = kernel_table._kernel("gemm")
        kernel_table._kernels["gemm"] = None  # Linear.pack() then keeps the other paths' weights
        try:
            other = load_model(args.model, dtype="bfloat16")
        finally:
            kernel_table._kernels["gemm"] = gemm
        if args.no_native_gemm_baseline:  # the fastest paths of no single summation order
            engines.append(
                Ours(other, num_blocks=blocks, name="no-native-gemm", batch_invariant=False)
            )
        if args.before_baseline:
            engines.append(portable_attention(Ours(other, num_blocks=blocks, name="before")))
    if args.python_layers_baseline:
        python_layers = Ours(loaded, num_blocks=blocks, name="python-layers")
        python_layers.runner.native_layers = False
        engines.append(python_layers)
    if args.portable_attention_baseline:
        engines.append(portable_attention(Ours(loaded, num_blocks=blocks, name="portable-attn")))
    if args.batch_invariant:
        engines.append(
            Ours(loaded, num_blocks=blocks, name="batch-invariant", batch_invariant=True)
        )
    if args.no_batch_invariant:
        engines.append(
            Ours(loaded, num_blocks=blocks, name="no-batch-invariant", batch_invariant=False)
        )
    for kv_dtype in filter(None, args.kv_cache_dtypes.split(",")):
        engines.append(
            Ours(loaded, num_blocks=blocks, name=f"kv-{kv_dtype}", kv_cache_dtype=kv_dtype)
        )
    for quantization in filter(None, args.quantizations.split(",")):
        other = load_model(args.model, dtype="bfloat16", quantization=quantization)
        engines.append(Ours(other, num_blocks=blocks, name=f"weights-{quantization}"))
    for tiles in filter(None, args.tiles_baseline.split(",")):
        engines.append(Ours(loaded, num_blocks=blocks, name=f"{tiles}-tiles", tiles=tiles))
    if args.fp32_rows_baseline is not None:
        engines.append(
            FixedRows(loaded, args.fp32_rows_baseline, num_blocks=blocks, name="fp32-rows-base")
        )
    if not args.skip_transformers:
        engines.append(Transformers(loaded.path, loaded.config.vocab_size))
    rates: Rates = {}
    ratios: list[float] = []
    for _ in range(args.rounds):
        with torch.inference_mode():
            round_rates = measure(engines, args)
        if args.llama_cpp:
            round_rates["llama.cpp"] = llama_cpp_rates(loaded.path, loaded.config.vocab_size, args)
            ratios.append(decode_ratio(round_rates, engines[0].name, "llama.cpp"))
        for name, r in round_rates.items():
            for metric, samples in r.items():
                rates.setdefault(name, {}).setdefault(metric, []).extend(samples)
    print_decode_limits(engines, args)
    if len(ratios) > 1:
        print(
            f"decode batch 1, {engines[0].name} / llama.cpp by round (medians of each round's "
            f"repeats, wall): {', '.join(f'{x:.2f}' for x in ratios)}; median "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        )

    print(f"\nload avg after: {os.getloadavg()[0]:.1f}")
    metrics = ("prefill", *(f"decode_b{b}" for b in args.batches))
    print(
        f"| engine | clock | prefill {args.prefill_len} (tok/s) | "
        + " | ".join(f"decode batch {b}, context {args.context} (tok/s)" for b in args.batches)
        + " |"
    )
    print("|---|---|" + "---:|" * len(metrics))
    for name, r in rates.items():
        for i, clock in enumerate(("wall", "cpu")):
            cells = []
            for m in metrics:
                if m not in r:
                    cells.append("-")
                    continue
                xs = [sample[i] for sample in r[m]]
                cells.append(f"{statistics.median(xs):.1f} ({min(xs):.0f}-{max(xs):.0f})")
            print(f"| {name} | {clock} | " + " | ".join(cells) + " |")
    print(
        "median (min-max) over repeats; wall = tokens / wall time; cpu = tokens / (process CPU "
        "time / threads), what the run would take with the cores to itself"
    )


if __name__ == "__main__":
    main()
