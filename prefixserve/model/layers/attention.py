"""Paged attention on the CPU: K/V live in blocks, each sequence reaches them via its block table.

Per layer the cache is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]` (K and V).
A step's new K/V are written through a slot mapping (slot = block_id * block_size + offset); then
each sequence attends over its history `[0, num_computed + num_new)` (for a sliding-window layer
only the last `sliding_window` positions, so blocks before them may be the null block and are
never read). Everything that depends only on the batch, not on the layer (gather indices, masks,
slot mappings), is built once per step per KV-cache group by `build_attention_metadata`.

With the compiled kernel (`prefixserve.model.kernels.build`, passed in as `kernel`), every
sequence with fewer than `kernel_max_queries` new tokens (default `KERNEL_MAX_QUERIES`, chosen
per kind of CPU; unbounded where the model runner takes the two kernels of one arithmetic, see
below) is served by one kernel call that reads K/V straight from the blocks: no gather, no
copies, online softmax in fp32. Where the native prefill kernel is built (AVX512-BF16; bf16
models with head dims 64/128/256 without soft-capping), a chunk of `PREFILL_MIN_QUERIES` or more
from position 0 with full attention goes to it instead (a tiled causal kernel over the chunk's
own K/V); it shares its tile arithmetic with the paged kernel's bf16 path
(csrc/attention/attn_lanes_bf16_avx512.h), so the split never changes a query's bits. Other long
chunks use the span path below: the prefill kernel over the gathered K/V where it applies,
otherwise PyTorch's flash SDPA serves them. Without the paged kernel, two paths:
- decode batch: the leading run of sequences with one new token each (at least two of them) is
  padded to a common number of blocks and served by one batched SDPA call with a padding mask;
- one call per other sequence (prefill chunks, or a lone decode): the slots of its exact key
  range are gathered, causal inside the chunk (`is_causal` when the chunk is the whole visible
  history, which then comes straight from this step's K/V; an explicit mask otherwise).
K/V are handed to SDPA contiguous and heads-first (several times faster on this CPU than strided
views), and chunks of 32+ queries attend in fp32 (the CPU flash kernel is faster there than in
bf16; decode-sized calls are faster in bf16).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from prefixserve.model.kernels.cpu_paths import cpu_paths_here
from prefixserve.model.layers.linear import STREAM_THREADS
from prefixserve.model.quant.kv_cache import KVFormat, dequantize_rows, quantize_rows


@dataclass(slots=True)
class SequenceSpan:
    """One sequence of this step: its new tokens and the cache slots it attends over."""

    # Rows [q_start, q_end) of the flattened batch are its new tokens.
    q_start: int
    q_end: int
    # Cache slots of the keys it attends to, oldest first (its visible history, this step's
    # tokens included).
    kv_slots: torch.Tensor
    # [num_new, kv_len] bool, True = may attend; None means plain causal (or a single query).
    mask: torch.Tensor | None
    is_causal: bool
    # Its keys are positions [0, end) and its queries the last of them (no sliding window): what
    # the native prefill kernel computes.
    from_start: bool = False


@dataclass(slots=True)
class DecodeBatch:
    """Rows [0, num_seqs) of the batch, one new token each, attended in one batched call."""

    num_seqs: int
    block_table: torch.Tensor  # [num_seqs, max_blocks], short rows padded (masked out)
    mask: torch.Tensor  # [num_seqs, 1, 1, max_blocks * block_size] bool


@dataclass(slots=True)
class KernelBatch:
    """The sequences the compiled kernel serves: `info` rows (q_start, q_end, first position)."""

    fn: Callable[..., None]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with the null block
    info: torch.Tensor  # [num_seqs, 3] int64
    window: int  # 0 = full attention


@dataclass(slots=True)
class AttentionMetadata:
    """What every layer of one KV-cache group needs for this step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode: DecodeBatch | None
    spans: list[SequenceSpan]
    kernel: KernelBatch | None = None
    # The native kernel for long bf16 chunks (`prefill_attention`), or None: SDPA serves them.
    prefill: Callable[..., None] | None = None
    # The cache's 8-bit format (model/quant/kv_cache.py), or None: K/V in the model's dtype.
    kv_format: KVFormat | None = None


# With the kernel, sequences with fewer new tokens than this go to it; longer chunks to SDPA.
# Per kind of CPU, measured with benchmarks/bench_attention.py (cpu_paths.CPU_TABLE): 12 on the
# Intel hosts, 513 on AMD Zen 5.
KERNEL_MAX_QUERIES = cpu_paths_here().kernel_max_queries
# With the native prefill kernel (csrc/attention/prefill_attention.cpp: AVX512-BF16 builds, bf16
# models with these head dims, no soft-capping, no sliding window), chunks of at least this many
# queries go to it instead, whatever KERNEL_MAX_QUERIES says: on AMD Zen 5 it beats the paged
# kernel from 32 queries and flash SDPA everywhere (BENCHMARKS.md, "A native attention kernel
# for long chunks"; `benchmarks/bench_attention.py`).
PREFILL_MIN_QUERIES = 32
PREFILL_HEAD_DIMS = (64, 128, 256)


def lanes_serve(config: Any) -> bool:
    """Whether the keys-in-lanes arithmetic (the prefill kernel, and the paged kernel's lanes
    path where the build has its tiles) serves a model of this ModelConfig: bf16, a head dim it
    is built for, no logit soft-capping. Other models attend on the paged kernel's portable
    path (and SDPA)."""
    return (
        config.torch_dtype == torch.bfloat16
        and config.head_dim in PREFILL_HEAD_DIMS
        and config.attn_logit_softcapping is None
    )


def prefill_kernel_for(
    config: Any, kernel: Callable[..., None] | None
) -> Callable[..., None] | None:
    """`kernel` (the native prefill kernel) where it serves a model of this ModelConfig
    (`lanes_serve`); else None."""
    return kernel if lanes_serve(config) else None


@dataclass(slots=True)
class ScheduledSpan:
    """Runner-side description of one sequence in the flattened batch (group independent)."""

    num_computed_tokens: int
    num_new_tokens: int
    block_ids: tuple[list[int], ...]  # one list per KV-cache group


def build_attention_metadata(  # noqa: C901, PLR0915 - one pass per step building every kernel's tensors; hot, measured
    seqs: list[ScheduledSpan],
    group: int,
    block_size: int,
    sliding_window: int | None,
    kernel: Callable[..., None] | None = None,
    prefill: Callable[..., None] | None = None,
    kernel_max_queries: int | None = None,
) -> AttentionMetadata:
    """Slot mapping, kernel batch, decode batch and per-sequence spans of one KV-cache group for
    this step.

    The sequences are in batch order; their new tokens are contiguous rows of the batch.
    `kernel` is the compiled paged-attention function, or None for the pure-PyTorch paths;
    `prefill` the compiled long-chunk kernel, or None. `kernel_max_queries`: chunks of fewer
    queries go to `kernel` (default KERNEL_MAX_QUERIES; batch-invariant runs send them all).
    """
    if kernel_max_queries is None:
        kernel_max_queries = KERNEL_MAX_QUERIES
    slots: list[torch.Tensor] = []
    pending: list[int] = []  # single-token slots, flushed into `slots` in order
    num_decode = 0
    if kernel is None:
        while num_decode < len(seqs) and seqs[num_decode].num_new_tokens == 1:
            num_decode += 1
    if num_decode < 2:
        num_decode = 0
    kernel_tables: list[list[int]] = []
    kernel_info: list[tuple[int, int, int]] = []

    decode_tables: list[list[int]] = []
    decode_ranges: list[tuple[int, int]] = []  # absolute key positions [lo, hi)
    spans: list[SequenceSpan] = []
    row = 0
    for i, seq in enumerate(seqs):
        table = seq.block_ids[group]
        start, n = seq.num_computed_tokens, seq.num_new_tokens
        end = start + n
        if end > len(table) * block_size:
            raise ValueError(
                f"block table of {len(table)} blocks cannot hold {end} tokens "
                f"(block_size {block_size})"
            )
        if n == 1:
            pending.append(table[start // block_size] * block_size + start % block_size)
        else:
            if pending:
                slots.append(torch.tensor(pending, dtype=torch.int64))
                pending = []
            pos = torch.arange(start, end)
            first_block = start // block_size
            chunk_blocks = torch.tensor(
                table[first_block : (end - 1) // block_size + 1], dtype=torch.int64
            )
            slots.append(
                chunk_blocks[pos // block_size - first_block] * block_size + pos % block_size
            )

        # Oldest key position any query of this chunk may see.
        kv_lo = 0 if sliding_window is None else max(0, start - sliding_window + 1)
        lo_block = kv_lo // block_size
        hi_block = (end - 1) // block_size + 1
        # A long chunk with nothing before it goes to the prefill kernel; over a cached prefix
        # the paged kernel (the same arithmetic) reads the prefix in place instead of gathering it.
        long_chunk = (
            prefill is not None
            and n >= PREFILL_MIN_QUERIES
            and sliding_window is None
            and start == 0
        )
        if kernel is not None and n < kernel_max_queries and not long_chunk:
            kernel_tables.append(table[:hi_block])
            kernel_info.append((row, row + n, start))
        elif i < num_decode:
            decode_tables.append(table[lo_block:hi_block])
            decode_ranges.append((kv_lo - lo_block * block_size, end - lo_block * block_size))
        else:
            blocks = torch.tensor(table[lo_block:hi_block], dtype=torch.int64)
            kv_slots = (blocks.unsqueeze(1) * block_size + torch.arange(block_size)).view(-1)
            kv_slots = kv_slots[kv_lo - lo_block * block_size : end - lo_block * block_size]
            mask = None
            is_causal = False
            if n > 1:
                if kv_lo == start and (sliding_window is None or n <= sliding_window):
                    is_causal = True  # the chunk is the whole visible history
                else:
                    q_pos = torch.arange(start, end).unsqueeze(1)
                    k_pos = torch.arange(kv_lo, end).unsqueeze(0)
                    mask = k_pos <= q_pos
                    if sliding_window is not None:
                        mask &= k_pos > q_pos - sliding_window
            spans.append(
                SequenceSpan(row, row + n, kv_slots, mask, is_causal, sliding_window is None)
            )
        row += n
    if pending:
        slots.append(torch.tensor(pending, dtype=torch.int64))

    decode = None
    if num_decode:
        max_blocks = max(len(t) for t in decode_tables)
        # Padding repeats a block of the row's own (masked out), so the null block is never read.
        table = torch.tensor(
            [blocks + blocks[:1] * (max_blocks - len(blocks)) for blocks in decode_tables],
            dtype=torch.int64,
        )
        ranges = torch.tensor(decode_ranges, dtype=torch.int64)
        k_idx = torch.arange(max_blocks * block_size).unsqueeze(0)
        mask = (k_idx >= ranges[:, :1]) & (k_idx < ranges[:, 1:])
        decode = DecodeBatch(num_decode, table, mask.view(num_decode, 1, 1, -1))
    batch = None
    if kernel_tables:
        width = max(len(t) for t in kernel_tables)
        batch = KernelBatch(
            kernel,
            torch.tensor([t + [0] * (width - len(t)) for t in kernel_tables], dtype=torch.int32),
            torch.tensor(kernel_info, dtype=torch.int64),
            sliding_window or 0,
        )
    slot_mapping = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.int64)
    return AttentionMetadata(slot_mapping, decode, spans, batch, prefill)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    kv_format: KVFormat | None = None,
) -> None:
    """Store new keys/values `[num_tokens, num_kv_heads, head_dim]` at their slots (as 8-bit
    rows with their scales where the cache has `kv_format`)."""
    if kv_format is not None:
        k, v = quantize_rows(k, kv_format), quantize_rows(v, kv_format)
    num_kv_heads, width = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, width).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, width).index_copy_(0, slots, v)


def _rows(cache: torch.Tensor, fmt: KVFormat | None, dtype: torch.dtype) -> torch.Tensor:
    """Rows gathered from a cache, as values of `dtype` (dequantized from an 8-bit cache)."""
    return cache if fmt is None else dequantize_rows(cache, fmt, dtype)


# Chunks with at least this many queries attend in fp32 (see paged_attention).
_UPCAST_MIN_QUERIES = 32


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of queries `[num_tokens, num_heads, head_dim]` over the paged cache.

    Returns `[num_tokens, num_heads * head_dim]`. The new tokens' K/V must already be written;
    `k_new`/`v_new` (the same K/V, `[num_tokens, num_kv_heads, head_dim]`) let a chunk that is
    its whole visible history skip gathering it back from the cache.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    decode = meta.decode
    batch = meta.kernel
    if decode is None and batch is None and len(meta.spans) == 1:
        # One sequence: its output is the whole output.
        return _attend_span(q, k_cache, v_cache, meta.spans[0], scale, softcap, k_new, v_new, meta)
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if batch is not None:
        batch.fn(
            out,
            q,
            k_cache,
            v_cache,
            batch.block_tables,
            batch.info,
            scale,
            softcap or 0.0,
            batch.window,
            STREAM_THREADS[0],
        )
    if decode is not None:
        b = decode.num_seqs
        # Query heads of one KV head are adjacent, so [b, kv_heads, group, d] pairs them with
        # their shared K/V without repeating it.
        qd = q[:b].view(b, num_kv_heads, group, head_dim)
        blocks = decode.block_table.view(-1)
        k = _rows(k_cache.index_select(0, blocks), meta.kv_format, q.dtype)
        v = _rows(v_cache.index_select(0, blocks), meta.kv_format, q.dtype)
        k = k.view(b, -1, num_kv_heads, head_dim)
        v = v.view(b, -1, num_kv_heads, head_dim)
        o = _attend(qd, _heads_first(k), _heads_first(v), decode.mask, False, scale, softcap)
        out[:b] = o.view(b, num_heads * head_dim)

    for span in meta.spans:
        out[span.q_start : span.q_end] = _attend_span(
            q, k_cache, v_cache, span, scale, softcap, k_new, v_new, meta
        )
    return out


def _attend_span(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    span: SequenceSpan,
    scale: float,
    softcap: float | None,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """One sequence's attention output, `[num_new, num_heads * head_dim]`. An 8-bit cache's
    rows are always read back from the cache (the new rows too: what a later step will read)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, width = k_cache.shape[2], k_cache.shape[3]
    n = span.q_end - span.q_start
    prefill, fmt = meta.prefill, meta.kv_format
    if span.is_causal and k_new is not None and v_new is not None and fmt is None:
        k = k_new[span.q_start : span.q_end]
        v = v_new[span.q_start : span.q_end]
    else:
        k = k_cache.view(-1, num_kv_heads, width).index_select(0, span.kv_slots)
        v = v_cache.view(-1, num_kv_heads, width).index_select(0, span.kv_slots)
        k, v = _rows(k, fmt, q.dtype), _rows(v, fmt, q.dtype)
    qs = q[span.q_start : span.q_end]
    if (
        prefill is not None
        and span.from_start
        and softcap is None
        and n >= PREFILL_MIN_QUERIES
        and q.dtype == torch.bfloat16
        and head_dim in PREFILL_HEAD_DIMS
    ):
        out = q.new_empty(n, num_heads * head_dim)
        prefill(out, qs, k, v, scale, STREAM_THREADS[0])
        return out
    k = _heads_first(k.unsqueeze(0))
    v = _heads_first(v.unsqueeze(0))
    if n == 1:
        qs = qs.view(1, num_kv_heads, num_heads // num_kv_heads, head_dim)
        return _attend(qs, k, v, None, False, scale, softcap).view(1, num_heads * head_dim)
    qs = qs.transpose(0, 1).unsqueeze(0)
    if n >= _UPCAST_MIN_QUERIES and q.dtype == torch.bfloat16:
        # The CPU flash kernel runs long query blocks faster in fp32 than in bf16 (BENCHMARKS.md,
        # "Intel Xeon (AVX-512 BF16, no AMX): where the 64-row threshold comes from").
        qs, k, v = qs.float(), k.float(), v.float()
    o = _attend(qs, k, v, span.mask, span.is_causal, scale, softcap, gqa=num_heads > num_kv_heads)
    return o[0].transpose(0, 1).reshape(n, num_heads * head_dim).to(q.dtype)


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """`[b, len, kv_heads, d]` -> contiguous `[b, kv_heads, len, d]` (SDPA on CPU is several times
    faster on contiguous keys than on the transposed view)."""
    return x.transpose(1, 2).contiguous()


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    softcap: float | None,
    gqa: bool = False,
) -> torch.Tensor:
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=gqa
        )
    # SDPA has no logit soft-capping: do it by hand (Gemma 2 style configs).
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if is_causal:
        lq, lk = scores.shape[-2], scores.shape[-1]
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)
