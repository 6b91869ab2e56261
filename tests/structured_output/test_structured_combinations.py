"""Structured outputs meet the engine's other features: hypothesis draws an engine (jump-forward
on or off, n-gram speculation, chunked prefill, prefix caching on or off, a pool small enough to
preempt) and a request (greedy or seeded, n of 1 or 2), and the answers must equal those of the
default engine, validate against their schema when they finish, and leave no block behind.

The model is the packaged default model in its batch-invariant dtype (`default_model_exact`), so
how a request was chunked, batched, preempted or cached cannot change a token.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve import LLM, SamplingParams
from prefixserve.sampling_params import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "London", "Berlin", "Madrid"]},
        "population": {"type": "integer", "minimum": 0},
        "sights": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
    },
    "required": ["city", "population", "sights"],
    "additionalProperties": False,
}
PROMPTS = [
    "A city described as a JSON object, with its population and two sights: ",
    "Here is a European capital as JSON: ",
    "A city described as a JSON object, with its population and two sights: Paris? ",
]
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}


@pytest.fixture(scope="module")
def model(default_model_exact):
    return default_model_exact


@pytest.fixture(scope="module")
def reference(model):
    return LLM(dtype=model.config.dtype, loaded_model=model, num_kv_blocks=256)


engines = st.fixed_dictionaries(
    {
        "structured_outputs_jump_forward": st.booleans(),
        "speculative_config": st.sampled_from([None, SPEC]),
        "long_prefill_token_threshold": st.sampled_from([0, 8]),
        "enable_prefix_caching": st.booleans(),
        "num_kv_blocks": st.sampled_from([12, 256]),
    }
)
requests = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.0, 0.9]),
        "seed": st.integers(0, 1000),
        "n": st.sampled_from([1, 2]),
    }
)


@settings(
    max_examples=6,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(engine=engines, request=requests)
def test_structured_answers_are_the_same_in_every_engine_configuration(
    model, reference, engine, request
):
    llm = LLM(dtype=model.config.dtype, loaded_model=model, **engine)
    params = SamplingParams(
        max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA), **request
    )
    got = llm.generate(PROMPTS, params, use_tqdm=False)
    want = reference.generate(PROMPTS, params, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], engine
        for completion in a.outputs:
            if completion.finish_reason == "stop":
                jsonschema.validate(json.loads(completion.text), SCHEMA)
    llm.llm_engine.check_no_leaks()
    reference.llm_engine.check_no_leaks()
