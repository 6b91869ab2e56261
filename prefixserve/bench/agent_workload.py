"""W9, the agent workload: N concurrent sessions of K tool turns over shared tools and one shared
system prompt, each turn built from what the server answered to the previous one.

Every request is a streamed chat completion (`/v1/chat/completions`, temperature 0, `max_tokens`
80, `parallel_tool_calls` false, `stream_options.include_usage`) with the same four function
tools (`agent_tools.TOOLS`: weather, web search, calendar, currency; small JSON Schemas; each
with `"strict": true`, OpenAI's way of asking that a call's arguments follow the schema, which
vLLM needs before it holds them to it) and the same system prompt (`agent_tools.system_prompt`:
about 600 tokens of the default model at the default 24 rules). A session's turns go in order,
each sent when the previous one has finished; the sessions run side by side. On the even turns
(0, 2, 4) the user asks for something a tool answers and the request says `tool_choice:
"required"`; on the odd turns it says `"auto"`, and the model answers from the tool's result. The
history is what an agent sends: the user's questions, each assistant answer exactly as the
server streamed it (the calls with `content` null), and for each call a `tool` message with a
small JSON result the harness makes from the call's arguments (`agent_tools.tool_result`). A
request that fails ends its session (its later turns are recorded as not sent): without the
answer there is no next turn.

Recorded per request (`AgentRecord`): time to the first streamed delta that carries content or a
tool call (TTFT), the whole latency, prompt and completion tokens, the cached prompt tokens and
where they came from (`usage.prompt_tokens_details.cached_tokens`, or llama.cpp's own
`timings.cache_n` where the server gives no usage detail), and whether the answer's calls parse
(`agent_tools.check_call`), with no `<tool_call>` left unparsed in the content. A `required`
turn without a valid call is a parse failure; an `auto` turn answered in plain text counts
neither way.

TTFT is what a client sees: the first delta it can use. Servers release a call at different
points (vLLM, llama.cpp and prefixserve stream its name once it is written or parsed, at
different points of its head), so a call turn's TTFT holds some decoding; the TTFT of the
answers in plain text (the odd turns, mostly) starts with the first token on every server, and
is summarized apart (`agent_summary`).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import httpx

from prefixserve.bench.agent_tools import (
    DEFAULT_RULES,
    FOLLOW_UP,
    TOOLS,
    check_call,
    question,
    system_prompt,
    tool_result,
)

AGENT_WORKLOADS = ("W9",)


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """W9's shape. `free_choice` is the `tool_choice` of the odd turns ("auto" or "none");
    `strict` sends the tools with `"strict": true`."""

    sessions: int = 8
    turns: int = 6
    max_tokens: int = 80
    rules: int = DEFAULT_RULES
    free_choice: str = "auto"
    strict: bool = True
    seed: int = 0
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1 or self.max_tokens < 1:
            raise ValueError(
                f"sessions, turns and max_tokens must be >= 1, got {self.sessions}, "
                f"{self.turns}, {self.max_tokens}"
            )
        if self.free_choice not in ("auto", "none"):
            raise ValueError(f"free_choice must be 'auto' or 'none', got {self.free_choice!r}")
        system_prompt(self.rules)

    @property
    def num_requests(self) -> int:
        return self.sessions * self.turns

    def describe(self) -> str:
        return (
            f"agent: {self.sessions} sessions x {self.turns} turns, {len(TOOLS)} tools, "
            f"{self.rules}-rule system prompt, required on even turns and {self.free_choice} "
            f"on odd ones, {self.max_tokens} max tokens"
            + ("" if self.strict else ", tools without strict")
        )

    def tools(self) -> list[dict[str, Any]]:
        """The `tools` of every request."""
        if not self.strict:
            return TOOLS
        return [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]


def is_call_turn(turn: int) -> bool:
    return turn % 2 == 0


@dataclass(slots=True)
class AgentRecord:
    """One W9 request. Times in seconds; `start` relative to the run's start. `cached_source`
    says which field `cached_tokens` came from; `parse_ok` is None for a turn that neither had
    to call nor tried to."""

    request_id: str
    session: int
    turn: int
    tool_choice: str
    start: float = 0.0
    ttft: float | None = None
    first_chunk: float | None = None
    e2e: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_source: str | None = None
    finish_reason: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parse_ok: bool | None = None
    parse_error: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AgentRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def judge_calls(record: AgentRecord) -> None:
    """Set `record.parse_ok` / `parse_error` from its calls and content (see the module doc)."""
    problems = [why for call in record.tool_calls if (why := check_call(call)) is not None]
    if record.content and "<tool_call>" in record.content:
        problems.append("an unparsed <tool_call> in the content")
    if record.tool_choice == "required" and not record.tool_calls:
        problems.append("no tool call on a required turn")
    if problems:
        record.parse_ok, record.parse_error = False, "; ".join(problems)[:300]
    elif record.tool_calls:
        record.parse_ok = True


class _Stream:
    """What the chunks of one streamed chat answer add up to."""

    def __init__(self, record: AgentRecord, sent: float) -> None:
        self.record = record
        self.sent = sent
        self.text: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}

    def add(self, chunk: dict[str, Any], now: float) -> None:
        rec = self.record
        if chunk.get("usage"):
            _apply_usage(rec, chunk["usage"])
        if chunk.get("timings"):
            _apply_timings(rec, chunk["timings"])
        for choice in chunk.get("choices") or ():
            if rec.first_chunk is None:
                rec.first_chunk = now - self.sent
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                if rec.ttft is None:
                    rec.ttft = now - self.sent
            if delta.get("content"):
                self.text.append(delta["content"])
            for piece in delta.get("tool_calls") or ():
                self._add_call(piece)
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]

    def _add_call(self, piece: dict[str, Any]) -> None:
        index = int(piece.get("index", len(self.calls)))
        call = self.calls.setdefault(
            index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
        )
        if piece.get("id"):
            call["id"] = piece["id"]
        function = piece.get("function") or {}
        if function.get("name"):
            call["function"]["name"] += function["name"]
        if function.get("arguments"):
            call["function"]["arguments"] += function["arguments"]

    def finish(self) -> None:
        rec = self.record
        rec.content = "".join(self.text) or None
        rec.tool_calls = [self.calls[i] for i in sorted(self.calls)]
        for i, call in enumerate(rec.tool_calls):
            call["id"] = call["id"] or f"call_w9_{rec.session}_{rec.turn}_{i}"


def _apply_usage(record: AgentRecord, usage: dict[str, Any]) -> None:
    if usage.get("prompt_tokens") is not None:
        record.prompt_tokens = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        record.completion_tokens = int(usage["completion_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        record.cached_tokens = int(details["cached_tokens"])
        record.cached_source = "usage.prompt_tokens_details.cached_tokens"


def _apply_timings(record: AgentRecord, timings: dict[str, Any]) -> None:
    """llama.cpp's server: `cache_n` prompt tokens reused, `prompt_n` computed. Used only where
    the usage gave no cached count."""
    cache_n, prompt_n = timings.get("cache_n"), timings.get("prompt_n")
    if cache_n is not None and record.cached_source in (None, "timings.cache_n"):
        record.cached_tokens = int(cache_n)
        record.cached_source = "timings.cache_n"
        if record.prompt_tokens is None and prompt_n is not None:
            record.prompt_tokens = int(cache_n) + int(prompt_n)


async def stream_chat(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], record: AgentRecord, t0: float
) -> None:
    """Send one streamed chat completion and fill `record` from its chunks. Never raises for a
    server or network error: it goes to `record.error`."""
    sent = time.perf_counter()
    record.start = sent - t0
    stream = _Stream(record, sent)
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                record.error = f"HTTP {response.status_code}: {detail}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {json.dumps(chunk['error'])[:300]}"
                    return
                stream.add(chunk, time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return
    record.e2e = time.perf_counter() - sent
    stream.finish()
    if record.ttft is None:
        record.error = "the answer streamed no content and no tool call"


def assistant_message(record: AgentRecord) -> dict[str, Any]:
    """The answer as an agent puts it back into the history: its calls with `content` null (its
    text, if it wrote any before them), or its text."""
    if record.tool_calls:
        calls = [
            {"id": c["id"], "type": "function", "function": dict(c["function"])}
            for c in record.tool_calls
        ]
        return {"role": "assistant", "content": record.content, "tool_calls": calls}
    return {"role": "assistant", "content": record.content or ""}


def tool_messages(record: AgentRecord) -> list[dict[str, Any]]:
    """One `tool` message per call of the answer, with the harness's result for it."""
    out = []
    for call in record.tool_calls:
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            arguments = None
        content = tool_result(function["name"], arguments)
        out.append({"role": "tool", "tool_call_id": call["id"], "content": content})
    return out


class Session:
    """One agent's conversation: the next request's messages, grown from each answer."""

    def __init__(self, index: int, config: AgentConfig) -> None:
        self.index = index
        self.config = config
        self.rng = random.Random(config.seed * 1_000_003 + index)
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": system_prompt(config.rules)}
        ]
        self.tool_order = [TOOLS[(index + k) % len(TOOLS)]["function"]["name"] for k in range(4)]

    def next_messages(self, turn: int) -> list[dict[str, Any]]:
        """The history for `turn`: a new user question on a call turn; on a free turn, the
        model answers the tool's result, or (after a text answer) a short follow-up."""
        if is_call_turn(turn):
            tool = self.tool_order[(turn // 2) % len(self.tool_order)]
            self.messages.append({"role": "user", "content": question(tool, self.rng)})
        elif self.messages[-1]["role"] != "tool":
            self.messages.append({"role": "user", "content": FOLLOW_UP})
        return self.messages

    def add_answer(self, record: AgentRecord) -> None:
        self.messages.append(assistant_message(record))
        self.messages.extend(tool_messages(record))


def request_body(
    model: str,
    messages: list[dict[str, Any]],
    tool_choice: str,
    config: AgentConfig,
    extra_body: dict[str, Any],
) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "tools": config.tools(),
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
        "temperature": 0.0,
        "max_tokens": config.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra_body,
    }


@dataclass(slots=True)
class AgentRun:
    records: list[AgentRecord]
    duration: float

    def to_dict(self) -> dict[str, Any]:
        return {"duration": self.duration, "records": [r.to_dict() for r in self.records]}


async def run_agent_workload(
    base_url: str,
    model: str,
    config: AgentConfig,
    extra_body: dict[str, Any] | None = None,
    api_key: str | None = None,
    on_done: Callable[[AgentRecord], None] | None = None,
) -> AgentRun:
    """Run W9 against the server at `base_url`: every session at once, each turn sent when the
    previous one of its session finished. Records come back session by session, turn by turn."""
    extra = dict(extra_body or {})
    url = base_url.rstrip("/") + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=config.sessions + 4)
    t0 = time.perf_counter()

    async def session_loop(client: httpx.AsyncClient, index: int) -> list[AgentRecord]:
        session = Session(index, config)
        records: list[AgentRecord] = []
        for turn in range(config.turns):
            choice = "required" if is_call_turn(turn) else config.free_choice
            record = AgentRecord(f"W9-s{index}-t{turn}", index, turn, choice)
            if records and not records[-1].ok:
                record.error = "not sent: an earlier turn of its session failed"
            else:
                body = request_body(model, session.next_messages(turn), choice, config, extra)
                await stream_chat(client, url, body, record, t0)
                if record.ok:
                    session.add_answer(record)
            judge_calls(record)
            records.append(record)
            if on_done is not None:
                on_done(record)
        return records

    async with httpx.AsyncClient(
        limits=limits, timeout=config.timeout_s, headers=headers
    ) as client:
        per_session = await asyncio.gather(
            *(session_loop(client, i) for i in range(config.sessions))
        )
    duration = time.perf_counter() - t0
    return AgentRun([r for records in per_session for r in records], duration)


async def warm_up(base_url: str, model: str, extra_body: dict[str, Any] | None = None) -> None:
    """One forced tool call under another system prompt (nothing of W9's prompts cached), so a
    server has compiled its tool grammar path before the timed run."""
    config = AgentConfig(sessions=1, turns=1, max_tokens=40)
    messages = [
        {"role": "system", "content": "You are a warm-up assistant."},
        {"role": "user", "content": "What is the weather in Rome tomorrow?"},
    ]
    record = AgentRecord("W9-warmup", -1, 0, "required")
    body = request_body(model, messages, "required", config, dict(extra_body or {}))
    async with httpx.AsyncClient(timeout=config.timeout_s) as client:
        await stream_chat(client, base_url.rstrip("/") + "/v1/chat/completions", body, record, 0)
