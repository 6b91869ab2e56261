"""The bf16 linear and its paths: the native GEMM (csrc/linear/gemm_bf16.cpp) wherever its vector
tiles
run; without it oneDNN's packed GEMM, the streaming kernel for a few rows (csrc/linear/gemv.cpp), an
fp32 copy for many (the fallback row of cpu_paths.CPU_TABLE); the batch-invariant switch (one
path at every row count); packing a model's linears at load."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model.kernels.cpu_paths import bf16_packing_supported, cpu_paths_here
from prefixserve.model.kernels.hugepages import move_to_huge_pages
from prefixserve.model.layers.kernel_table import _kernel
from prefixserve.model.quant.weights import Int8Weight, packed_weight, quantizable
from prefixserve.settings import fp32_prefill


def _fp32_large_batches() -> bool:
    """Whether bf16 linears also keep an fp32 weight for large batches (see Linear): as this
    CPU's row of `cpu_paths.CPU_TABLE` says, unless `PREFIXSERVE_FP32_PREFILL=1/0` forces it (the
    copy costs 4 bytes per weight of memory)."""
    flag = fp32_prefill()
    return flag if flag is not None else cpu_paths_here().fp32_min_rows is not None


def _fp32_min_rows() -> int:
    """Rows from which a bf16 Linear computes from its fp32 copy: this CPU's row of
    `cpu_paths.CPU_TABLE` (measured there). Where the row keeps no copy and
    `PREFIXSERVE_FP32_PREFILL=1` forces one: 64 where oneDNN packs bf16, 16 where it cannot."""
    rows = cpu_paths_here().fp32_min_rows
    if rows is not None:
        return rows
    return 64 if bf16_packing_supported() else 16


# Batches with at least this many rows use the fp32 copy (where Linear keeps one).
FP32_MIN_ROWS = _fp32_min_rows()


# Largest LM head (in elements) that keeps an fp32 copy: 256 MiB of fp32. SmolLM2's 576 x 49,152
# (113 MB) does; Gemma 3's 640 x 262,144 (671 MB) does not.
LM_HEAD_FP32_MAX_ELEMENTS = 64 * 1024 * 1024


def lm_head_fp32_copy(lm_head: nn.Linear) -> bool:
    """Whether the LM head keeps an fp32 copy too: where this CPU's row of the CPU table says so
    (AVX2, where bf16 is plain `F.linear`), only up to LM_HEAD_FP32_MAX_ELEMENTS, and only while
    the linears keep fp32 copies at all. Elsewhere the vocabulary-sized copy is memory for little:
    the head is applied only to the sampled rows."""
    small = lm_head.weight.numel() <= LM_HEAD_FP32_MAX_ELEMENTS
    return small and _fp32_large_batches() and cpu_paths_here().lm_head_fp32


# Batches of at most this many rows run a bf16 Linear through the native streaming kernel
# (`kernels.linear_bf16_small`). Weights from memory, AMD Zen 5: at 1-8 rows it reads them
# faster than oneDNN's packed GEMM, on one thread and on two; at 16 rows oneDNN's blocked GEMM
# is faster (BENCHMARKS.md, "Per-CPU paths, a streaming decode kernel and the llama.cpp peer";
# `benchmarks/bench_gemm.py`).
STREAM_MAX_ROWS = 8

# Threads that stream a small batch's linear (the caller and helpers of the kernel's own pool,
# which spin between the linears of one step instead of sleeping as OpenMP's do here): the
# torch thread count the engine was built with (`set_stream_threads`, from ModelRunner; one
# value per process: the last runner built sets it).
STREAM_THREADS = [1]


def set_stream_threads(threads: int) -> None:
    STREAM_THREADS[0] = max(1, int(threads))


# True inside a batch-invariant forward pass (`batch_invariant_linears`, set by the runner; a
# context variable, so each engine's step thread has its own): every bf16 Linear then takes one
# path whatever its row count, whose result for a row does not depend on the other rows of the
# call (`tests/model/test_batch_invariance.py` checks it on this CPU): the native GEMM where the
# CPU takes it (it is that path in every mode), else oneDNN's GEMM on the packed weight, else
# (AVX2 only, where oneDNN cannot pack bf16) the native GEMM on its AVX2 tiles. The streaming
# kernel (small batches) and the fp32 copy (large ones) sum in other orders, so they are
# skipped.
_BATCH_INVARIANT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "batch_invariant", default=False
)


def linears_batch_invariant() -> bool:
    """Whether the current forward pass runs inside `batch_invariant_linears(True)` (LoRA's
    updates then take one path too, lora/layers.py)."""
    return _BATCH_INVARIANT.get()


@contextlib.contextmanager
def batch_invariant_linears(on: bool) -> Iterator[None]:
    """Run the enclosed forward pass's linears batch-invariantly (when `on`)."""
    token = _BATCH_INVARIANT.set(on)
    try:
        yield
    finally:
        _BATCH_INVARIANT.reset(token)


class Linear(nn.Linear):
    """nn.Linear whose bf16 weight can be pre-packed into oneDNN's blocked layout.

    Wherever the native GEMM's vector tiles run (`cpu_paths.native_gemm_wanted`: every x86 CPU
    with AVX2 or AVX-512), `pack()` packs the weight into its panels instead and every bf16 call
    of any row count goes through it (csrc/linear/gemm_bf16.cpp: one summation order, so
    batch-invariant in every mode); the rest of this paragraph is about the fallback paths
    (`PREFIXSERVE_NATIVE_GEMM=0`, no kernels, other CPUs).
    oneDNN repacks a plain weight on every call; packing once (`pack()`, done by the models'
    `load_weights`) makes decode-sized matmuls faster, and prefill ones a little (BENCHMARKS.md,
    "Intel Xeon (AVX-512 BF16, no AMX): where the 64-row threshold comes from"). On CPUs whose
    bf16 arithmetic is slower than fp32 (`cpu_paths.CPU_TABLE`: Intel without AMX, AVX2 only),
    `pack()` also keeps an fp32 copy of the weight: batches of `FP32_MIN_ROWS` rows or more are
    computed in fp32 from it and the result is rounded back to bf16. Batches of up to
    `STREAM_MAX_ROWS` rows of a packed bf16 Linear stream its weight through the native kernel.
    Inside `batch_invariant_linears(True)` none of these row-count choices is made: every call
    takes oneDNN's packed GEMM (a lone row padded to two), or where oneDNN cannot pack bf16 (AVX2
    only) the native GEMM on a weight packed at the first such call (the build's vector tiles:
    AVX2 there).
    The packed copies are taken at `pack()` time: call it again after changing the weight.
    """

    _packed: torch.Tensor | None = None
    _fp32: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # (weight, bias) for the streaming kernel: a bf16 contiguous weight, taken at pack() time as
    # plain attributes (a parameter is looked up through nn.Module.__getattr__ on every access,
    # a few times for each of a decode step's ~120 linears: BENCHMARKS.md, "Per-CPU paths, a
    # streaming decode kernel and the llama.cpp peer").
    _stream: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # (packed weight, out features, bias) for the native GEMM, where the CPU takes it.
    _gemm: tuple[torch.Tensor, int, torch.Tensor | None] | None = None
    # The packed weight of the Linear the forward pass runs next (`pack_linears`): a
    # decode-sized native call has the stream pool's helpers prefetch it.
    _next_packed: torch.Tensor | None = None

    def reset_parameters(self) -> None:
        # On the meta device (create_model) there is nothing to initialize, and the random init's
        # meta decompositions cost ~0.3 s per model; load_weights fills the weights.
        if self.weight.is_meta:
            return
        super().reset_parameters()

    # The 8-bit weight (`set_int8`): (codes packed by `packed_weight`, in 8 bits or Q4_0's and
    # Q5_0's 4 and 5, scales [N, K / group] fp32 or, per 32 where fp16 holds them, fp16, bias)
    # for csrc/linear/linear_int8.cpp, which every call of any row count takes (one summation
    # order, so batch-invariant in every mode); None for a bf16 or fp32 weight.
    _int8: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    # The 8-bit weight's format ("int8" per channel, or its GGUF block type: "q8_0", ...), or None.
    int8_format: str | None = None

    def set_int8(self, weight: Int8Weight) -> None:
        """Compute from 8-bit codes from now on (model/quant/weights.py); the bf16 weight is
        dropped (an lm_head tied to the embedding leaves the embedding's alone)."""
        if _kernel("linear_int8") is None:
            raise RuntimeError("8-bit weights need the native kernels (PREFIXSERVE_KERNELS=1)")
        if self.weight.dtype != torch.bfloat16:
            raise ValueError(f"8-bit weights need a bfloat16 model, not {self.weight.dtype}")
        if tuple(weight.codes.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"8-bit weight of shape {tuple(weight.codes.shape)} for a linear of "
                f"{(self.out_features, self.in_features)}"
            )
        if not quantizable(weight.codes):
            raise ValueError(f"8-bit weights need K a multiple of 64, not {self.in_features}")
        bias = None if self.bias is None else self.bias.detach().contiguous()
        codes, scales = packed_weight(weight)
        self._int8 = (codes, scales, bias)
        self.int8_format = weight.fmt
        self._packed = self._fp32 = self._stream = self._gemm = self._next_packed = None
        self._invariant_packed = None
        self.weight = nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)

    def take_loaded_bias(self) -> None:
        """The 8-bit call's bias from the bias parameter as it is now: codes given before the
        checkpoint's bf16 tensors were loaded (`quantize.give_block_weights`) held the bias
        before its values came."""
        if self._int8 is not None and self.bias is not None:
            codes, scales, _ = self._int8
            self._int8 = (codes, scales, self.bias.detach().contiguous())

    def _residual_fits(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        """Whether the 8-bit kernel's epilogue can add this residual: bf16 [rows of x, N]."""
        return (
            x.dim() == 2
            and residual.shape == (x.shape[0], self.out_features)
            and residual.dtype == torch.bfloat16
        )

    def _int8_call(
        self,
        x: torch.Tensor,
        act: int = 0,
        residual: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        codes, scales, bias = self._int8
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        if rows.dtype != torch.bfloat16:
            raise TypeError(f"an 8-bit linear takes bfloat16 activations, not {rows.dtype}")
        width = scales.shape[-2] // 2 if act else scales.shape[-2]
        out = rows.new_empty(rows.shape[0], width, dtype=out_dtype)
        run = _kernel("linear_int8")
        run(out, rows, codes, scales, bias, act, residual, STREAM_THREADS[0], self._next_packed)
        return out.view(*x.shape[:-1], width)

    def pack(self, fp32_copy: bool = True) -> None:
        if self._int8 is not None:  # nothing of a bf16 weight to pack
            return
        self._packed = self._fp32 = self._stream = self._gemm = self._next_packed = None
        self._invariant_packed = None
        gemm = _kernel("gemm") if self.weight.dtype == torch.bfloat16 else None
        if gemm is not None:
            self._gemm = self._packed_for(gemm[0])
            if fp32_copy and fp32_prefill():  # forced on: still the path of large batches
                bias = None if self.bias is None else self.bias.detach().float()
                self._fp32 = (self.weight.detach().float(), bias)
            return
        if self.weight.dtype == torch.bfloat16 and self.weight.is_contiguous():
            bias = None if self.bias is None else self.bias.detach()
            self._stream = (self.weight.detach(), bias)
        if self.weight.dtype == torch.bfloat16 and bf16_packing_supported():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 512)
        if self.weight.dtype == torch.bfloat16 and fp32_copy and _fp32_large_batches():
            bias = None if self.bias is None else self.bias.detach().float()
            self._fp32 = (self.weight.detach().float(), bias)

    # LoRA's low-rank updates for this linear (`lora/layers.py` LoRALinear: `apply(x, out)` adds
    # them in place), or None: the base model only.
    lora = None

    def on_stream_pool(self) -> bool:
        """Whether every call of this linear runs on the kernels' stream pool (the 8-bit kernel,
        or the native GEMM at every row count: no fp32 copy takes large batches to MKL) and none
        on OpenMP's threads; a LoRA update's matmuls do not."""
        native = self._int8 is not None or (self._gemm is not None and self._fp32 is None)
        return native and self.lora is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._base(x)
        lora = self.lora
        if lora is not None:
            lora.apply(x, out)
        return out

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """self(x) in fp32 with no bf16 rounding between the sums and the result: the LM head's
        logits (`compute_logits`). A bf16 linear's kernels write their fp32 accumulators (+ bias)
        as they are, on the path `_base` takes (the native GEMM, the 8-bit kernel: one
        summation order at every row count and on every tile family), else `_fallback_fp32`'s;
        an fp32 linear is its own forward. No LoRA update (adapters target no LM head)."""
        assert self.lora is None, "forward_fp32 computes the base linear only"
        if x.dtype != torch.bfloat16:
            return self._base(x).float()
        if self._int8 is not None:
            return self._int8_call(x, out_dtype=torch.float32)
        if self._takes_native(x):
            return self._native(x, out_dtype=torch.float32)
        if _BATCH_INVARIANT.get() and self._packed is None and self._invariant_gemm_applies(x):
            # `_base`'s batch-invariant path where oneDNN cannot pack bf16 (AVX2 only)
            return self._native(x, self._invariant_gemm(), out_dtype=torch.float32)
        return self._fallback_fp32(x)

    def _fallback_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """forward_fp32 where no native GEMM takes the call (`PREFIXSERVE_NATIVE_GEMM=0`, no
        vector tiles): the fp32 copy where it takes this many rows (outside the batch-invariant
        mode), else the streaming kernel into an fp32 out (one summation order per output at
        every row count: batch-invariant by itself), else (no kernels, so no batch-invariant
        mode: `resolve_batch_invariant`) MKL's fp32 sums of the fp32 copy or of the widened
        weight (`widened_linear`)."""
        rows = x.reshape(-1, x.shape[-1])
        large = rows.shape[0] >= FP32_MIN_ROWS and not _BATCH_INVARIANT.get()
        if self._fp32 is not None and large:
            return F.linear(x.float(), *self._fp32)
        kernel = _kernel("linear_small")
        if kernel is not None and self._stream is not None:
            out = rows.new_empty(rows.shape[0], self.out_features, dtype=torch.float32)
            kernel(out, rows.contiguous(), *self._stream, STREAM_THREADS[0])
            return out.view(*x.shape[:-1], self.out_features)
        if self._fp32 is not None:
            return F.linear(x.float(), *self._fp32)
        return widened_linear(x, self.weight, self.bias)

    def _takes_native(self, x: torch.Tensor) -> bool:
        """Whether this call goes through the native GEMM: a bf16 x on a Linear that has it,
        unless a forced fp32 copy (PREFIXSERVE_FP32_PREFILL=1) takes this many rows outside the
        batch-invariant mode."""
        if self._gemm is None or x.dtype != torch.bfloat16:
            return False
        return self._fp32 is None or x.shape[0] < FP32_MIN_ROWS or _BATCH_INVARIANT.get()

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self._int8 is not None:
            return self._int8_call(x)
        if self._takes_native(x):
            return self._native(x)
        if not _BATCH_INVARIANT.get():
            out = self._by_row_count(x)
            if out is not None:
                return out
        elif self._packed is None and self._invariant_gemm_applies(x):
            return self._native(x, self._invariant_gemm())
        elif x.shape[0] == 1 and x.dim() == 2:
            # oneDNN computes a lone row with another kernel (a GEMV summing K in another order,
            # seen at K = 2048): two rows take the GEMM's path, whose row sums match any batch's.
            return self._base(x.expand(2, -1))[:1]
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """`self(x) + residual` with the two bf16 roundings of the separate ops (a decoder
        layer's residual add after o_proj or down_proj): in the native GEMM's epilogue where
        this call takes it (no LoRA, 2-D contiguous operands), else the linear then an add."""
        if self._int8 is not None and self.lora is None and self._residual_fits(x, residual):
            return self._int8_call(x, residual=residual.contiguous())
        if (
            self.lora is None
            and self._takes_native(x)
            and x.dim() == 2
            and residual.shape == (x.shape[0], self._gemm[1])
            and residual.dtype == torch.bfloat16
            and residual.is_contiguous()
        ):
            packed, out_features, bias = self._gemm
            out = x.new_empty(x.shape[0], out_features)
            _kernel("gemm")[1](
                out,
                x.contiguous(),
                packed,
                out_features,
                bias,
                STREAM_THREADS[0],
                self._next_packed,
                residual,
            )
            return out
        return self.forward(x).add_(residual)

    def gated(self, x: torch.Tensor, act: int) -> torch.Tensor | None:
        """For a gated MLP's fused gate_up linear: act(gate) * up in the native GEMM's epilogue
        (`act` as `GATED_ACTS`), [rows, out_features / 2]; None where this call would not take
        the native GEMM (the caller then runs the linear and the activation itself)."""
        if self._int8 is not None:
            if self.lora is not None or x.dim() != 2 or self.out_features % 2:
                return None
            return self._int8_call(x, act=act)
        if not self._takes_native(x) or x.dim() != 2 or self._gemm[1] % 64:
            return None
        gated = _kernel("gemm")[2]
        packed, out_features, bias = self._gemm
        x = x.contiguous()
        out = x.new_empty(x.shape[0], out_features // 2)
        gated(out, x, packed, out_features, bias, act, STREAM_THREADS[0], self._next_packed)
        return out

    # The native GEMM's packed weight for batch-invariant calls where oneDNN cannot pack bf16
    # and the linears do not take the native GEMM (PREFIXSERVE_NATIVE_GEMM=0 on an AVX2-only
    # CPU: the build's tiles, the same sums): packed on the first such call, so engines
    # outside the mode pay no memory for it. It is a second copy of the weight (2 bytes a
    # parameter, the LM head's too) kept with the model for its lifetime; two engines sharing the
    # model may both pack it on their first step (one copy is kept).
    _invariant_packed: tuple[torch.Tensor, int, torch.Tensor | None] | None = None

    def _invariant_gemm_applies(self, x: torch.Tensor) -> bool:
        return x.dtype == self.weight.dtype == torch.bfloat16 and _kernel("gemm_any") is not None

    def _invariant_gemm(self) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        if self._invariant_packed is None:
            self._invariant_packed = self._packed_for(_kernel("gemm_any")[0])
        return self._invariant_packed

    def _packed_for(
        self, pack: Callable[[torch.Tensor], torch.Tensor]
    ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """(packed weight, out features, bias) for the native GEMM, packed by `pack`."""
        bias = None if self.bias is None else self.bias.detach().contiguous()
        return (pack(self.weight.detach()), self.weight.shape[0], bias)

    def _native(
        self,
        x: torch.Tensor,
        gemm: tuple[torch.Tensor, int, torch.Tensor | None] | None = None,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The native GEMM (`_gemm`, or the given packed weight) over x's rows, any leading
        shape; `out_dtype` float32 keeps its fp32 sums unrounded."""
        packed, out_features, bias = gemm or self._gemm
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = rows.new_empty(rows.shape[0], out_features, dtype=out_dtype)
        run = _kernel("gemm_any" if gemm else "gemm")[1]
        run(out, rows, packed, out_features, bias, STREAM_THREADS[0], self._next_packed)
        return out.view(*x.shape[:-1], out_features)

    def _by_row_count(self, x: torch.Tensor) -> torch.Tensor | None:
        """The fastest path for this many rows where it is not the packed GEMM: the streaming
        kernel for small batches, the fp32 copy for large ones; None otherwise."""
        rows = x.shape[0]
        stream = self._stream
        if stream is not None and rows <= STREAM_MAX_ROWS and x.dim() == 2:
            kernel = _kernel("linear_small")
            if kernel is not None and x.dtype == torch.bfloat16 and x.is_contiguous():
                out = x.new_empty(rows, stream[0].shape[0])
                kernel(out, x, stream[0], stream[1], STREAM_THREADS[0])
                return out
        if self._fp32 is not None and rows >= FP32_MIN_ROWS:
            return F.linear(x.float(), *self._fp32).to(x.dtype)
        return None


# Weight rows `widened_linear` widens to fp32 at a time (8,192 x 640 for Gemma 3's head: 21 MB).
WIDEN_ROWS = 8192


def widened_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T (+ bias) summed in fp32 over the bf16 operands widened (exact), the weight
    a slice of WIDEN_ROWS rows at a time (no fp32 copy of a vocabulary-sized head is kept)."""
    xf = x.float()
    parts = [
        F.linear(
            xf,
            weight[i : i + WIDEN_ROWS].float(),
            None if bias is None else bias[i : i + WIDEN_ROWS].float(),
        )
        for i in range(0, weight.shape[0], WIDEN_ROWS)
    ]
    return torch.cat(parts, dim=-1)


def pack_linears(model: nn.Module, no_fp32_copy: tuple[nn.Module, ...] = ()) -> None:
    """Pre-pack every `Linear` of `model` (a no-op outside bf16). Modules in `no_fp32_copy` keep
    no fp32 copy (the LM head: vocabulary-sized, applied only to the few rows a step samples).
    The bf16 weights decode streams move to huge pages (`hugepages.py`): the native GEMM's
    packed weights once packed, or else the weights themselves first (the streaming kernel reads
    them through views taken at packing)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    if _kernel("gemm") is None:
        move_to_huge_pages(
            m.weight
            for m in linears
            if m.weight.dtype == torch.bfloat16 and m.weight.is_contiguous()
        )
    for module in linears:
        module.pack(fp32_copy=not any(module is m for m in no_fp32_copy))
    move_to_huge_pages(m._gemm[0] for m in linears if m._gemm is not None)
    link_next_weights(model)


def _streamed_weight(linear: Linear) -> torch.Tensor | None:
    """The weight a decode step streams through a native kernel: the native GEMM's packed
    weight or the 8-bit codes; None for the other paths."""
    if linear._int8 is not None:
        return linear._int8[0]
    return None if linear._gemm is None else linear._gemm[0]


def link_next_weights(model: nn.Module) -> None:
    """Each Linear on a native kernel names the next one's weight (`_next_packed`; module order
    is the forward order: a layer's qkv, o, gate_up, down, ..., the LM head, then the first
    layer's qkv again), which a decode-sized call has the helper threads prefetch."""
    native = [
        m for m in model.modules() if isinstance(m, Linear) and _streamed_weight(m) is not None
    ]
    for module, following in zip(native, native[1:] + native[:1], strict=True):
        module._next_packed = _streamed_weight(following)
