"""Structured outputs over HTTP: OpenAI's `response_format` and vLLM's `structured_outputs` on
both generation routes, through the official SDK, instructor and pydantic-ai; the 400s naming
the field, the 429 of a client with too many compiles in flight, and the metrics.

Every answer is greedy and a few tokens long (the schemas bound their strings), so the whole file
costs a dozen short generations of the default model.
"""

from __future__ import annotations

import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import httpx
import instructor
import jsonschema
import pytest
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from prefixserve.entrypoints.openai import protocol as p
from prefixserve.entrypoints.openai.structured_outputs import (
    JSON_OBJECT_NAMES,
    JSON_SCHEMA_NAMES,
    structured_outputs_params,
)
from prefixserve.entrypoints.server.errors import from_value_error
from prefixserve.sampling_params import MAX_SCHEMA_DEPTH
from prefixserve.structured_output.errors import GrammarError
from tests.helpers.server import KEY_BETA, MODEL_NAME, ssl_context
from tests.server.test_server_metrics import delta, scrape

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


class City(BaseModel):
    """A city and its country (the strings bounded, so an answer is a few tokens)."""

    name: str = Field(max_length=12)
    country: Literal["France", "Italy", "Spain"]


CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "country": {"enum": ["France", "Italy", "Spain"]},
    },
    "required": ["name", "country"],
    "additionalProperties": False,
}
CITY_PROMPT = [{"role": "user", "content": "Name a city in France, as JSON."}]


def body(path: str, **fields: Any) -> dict[str, Any]:
    """A request to `path` with a short prompt and greedy sampling, plus `fields`."""
    head: dict[str, Any] = (
        {"messages": CITY_PROMPT} if path == CHAT else {"prompt": "The answer is: "}
    )
    return {"model": MODEL_NAME, "temperature": 0, "max_tokens": 32, **head, **fields}


def json_schema_format(schema: Any, name: str = "city") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}


def post(server, path: str, payload: dict[str, Any] | str, key: str | None = None):
    """POST `payload` as JSON text (ASCII: a lone surrogate travels as its escape)."""
    content = payload if isinstance(payload, str) else json.dumps(payload)
    with server.http(key) as http:
        return http.post(path, content=content, headers={"Content-Type": "application/json"})


def refused(response: httpx.Response, param: str, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error", error
    return error


def answer(response: httpx.Response, path: str) -> tuple[str, str]:
    """(text, finish_reason) of a one-choice answer."""
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    text = choice["message"]["content"] if path == CHAT else choice["text"]
    return text, choice["finish_reason"]


# ------------------------------------------------------------------------------ the clients
def test_the_openai_sdk_parse_returns_a_validated_pydantic_object(server, client):
    completion = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=CITY_PROMPT,
        response_format=City,
        temperature=0,
        max_completion_tokens=40,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, City)
    assert message.parsed == City.model_validate_json(message.content)


def test_instructor_json_schema_mode_returns_a_validated_pydantic_object(server, client):
    patched = instructor.from_openai(client, mode=instructor.Mode.JSON_SCHEMA)
    city = patched.chat.completions.create(
        model=MODEL_NAME,
        messages=CITY_PROMPT,
        response_model=City,
        temperature=0,
        max_tokens=40,
        max_retries=1,
    )
    assert isinstance(city, City)


def test_pydantic_ai_native_output_returns_a_validated_pydantic_object(server):
    provider = OpenAIProvider(openai_client=server.async_client())
    agent = Agent(OpenAIChatModel(MODEL_NAME, provider=provider), output_type=NativeOutput(City))
    result = agent.run_sync(
        CITY_PROMPT[0]["content"], model_settings={"temperature": 0, "max_tokens": 40}
    )
    assert isinstance(result.output, City)


# ----------------------------------------------------------------------------- the answers
def test_json_object_answers_a_json_object(server):
    payload = body(CHAT, response_format={"type": "json_object"}, max_tokens=48)
    payload["messages"] = [
        {"role": "user", "content": 'Reply with the JSON object {"ok": true} and nothing else.'}
    ]
    text, finish = answer(post(server, CHAT, payload), CHAT)
    assert finish == "stop", text
    assert isinstance(json.loads(text), dict)


def test_structured_outputs_regex_on_completions_matches_the_regex(server):
    regex = r"[0-9]{3}-[0-9]{4}"
    payload = body(COMPLETIONS, structured_outputs={"regex": regex})
    text, finish = answer(post(server, COMPLETIONS, payload), COMPLETIONS)
    assert finish == "stop"
    assert re.fullmatch(regex, text), text


def test_structured_outputs_choice_on_completions_answers_one_of_the_choices(server):
    choices = ["red", "green", "blue"]
    payload = body(COMPLETIONS, structured_outputs={"choice": choices})
    text, finish = answer(post(server, COMPLETIONS, payload), COMPLETIONS)
    assert finish == "stop"
    assert text in choices


def test_structured_outputs_grammar_on_completions_answers_a_sentence_of_the_grammar(server):
    grammar = 'start: "(" NUM "," NUM ")"\nNUM: /[0-9]{1,2}/'
    payload = body(COMPLETIONS, structured_outputs={"grammar": grammar})
    text, finish = answer(post(server, COMPLETIONS, payload), COMPLETIONS)
    assert finish == "stop"
    assert re.fullmatch(r"\([0-9]{1,2},[0-9]{1,2}\)", text), text


@pytest.mark.parametrize(
    "constraint",
    [
        {"choice": ["New York", "Los Angeles"]},
        {"grammar": 'start: "(" NUM ", " NUM ")"\nNUM: /[0-9]/'},
    ],
)
def test_an_answer_with_a_space_matches_its_constraint(server, constraint):
    """The grammar sees the bytes the client sees: the default model's byte-level "Ġ" is a
    space to the constraint too (its vocabulary is read with its ByteLevel decoder)."""
    payload = body(COMPLETIONS, structured_outputs=constraint)
    text, finish = answer(post(server, COMPLETIONS, payload), COMPLETIONS)
    assert finish == "stop"
    assert " " in text


def test_a_streamed_json_schema_answer_concatenates_to_valid_json(server, client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CITY_PROMPT,
        response_format=json_schema_format(CITY_SCHEMA),
        temperature=0,
        max_tokens=40,
        stream=True,
    )
    pieces, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads("".join(pieces)), CITY_SCHEMA)


def test_max_tokens_too_small_for_the_schema_finishes_with_length(server):
    payload = body(CHAT, response_format=json_schema_format(CITY_SCHEMA), max_tokens=2)
    text, finish = answer(post(server, CHAT, payload), CHAT)
    assert finish == "length"
    with pytest.raises(ValueError):
        json.loads(text)


# ------------------------------------------------------------------------------ the 400s
SCHEMA = "response_format.json_schema.schema"


def named_schema(**json_schema: Any) -> dict[str, Any]:
    """A `response_format` of type json_schema with this `json_schema` object."""
    return {"response_format": {"type": "json_schema", "json_schema": json_schema}}


def structured(**fields: Any) -> dict[str, Any]:
    return {"structured_outputs": fields}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, named_schema(name="a", schema={"type": "foo"}), SCHEMA),
        (COMPLETIONS, named_schema(name="a", schema={"type": "foo"}), SCHEMA),
        (COMPLETIONS, structured(json={"type": "foo"}), "structured_outputs.json"),
        (CHAT, structured(json='{"type": "foo"}'), "structured_outputs.json"),
    ],
)
def test_a_schema_that_is_not_json_schema_is_a_400_naming_the_field(server, path, fields, param):
    error = refused(post(server, path, body(path, **fields)), param)
    assert error["code"] == "invalid_schema"
    assert error["message"].startswith(f"{param} is not a valid JSON Schema"), error


IF_THEN = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "if": {"properties": {"a": {"const": 1}}},
    "then": {"required": ["a"]},
}


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, named_schema(name="a", schema=IF_THEN), SCHEMA),
        (COMPLETIONS, structured(json=IF_THEN), "structured_outputs.json"),
    ],
)
def test_a_schema_keyword_the_grammar_engine_lacks_is_a_400_naming_it(server, path, fields, param):
    error = refused(post(server, path, body(path, **fields)), param)
    assert error["code"] == "unsupported_schema"
    assert '"if"' in error["message"] and '"then"' in error["message"], error


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_regex_that_does_not_parse_is_a_400_naming_structured_outputs_regex(server, path):
    response = post(server, path, body(path, **structured(regex="a(b")))
    error = refused(response, "structured_outputs.regex")
    assert error["code"] == "invalid_grammar"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_lark_grammar_that_does_not_parse_is_a_400_naming_structured_outputs_grammar(
    server, path
):
    response = post(server, path, body(path, **structured(grammar="start: foo (")))
    error = refused(response, "structured_outputs.grammar")
    assert error["code"] == "invalid_grammar"


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_response_format_and_structured_outputs_together_are_a_400(server, path):
    fields = {"response_format": {"type": "json_object"}, **structured(regex="a")}
    refused(post(server, path, body(path, **fields)), "structured_outputs")


MALFORMED = [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "text", "json_schema": {}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "text", "json_schema": {"name": "a", "schema": {}}}},
     "response_format"),
    (named_schema(schema={}), "response_format.json_schema.name"),
    (named_schema(name="has space", schema={}), "response_format.json_schema.name"),
    (named_schema(name="x" * 65, schema={}), "response_format.json_schema.name"),
    (named_schema(name="a"), SCHEMA),
    (named_schema(name="a", schema=[1, 2]), SCHEMA),
    (named_schema(name="a", schema={}, strict="yes"), "response_format.json_schema.strict"),
    (named_schema(name="a", schema={}, extra=1), "response_format.json_schema.extra"),
    (structured(), "structured_outputs"),
    (structured(regex="a", choice=["a"]), "structured_outputs"),
    (structured(guided_regex="a"), "structured_outputs.guided_regex"),
    (structured(choice=[]), "structured_outputs.choice"),
    (structured(choice="a"), "structured_outputs.choice"),
    (structured(regex=""), "structured_outputs.regex"),
    (structured(json_object="yes"), "structured_outputs.json_object"),
    (structured(json="{not json"), "structured_outputs.json"),
    (structured(json="[1]"), "structured_outputs.json"),
    (structured(regex="a" * (256 * 1024 + 1)), "structured_outputs.regex"),
    (structured(json_object=True, whitespace_pattern=" " * 257),
     "structured_outputs.whitespace_pattern"),
    # A lone surrogate (JSON carries one; UTF-8 cannot) anywhere in a constraint.
    (structured(regex="\ud800"), "structured_outputs.regex"),
    (structured(grammar='start: "\udfff"'), "structured_outputs.grammar"),
    (structured(choice=["a", "\ud800"]), "structured_outputs.choice"),
    (structured(json_object=True, whitespace_pattern="\ud800"),
     "structured_outputs.whitespace_pattern"),
    (structured(json={"properties": {"\ud800": {}}}), "structured_outputs.json"),
    (structured(json='{"enum": ["\\ud800"]}'), "structured_outputs.json"),
    (named_schema(name="a", schema={"enum": ["\udfff"]}), SCHEMA),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "param"), MALFORMED)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_malformed_response_format_or_structured_outputs_is_a_400_naming_the_field(
    server, path, fields, param
):
    refused(post(server, path, body(path, **fields)), param)


@pytest.mark.parametrize(
    ("kind", "names", "param"),
    [
        ("json", JSON_SCHEMA_NAMES, SCHEMA),
        ("json_object", JSON_OBJECT_NAMES, "response_format"),
        ("regex", {}, "structured_outputs.regex"),
    ],
)
def test_a_compile_past_its_timeout_is_a_400_coded_grammar_compile_timeout(kind, names, param):
    """The engine's words for the timeout (compiler.py), as the server answers them: the field
    as the client sent it."""
    exc = GrammarError(
        f"structured_outputs.{kind}: the grammar did not compile within 5 s", "timeout"
    )
    error = from_value_error(exc, names)
    assert (error.status_code, error.code, error.param) == (400, "grammar_compile_timeout", param)
    assert error.message.startswith(f"{param}: the grammar did not compile")


@pytest.mark.parametrize("field", p.GUIDED_FIELDS)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_vllms_removed_guided_fields_are_a_400_never_ignored(server, path, field):
    error = refused(post(server, path, body(path, **{field: "a"})), field)
    assert "structured_outputs" in error["message"]


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def nested_text(depth: int) -> str:
    """A `depth`-deep {"items": {"items": ...}} schema as JSON text (built without recursion)."""
    return '{"items": ' * (depth - 1) + '{"type": "string"}' + "}" * (depth - 1)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_a_deeply_nested_schema_is_a_400_never_a_500(server, path):
    """10,000 levels do not parse as a body (Python's JSON parser stops at its recursion limit:
    a 400); as the JSON text of `structured_outputs.json` they are the field's 400; a depth that
    parses but passes MAX_SCHEMA_DEPTH is the field's 400 too, before any check recurses."""
    deep = nested_text(10_000)
    head = json.dumps(body(path))[:-1]
    as_body = head + ', "response_format": {"type": "json_schema", "json_schema": '
    as_body += '{"name": "deep", "schema": ' + deep + "}}}"
    assert post(server, path, as_body).status_code == 400
    response = post(server, path, body(path, structured_outputs={"json": deep}))
    refused(response, "structured_outputs.json")
    beyond = MAX_SCHEMA_DEPTH + 1
    response = post(server, path, body(path, response_format=json_schema_format(nested(beyond))))
    assert "nests deeper" in refused(response, "response_format.json_schema.schema")["message"]
    response = post(server, path, body(path, structured_outputs={"json": nested_text(beyond)}))
    refused(response, "structured_outputs.json")


def test_a_schema_at_the_depth_bound_is_served(server):
    """MAX_SCHEMA_DEPTH is within what the engine's checks (jsonschema, the grammar compiler)
    take without exhausting the recursion limit: the 400 above is the bound's, never theirs."""
    fields = {"response_format": json_schema_format(nested(MAX_SCHEMA_DEPTH)), "max_tokens": 1}
    response = post(server, COMPLETIONS, body(COMPLETIONS, **fields))
    assert response.status_code == 200, response.text


def test_response_format_text_is_no_constraint():
    request = p.CompletionRequest.model_validate(
        {"prompt": "hi", "response_format": {"type": "text"}}
    )
    assert structured_outputs_params(request) == (None, {})


# ------------------------------------------------------------------------------- the 429
def distinct_slow_schema(salt: str) -> dict[str, Any]:
    """A schema of 1,000 patterned properties: ~0.1-0.3 s to compile, distinct per `salt`."""
    names = [f"{salt}{i}" for i in range(1000)]
    properties = {
        n: {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}$"} for i, n in enumerate(names)
    }
    return {"type": "object", "properties": properties, "required": names}


def test_a_client_past_its_grammar_compiles_in_flight_gets_a_429_with_retry_after(server):
    """One client sends twelve distinct slow schemas at once: with at most four compiles in
    flight per client (--max-grammar-compiles-per-tenant), some are refused with a 429 and
    Retry-After before they are queued; the others are answered."""
    payloads = [
        body(
            COMPLETIONS,
            structured_outputs={"json": distinct_slow_schema(f"k{uuid.uuid4().hex[:6]}_")},
            max_tokens=1,
        )
        for _ in range(12)
    ]
    with (
        httpx.Client(
            base_url=server.url,
            headers={"Authorization": f"Bearer {KEY_BETA}"},
            timeout=120,
            verify=ssl_context(),
        ) as http,
        ThreadPoolExecutor(len(payloads)) as pool,
    ):
        responses = list(pool.map(lambda b: http.post(COMPLETIONS, json=b), payloads))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 429}, [r.text for r in responses]
    assert 200 in statuses and 429 in statuses, statuses
    busy = next(r for r in responses if r.status_code == 429)
    assert busy.headers["Retry-After"] == "1"
    error = busy.json()["error"]
    assert error["type"] == "rate_limit_error"
    assert error["code"] == "too_many_grammar_compiles"


# ---------------------------------------------------------------------------- the metrics
def test_metrics_count_grammar_compiles_cache_hits_and_rejections_by_reason(server):
    before = scrape(server)
    regex = f"{uuid.uuid4().hex[:8]}[0-9]"  # never compiled before
    for _ in range(2):  # compiled once, then found in the client's cache
        payload = body(COMPLETIONS, structured_outputs={"regex": regex}, max_tokens=1)
        assert post(server, COMPLETIONS, payload).status_code == 200
    bad_regex = body(COMPLETIONS, structured_outputs={"regex": "a(b"})
    assert post(server, COMPLETIONS, bad_regex).status_code == 400
    bad = body(COMPLETIONS, response_format=json_schema_format(IF_THEN))
    assert post(server, COMPLETIONS, bad).status_code == 400
    after = scrape(server)
    assert delta(after, before, "prefixserve_structured_output_compiles_total") >= 1
    assert delta(after, before, "prefixserve_structured_output_cache_hits_total") >= 1
    assert delta(after, before, "prefixserve_structured_output_compile_seconds_total") > 0
    rejected = "prefixserve_structured_output_rejections_total{reason=%s}"
    assert delta(after, before, rejected % "invalid_grammar") >= 1
    assert delta(after, before, rejected % "unsupported") >= 1
    for reason in ("invalid_schema", "timeout", "busy"):
        assert rejected % reason in after
    assert after["prefixserve_structured_output_cached_grammars"] >= 1
    assert not any(name.startswith("prefixserve_engine_structured") for name in after)
