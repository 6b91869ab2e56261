"""Prompt embeddings as input (`{"prompt_embeds": tensor}` with enable_prompt_embeds), in fp32:
the embeddings of a prompt's tokens give the token ids' output, equal embeddings share blocks,
different ones share exactly the blocks before the first difference, and bad tensors are
refused before they reach the engine."""

from __future__ import annotations

import pytest
import torch

from prefixserve import LLM, SamplingParams
from tests.helpers import random_tokens


@pytest.fixture(scope="module")
def llm(default_model_exact):
    return LLM(
        dtype=default_model_exact.config.dtype,
        loaded_model=default_model_exact,
        num_kv_blocks=96,
        enable_prompt_embeds=True,
        enable_kv_store=False,
    )


def embed(llm: LLM, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return llm.llm_engine.runner.model.embed(torch.tensor(ids)).clone()


def greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate(llm: LLM, prompts: list[dict], params: SamplingParams):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_no_leaks()
    return outputs


def test_embeddings_of_the_tokens_give_the_token_ids_output(llm):
    prompts = [random_tokens(n, seed=n) for n in (5, 37, 64)]
    by_ids = generate(llm, [{"prompt_token_ids": p} for p in prompts], greedy())
    llm.reset_prefix_cache()
    by_embeds = generate(llm, [{"prompt_embeds": embed(llm, p)} for p in prompts], greedy())
    for a, b in zip(by_ids, by_embeds, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.num_cached_tokens == 0  # token ids' blocks never serve embeddings


def test_gemma3_embeddings_are_taken_after_its_embedding_scale(default_model_exact, tmp_path):
    from tests.helpers.lora import build_hf_model, our_llm

    hf, config = build_hf_model("gemma3", tmp_path)
    tiny = our_llm(
        hf, config, default_model_exact.tokenizer, enable_lora=False, enable_prompt_embeds=True
    )
    prompt = [t % 128 for t in random_tokens(11, seed=4)]
    by_ids = generate(tiny, [{"prompt_token_ids": prompt}], greedy())
    by_embeds = generate(tiny, [{"prompt_embeds": embed(tiny, prompt)}], greedy())
    assert by_ids[0].outputs[0].token_ids == by_embeds[0].outputs[0].token_ids


def test_same_embeddings_share_blocks(llm):
    llm.reset_prefix_cache()
    embeds = embed(llm, random_tokens(50, seed=7))  # 3 full blocks of 16 + 2
    first, second = (generate(llm, [{"prompt_embeds": embeds}], greedy(2))[0] for _ in range(2))
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 48
    assert first.outputs[0].token_ids == second.outputs[0].token_ids


def test_embeddings_differing_in_one_position_share_only_the_blocks_before_it(llm):
    llm.reset_prefix_cache()
    embeds = embed(llm, random_tokens(70, seed=8))  # 4 full blocks of 16 + 6
    generate(llm, [{"prompt_embeds": embeds}], greedy(1))
    changed = embeds.clone()
    changed[40, 3] += 1.0  # inside the third block
    out = generate(llm, [{"prompt_embeds": changed}], greedy(1))[0]
    assert out.num_cached_tokens == 32


def test_preempted_embeddings_request_recomputes_from_its_embeddings(default_model_exact):
    small = LLM(
        dtype=default_model_exact.config.dtype,
        loaded_model=default_model_exact,
        num_kv_blocks=12,
        enable_prompt_embeds=True,
        enable_kv_store=False,
    )
    prompts = [random_tokens(40, seed=20 + i) for i in range(3)]
    by_ids = generate(small, [{"prompt_token_ids": p} for p in prompts], greedy(60))
    small.reset_prefix_cache()
    before = small.get_metrics()["num_preemptions"]
    by_embeds = generate(small, [{"prompt_embeds": embed(small, p)} for p in prompts], greedy(60))
    assert small.get_metrics()["num_preemptions"] > before
    for a, b in zip(by_ids, by_embeds, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize(
    "value,match",
    [
        (torch.zeros(4, 7), r"shape \[num_tokens, 576\]"),
        (torch.zeros(576), r"shape \[num_tokens, 576\]"),
        (torch.zeros(0, 576), "between 1 and max_model_len"),
        (torch.zeros(10_000, 576), "between 1 and max_model_len=8192"),
        (torch.zeros(3, 576, dtype=torch.int64), "float32, bfloat16 or float16, got int64"),
        (torch.full((3, 576), float("nan")), "NaN or infinite"),
        (torch.full((3, 576), float("inf")), "NaN or infinite"),
        ([[0.0] * 576], "must be a torch.Tensor, got list"),
    ],
)
def test_bad_prompt_embeds_are_refused(llm, value, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_embeds": value}], greedy(), use_tqdm=False)
    llm.llm_engine.check_no_leaks()


def _nested(layout: torch.layout) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.zeros(2, 576), torch.zeros(3, 576)], layout=layout)


@pytest.mark.parametrize(
    "make,match",
    [
        pytest.param(lambda t: t.to_sparse(), "got layout torch.sparse_coo", id="coo"),
        pytest.param(lambda t: t.to_sparse_csr(), "got layout torch.sparse_csr", id="csr"),
        pytest.param(lambda t: t.to_sparse_csc(), "got layout torch.sparse_csc", id="csc"),
        pytest.param(lambda t: t.to_sparse_bsr((1, 1)), "got layout torch.sparse_bsr", id="bsr"),
        pytest.param(lambda t: t.to_sparse_bsc((1, 1)), "got layout torch.sparse_bsc", id="bsc"),
        pytest.param(lambda t: _nested(torch.strided), "got a nested tensor", id="nested"),
        pytest.param(
            lambda t: _nested(torch.jagged),
            "plain torch.Tensor, got its subclass .*NestedTensor",
            id="nested_jagged",
        ),
    ],
)
def test_sparse_and_nested_prompt_embeds_are_refused_by_layout_first(llm, make, match):
    """These have no storage (and nested ones no shape): the layout is checked before either is
    read, so they are a ValueError naming the layout, not whatever reading them raises."""
    with pytest.raises(ValueError, match=f"prompt_embeds must be .*{match}"):
        llm.generate([{"prompt_embeds": make(torch.eye(3, 576))}], greedy(), use_tqdm=False)
    llm.llm_engine.check_no_leaks()


def test_embeds_with_token_ids_or_prompt_logprobs_or_when_disabled_are_refused(
    llm, default_model_exact
):
    embeds = embed(llm, [1, 2, 3])
    with pytest.raises(ValueError, match="not both"):
        llm.generate([{"prompt_embeds": embeds, "prompt_token_ids": [1]}], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs are not available"):
        llm.generate([{"prompt_embeds": embeds}], SamplingParams(prompt_logprobs=1), use_tqdm=False)
    off = LLM(
        dtype=default_model_exact.config.dtype, loaded_model=default_model_exact, num_kv_blocks=16
    )
    with pytest.raises(ValueError, match="enable_prompt_embeds=True"):
        off.generate([{"prompt_embeds": embeds}], use_tqdm=False)
    llm.llm_engine.check_no_leaks()
    off.llm_engine.check_no_leaks()


def test_repetition_penalty_sees_only_the_output_of_an_embeddings_prompt(llm):
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=3, repetition_penalty=1.5, ignore_eos=True)
    engine.add_request("p", [], params, prompt_embeds=embed(llm, [11, 12, 13]))
    request = engine.scheduler.requests["p"]
    assert request.prompt_token_ids == [0, 0, 0] and request.history_token_ids == []
    engine.step()
    assert request.history_token_ids == request.output_token_ids != []
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_no_leaks()


def test_caller_changing_its_tensor_afterwards_changes_nothing(llm):
    llm.reset_prefix_cache()
    embeds = embed(llm, random_tokens(20, seed=9))
    engine = llm.llm_engine
    engine.add_request("r", [], greedy(4), prompt_embeds=embeds)
    hashes = list(engine.scheduler.requests["r"].block_hashes)
    embeds.fill_(0.0)
    assert engine.scheduler.requests["r"].block_hashes == hashes
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_no_leaks()
