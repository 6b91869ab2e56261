"""Every malformed request gets a 4xx OpenAI error naming the field; the server keeps serving."""

from __future__ import annotations

import openai
import pytest

from prefixserve.entrypoints.server.errors import from_value_error
from tests.helpers.server import MAX_MODEL_LEN, MODEL_NAME

CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "hi"}]


def cmpl(**fields):
    return {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **fields}


def chat(**fields):
    return {"model": MODEL_NAME, "messages": OK_MESSAGES, "max_tokens": 2, **fields}


# (id, path, json body, status, param that must be named)
BAD_REQUESTS = [
    ("unknown-model", CMPL, cmpl(model="gpt-17"), 404, "model"),
    ("unknown-model-chat", CHAT, chat(model="gpt-17"), 404, "model"),
    ("missing-prompt", CMPL, {"model": MODEL_NAME}, 400, "prompt"),
    ("missing-messages", CHAT, {"model": MODEL_NAME}, 400, "messages"),
    ("empty-prompt", CMPL, cmpl(prompt=""), 400, "prompt"),
    ("empty-token-list", CMPL, cmpl(prompt=[]), 400, "prompt"),
    ("empty-messages", CHAT, chat(messages=[]), 400, "messages"),
    ("prompt-wrong-type", CMPL, cmpl(prompt={"text": "hi"}), 400, "prompt"),
    ("prompt-batch", CMPL, cmpl(prompt=["a", "b"]), 400, "prompt"),
    ("prompt-mixed-list", CMPL, cmpl(prompt=[1, "a"]), 400, "prompt"),
    ("messages-wrong-type", CHAT, chat(messages="hi"), 400, "messages"),
    (
        "message-bad-role",
        CHAT,
        chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages[0].role",
    ),
    ("prompt-too-long-text", CMPL, cmpl(prompt="hello " * (MAX_MODEL_LEN + 10)), 400, "prompt"),
    ("prompt-too-long-ids", CMPL, cmpl(prompt=[1] * MAX_MODEL_LEN), 400, "prompt"),
    (
        "chat-too-long",
        CHAT,
        chat(messages=[{"role": "user", "content": "hi " * 2 * MAX_MODEL_LEN}]),
        400,
        "messages",
    ),
    ("token-id-negative", CMPL, cmpl(prompt=[1, -1, 2]), 400, "prompt"),
    ("token-id-past-vocab", CMPL, cmpl(prompt=[1, 10_000_000]), 400, "prompt"),
    ("token-id-float", CMPL, cmpl(prompt=[1, 2.5]), 400, "prompt"),
    ("max-tokens-zero", CMPL, cmpl(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-negative", CMPL, cmpl(max_tokens=-5), 400, "max_tokens"),
    ("max-tokens-past-context", CMPL, cmpl(max_tokens=MAX_MODEL_LEN), 400, "max_tokens"),
    ("max-tokens-wrong-type", CMPL, cmpl(max_tokens="ten"), 400, "max_tokens"),
    (
        "chat-max-completion-tokens-zero",
        CHAT,
        chat(max_completion_tokens=0),
        400,
        "max_completion_tokens",
    ),
    ("chat-max-tokens-past-context", CHAT, chat(max_tokens=10 * MAX_MODEL_LEN), 400, "max_tokens"),
    ("n-zero", CMPL, cmpl(n=0), 400, "n"),
    ("n-too-large", CMPL, cmpl(n=65), 400, "n"),
    ("n-chat-zero", CHAT, chat(n=0), 400, "n"),
    ("temperature-negative", CMPL, cmpl(temperature=-0.1), 400, "temperature"),
    ("temperature-wrong-type", CMPL, cmpl(temperature="hot"), 400, "temperature"),
    ("temperature-negative-chat", CHAT, chat(temperature=-1), 400, "temperature"),
    ("top-p-zero", CMPL, cmpl(top_p=0), 400, "top_p"),
    ("top-p-above-one", CMPL, cmpl(top_p=1.5), 400, "top_p"),
    ("top-p-chat", CHAT, chat(top_p=-0.2), 400, "top_p"),
    ("logprobs-too-large", CMPL, cmpl(logprobs=21), 400, "logprobs"),
    ("top-logprobs-too-large", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top-logprobs-without-logprobs", CHAT, chat(top_logprobs=2), 400, "top_logprobs"),
    ("prompt-logprobs-too-large", CMPL, cmpl(prompt_logprobs=50), 400, "prompt_logprobs"),
    ("cache-salt-empty", CMPL, cmpl(cache_salt=""), 400, "cache_salt"),
    ("cache-salt-oversize", CMPL, cmpl(cache_salt="s" * 257), 400, "cache_salt"),
    ("cache-salt-wrong-type", CHAT, chat(cache_salt=12), 400, "cache_salt"),
    ("too-many-stop-strings", CMPL, cmpl(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    ("empty-stop-string", CMPL, cmpl(stop=[""]), 400, "stop"),
    ("presence-penalty-range", CMPL, cmpl(presence_penalty=3), 400, "presence_penalty"),
    ("frequency-penalty-range", CHAT, chat(frequency_penalty=-3), 400, "frequency_penalty"),
    ("top-k-below-minus-one", CMPL, cmpl(top_k=-2), 400, "top_k"),
    ("min-p-range", CMPL, cmpl(min_p=1.5), 400, "min_p"),
    ("repetition-penalty-zero", CMPL, cmpl(repetition_penalty=0), 400, "repetition_penalty"),
    ("seed-wrong-type", CMPL, cmpl(seed="abc"), 400, "seed"),
    ("stream-wrong-type", CMPL, cmpl(stream=[1]), 400, "stream"),
    ("echo-unsupported", CMPL, cmpl(echo=True), 400, "echo"),
]


def assert_openai_error(response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_bad_request_gets_an_openai_error_naming_the_field(server, path, body, status, param):
    with server.http() as http:
        response = http.post(path, json=body)
        error = assert_openai_error(response, status, param)
        assert error["type"] == "invalid_request_error"
        # ... and the server keeps serving.
        assert http.get("/v1/models").status_code == 200


@pytest.mark.parametrize(
    "content",
    [b"{not json", b'{"model": "x", "prompt": "a",}', b"", b"\xff\xfe"],
    ids=["garbage", "trailing-comma", "empty", "not-utf8"],
)
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_invalid_json_is_a_400(server, path, content):
    with server.http() as http:
        response = http.post(path, content=content, headers={"Content-Type": "application/json"})
        error = assert_openai_error(response, 400, None)
        assert "JSON" in error["message"] or "body" in error["message"]


@pytest.mark.parametrize("content", [b"[1, 2]", b'"a string"', b"42"])
def test_a_body_that_is_not_an_object_is_a_400(server, content):
    with server.http() as http:
        response = http.post(CMPL, content=content, headers={"Content-Type": "application/json"})
        assert_openai_error(response, 400, None)


def test_unknown_route_is_a_404_in_the_openai_shape(open_server):
    # With keys, a route not listed for tenants is operator-only (403; deny by default): the
    # operator sees the 404.
    with open_server.http() as http:
        assert_openai_error(http.get("/v1/nothing-here"), 404, None)


def test_the_openai_client_sees_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, temperature=-1)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_the_server_serves_normally_after_bad_requests(client, server):
    response = client.completions.create(model=MODEL_NAME, prompt="Still alive?", max_tokens=3)
    assert response.usage.completion_tokens >= 1
    server.check_no_leaks()


# (id, path, json body, param): a request past the context, refused by the engine's check.
PAST_THE_CONTEXT = [
    ("prompt", CMPL, cmpl(prompt=[1] * MAX_MODEL_LEN), "prompt"),
    ("max-tokens", CMPL, cmpl(max_tokens=MAX_MODEL_LEN), "max_tokens"),
    (
        "chat-prompt",
        CHAT,
        chat(messages=[{"role": "user", "content": "hi " * MAX_MODEL_LEN}]),
        "messages",
    ),
    ("chat-max-tokens", CHAT, chat(max_tokens=MAX_MODEL_LEN), "max_tokens"),
    (
        "chat-max-completion-tokens",
        CHAT,
        chat(max_completion_tokens=MAX_MODEL_LEN),
        "max_completion_tokens",
    ),
    ("streamed", CMPL, cmpl(prompt=[1] * MAX_MODEL_LEN, stream=True), "prompt"),
]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [pytest.param(*case[1:], id=case[0]) for case in PAST_THE_CONTEXT],
)
def test_a_request_past_the_context_is_context_length_exceeded(server, path, body, param):
    with server.http() as http:
        error = assert_openai_error(http.post(path, json=body), 400, param)
    assert error["code"] == "context_length_exceeded"
    assert str(MAX_MODEL_LEN) in error["message"]


def test_a_token_id_outside_the_vocabulary_is_no_context_error(server):
    with server.http() as http:
        error = assert_openai_error(
            http.post(CMPL, json=cmpl(prompt=[1, 10_000_000])), 400, "prompt"
        )
    assert error["code"] is None
    assert "10000000" in error["message"]


@pytest.mark.parametrize(
    ("message", "fields", "param", "code"),
    [
        ("prompt_token_ids must be integers in [0, 10), got 12", None, "prompt", None),
        ("prompt_token_ids must hold at least one token", {"prompt": "messages"}, "messages", None),
        (
            "the prompt has 9 tokens but max_model_len is 8; at most 7",
            {"prompt": "messages"},
            "messages",
            "context_length_exceeded",
        ),
        (
            "max_tokens=9 plus the prompt's 1 tokens exceeds max_model_len=8",
            {"max_tokens": "max_completion_tokens"},
            "max_completion_tokens",
            "context_length_exceeded",
        ),
        ("top_p must be in (0, 1], got 0", {"prompt": "messages"}, "top_p", None),
        ("something else went wrong", {"prompt": "messages"}, None, None),
    ],
)
def test_an_engine_value_error_names_the_endpoint_field(message, fields, param, code):
    error = from_value_error(ValueError(message), fields)
    assert (error.status_code, error.param, error.code) == (400, param, code)
    assert error.message == message


class _BrokenDetokenizer:
    def add_tokens(self, token_ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad byte")


class _BreakingTokenizer:
    """The engine's tokenizer, but every new request's detokenizer fails."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def incremental_detokenizer(self, prompt_token_ids):
        return _BrokenDetokenizer()


def test_a_request_that_fails_alone_is_a_500_naming_the_cause_and_the_server_goes_on(server):
    def install(engine):
        real = engine.output_processor.tokenizer
        engine.output_processor.tokenizer = _BreakingTokenizer(real)
        return real

    real = server.run_in_engine(install)
    try:
        with server.http() as http:
            response = http.post(CMPL, json=cmpl())
            assert response.status_code == 500
            error = response.json()["error"]
            assert error["code"] == "request_failed" and "detokeniz" in error["message"]
            streamed = http.post(CMPL, json=cmpl(stream=True)).text
            assert '"code": "request_failed"' in streamed and streamed.endswith("data: [DONE]\n\n")
    finally:
        server.run_in_engine(lambda e: setattr(e.output_processor, "tokenizer", real))
    with server.http() as http:
        assert http.post(CMPL, json=cmpl()).status_code == 200
    server.check_no_leaks()
