"""Function tools on /v1/chat/completions through the official openai SDK, on a live server with
the packaged default model: forced calls (required, by name) parse and validate against their
schema, `auto` answers text or a valid call, the history of calls and results renders, the
answer streams as OpenAI streams calls (the SDK's own accumulator rebuilds them), and bad tool
input is a 400 naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {"query": {"type": "string", "maxLength": 40}},
    "required": ["query"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH}},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _validate(calls) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _model(server) -> str:
    return server.client().models.list().data[0].id


def test_a_required_call_parses_and_its_arguments_validate(server):
    answer = server.client().chat.completions.create(
        model=_model(server),
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    _validate(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1


def test_a_call_forced_by_name_is_that_call_and_finishes_with_stop(server):
    answer = server.client().chat.completions.create(
        model=_model(server),
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "search"}},
        max_tokens=80,
        temperature=0.8,
        seed=3,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    _validate(choice.message.tool_calls)
    assert [c.function.name for c in choice.message.tool_calls] == ["search"]


def test_auto_answers_text_or_a_call_that_validates(server):
    answer = server.client().chat.completions.create(
        model=_model(server), messages=ASK, tools=TOOLS, max_tokens=60, temperature=0
    )
    choice = answer.choices[0]
    if choice.message.tool_calls:
        _validate(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls"
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def _after_a_call(name: str, arguments: str, result: str) -> list:
    """ASK, the assistant's call of `name` with `arguments`, and the tool's `result`."""
    call = {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}
    return [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]


def test_a_history_of_calls_and_results_is_answered(server):
    history = _after_a_call(
        "get_weather", '{"city": "Paris", "unit": "celsius"}', '{"temperature": 21}'
    )
    answer = server.client().chat.completions.create(
        model=_model(server),
        messages=history,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=20,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.message.content and not choice.message.tool_calls


def test_streamed_calls_rebuild_through_the_sdks_accumulator(server):
    client = server.client()
    with client.chat.completions.stream(
        model=_model(server),
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    _validate(choice.message.tool_calls)
    whole = client.chat.completions.create(
        model=_model(server),
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=0,
    )
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    want = [
        (c.function.name, json.loads(c.function.arguments))
        for c in whole.choices[0].message.tool_calls
    ]
    assert got == want


def test_text_held_back_as_a_possible_call_sends_no_empty_chunks(server):
    """The answer after a tool's result opens with "<tool_response>" (the packaged model copies
    the template): "<", "tool", "_" may open a call, so the parser holds them. Those tokens send
    no chunk (OpenAI sends no empty delta); the text goes out once settled, whole."""
    history = _after_a_call("search", '{"query": "Paris weather"}', '{"results": ["sunny, 21 C"]}')
    fields = dict(model=_model(server), messages=history, tools=TOOLS, max_tokens=24, temperature=0)
    client = server.client()
    whole = client.chat.completions.create(**fields).choices[0].message.content
    chunks = list(client.chat.completions.create(**fields, stream=True))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert whole.startswith("<tool_"), whole
    for choice in deltas:
        delta = choice.delta
        assert delta.role or delta.content or delta.tool_calls or choice.finish_reason, choice
    assert "".join(c.delta.content or "" for c in deltas) == whole


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "duplicate function names"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "is not one of the tools",
        ),
        (
            {
                "tools": TOOLS,
                "messages": [*ASK, {"role": "tool", "tool_call_id": "x", "content": "1"}],
            },
            "answers no earlier",
        ),
        ({"tools": TOOLS * 100}, "tools"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}
                ]
            },
            "not a valid JSON Schema",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(server, fields, param):
    body = {"model": _model(server), "messages": ASK, "max_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(**body)
    assert param in str(info.value)
    server.check_no_leaks()
