"""A history that stays cached from turn to turn: a 30-turn tool loop replayed against a live
server through the openai SDK, streamed and not by turns (a call and a text answer each both
ways, so a streamed answer's history serves a whole request and the other way round). Each turn
resends the tools, the system prompt and the whole history, with the assistant turns as the SDK
returned them; on at least 99% of turns the prompt's cached tokens reach the previous prompt plus
the previous completion less one block, and every turn that falls short is named in its cache
report (`history_rerendered`). The reuse is per tenant: another tenant sending the same history
reuses none of it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from prefixserve.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixserve.engine.async_llm import AsyncLLMEngine
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.auth import ApiKeys
from tests.helpers.server import LiveServer, serve_in_thread

BLOCK = 16
TURNS = 30
KEYS = {"sk-agent-a": "agent-a", "sk-agent-b": "agent-b"}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo", "Lima"]},
        "day": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "day"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
SYSTEM = "You plan trips. Check the weather with the tool, then answer in one short sentence."


@pytest.fixture(scope="module")
def agent_server() -> Iterator[LiveServer]:
    config = EngineConfig(
        model=None,
        dtype="bfloat16",
        max_model_len=8192,
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=2048),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2048),
    )
    engine = AsyncLLMEngine(LLMEngine(config), log_stats_interval_s=60.0)
    engine.start()
    keys = ApiKeys()
    for key, tenant in KEYS.items():
        keys.add(key, tenant)
    app = build_app(engine, ["agent"], api_keys=keys)
    server, thread, url = serve_in_thread(app)
    yield LiveServer(url=url, api_key="sk-agent-a", engine=engine)
    server.should_exit = True
    thread.join(timeout=30)
    engine.shutdown()


def _turn(client, messages: list, call: bool, stream: bool):
    """One turn as an agent sends it; returns (assistant message dict, usage, cache report)."""
    fields = dict(
        model="agent",
        messages=messages,
        tools=TOOLS,
        tool_choice="required" if call else "none",
        parallel_tool_calls=False,
        max_tokens=40,
        temperature=0,
        extra_body={"cache_report": True},
    )
    if not stream:
        answer = client.chat.completions.create(**fields)
        message = answer.choices[0].message
        return (
            message.model_dump(exclude_none=True),
            answer.usage,
            answer.model_extra["cache_report"],
        )
    with client.chat.completions.stream(**fields, stream_options={"include_usage": True}) as s:
        report = None
        for event in s:
            if event.type == "chunk" and event.chunk.model_extra.get("cache_report"):
                report = event.chunk.model_extra["cache_report"]
        final = s.get_final_completion()
    message = final.choices[0].message.model_dump(exclude_none=True)
    message.pop("parsed", None)
    for call_ in message.get("tool_calls", ()):
        call_.get("function", {}).pop("parsed_arguments", None)
    return message, final.usage, report


def test_a_thirty_turn_tool_loop_keeps_its_history_cached(agent_server):
    client = agent_server.client()
    messages: list = [{"role": "system", "content": SYSTEM}]
    previous = None
    short, named = [], []
    for turn in range(TURNS):
        call = turn % 2 == 0
        stream = turn % 4 in (1, 2)  # a whole call, a streamed text, a streamed call, a whole text
        if call:
            messages.append({"role": "user", "content": f"Trip {turn}: what is the weather?"})
        message, usage, report = _turn(client, messages, call, stream)
        cached = usage.prompt_tokens_details.cached_tokens
        if previous is not None and cached < previous - BLOCK:
            short.append(turn)
            if report["history_rerendered"]:
                named.append(turn)
        previous = usage.prompt_tokens + usage.completion_tokens
        message.setdefault("content", None)
        messages.append(message)
        for tool_call in message.get("tool_calls", ()):
            arguments = json.loads(tool_call["function"]["arguments"])
            result = {"city": arguments["city"], "forecast": "sunny", "high_c": 20 + turn % 7}
            messages.append(
                {"role": "tool", "tool_call_id": tool_call["id"], "content": json.dumps(result)}
            )
        assert call == bool(message.get("tool_calls")), message
    assert len(short) <= (TURNS - 1) // 100, short
    assert named == short
    agent_server.check_no_leaks()


def test_the_history_of_one_tenant_is_never_reused_for_another(agent_server):
    messages = [
        {"role": "system", "content": SYSTEM + " (tenants)"},
        {"role": "user", "content": "Trip to Lima: what is the weather?"},
    ]
    alpha = agent_server.client()
    message, _, _ = _turn(alpha, messages, True, False)
    messages.append({**message, "content": None})
    call = message["tool_calls"][0]
    messages.append({"role": "tool", "tool_call_id": call["id"], "content": '{"ok": true}'})
    _, _, mine = _turn(alpha, messages, False, False)
    beta = agent_server.client(api_key="sk-agent-b")
    _, _, theirs = _turn(beta, messages, False, False)
    assert mine["history_reused_tokens"] > 0
    assert theirs["history_reused_tokens"] == 0
