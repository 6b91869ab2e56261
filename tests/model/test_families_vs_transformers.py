"""Our decoders over the paged KV cache give transformers' logits (fp32, random tiny weights).

Driven through ModelRunner.execute with hand-built SchedulerOutputs. The null block is filled with
NaN, so any read of it (e.g. a sliding-window layer looking before its window) fails the test.
"""

from __future__ import annotations

import pytest
import torch

from prefixserve.core.kv_cache.spec import SlidingWindowSpec
from prefixserve.model.kernels.cpu_paths import bf16_packing_supported
from prefixserve.model.layers import kernel_table
from prefixserve.model.layers.attention import ScheduledSpan, build_attention_metadata
from prefixserve.model.layers.common import ForwardContext
from tests.helpers.models import VOCAB, assert_close, build_hf_model, build_ours, reference_logits
from tests.helpers.runner import BlockAllocator, Harness, greedy_request, make_harness, step

FAMILIES = ["llama", "llama_tied", "mistral", "qwen2", "qwen3", "gemma3"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    return build_hf_model(request.param, tmp_path_factory.mktemp(request.param))


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def blocks_for(h: Harness, alloc: BlockAllocator, num_tokens: int) -> tuple[list[int], ...]:
    count = -(-num_tokens // h.block_size)
    return tuple(alloc.take(g, count) for g in range(h.num_groups))


def drop_out_of_window(h: Harness, block_ids: tuple[list[int], ...], start: int):
    """What the sliding-window manager does: blocks no query from `start` on can see become the
    null block."""
    out = []
    for g, spec in enumerate(h.config.kv_cache_groups()):
        ids = list(block_ids[g])
        if isinstance(spec, SlidingWindowSpec):
            first_visible = max(0, start - spec.sliding_window + 1)
            for i in range(first_visible // h.block_size):
                ids[i] = 0
        out.append(ids)
    return tuple(out)


def prompt_and_sampled_logits(h: Harness, req_id: str) -> torch.Tensor:
    return torch.cat(h.sampler.prompt + [h.sampler.sampled[req_id][-1].unsqueeze(0)])


def test_whole_prompt_matches_transformers(family_model):
    hf_model, config_json = family_model
    h = make_harness(hf_model, config_json)
    prompt = tokens(21, seed=1)
    req = greedy_request("a", prompt)
    out = step(h, [(req, 0, 21, blocks_for(h, BlockAllocator(h.num_groups), 21))])
    ref = reference_logits(hf_model, prompt)
    assert_close(prompt_and_sampled_logits(h, "a"), ref)
    assert out.sampled_token_ids == {"a": int(ref[-1].argmax())}
    assert len(out.prompt_logprobs["a"]) == 20  # positions 1..20


def test_prompt_in_chunks_matches_transformers(family_model):
    hf_model, config_json = family_model
    h = make_harness(hf_model, config_json)
    prompt = tokens(21, seed=2)
    req = greedy_request("a", prompt)
    ids = blocks_for(h, BlockAllocator(h.num_groups), 21)
    start = 0
    for n in (7, 5, 9):
        out = step(h, [(req, start, n, drop_out_of_window(h, ids, start))])
        assert ("a" in out.sampled_token_ids) == (start + n == 21)
        start += n
    assert_close(prompt_and_sampled_logits(h, "a"), reference_logits(hf_model, prompt))


def test_suffix_on_prefix_blocks_written_by_another_sequence(family_model):
    """Exactly a prefix-cache hit: B's block table starts with the blocks A's forward wrote."""
    hf_model, config_json = family_model
    h = make_harness(hf_model, config_json)
    alloc = BlockAllocator(h.num_groups)
    shared = tokens(12, seed=3)  # three full blocks of 4
    prompt_a = shared + tokens(9, seed=4)
    prompt_b = shared + tokens(10, seed=5)
    req_a = greedy_request("a", prompt_a, prompt_logprobs=None)
    ids_a = blocks_for(h, alloc, len(prompt_a))
    step(h, [(req_a, 0, len(prompt_a), ids_a)])

    req_b = greedy_request("b", prompt_b)
    tail = blocks_for(h, alloc, len(prompt_b) - 12)
    ids_b = tuple(ids_a[g][:3] + tail[g] for g in range(h.num_groups))
    start = 12
    for n in (4, 6):  # the suffix in two chunks; the window moves between them
        step(h, [(req_b, start, n, drop_out_of_window(h, ids_b, start))])
        start += n
    ref = reference_logits(hf_model, prompt_b)
    assert_close(prompt_and_sampled_logits(h, "b"), ref[12:])


def test_batched_decode_with_sequences_of_different_lengths(family_model):
    hf_model, config_json = family_model
    h = make_harness(hf_model, config_json, num_blocks=96)
    alloc = BlockAllocator(h.num_groups)
    max_len = 40
    reqs, ids = [], {}
    for i, n in enumerate((5, 13, 22)):
        r = greedy_request(f"r{i}", tokens(n, seed=10 + i), prompt_logprobs=None)
        reqs.append(r)
        ids[r.request_id] = blocks_for(h, alloc, max_len)
    late = greedy_request("late", tokens(9, seed=20), prompt_logprobs=None)
    ids["late"] = blocks_for(h, alloc, max_len)

    def run(entries_reqs: list) -> None:
        entries = []
        for r in entries_reqs:
            start = r.num_computed_tokens
            n = r.num_tokens - start
            entries.append((r, start, n, drop_out_of_window(h, ids[r.request_id], start)))
        out = step(h, entries)
        for r in entries_reqs:
            ref = reference_logits(hf_model, r.all_token_ids)[-1]
            assert_close(h.sampler.sampled[r.request_id][-1], ref)
            r.num_computed_tokens = r.num_tokens
            r.append_output_token_ids(out.sampled_token_ids[r.request_id])

    run(reqs)  # three prefills in one mixed batch
    for i in range(6):
        # A new prompt joins the running decodes mid-way: a mixed decode + prefill batch.
        run(reqs + [late] if i >= 2 else reqs)
    for _ in range(2):
        run([reqs[1]])  # a lone decode
    assert all(r.num_tokens <= max_len for r in reqs)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bfloat16_stays_close_to_fp32_reference(family, tmp_path):
    hf_model, config_json = build_hf_model(family, tmp_path)
    model, config = build_ours(hf_model, config_json, dtype="bfloat16")
    assert next(model.parameters()).dtype == torch.bfloat16
    linear = model.model.layers[0].mlp.gate_up_proj
    if kernel_table._kernel("gemm") is not None:  # the native GEMM where the CPU takes it
        assert linear._gemm is not None and linear._packed is None
    else:  # else oneDNN-packed wherever oneDNN can pack bf16 (not on AVX2-only CPUs)
        assert (linear._packed is not None) == bf16_packing_supported()
    prompt = tokens(40, seed=6)  # >= 32 queries: the fp32 attention path
    bs = 4
    caches = [
        (
            torch.zeros(12, bs, config.num_kv_heads, config.head_dim, dtype=torch.bfloat16),
            torch.zeros(12, bs, config.num_kv_heads, config.head_dim, dtype=torch.bfloat16),
        )
        for _ in range(config.num_layers)
    ]
    groups = config.kv_cache_groups()
    spans = [ScheduledSpan(0, 40, tuple(list(range(1, 11)) for _ in groups))]
    meta = [
        build_attention_metadata(spans, g, bs, getattr(spec, "sliding_window", None))
        for g, spec in enumerate(groups)
    ]
    with torch.inference_mode():
        hidden = model(torch.tensor(prompt), ForwardContext(torch.arange(40), caches, meta))
        logits = model.compute_logits(hidden)
    ref = reference_logits(hf_model, prompt)
    assert logits.dtype == torch.float32
    err = (logits - ref).abs().max().item()
    assert err < 0.05 * ref.abs().max().item()
