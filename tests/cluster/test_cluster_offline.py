"""The offline API over replicas: `LLM(num_replicas=2)` on a local Ray runtime of its own (a
module apart from test_cluster_ray.py, whose cluster holds the runtime's CPUs)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.timeout(600)


def test_the_offline_api_with_replicas_matches_one_engine(tiny_model: Any) -> None:
    """`LLM(num_replicas=2)` gives one engine's greedy outputs, and repeats of a prompt hit."""
    from prefixserve import LLM, SamplingParams

    config = dict(model=str(tiny_model), dtype="float32", max_model_len=1024, num_kv_blocks=256)
    prompts = [{"prompt_token_ids": [7000 + 30 * i + j for j in range(48)]} for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    one = [o.outputs[0].token_ids for o in LLM(**config).generate(prompts, params, use_tqdm=False)]
    llm = LLM(**config, num_replicas=2)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == one
        assert [o.outputs[0].token_ids for o in again] == one
        assert all(o.num_cached_tokens == 32 for o in again)
        assert llm.get_metrics()["router_decisions"] == 8
    finally:
        llm.shutdown()
