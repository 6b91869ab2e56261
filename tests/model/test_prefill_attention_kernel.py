"""The native long-chunk attention kernel (csrc/attention/prefill_attention.cpp) against an fp64
reference, and the attention path that hands it chunks (model/attention.py).

Its scores are bf16 x bf16 products summed in fp32 and its softmax and P @ V are in fp32, so it
must be as close to the exact result as PyTorch's fp32 flash SDPA on the same bf16 inputs: the
tests bound its error by that path's error (plus one bf16 rounding of the output).
"""

import sys

import pytest
import torch
import torch.nn.functional as F

import prefixserve.settings as settings
from prefixserve.model.kernels.build import paged_attention_kernel, prefill_attention_kernel
from prefixserve.model.kernels.cpu_paths import cpu_kind
from prefixserve.model.layers.attention import (
    ScheduledSpan,
    build_attention_metadata,
    paged_attention,
)

prefill = prefill_attention_kernel()
needs_prefill = pytest.mark.skipif(
    prefill is None, reason="the prefill kernel needs an AVX512-BF16 build (not this CPU)"
)


def test_prefill_kernel_is_built_where_the_cpu_has_avx512_bf16():
    """Where the CPU has AVX512-BF16 a missing kernel is a build problem, not a skip (unless
    the kernels were built for another kind on purpose, PREFIXSERVE_KERNEL_MARCH)."""
    if (
        settings.kernel_march() == "native"
        and cpu_kind() in ("avx512_bf16_amd", "avx512_bf16_intel", "amx")
        and paged_attention_kernel()
    ):
        assert prefill is not None
    elif prefill is None:
        pytest.skip("no AVX512-BF16 here")


def exact(q, k, v, scale):
    """fp64 causal attention: the chunk q [n, H, D] is the last n of the L positions of k/v."""
    n, heads, _ = q.shape
    length, kv_heads, _ = k.shape
    kk = k.double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    vv = v.double().repeat_interleave(heads // kv_heads, 1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ kk.transpose(1, 2) * scale
    mask = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ vv).transpose(0, 1).reshape(n, -1)


def flash_fp32(q, k, v, scale):
    n, length = q.shape[0], k.shape[0]
    mask = torch.ones(n, length, dtype=torch.bool).tril(length - n)
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().transpose(0, 1),
        v.float().transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1).reshape(n, -1).bfloat16()


@needs_prefill
@pytest.mark.parametrize(
    "n, length, heads, kv_heads, head_dim",
    [
        (1, 1, 9, 3, 64),  # one query, one key
        (5, 5, 9, 3, 64),  # fewer rows than a micro-tile
        (37, 37, 9, 3, 64),  # a short tail tile of keys and rows
        (64, 1088, 9, 3, 64),  # a chunk over a cached prefix
        (300, 300, 4, 4, 64),  # no GQA
        (130, 700, 16, 8, 128),  # head dim 128, a prefix that is not a multiple of the tiles
        (513, 513, 9, 3, 64),
    ],
)
def test_prefill_kernel_is_as_exact_as_fp32_flash_attention(n, length, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(n * 1000 + length)
    q = (torch.randn(n, heads, head_dim, generator=g) * 1.5).bfloat16()
    k = (torch.randn(length, kv_heads, head_dim, generator=g) * 1.5).bfloat16()
    v = torch.randn(length, kv_heads, head_dim, generator=g).bfloat16()
    scale = head_dim**-0.5
    out = torch.full((n, heads * head_dim), float("nan"), dtype=torch.bfloat16)
    prefill(out, q, k, v, scale)
    truth = exact(q, k, v, scale)
    ours = (out.double() - truth).abs()
    theirs = (flash_fp32(q, k, v, scale).double() - truth).abs()
    ulp = truth.abs().max().item() * 2**-8
    assert ours.max().item() <= theirs.max().item() + ulp
    assert ours.mean().item() <= theirs.mean().item() * 1.05 + 1e-6


@needs_prefill
def test_prefill_kernel_gives_the_same_bits_on_any_number_of_pool_threads():
    """Its K packing and its (head, 32 positions) items run on the caller and `threads - 1`
    stream-pool helpers: the same bits on 1 to 3 threads and on OpenMP's count (0), every row
    written (the output starts as NaN)."""
    g = torch.Generator().manual_seed(11)
    n, length, heads, kv_heads, d = 300, 700, 9, 3, 64
    q = torch.randn(n, heads, d, generator=g).bfloat16()
    k = torch.randn(length, kv_heads, d, generator=g).bfloat16()
    v = torch.randn(length, kv_heads, d, generator=g).bfloat16()
    outs = []
    for threads in (1, 2, 3, 0):
        out = torch.full((n, heads * d), float("nan"), dtype=torch.bfloat16)
        prefill(out, q, k, v, 0.125, threads)
        assert not out.isnan().any()
        outs.append(out)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@needs_prefill
def test_prefill_kernel_reads_strided_queries_keys_and_values():
    """q as a view into a fused qkv and k/v as views of this step's K/V (what the model passes),
    k and v with different strides too."""
    g = torch.Generator().manual_seed(7)
    n, heads, kv_heads, d = 70, 9, 3, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=g).bfloat16()
    q = qkv[:, : heads * d].view(n, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(n, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
    out = torch.empty(n, heads * d, dtype=torch.bfloat16)
    prefill(out, q, k, v, 0.125)
    dense = torch.empty_like(out)
    prefill(dense, q.contiguous(), k.contiguous(), v.contiguous(), 0.125)
    assert torch.equal(out, dense)
    # qk-norm models (Qwen3): k comes out of the norm and rotary contiguous, v stays a view.
    mixed = torch.empty_like(out)
    prefill(mixed, q, k.contiguous(), v, 0.125)
    assert torch.equal(mixed, dense)
    assert (out.double() - exact(q, k, v, 0.125)).abs().max().item() < 0.02


@needs_prefill
def test_prefill_kernel_refuses_what_it_does_not_compute():
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    kv = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    out = torch.empty(4, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        prefill(out.float(), q.float(), kv.float(), kv.float(), 1.0)
    with pytest.raises(RuntimeError, match="L >= n"):
        prefill(out, q, kv[:2], kv[:2], 1.0)
    with pytest.raises(RuntimeError, match="head dims"):
        prefill(
            torch.empty(4, 64, dtype=torch.bfloat16),
            q[..., :32],
            kv[..., :32],
            kv[..., :32],
            1.0,
        )


@needs_prefill
def test_paged_attention_sends_long_chunks_to_the_prefill_kernel_and_short_ones_elsewhere():
    """A step with a decode row, a short chunk and two long chunks (one over a cached prefix):
    the long ones are served by the prefill kernel and every row matches the exact result."""
    heads, kv_heads, d, block = 9, 3, 64, 16
    g = torch.Generator().manual_seed(3)
    seqs = [(40, 1), (20, 8), (0, 100), (64, 40)]
    blocks = sum(-(-(c + n) // block) for c, n in seqs) + 1
    k_cache = torch.randn(blocks, block, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(blocks, block, kv_heads, d, generator=g).bfloat16()
    free = (torch.randperm(blocks - 1, generator=g) + 1).tolist()
    spans = [
        ScheduledSpan(c, n, ([free.pop() for _ in range(-(-(c + n) // block))],)) for c, n in seqs
    ]
    rows = sum(n for _, n in seqs)
    q = torch.randn(rows, heads, d, generator=g).bfloat16()
    calls = []

    def counting(out, q_, k_, v_, scale, threads):
        calls.append(q_.shape[0])
        prefill(out, q_, k_, v_, scale, threads)

    # The chunks of 32+ queries leave the paged kernel whatever this CPU's fallback row says
    meta = build_attention_metadata(
        spans, 0, block, None, paged_attention_kernel(), counting, kernel_max_queries=32
    )
    out = paged_attention(q, k_cache, v_cache, meta, d**-0.5)
    assert sorted(calls) == [40, 100]
    row = 0
    for span in spans:
        table = torch.tensor(span.block_ids[0])
        end = span.num_computed_tokens + span.num_new_tokens
        slots = (table.unsqueeze(1) * block + torch.arange(block)).view(-1)[:end]
        keys = k_cache.view(-1, kv_heads, d)[slots]
        values = v_cache.view(-1, kv_heads, d)[slots]
        n = span.num_new_tokens
        truth = exact(q[row : row + n], keys, values, d**-0.5)
        assert (out[row : row + n].double() - truth).abs().max().item() < 0.03
        row += n


@needs_prefill
def test_with_every_chunk_on_the_kernels_only_prompts_from_position_0_take_the_prefill_kernel():
    """The model runner's routing where the two kernels agree (kernel_max_queries unbounded):
    a long chunk over a cached prefix reads it in place through the paged kernel, a long chunk
    from position 0 takes the prefill kernel, and the chunk's output is the same bits either
    way."""
    heads, kv_heads, d, block = 9, 3, 64, 16
    g = torch.Generator().manual_seed(4)
    k_cache = torch.randn(20, block, kv_heads, d, generator=g).bfloat16()
    v_cache = torch.randn(20, block, kv_heads, d, generator=g).bfloat16()
    table = (torch.randperm(19, generator=g)[:8] + 1).tolist()
    q = torch.randn(120, heads, d, generator=g).bfloat16()
    calls = []

    def counting(out, q_, k_, v_, scale, threads):
        calls.append(q_.shape[0])
        prefill(out, q_, k_, v_, scale, threads)

    def attend(computed, new):
        spans = [ScheduledSpan(computed, new, (table,))]
        meta = build_attention_metadata(
            spans, 0, block, None, paged_attention_kernel(), counting, sys.maxsize
        )
        return paged_attention(q[computed : computed + new], k_cache, v_cache, meta, d**-0.5)

    whole = attend(0, 120)
    assert calls == [120]
    assert torch.equal(attend(64, 56), whole[64:])
    assert calls == [120]


@needs_prefill
def test_a_bf16_qk_norm_model_runs_long_prompts_through_the_kernel(tmp_path):
    """Qwen3 normalizes q and k (k leaves rotary contiguous while v stays a view of the fused
    qkv): a 40-token bf16 prompt goes through the prefill kernel and gives the prompt logprobs of
    the SDPA path within bf16 noise."""
    from prefixserve.config import CacheConfig, EngineConfig
    from prefixserve.engine.llm_engine import LLMEngine
    from prefixserve.sampling_params import SamplingParams
    from tests.helpers.models import build_hf_model, default_vocab_size

    build_hf_model(
        "qwen3",
        tmp_path,
        std=None,
        tokenizer=True,
        vocab_size=default_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
    )
    engine = LLMEngine(
        EngineConfig(model=str(tmp_path), dtype="bfloat16", cache=CacheConfig(num_kv_blocks=32))
    )
    assert engine.runner.prefill_kernel is not None
    prompt = list(range(1000, 1040))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)

    def logprobs(request_id: str) -> list[float]:
        engine.reset_prefix_cache()
        engine.add_request(request_id, prompt, params)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        final = outputs[-1]
        return [next(iter(p.values())).logprob for p in final.prompt_logprobs[1:]]

    with_kernel = logprobs("kernel")
    engine.runner.prefill_kernel = None
    without = logprobs("sdpa")
    assert max(abs(a - b) for a, b in zip(with_kernel, without, strict=True)) < 0.1
