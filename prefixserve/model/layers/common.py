"""Blocks shared by the decoder families: norms, gated MLP, attention (linears: linear.py;
rotary: rotary.py).

Mapping checkpoint tensors onto these blocks' (fused) parameters is `weights.py`'s job.

Inside a forward pass, submodules are called through `.forward`: nn.Module.__call__'s hook
bookkeeping costs time on every call, and a decode step of the default model makes ~270 of them
(BENCHMARKS.md, "Per-CPU paths, a streaming decode kernel and the llama.cpp peer"). None of
these modules takes hooks."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.model.config import ModelConfig
from prefixserve.model.kernels.build import rope_kv_vectorized
from prefixserve.model.layers.attention import AttentionMetadata, paged_attention, write_kv
from prefixserve.model.layers.kernel_table import _kernel
from prefixserve.model.layers.linear import Linear
from prefixserve.model.layers.rotary import apply_rotary


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
    # Whether the model may run its decoder layers as one native call each (native_layer.py):
    # the runner says so for steps whose every row attends through the paged kernel and that
    # carry no LoRA update.
    native_layers: bool = False


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
# (`kernels.rope_write_kv`, bit for bit PyTorch's result) where only its scalar loop runs: it
# beats PyTorch's ops at 1 token, not at 8. In bf16, with a head dim that is a multiple of 32,
# where the build has its AVX512-BF16 vector loop (`kernels.rope_kv_vectorized`), it takes every
# step: faster than PyTorch's ops from 1 to 2,048 tokens (one thread, the default model's
# shapes; both: BENCHMARKS.md, "Per-CPU paths, a streaming decode kernel and the llama.cpp
# peer").
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
    2-D inputs go through the compiled kernel when it is available (same roundings), and so do
    `forward_`'s in-place ones with a contiguous last dim (per-head q/k rows inside qkv)."""

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
        return self._pytorch(x)

    def forward_(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x [rows, dim] or [outer, inner, dim] in place, through the kernel where it
        takes x (a contiguous last dim, other strides free: q/k heads inside a fused qkv); x."""
        kernel = _kernel("rms_norm")
        if (
            kernel is not None
            and x.dim() in (2, 3)
            and x.stride(-1) == 1
            and x.dtype == self.weight.dtype
            and x.dtype in (torch.bfloat16, torch.float32)
        ):
            kernel(x, x, self.weight, self.eps, self.offset)
            return x
        return x.copy_(self._pytorch(x))

    def _pytorch(self, x: torch.Tensor) -> torch.Tensor:
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


# The activations the native GEMM's gated epilogue computes (csrc/linear/gemm_bf16.cpp's Act).
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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x, plus `residual` when given (added in down_proj's epilogue where it
        can be: `Linear.add_to`)."""
        hidden = None
        if self.gated_act and self.gate_up_proj.lora is None:
            hidden = self.gate_up_proj.gated(x, self.gated_act)
        if hidden is None:
            gate, up = self.gate_up_proj.forward(x).split(self.intermediate, dim=-1)
            hidden = self.act(gate) * up
        if residual is None:
            return self.down_proj.forward(hidden)
        return self.down_proj.add_to(hidden, residual)


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
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ctx: ForwardContext,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of x's rows, plus `residual` when given (added in o_proj's epilogue where
        it can be: `Linear.add_to`)."""
        t = x.shape[0]
        qkv = self.qkv_proj.forward(x)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        meta = ctx.groups[self.group]
        if self.q_norm is not None and self.k_norm is not None:
            # Per head, in place in qkv: the rotary below then takes the normed q and k.
            self.q_norm.forward_(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k_part = qkv[:, self.q_size : self.q_size + self.kv_size]
            self.k_norm.forward_(k_part.view(t, self.num_kv_heads, self.head_dim))
        if (
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
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping, meta.kv_format)
        out = paged_attention(q, k_cache, v_cache, meta, self.scale, self.softcap, k, v)
        if residual is None:
            return self.o_proj.forward(out)
        return self.o_proj.add_to(out, residual)
