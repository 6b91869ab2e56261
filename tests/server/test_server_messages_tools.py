"""Tools on the Messages API through Anthropic's own SDK against a live server with the packaged
default model (its own template renders no tools: the packaged ChatML tool template does): a call
forced by `tool_choice` is a `tool_use` block whose input validates against its schema, `auto`
answers text or a valid call, a tool-use loop (call -> tool_result -> answer) renders and reads
its history from the cache, the SDK's stream helper rebuilds a streamed call, `count_tokens`
counts the tools, `cache_control` on a tool makes a breakpoint that covers the whole tool, and
bad tool input is a 400 in Anthropic's shape naming the field, holding nothing after it."""

from __future__ import annotations

import copy
import re
import uuid

import anthropic
import httpx
import jsonschema
import pytest

from prefixserve.entrypoints.anthropic import protocol as a
from prefixserve.entrypoints.anthropic.render import render
from tests.helpers.server import (
    BLOCK_SIZE,
    KEY_ADMIN,
    KEY_ALPHA,
    KEY_BETA,
    MODEL_NAME,
    ssl_context,
)

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
    {"name": "get_weather", "description": "The weather in a city now", "input_schema": WEATHER},
    {"name": "search", "description": "Search the web", "input_schema": SEARCH},
]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GREEDY = {"temperature": 0.0}
TOOL_USE_ID = re.compile(r"^toolu_[0-9a-f]{24}$")
# A schema keyword the grammar engine lacks (llguidance refuses if/then): a GrammarError.
IF_THEN = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "if": {"properties": {"a": {"const": 1}}},
    "then": {"required": ["a"]},
}


@pytest.fixture(scope="module", autouse=True)
def _release_breakpoints(server):
    """The cache_control tests hold breakpoints in the session's shared engine; a reset at the
    end releases them, so later tests find an idle pool idle."""
    yield
    server.wait_idle()
    with httpx.Client(base_url=server.url, timeout=60, verify=ssl_context()) as http:
        reset = http.post("/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY_ADMIN}"})
    assert reset.json() == {"success": True}


def _client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.url,
        api_key=KEY_ALPHA,
        max_retries=0,
        timeout=120,
        http_client=anthropic.DefaultHttpxClient(verify=ssl_context()),
    )


def _create(server, **kwargs):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("tools", TOOLS)
    kwargs.setdefault("max_tokens", 80)
    return _client(server).messages.create(model=MODEL_NAME, **kwargs)


def _calls(message) -> list:
    """The message's tool_use blocks, each checked: its id, its input valid for its schema."""
    calls = [b for b in message.content if b.type == "tool_use"]
    for call in calls:
        assert TOOL_USE_ID.match(call.id), call.id
        assert isinstance(call.input, dict)
        jsonschema.validate(call.input, SCHEMAS[call.name])
    return calls


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_a_call_forced_by_name_is_that_tool_use_and_its_input_validates(server):
    message = _create(
        server,
        tool_choice={"type": "tool", "name": "search"},
        extra_body={"temperature": 0.8, "top_k": 20},
    )
    assert message.stop_reason == "tool_use"  # Anthropic's, also for a forced call
    assert [c.name for c in _calls(message)] == ["search"]
    assert [b.type for b in message.content] == ["tool_use"]


def test_any_needs_a_call_to_one_of_the_tools_one_without_parallel_use(server):
    message = _create(
        server,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    assert message.stop_reason == "tool_use"
    assert len(_calls(message)) == 1
    assert message.content[-1].type == "tool_use"


def test_auto_answers_text_or_a_call_that_validates(server):
    message = _create(server, max_tokens=60, extra_body=GREEDY)
    if _calls(message):
        assert message.stop_reason == "tool_use"
    else:
        assert [b.type for b in message.content] == ["text"]
        assert message.stop_reason in ("end_turn", "max_tokens")


def test_none_answers_text_from_the_same_prompt_as_auto(server):
    client = _client(server)
    counted = client.messages.count_tokens(model=MODEL_NAME, messages=ASK, tools=TOOLS)
    message = _create(server, tool_choice={"type": "none"}, max_tokens=8, extra_body=GREEDY)
    assert [b.type for b in message.content] == ["text"]
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert _prompt_tokens(message.usage) == counted.input_tokens  # the tools are in the prompt


def test_a_tool_use_loop_renders_the_call_and_its_result_and_reads_its_history(server):
    first = _create(server, tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    [call] = _calls(first)
    history = [
        *ASK,
        # The SDK's own content blocks, sent back as they came.
        {"role": "assistant", "content": first.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": "21 degrees, sunny"}
            ],
        },
    ]
    second = _create(server, messages=history, max_tokens=30, extra_body=GREEDY)
    if _calls(second):
        assert second.stop_reason == "tool_use"
    else:
        assert [b.type for b in second.content] == ["text"]
        assert second.stop_reason in ("end_turn", "max_tokens")
    # The first turn's prompt is a prefix of the second's: read from the cache.
    first_prompt = _prompt_tokens(first.usage)
    assert second.usage.cache_read_input_tokens >= first_prompt // BLOCK_SIZE * BLOCK_SIZE
    # An error result renders too, and so does a result given as text blocks.
    history[-1]["content"] = [
        {
            "type": "tool_result",
            "tool_use_id": call.id,
            "is_error": True,
            "content": [{"type": "text", "text": "the weather service is down"}],
        },
        {"type": "text", "text": "Say so briefly."},
    ]
    third = _create(server, messages=history, tool_choice={"type": "none"}, max_tokens=8)
    assert third.content[0].type == "text"


def test_the_sdk_stream_helper_rebuilds_the_tool_use_of_the_whole_answer(server):
    kwargs = {
        "model": MODEL_NAME,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "any"},
        "max_tokens": 120,
        "extra_body": GREEDY,
    }
    client = _client(server)
    with client.messages.stream(**kwargs) as stream:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    streamed = _calls(final)
    assert ("content_block_delta", "input_json_delta") in kinds
    starts = [k for k in kinds if k[0] == "content_block_start"]
    stops = [k for k in kinds if k[0] == "content_block_stop"]
    assert len(starts) == len(stops) == len(final.content)
    whole = client.messages.create(**kwargs)
    assert [(c.name, c.input) for c in streamed] == [(c.name, c.input) for c in _calls(whole)]


def test_count_tokens_grows_by_the_tools_and_matches_the_messages_usage(server):
    client = _client(server)
    without = client.messages.count_tokens(model=MODEL_NAME, messages=ASK)
    with_tools = client.messages.count_tokens(model=MODEL_NAME, messages=ASK, tools=TOOLS)
    one_tool = client.messages.count_tokens(model=MODEL_NAME, messages=ASK, tools=TOOLS[:1])
    assert without.input_tokens < one_tool.input_tokens < with_tools.input_tokens
    message = _create(server, tool_choice={"type": "tool", "name": "search"})
    assert _prompt_tokens(message.usage) == with_tools.input_tokens


def _tools_with_breakpoint(ttl: str = "5m") -> list[dict]:
    """TOOLS, the last one with a long schema no other test sends and a breakpoint."""
    tools = copy.deepcopy(TOOLS)
    tag = uuid.uuid4().hex
    tools[-1]["input_schema"]["properties"]["query"]["description"] = f"[{tag}] " + " ".join(
        f"word{i}" for i in range(120)
    )
    tools[-1]["cache_control"] = {"type": "ephemeral", "ttl": ttl}
    return tools


def test_cache_control_on_the_last_tool_holds_the_prompt_through_that_whole_tool(server):
    tools = _tools_with_breakpoint()
    kwargs = {"tools": tools, "max_tokens": 2, "tool_choice": {"type": "none"}}
    first = _create(server, extra_body={"cache_report": True}, **kwargs)
    [entry] = first.model_extra["cache_report"]["breakpoints"]
    assert entry["status"] == "held"
    # The breakpoint ends with the tool (its schema included), not before it.
    body = a.MessagesRequest.model_validate(
        {"model": MODEL_NAME, "max_tokens": 2, "messages": ASK, "tools": tools}
    )
    text = render(server.engine.tokenizer, body).text
    through_tools = text[: text.rindex("</tools>")]
    hf = server.engine.tokenizer.hf_tokenizer
    num_tokens = len(hf(through_tools, add_special_tokens=False)["input_ids"])
    assert (num_tokens - 4) // BLOCK_SIZE * BLOCK_SIZE <= entry["tokens"] <= num_tokens
    # Written up to the breakpoint, from where its read (the tools' shared head) stopped.
    usage = first.usage
    assert usage.cache_creation_input_tokens > 0
    assert usage.cache_read_input_tokens + usage.cache_creation_input_tokens >= entry["tokens"]
    second = _create(server, extra_body={"cache_report": True}, **kwargs)
    assert second.usage.cache_read_input_tokens >= entry["tokens"]
    assert second.model_extra["cache_report"]["breakpoints"][0]["read"]


def test_a_1h_tool_breakpoint_before_a_5m_system_one_is_taken_in_anthropics_order(server):
    """Tools come before the system in Anthropic's order (so 1h then 5m is allowed), though the
    packaged template renders the system text first; the system's breakpoint is then held as
    long as the tools' one, which holds its blocks anyway."""
    message = _create(
        server,
        tools=_tools_with_breakpoint("1h"),
        system=[
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        ],
        tool_choice={"type": "none"},
        max_tokens=2,
        extra_body={"cache_report": True},
    )
    breakpoints = message.model_extra["cache_report"]["breakpoints"]
    assert [b["ttl_s"] for b in breakpoints] == [3600, 3600]
    assert breakpoints[-1]["status"] == "held"
    with pytest.raises(anthropic.BadRequestError, match="ttl '1h' cannot come after"):
        _create(
            server,
            tools=_tools_with_breakpoint("5m"),
            system=[
                {
                    "type": "text",
                    "text": "Be brief.",
                    "cache_control": {"type": "ephemeral", "ttl": "1h"},
                }
            ],
            max_tokens=2,
        )


def _result_without_call() -> list[dict]:
    result = {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "1"}
    return [*ASK, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [result]}]


def _call_in_a_user_message() -> list[dict]:
    call = {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"query": "x"}}
    return [{"role": "user", "content": [call]}]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools: duplicate tool names ['get_weather']"),
        ({"tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name: 'nope' is not"),
        ({"tools": [], "tool_choice": {"type": "any"}}, 'tool_choice: {"type": "any"} needs tools'),
        (
            {"tools": [], "tool_choice": {"type": "tool", "name": "search"}},
            'tool_choice: {"type": "tool"} needs tools',
        ),
        (
            {
                "tools": [
                    {
                        "name": "f",
                        "input_schema": {"type": "object", "properties": {"a": {"type": "strin"}}},
                    }
                ]
            },
            "tools[0].input_schema: not a valid JSON Schema at properties/a/type",
        ),
        ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools[0].input_schema"),
        ({"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        (
            {"tools": [{**TOOLS[1], "name": f"t{i}"} for i in range(129)]},
            "tools: List should have at most 128 items",
        ),
        (
            {"messages": _result_without_call()},
            "messages[2].content[0].tool_use_id: 'toolu_nope' answers no earlier tool_use",
        ),
        ({"messages": _call_in_a_user_message()}, "a user message cannot hold"),
        ({"tool_choice": {"type": "auto", "name": "search"}}, "takes no name"),
        (
            {
                "tools": [
                    {
                        "name": f"t{i}",
                        "input_schema": {"type": "object", "description": "x" * 140_000},
                    }
                    for i in range(2)
                ]
            },
            "tools is",  # their grammar past the bound of characters a grammar may have
        ),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field_and_holds_nothing(server, fields, needle):
    with pytest.raises(anthropic.BadRequestError) as caught:
        _create(server, max_tokens=4, **fields)
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert needle in body["error"]["message"], body["error"]["message"]
    server.check_no_leaks()


def test_a_tools_schema_the_grammar_engine_refuses_is_named_as_the_tools(server):
    with pytest.raises(anthropic.BadRequestError) as caught:
        _create(server, max_tokens=4, tools=[{"name": "f", "input_schema": IF_THEN}])
    message = caught.value.body["error"]["message"]
    assert message.startswith("tools") and '"if"' in message, message
    assert "structured_outputs" not in message
    server.check_no_leaks()


def test_count_tokens_refuses_bad_tool_input_as_the_messages_route_does(server):
    with pytest.raises(anthropic.BadRequestError, match="duplicate tool names"):
        _client(server).messages.count_tokens(
            model=MODEL_NAME, messages=ASK, tools=[TOOLS[0], TOOLS[0]]
        )


def _loop_turn(client, history: list, turn: int, stream: bool):
    """One turn of an agent's tool-use loop: a forced call on even turns, text on odd ones."""
    fields = dict(
        model=MODEL_NAME,
        messages=history,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"} if turn % 2 == 0 else {"type": "none"},
        max_tokens=64 if turn % 2 == 0 else 24,  # a call written whole (a cut one streams cut)
        extra_body={"temperature": 0.0, "cache_report": True},
    )
    if not stream:
        answer = client.messages.create(**fields)
        return answer, answer.model_extra["cache_report"]
    report = None
    with client.messages.stream(**fields) as events:
        for event in events:
            if event.type == "message_delta":
                report = event.model_extra.get("cache_report") or report
        return events.get_final_message(), report


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_use_loop_reuses_the_generated_ids_of_its_history(server, stream):
    client = _client(server)
    tag = uuid.uuid4().hex[:8]
    history: list = [{"role": "user", "content": f"Plan a trip ({tag}): the weather in Oslo?"}]
    previous = None
    for turn in range(6):
        answer, report = _loop_turn(client, history, turn, stream)
        prompt = _prompt_tokens(answer.usage)
        if previous is not None:
            assert report["history_reused_tokens"] >= previous, (turn, report)
            assert report["history_rerendered"] == []
            held = answer.usage.cache_read_input_tokens + answer.usage.cache_creation_input_tokens
            assert held >= previous - BLOCK_SIZE, (turn, answer.usage)
        previous = prompt + answer.usage.output_tokens - 1  # the template writes the end token
        history.append({"role": "assistant", "content": answer.content})
        calls = [b for b in answer.content if b.type == "tool_use"]
        results = [{"type": "tool_result", "tool_use_id": c.id, "content": "4 C"} for c in calls]
        history.append({"role": "user", "content": results or "And then?"})
    beta = anthropic.Anthropic(
        base_url=server.url,
        api_key=KEY_BETA,
        max_retries=0,
        timeout=120,
        http_client=anthropic.DefaultHttpxClient(verify=ssl_context()),
    )
    _, theirs = _loop_turn(beta, history, 1, False)
    assert theirs["history_reused_tokens"] == 0
