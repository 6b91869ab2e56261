"""The offline API over replicas: `LLM(num_replicas=2)` on the tests' local Ray runtime (a module
apart from test_cluster_ray.py, whose cluster holds two replicas for the whole module)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers.cluster import start_ray

pytestmark = pytest.mark.timeout(600)


def test_the_offline_api_with_replicas_matches_one_engine(tiny_model: Any) -> None:
    """`LLM(num_replicas=2)` gives one engine's greedy outputs, and repeats of a prompt hit. In
    bf16 with batch invariance, bit for bit (tokens and logprobs): one engine ran the four
    prompts in one batch, each replica two of them, and the repeats come from the cache."""
    from prefixserve import LLM, SamplingParams

    start_ray()

    config = dict(
        model=str(tiny_model),
        dtype="bfloat16",
        max_model_len=1024,
        num_kv_blocks=256,
        batch_invariant=True,
    )
    prompts = [{"prompt_token_ids": [7000 + 30 * i + j for j in range(48)]} for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2)

    def key(output: Any) -> tuple:
        completion = output.outputs[0]
        steps = [sorted((t, lp.logprob) for t, lp in step.items()) for step in completion.logprobs]
        return tuple(completion.token_ids), str(steps)

    one = [key(o) for o in LLM(**config).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**config, num_replicas=2)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)
        assert [key(o) for o in outs] == one
        assert [key(o) for o in again] == one
        assert all(o.num_cached_tokens == 32 for o in again)
        assert llm.get_metrics()["router_decisions"] == 8
    finally:
        llm.shutdown()
