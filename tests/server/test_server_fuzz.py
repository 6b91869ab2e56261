"""Request bodies of random shapes against the real app: never a 5xx, and the server is whole after.

Each field is drawn either from small legal values (so legal requests stay cheap: a few tokens)
or from junk: wrong types, extreme and non-finite numbers (sent as JSON's NaN / Infinity
literals, which Python's json writes), unicode including lone surrogates, nesting, unknown keys.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.helpers.server import MODEL_NAME

pytestmark = pytest.mark.timeout(600)

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"

_FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 1e38, 1e308, -1e308]),
)
_INTS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([-1, 0, 2**31, 2**32 + 1, 2**63, 2**64 - 1, 2**64]),
)
# st.text leaves out lone surrogates, which JSON can carry: add them.
_TEXT = st.one_of(st.text(max_size=40), st.sampled_from(["\ud800", "a\udfff", "\udbff\udc00"]))
_SCALARS = st.one_of(st.none(), st.booleans(), _INTS, _FLOATS, _TEXT)
_JUNK = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)


def _either(legal: st.SearchStrategy) -> st.SearchStrategy:
    """Legal four times in five: with a dozen fields, some bodies are legal throughout."""
    return st.one_of(legal, legal, legal, legal, _JUNK)


_PROMPTS = st.one_of(
    st.text(min_size=1, max_size=40),
    st.text(min_size=1, max_size=40),
    st.lists(st.integers(min_value=0, max_value=20_000), min_size=1, max_size=20),
    st.sampled_from(["\ud800", "\udfff tail", "\x00", "a" * 200]),
    _JUNK,
)
_LEGAL_MESSAGES = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": _TEXT}
    ),
    min_size=1,
    max_size=3,
)
_MESSAGES = st.one_of(
    _LEGAL_MESSAGES,
    _LEGAL_MESSAGES,
    _LEGAL_MESSAGES,
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "tool", "wizard", ""]),
                "content": st.one_of(st.sampled_from(["\ud800", ""]), _JUNK),
            }
        ),
        max_size=3,
    ),
    _JUNK,
)
_SAMPLING = {
    "n": _either(st.integers(1, 2)),
    "temperature": _either(st.floats(0, 2)),
    "top_p": _either(st.floats(0.1, 1)),
    "top_k": _either(st.integers(-1, 50)),
    "min_p": _either(st.floats(0, 1)),
    "presence_penalty": _either(st.floats(-2, 2)),
    "frequency_penalty": _either(st.floats(-2, 2)),
    "repetition_penalty": _either(st.floats(0.5, 2)),
    "seed": _either(st.integers(0, 2**64 - 2)),
    "stop": _either(st.lists(st.text(min_size=1, max_size=5), max_size=3)),
    "stop_token_ids": _either(st.lists(st.integers(0, 50_000), max_size=3)),
    "stream": _either(st.booleans()),
    "ignore_eos": _either(st.booleans()),
    "cache_salt": _either(st.one_of(st.text(min_size=1, max_size=10), _TEXT)),
}


def _optional(fields: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional=fields)


def _body(required: dict[str, st.SearchStrategy], extra: dict[str, st.SearchStrategy]):
    return st.builds(
        lambda base, opt, unknown: {**base, **opt, **unknown},
        st.fixed_dictionaries(required),
        _optional({**_SAMPLING, **extra}),
        _either(st.just({})).filter(lambda extra: isinstance(extra, dict))
        | st.dictionaries(st.text(min_size=1, max_size=6), _JUNK, max_size=2),
    )


# max_tokens is always there and small when legal: a legal request costs a few tokens.
COMPLETION_BODIES = _body(
    {
        "model": _either(st.just(MODEL_NAME)),
        "prompt": _PROMPTS,
        "max_tokens": _either(st.integers(1, 3)),
    },
    {
        "logprobs": _either(st.integers(0, 5)),
        "echo": _either(st.booleans()),
        "prompt_logprobs": _either(st.integers(0, 2)),
    },
)
CHAT_BODIES = _body(
    {
        "model": _either(st.just(MODEL_NAME)),
        "messages": _MESSAGES,
        "max_tokens": _either(st.integers(1, 3)),
    },
    {
        "logprobs": _either(st.booleans()),
        "top_logprobs": _either(st.integers(0, 5)),
        "max_completion_tokens": _either(st.integers(1, 3)),
    },
)


def _check(http, path: str, body: object) -> None:
    raw = json.dumps(body)  # NaN and Infinity become JSON's non-standard literals
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    event(f"{path} {response.status_code}")
    assert response.status_code < 500, (response.status_code, raw[:300], response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
        assert '"error"' not in response.text, response.text[:500]


FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


@pytest.fixture(params=["keys", "open"])
def any_server(request, server, open_server):
    """The server with tenant keys, and the one without (the client's cache_salt unhashed)."""
    return server if request.param == "keys" else open_server


@FUZZ
@given(body=COMPLETION_BODIES)
def test_completion_bodies_of_any_shape_never_get_a_5xx(any_server, body):
    with any_server.http() as http:
        _check(http, CMPL, body)


@FUZZ
@given(body=CHAT_BODIES)
def test_chat_bodies_of_any_shape_never_get_a_5xx(any_server, body):
    with any_server.http() as http:
        _check(http, CHAT, body)


@FUZZ
@given(body=_JUNK)
def test_bodies_that_are_not_objects_are_a_4xx(server, body):
    with server.http() as http:
        _check(http, CMPL, body)
        _check(http, CHAT, body)


def test_a_lone_surrogate_cache_salt_is_a_400_not_a_dead_engine(open_server):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 20, "cache_salt": "\ud800"}
    with open_server.http() as http:
        response = http.post(CMPL, content=json.dumps(body))
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"]
        assert http.get("/health").status_code == 200


def test_after_the_fuzzing_the_server_is_whole(server):
    with server.http() as http:
        assert http.get("/health").status_code == 200
        ok = http.post(CMPL, json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    server.check_no_leaks()
