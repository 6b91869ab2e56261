"""A failure that belongs to one request fails that request only: its prompt finishes with
`error` set (the failed sample's finish_reason "error"), its blocks are freed, and the engine goes
on serving everyone else with the outputs they would have had alone."""

from __future__ import annotations

import pytest
import torch

from prefixserve.config import CacheConfig, EngineConfig
from prefixserve.core.request import Request
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.sampling_params import SamplingParams
from prefixserve.worker.model_runner import seeded_generator
from tests.helpers import random_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture
def engine(default_model_fp32):
    engine = LLMEngine(
        EngineConfig(dtype="float32", cache=CacheConfig(num_kv_blocks=128)),
        loaded_model=default_model_fp32,
    )
    yield engine
    engine.check_no_leaks()
    assert not engine.runner._seeded_generators


def forced(params: SamplingParams, **fields) -> SamplingParams:
    """Params the validation would refuse: the engine must survive them anyway."""
    for name, value in fields.items():
        object.__setattr__(params, name, value)
    return params


def drain(engine: LLMEngine) -> dict:
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def alone(engine: LLMEngine, prompt: list[int]) -> list[int]:
    engine.add_request("alone", prompt, GREEDY)
    return drain(engine)["alone"].outputs[0].token_ids


def test_a_seed_that_cannot_seed_fails_only_its_request(engine):
    good, bad = random_tokens(20, seed=1), random_tokens(20, seed=2)
    engine.add_request("good", good, GREEDY)
    engine.add_request("bad", bad, SamplingParams(n=2, max_tokens=4, seed=2**64 - 2))
    # Sample 1 has seed 2**64 - 1; one past it is what a seed outside the validation looks like.
    [child] = [r for r in engine.scheduler.waiting if r.request_id == "1_bad"]
    forced(child.sampling_params, seed=2**64)
    finals = drain(engine)
    failed = finals["bad"]
    assert failed.finished and "seed" in failed.error
    assert [c.finish_reason for c in failed.outputs] == ["abort", "error"]
    assert finals["good"].error is None
    assert finals["good"].outputs[0].token_ids == alone(engine, good)


def test_non_finite_penalized_logits_fail_only_their_request(engine):
    good = random_tokens(20, seed=3)
    engine.add_request("good", good, GREEDY)
    engine.add_request(
        "inf",
        random_tokens(20, seed=4),
        forced(SamplingParams(max_tokens=4), repetition_penalty=1e-38),
    )
    finals = drain(engine)
    assert "non-finite" in finals["inf"].error
    assert finals["inf"].outputs[0].finish_reason == "error"
    assert finals["good"].outputs[0].token_ids == alone(engine, good)


def test_a_sampler_error_on_one_row_fails_only_that_request(engine):
    sampler = engine.runner.sampler

    def flaky(logits, requests, generators):
        if any(r.request_id == "bad" for r in requests):
            raise RuntimeError("boom")
        return sampler(logits, requests, generators)

    engine.runner.sampler = flaky
    good = random_tokens(20, seed=5)
    engine.add_request("good", good, GREEDY)
    engine.add_request("bad", random_tokens(20, seed=6), GREEDY)
    finals = drain(engine)
    assert "boom" in finals["bad"].error
    engine.runner.sampler = sampler
    assert finals["good"].outputs[0].token_ids == alone(engine, good)


def test_a_detokenizer_error_fails_only_its_request(engine):
    class Broken:
        def add_tokens(self, token_ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")

    good = random_tokens(20, seed=7)
    engine.add_request("good", good, GREEDY)
    engine.add_request("bad", random_tokens(20, seed=8), SamplingParams(n=2, max_tokens=4))
    engine.output_processor._sample_of["1_bad"][1].detokenizer = Broken()
    finals = drain(engine)
    assert "detokeniz" in finals["bad"].error
    assert [c.finish_reason for c in finals["bad"].outputs] == ["abort", "error"]
    assert finals["good"].outputs[0].token_ids == alone(engine, good)


def test_the_engine_serves_on_after_a_failed_request(engine):
    engine.add_request("bad", random_tokens(20, seed=9), forced(SamplingParams(), seed=2**64))
    assert drain(engine)["bad"].error
    prompt = random_tokens(20, seed=10)
    assert len(alone(engine, prompt)) == 4


# ----------------------------------------------------------------------------- seeds


def test_seeds_differing_above_32_bits_give_different_streams():
    streams = [torch.rand(8, generator=seeded_generator(s)) for s in (1, 2**32 + 1, 2**33 + 1)]
    for i in range(3):
        for j in range(i):
            assert not torch.equal(streams[i], streams[j])
    again = torch.rand(8, generator=seeded_generator(2**33 + 1))
    assert torch.equal(again, streams[2])  # same seed, same stream
    # Below 2**32 a seed is torch's own manual_seed stream, as before.
    assert torch.equal(streams[0], torch.rand(8, generator=torch.Generator().manual_seed(1)))


def test_seeds_differing_above_32_bits_give_different_samples_in_the_engine(engine):
    prompt = random_tokens(20, seed=11)
    outs = []
    for i, seed in enumerate((1, 2**32 + 1, 2**33 + 1, 2**33 + 1)):
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=seed)
        engine.add_request(f"r{i}", prompt, params)
        outs.append(drain(engine)[f"r{i}"].outputs[0].token_ids)
    assert outs[0] != outs[1] and outs[0] != outs[2] and outs[1] != outs[2]
    assert outs[2] == outs[3]


# ----------------------------------------------------------------------------- prompt logprobs


def test_only_sample_0_computes_prompt_logprobs(engine):
    prompt = random_tokens(40, seed=12)
    params = SamplingParams(n=3, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    engine.add_request("p", prompt, params)
    seen: list[Request] = list(engine.scheduler.waiting)
    assert [r.sampling_params.prompt_logprobs for r in seen] == [2, None, None]
    assert [r.skip_reading_prefix_cache for r in seen] == [True, False, False]
    out = drain(engine)["p"]
    assert len(out.prompt_logprobs) == 40 and out.prompt_logprobs[0] is None
    # Samples 1 and 2 hit sample 0's full blocks: only its 40 tokens plus their tails computed.
    assert engine.get_metrics()["computed_prompt_tokens"] == 40 + 2 * (40 % 16)


def test_nan_logits_on_one_row_fail_that_request_and_uncache_its_blocks(engine, monkeypatch):
    model = engine.runner.model
    compute_logits = model.compute_logits
    calls = []

    def poisoned(hidden):
        logits = compute_logits(hidden)
        if not calls:  # the first step: rows [good, bad], both prefilling 20 tokens
            logits[1] = float("nan")
        calls.append(1)
        return logits

    monkeypatch.setattr(model, "compute_logits", poisoned)
    good, bad = random_tokens(20, seed=13), random_tokens(20, seed=14)
    engine.add_request("good", good, GREEDY)
    engine.add_request("bad", bad, GREEDY)
    finals = drain(engine)
    assert "non-finite" in finals["bad"].error
    assert finals["good"].error is None and len(finals["good"].outputs[0].token_ids) == 4
    monkeypatch.undo()
    assert finals["good"].outputs[0].token_ids == alone(engine, good)
    # The block the failed request filled was uncached: the same prompt again hits nothing.
    engine.add_request("again", bad, GREEDY)
    assert drain(engine)["again"].num_cached_tokens == 0


def test_a_lone_surrogate_cache_salt_is_refused_at_admission(engine):
    with pytest.raises(ValueError, match="cache_salt"):
        engine.add_request("s", [1, 2], GREEDY, cache_salt="\ud800")
    engine.check_no_leaks()


def test_a_row_that_rules_out_every_token_counts_as_non_finite():
    from prefixserve.worker.model_runner import _all_finite

    ok = torch.tensor([[0.0, float("-inf")], [1.0, 2.0]])
    assert _all_finite(ok)
    assert not _all_finite(torch.tensor([[float("-inf"), float("-inf")], [1.0, 2.0]]))
    assert not _all_finite(torch.tensor([[float("nan"), 0.0]]))
    assert not _all_finite(torch.tensor([[float("inf"), 0.0]]))
