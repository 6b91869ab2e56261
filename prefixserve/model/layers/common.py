"""Blocks shared by the decoder families: linears, norms, gated MLP, attention (rotary: rotary.py).

Mapping checkpoint tensors onto these blocks' (fused) parameters is `weights.py`'s job.

Inside a forward pass, submodules are called through `.forward`: nn.Module.__call__'s hook
bookkeeping costs 1-2 us a call, and a decode step of the default model makes ~270 of them
(0.3-0.5 ms of a ~10 ms step). None of these modules takes hooks."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model.config import ModelConfig
from prefixserve.model.kernels.build import (
    gemm_bf16_vectorized,
    linear_bf16_packed_kernels,
    linear_bf16_small_kernel,
    lora_add_kernel,
    rms_norm_kernel,
    rope_kv_vectorized,
    rope_write_kv_kernel,
)
from prefixserve.model.kernels.cpu_paths import (
    bf16_packing_supported,
    cpu_paths_here,
    native_gemm_wanted,
)
from prefixserve.model.kernels.hugepages import move_to_huge_pages
from prefixserve.model.layers.attention import AttentionMetadata, paged_attention, write_kv
from prefixserve.model.layers.rotary import apply_rotary
from prefixserve.settings import fp32_prefill


@dataclass(slots=True)
class ForwardContext:
    """Everything a forward pass needs besides the token ids: the per-layer K/V caches and the
    per-KV-cache-group attention metadata of this step."""

    positions: torch.Tensor  # [num_tokens] int64
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer
    groups: list[AttentionMetadata]  # per KV-cache group
    # (rows [k] int64, embeddings [k, hidden]) that replace the embeddings of those rows' token
    # ids: prompt positions of requests that brought prompt_embeds; None when there are none.
    embeds: tuple[torch.Tensor, torch.Tensor] | None = None


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
# (`kernels.linear_bf16_small`). Weights from memory, AMD Zen 5 (BENCHMARKS.md "Model speed"):
# at 1-4 rows it reads 33-38 GB/s on one thread against oneDNN's packed GEMM's 25-31, 49 on two
# against 37-40; at 8 rows 24.6 against 21.7 (one thread), 41 against 33 (two); at 16 rows
# oneDNN's blocked GEMM is faster (16.4 against 13.6, 26.7 against 25.1).
STREAM_MAX_ROWS = 8

# Threads that stream a small batch's linear (the caller and helpers of the kernel's own pool,
# which spin between the linears of one step instead of sleeping as OpenMP's do here): the
# torch thread count the engine was built with (`set_stream_threads`, from ModelRunner; one
# value per process: the last runner built sets it).
STREAM_THREADS = [1]


def set_stream_threads(threads: int) -> None:
    STREAM_THREADS[0] = max(1, int(threads))


# The compiled kernels by name, each looked up once (None where unavailable); tests and
# benchmarks put None or a stand-in here to take the PyTorch path.
_kernels: dict[str, object] = {}


def _native_gemm_kernels() -> object:
    """(pack, run) of the native GEMM where this CPU takes it for bf16 linears and its AVX-512
    tiles are built (`cpu_paths.native_gemm_wanted`); None elsewhere."""
    if not (native_gemm_wanted() and gemm_bf16_vectorized()):
        return None
    return linear_bf16_packed_kernels()


_KERNEL_LOOKUPS = {
    "gemm": _native_gemm_kernels,
    "linear_small": linear_bf16_small_kernel,
    "lora_add": lora_add_kernel,  # lora/layers.py
    "rope_kv": rope_write_kv_kernel,
    "rms_norm": rms_norm_kernel,
}


def _kernel(name: str) -> object:
    """The compiled kernel `name` of `_KERNEL_LOOKUPS`, looked up once; None if unavailable."""
    kernel = _kernels.get(name, _kernels)
    if kernel is _kernels:
        kernel = _kernels[name] = _KERNEL_LOOKUPS[name]()
    return kernel


# The same lookup for the modules beside the model (lora/layers.py).
compiled_kernel = _kernel


# True inside a batch-invariant forward pass (`batch_invariant_linears`, set by the runner; a
# context variable, so each engine's step thread has its own): every bf16 Linear then takes one
# path whatever its row count, whose result for a row does not depend on the other rows of the
# call (`tests/model/test_batch_invariance.py` checks it on this CPU): the native GEMM where the
# CPU takes it (it is that path in every mode), else oneDNN's GEMM on the packed weight. The
# streaming kernel (small batches) and the fp32 copy (large ones) sum in other orders, so they
# are skipped.
_BATCH_INVARIANT: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "batch_invariant", default=False
)


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

    Where the CPU table takes the native GEMM (`cpu_paths.CpuPaths.native_gemm`: Intel without
    AMX), `pack()` packs the weight into its panels instead and every bf16 call of any row count
    goes through it (csrc/gemm_bf16.cpp: one summation order, so batch-invariant in every mode);
    the rest of this paragraph is about the other CPUs.
    oneDNN repacks a plain weight on every call; packing once (`pack()`, done by the models'
    `load_weights`) makes decode-sized matmuls ~25% faster and prefill ones ~5%. On CPUs whose
    bf16 arithmetic is slower than fp32 (`cpu_paths.CPU_TABLE`: Intel without AMX, AVX2 only),
    `pack()` also keeps an fp32 copy of the weight: batches of `FP32_MIN_ROWS` rows or more are
    computed in fp32 from it and the result is rounded back to bf16. Batches of up to
    `STREAM_MAX_ROWS` rows of a packed bf16 Linear stream its weight through the native kernel.
    Inside `batch_invariant_linears(True)` none of these row-count choices is made: every call
    takes the packed GEMM (a lone row padded to two).
    The packed copies are taken at `pack()` time: call it again after changing the weight.
    """

    _packed: torch.Tensor | None = None
    _fp32: tuple[torch.Tensor, torch.Tensor | None] | None = None
    # (weight, bias) for the streaming kernel: a bf16 contiguous weight, taken at pack() time as
    # plain attributes (a parameter is looked up through nn.Module.__getattr__ on every access,
    # ~0.5 us, a few times for each of a decode step's ~120 linears).
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

    def pack(self, fp32_copy: bool = True) -> None:
        self._packed = self._fp32 = self._stream = self._gemm = self._next_packed = None
        gemm = _kernel("gemm") if self.weight.dtype == torch.bfloat16 else None
        if gemm is not None:
            bias = None if self.bias is None else self.bias.detach().contiguous()
            self._gemm = (gemm[0](self.weight.detach()), self.weight.shape[0], bias)
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._base(x)
        lora = self.lora
        if lora is not None:
            lora.apply(x, out)
        return out

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        if self._gemm is not None and x.dtype == torch.bfloat16:
            if self._fp32 is None or x.shape[0] < FP32_MIN_ROWS or _BATCH_INVARIANT.get():
                return self._native(x)
        if not _BATCH_INVARIANT.get():
            out = self._by_row_count(x)
            if out is not None:
                return out
        elif x.shape[0] == 1 and x.dim() == 2:
            # oneDNN computes a lone row with another kernel (a GEMV summing K in another order,
            # seen at K = 2048): two rows take the GEMM's path, whose row sums match any batch's.
            return self._base(x.expand(2, -1))[:1]
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def gated(self, x: torch.Tensor, act: int) -> torch.Tensor | None:
        """For a gated MLP's fused gate_up linear: act(gate) * up in the native GEMM's epilogue
        (`act` as `GATED_ACTS`), [rows, out_features / 2]; None where this call would not take
        the native GEMM (the caller then runs the linear and the activation itself)."""
        gemm = self._gemm
        if gemm is None or x.dtype != torch.bfloat16 or x.dim() != 2 or gemm[1] % 64:
            return None
        if self._fp32 is not None and x.shape[0] >= FP32_MIN_ROWS and not _BATCH_INVARIANT.get():
            return None
        packed, out_features, bias = gemm
        x = x.contiguous()
        out = x.new_empty(x.shape[0], out_features // 2)
        gated = _kernel("gemm")[2]
        gated(out, x, packed, out_features, bias, act, STREAM_THREADS[0], self._next_packed)
        return out

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        """The native GEMM (`_gemm`) over x's rows, any leading shape."""
        packed, out_features, bias = self._gemm
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = rows.new_empty(rows.shape[0], out_features)
        _kernel("gemm")[1](
            out, rows, packed, out_features, bias, STREAM_THREADS[0], self._next_packed
        )
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
    # Each native Linear names the next one's weight (module order is the forward order: a
    # layer's qkv, o, gate_up, down, ..., the LM head, then the first layer's qkv again).
    native = [m for m in linears if m._gemm is not None]
    for module, following in zip(native, native[1:] + native[:1], strict=True):
        module._next_packed = following._gemm[0]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run torch ops on one intra-op thread inside the block (restored after).

    For loading (and decode-sized steps, runner.py): its copies and weight reorders are short,
    memory-bound ops, and on a busy CPU each multi-threaded one waits for a second thread to be
    scheduled; measured on this 2-core machine under load, load_weights took 2.4 s with two
    threads and 0.25 s with one.
    """
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# Steps of at most this many tokens rotate q/k and write K/V in one native call per layer
# (`kernels.rope_write_kv`, bit for bit PyTorch's result) where only its scalar loop runs:
# 4.6 against 31 us at 1 token, 29 against 26 at 8. In bf16, with a head dim that is a multiple
# of 32, where the build has its AVX512-BF16 vector loop (`kernels.rope_kv_vectorized`), it
# takes every step: 0.7 against 18 us at 1 token, 51 against 333 at 512, 206 against 1,579 at
# 2,048 (one thread, the default model's shapes).
ROPE_KV_MAX_TOKENS = 4


@functools.cache
def rope_kv_max_tokens(dtype: torch.dtype, head_dim: int) -> int:
    """The largest step that rotates and writes K/V through the native kernel."""
    if dtype == torch.bfloat16 and head_dim % 32 == 0 and rope_kv_vectorized():
        return 1 << 62
    return ROPE_KV_MAX_TOKENS


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. Gemma scales by (1 + weight) and casts after scaling;
    Llama-style norms cast first and scale by weight (as transformers does for each). Contiguous
    2-D inputs go through the compiled kernel when it is available (same roundings)."""

    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel = _kernel("rms_norm")
        if kernel is not None and x.dim() == 2 and x.is_contiguous():
            if x.dtype == self.weight.dtype and x.dtype in (torch.bfloat16, torch.float32):
                out = torch.empty_like(x)
                kernel(out, x, self.weight, self.eps, self.offset)
                return out
        xf = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


_ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


# The activations the native GEMM's gated epilogue computes (csrc/gemm_bf16.cpp's Act).
GATED_ACTS = {"silu": 1, "gelu_pytorch_tanh": 2, "gelu_tanh": 2}


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul; where gate_up takes the
    native GEMM (and has no LoRA), act(gate) * up is its epilogue (`Linear.gated`): the same
    roundings as the separate bf16 ops, its own exp (so the activation may differ from
    PyTorch's by a bf16 ulp)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool = False) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"activation {act!r} is not supported; supported: {list(_ACTIVATIONS)}"
            )
        self.intermediate = intermediate
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]
        self.gated_act = GATED_ACTS.get(act, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated_act and self.gate_up_proj.lora is None:
            fused = self.gate_up_proj.gated(x, self.gated_act)
            if fused is not None:
                return self.down_proj.forward(fused)
        gate_up = self.gate_up_proj.forward(x)
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj.forward(self.act(gate) * up)


class Attention(nn.Module):
    """Self-attention over the paged KV cache, with fused q/k/v projection, optional per-head
    q/k norms (Qwen3, Gemma 3) and soft-capping (Gemma 2 style)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.group = config.layer_to_group[layer_idx]
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attn_scale
        self.softcap = config.attn_logit_softcapping
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            gemma = config.architecture.startswith("Gemma3")
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset=gemma)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, offset=gemma)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        meta = ctx.groups[self.group]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = qkv[:, : self.q_size + self.kv_size].split((self.q_size, self.kv_size), dim=-1)
            q = apply_rotary(
                self.q_norm.forward(q.view(t, self.num_heads, self.head_dim)), cos, sin
            )
            k = apply_rotary(
                self.k_norm.forward(k.view(t, self.num_kv_heads, self.head_dim)), cos, sin
            )
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        elif (
            t <= rope_kv_max_tokens(qkv.dtype, self.head_dim)
            and (kernel := _kernel("rope_kv")) is not None
        ):
            # Rotary in place on qkv and the K/V writes, in one native call.
            kernel(
                qkv,
                cos.view(t, self.head_dim),
                sin.view(t, self.head_dim),
                self.num_heads,
                self.num_kv_heads,
                k_cache,
                v_cache,
                meta.slot_mapping,
            )
            q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(
                t, self.num_kv_heads, self.head_dim
            )
        else:  # rotate queries and keys in one pass
            qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
            qk = apply_rotary(qk, cos, sin)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, self.softcap, k, v)
        return self.o_proj.forward(out)
