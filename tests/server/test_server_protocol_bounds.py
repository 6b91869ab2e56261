"""The protocol models refuse what SamplingParams refuses, as 400s naming the field.

The bounds are SamplingParams' (one definition); these run on the stand-in engine."""

from __future__ import annotations

import json

import pytest

from prefixserve.core.kv_cache.salts import validate_cache_salt
from prefixserve.entrypoints.openai import protocol as p
from prefixserve.sampling_params import SamplingParams
from tests.helpers.asgi import TENANT_KEY, call, keys, make_app

BAD = [
    ("temperature", "NaN"),
    ("temperature", "Infinity"),
    ("temperature", "101"),
    ("top_p", "NaN"),
    ("min_p", "-Infinity"),
    ("presence_penalty", "NaN"),
    ("frequency_penalty", "3"),
    ("repetition_penalty", "1e-38"),
    ("repetition_penalty", "NaN"),
    ("top_k", str(2**31)),
    ("seed", str(2**64)),
    ("seed", "-1"),
    ("stop", '["' + "x" * 1025 + '"]'),
    ("stop_token_ids", str([2**31])),
    ("stop_token_ids", str(list(range(1025)))),
]


@pytest.mark.parametrize(("name", "raw"), BAD)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_out_of_range_and_non_finite_fields_are_a_400_naming_the_field(path, name, raw):
    app, engine = make_app(keys())
    head = (
        '"prompt": "hi"'
        if path == "/v1/completions"
        else '"messages": [{"role": "user", "content": "hi"}]'
    )
    body = ("{" + head + f', "{name}": {raw}' + "}").encode()
    result = call(app, "POST", path, key=TENANT_KEY, chunks=[body])
    assert result.status == 400, result.body
    error = result.json()["error"]
    assert error["param"] == name, error
    assert not engine.added


def test_the_seed_of_every_child_fits_64_bits_over_http():
    app, engine = make_app(keys())
    body = {"prompt": "hi", "seed": 2**64 - 1, "n": 2}
    result = call(app, "POST", "/v1/completions", key=TENANT_KEY, body=body)
    assert result.status == 400
    assert result.json()["error"]["param"] == "seed"
    assert not engine.added


@pytest.mark.parametrize("body", [{"prompt": "hi"}, {"prompt": "hi", "max_tokens": None}])
def test_completions_max_tokens_absent_or_null_is_16(body):
    assert p.CompletionRequest(**body).max_tokens == 16


def test_chat_max_tokens_absent_stays_unset():
    request = p.ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}])
    assert request.effective_max_tokens is None


@pytest.mark.parametrize(("name", "raw"), BAD)
def test_the_offline_api_refuses_every_value_the_server_refuses(name, raw):
    """One table, both sides: what the protocol models refuse above, SamplingParams (the offline
    API's) refuses too, naming the same field."""
    value = json.loads(raw)  # Python's json reads NaN and Infinity as the server's parser does
    with pytest.raises(ValueError, match=name):
        SamplingParams(**{name: value})


SALTS = ["x" * 257, ""]


@pytest.mark.parametrize("salt", SALTS)
def test_a_cache_salt_is_refused_alike_over_http_and_offline(salt):
    app, engine = make_app(keys())
    body = {"prompt": "hi", "cache_salt": salt}
    result = call(app, "POST", "/v1/completions", key=TENANT_KEY, body=body)
    assert result.status == 400 and result.json()["error"]["param"] == "cache_salt"
    assert not engine.added
    with pytest.raises(ValueError, match="cache_salt"):
        validate_cache_salt(salt)  # what LLM.generate runs on a prompt's cache_salt
