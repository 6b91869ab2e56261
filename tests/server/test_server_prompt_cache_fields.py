"""OpenAI's prompt-caching fields: `prompt_cache_retention` reaches the engine (or gets a 400),
`prompt_cache_key` is accepted within its bound and handed to the engine, whose router uses it
to break ties between replicas (one engine drops it)."""

from __future__ import annotations

import pytest

from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.openai.protocol import MAX_PROMPT_CACHE_KEY_CHARS
from tests.helpers.asgi import RecordingEngine, call

CHAT = [{"role": "user", "content": "hi"}]


def _post(app, path: str, **fields):
    body = {"model": "m", **fields}
    if path == "/v1/completions":
        body["prompt"] = "hi"
    else:
        body["messages"] = CHAT
    return call(app, "POST", path, body=body)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("retention", ["in_memory", "24h", None])
def test_prompt_cache_retention_reaches_the_engine(path, retention):
    engine = RecordingEngine()
    app = build_app(engine, ["m"])  # type: ignore[arg-type]
    fields = {} if retention is None else {"prompt_cache_retention": retention}
    _post(app, path, **fields)
    assert engine.added[-1].cache_retention == retention


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("bad", ["forever", "", 24, ["24h"]])
def test_an_unknown_prompt_cache_retention_is_a_400_naming_the_field(path, bad):
    engine = RecordingEngine()
    app = build_app(engine, ["m"])  # type: ignore[arg-type]
    result = _post(app, path, prompt_cache_retention=bad)
    assert result.status == 400 and "prompt_cache_retention" in result.body.decode()
    assert engine.added == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_cache_key_is_accepted_within_its_bound_and_handed_on_as_a_routing_hint(path):
    engine = RecordingEngine()
    app = build_app(engine, ["m"])  # type: ignore[arg-type]
    _post(app, path, prompt_cache_key="k" * MAX_PROMPT_CACHE_KEY_CHARS)
    assert len(engine.added) == 1
    assert engine.added[0].prompt_cache_key == "k" * MAX_PROMPT_CACHE_KEY_CHARS
    result = _post(app, path, prompt_cache_key="k" * (MAX_PROMPT_CACHE_KEY_CHARS + 1))
    assert result.status == 400 and "prompt_cache_key" in result.body.decode()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("bad", ["yes", "on", "true", 1, 0, None])
def test_cache_report_takes_a_json_bool_only_as_the_offline_api_does(path, bad):
    from prefixserve.sampling_params import SamplingParams

    with pytest.raises(ValueError, match="cache_report"):
        SamplingParams(cache_report=bad)
    engine = RecordingEngine()
    app = build_app(engine, ["m"])  # type: ignore[arg-type]
    result = _post(app, path, cache_report=bad)
    assert result.status == 400 and not engine.added
    assert result.json()["error"]["param"] == "cache_report"


def _json_bool_fields() -> list[tuple[str, str]]:
    """(path, field) for every bool field of the completions and chat request bodies (the
    stream options' as `stream_options.<name>`)."""
    from prefixserve.entrypoints.openai.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        StreamOptions,
    )

    def bools(model: type) -> list[str]:
        return [name for name, f in model.model_fields.items() if f.annotation is bool]

    nested = [f"stream_options.{name}" for name in bools(StreamOptions)]
    return [
        (path, name)
        for path, model in (
            ("/v1/completions", CompletionRequest),
            ("/v1/chat/completions", ChatCompletionRequest),
        )
        for name in bools(model) + nested
    ]


@pytest.mark.parametrize(("path", "name"), _json_bool_fields())
@pytest.mark.parametrize("bad", ["yes", "on", 1, 0])
def test_every_bool_of_a_request_body_takes_a_json_bool_only(path, name, bad):
    """As cache_report (and OpenAI's API): a JSON bool, never a string or a number."""
    engine = RecordingEngine()
    app = build_app(engine, ["m"])  # type: ignore[arg-type]
    field, _, sub = name.partition(".")
    value = {sub: bad} if sub else bad
    extra = {"stream": True} if sub else {}
    result = _post(app, path, **extra, **{field: value})
    assert result.status == 400 and not engine.added, (name, bad, result.status)
    assert sub or name in result.body.decode()


@pytest.mark.parametrize("name", ["reset_running_requests", "ram_only"])
def test_a_reset_body_takes_json_bools_only_and_its_query_string_text(name):
    engine = RecordingEngine()
    app = build_app(engine, ["m"])  # type: ignore[arg-type]
    refused = call(app, "POST", "/reset_prefix_cache", body={name: "yes"})
    assert refused.status == 400 and name in refused.body.decode()
    assert call(app, "POST", "/reset_prefix_cache", query=f"{name}=true").status == 200
    assert engine.resets == [(name == "reset_running_requests", name == "ram_only")]
