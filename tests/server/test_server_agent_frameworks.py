"""Function tools through the agent frameworks people use, on a live server with the packaged
default model: OpenAI's Agents SDK, LangChain, instructor (tools mode) and pydantic-ai each run a
real tool (or build a real object) from a call the server forced, and its arguments validate
against the schema the framework itself sent.

Every client records the bodies it POSTs and the answers it gets, so each test also pins what its
framework sends (tool_choice, parallel_tool_calls, stream) and validates the arguments on the wire
against the very schema on the wire, not only what the framework parsed out of them. The model is
weak: each call is forced ("required" or a named tool, which holds it to the call grammar), greedy
and short (the schemas bound their strings), so the file costs about seven short generations.

LangChain's bind_tools and instructor's TOOLS mode send schemas without "additionalProperties":
false, which JSON Schema reads as "more keys allowed"; the default model then pads its call with
keys copied from the schema ("maxLength", "type", ...), so those two get more room (120 tokens).
"""

from __future__ import annotations

import json
from functools import reduce
from operator import add
from typing import Annotated, Any, Literal

import httpx
import instructor
import jsonschema
import openai
from agents import Agent as OpenAIAgent
from agents import (
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from pydantic_ai import Agent as PydanticAgent
from pydantic_ai import RunContext
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider

from tests.helpers.server import MODEL_NAME, ssl_context

ASK = "What is the weather in Paris? Use the tool."
NAMED_WEATHER = {"type": "function", "function": {"name": "Weather"}}


class Weather(BaseModel):
    """Ask for the weather in a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


def weather_report(city: str, unit: str) -> str:
    return f"21 degrees {unit} in {city}"


class Recorder:
    """What a client POSTed to /chat/completions and what came back (JSON answers), in order."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.answers: list[dict[str, Any]] = []

    def record_request(self, request: httpx.Request) -> None:
        if request.url.path.endswith("/chat/completions"):
            self.bodies.append(json.loads(request.read()))

    def record_response(self, response: httpx.Response) -> None:
        if _is_json_answer(response):
            self.answers.append(json.loads(response.read()))

    async def arecord_request(self, request: httpx.Request) -> None:
        self.record_request(request)

    async def arecord_response(self, response: httpx.Response) -> None:
        if _is_json_answer(response):
            self.answers.append(json.loads(await response.aread()))

    def http_client(self) -> httpx.Client:
        hooks = {"request": [self.record_request], "response": [self.record_response]}
        return openai.DefaultHttpxClient(verify=ssl_context(), event_hooks=hooks)

    def async_http_client(self) -> httpx.AsyncClient:
        hooks = {"request": [self.arecord_request], "response": [self.arecord_response]}
        return openai.DefaultAsyncHttpxClient(verify=ssl_context(), event_hooks=hooks)

    def sent_parameters(self, name: str, body: int = 0) -> dict[str, Any]:
        """The JSON schema of tool `name` in the `body`-th request."""
        tools = self.bodies[body]["tools"]
        for tool in tools:
            if tool["function"]["name"] == name:
                return tool["function"]["parameters"]
        raise AssertionError(f"no tool {name!r} in {tools}")

    def validate_wire_calls(self, answer: int = 0) -> list[dict[str, Any]]:
        """The `answer`-th answer's tool calls, each checked against the schema its request sent
        (the JSON the server wrote, before any framework parsed or filtered it)."""
        message = self.answers[answer]["choices"][0]["message"]
        calls = message["tool_calls"]
        assert calls, message
        for call in calls:
            assert call["id"].startswith("call_") and call["type"] == "function", call
            arguments = json.loads(call["function"]["arguments"])
            jsonschema.validate(arguments, self.sent_parameters(call["function"]["name"], answer))
        return calls


def _is_json_answer(response: httpx.Response) -> bool:
    return response.request.url.path.endswith("/chat/completions") and response.headers.get(
        "content-type", ""
    ).startswith("application/json")


def _client(server, recorder: Recorder) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1",
        api_key=server.api_key,
        max_retries=0,
        timeout=120,
        http_client=recorder.http_client(),
    )


def _async_client(server, recorder: Recorder) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=f"{server.url}/v1",
        api_key=server.api_key,
        max_retries=0,
        timeout=120,
        http_client=recorder.async_http_client(),
    )


def test_openai_agents_sdk_runs_a_required_function_tool_with_valid_arguments(server):
    """Agents SDK on Chat Completions: tool_choice "required", parallel_tool_calls false, not
    streamed; the tool runs once and, stopping on the first tool, its result is the output."""
    set_tracing_disabled(True)
    recorder = Recorder()
    ran: list[dict[str, Any]] = []

    @function_tool
    def get_weather(
        city: Annotated[str, Field(max_length=20)], unit: Literal["celsius", "fahrenheit"]
    ) -> str:
        """Look up the current weather in a city."""
        ran.append({"city": city, "unit": unit})
        return weather_report(city, unit)

    model = OpenAIChatCompletionsModel(MODEL_NAME, openai_client=_async_client(server, recorder))
    agent = OpenAIAgent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=model,
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=80
        ),
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, ASK, max_turns=2)

    [sent] = recorder.bodies
    assert sent["tool_choice"] == "required" and sent["parallel_tool_calls"] is False
    assert not sent.get("stream")
    assert recorder.answers[0]["choices"][0]["finish_reason"] == "tool_calls"
    assert len(recorder.validate_wire_calls()) == 1
    [arguments] = ran
    jsonschema.validate(arguments, recorder.sent_parameters("get_weather"))
    assert result.final_output == weather_report(**arguments)
    server.check_no_leaks()


def test_langchain_bound_tool_calls_whole_and_streamed_and_structured_output_validate(server):
    """LangChain's ChatOpenAI: bind_tools with a named tool_choice answers an AIMessage whose
    tool_calls validate, whole and streamed (chunks merged by LangChain); with_structured_output
    (json_schema) answers a validated object."""
    recorder = Recorder()
    chat = ChatOpenAI(
        base_url=f"{server.url}/v1",
        api_key=server.api_key,
        model=MODEL_NAME,
        temperature=0,
        max_tokens=120,
        max_retries=0,
        http_client=recorder.http_client(),
    )
    bound = chat.bind_tools([Weather], tool_choice="Weather")
    message = bound.invoke(ASK)
    streamed = reduce(add, bound.stream(ASK))
    city = chat.with_structured_output(Weather, method="json_schema").invoke(ASK)

    whole, stream, structured = recorder.bodies
    assert whole["tool_choice"] == stream["tool_choice"] == NAMED_WEATHER
    assert "parallel_tool_calls" not in whole and not whole.get("stream")
    assert stream["stream"] is True
    recorder.validate_wire_calls()
    schema = recorder.sent_parameters("Weather")
    for answer in (message, streamed):
        assert [call["name"] for call in answer.tool_calls] == ["Weather"], answer
        assert not answer.invalid_tool_calls, answer
        jsonschema.validate(answer.tool_calls[0]["args"], schema)
        Weather.model_validate(answer.tool_calls[0]["args"])
    assert structured["response_format"]["type"] == "json_schema"
    assert isinstance(city, Weather)
    server.check_no_leaks()


def test_instructor_tools_mode_returns_a_validated_pydantic_object(server):
    """instructor's TOOLS mode forces the response model's tool by name; the call validates."""
    recorder = Recorder()
    patched = instructor.from_openai(_client(server, recorder), mode=instructor.Mode.TOOLS)
    weather = patched.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": ASK}],
        response_model=Weather,
        temperature=0,
        max_tokens=120,
        max_retries=1,
    )

    [sent] = recorder.bodies
    assert sent["tool_choice"] == NAMED_WEATHER and not sent.get("stream")
    [call] = recorder.validate_wire_calls()
    assert isinstance(weather, Weather)
    assert (
        weather.model_dump()
        == Weather.model_validate_json(call["function"]["arguments"]).model_dump()
    )
    server.check_no_leaks()


def test_pydantic_ai_runs_a_forced_tool_then_answers_from_its_result(server):
    """pydantic-ai forces the tool on the first step only (per-step model settings: a static
    "required" is refused by pydantic-ai), runs every call it got, and sends the calls and their
    results back with tool_choice "none", which the server answers with text."""
    recorder = Recorder()
    ran: list[dict[str, Any]] = []
    provider = OpenAIProvider(openai_client=_async_client(server, recorder))
    agent = PydanticAgent(OpenAIChatModel(MODEL_NAME, provider=provider), output_type=str)

    @agent.tool_plain
    def get_weather(
        city: Annotated[str, Field(max_length=20)], unit: Literal["celsius", "fahrenheit"]
    ) -> str:
        """Look up the current weather in a city."""
        ran.append({"city": city, "unit": unit})
        return weather_report(city, unit)

    def settings(ctx: RunContext[None]) -> dict[str, Any]:
        first = ctx.run_step <= 1
        return {
            "tool_choice": ["get_weather"] if first else "none",
            "temperature": 0,
            "max_tokens": 80 if first else 24,
        }

    result = agent.run_sync(ASK, model_settings=settings)

    forced, after = recorder.bodies
    assert forced["tool_choice"] == "required" and after["tool_choice"] == "none"
    assert not forced.get("stream") and not after.get("stream")
    calls = recorder.validate_wire_calls()
    assert len(ran) == len(calls)
    for arguments in ran:
        jsonschema.validate(arguments, recorder.sent_parameters("get_weather"))
    results = [m for m in after["messages"] if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in results] == [call["id"] for call in calls]
    assert [m["content"] for m in results] == [weather_report(**a) for a in ran]
    assert recorder.answers[1]["choices"][0]["message"].get("tool_calls") in (None, [])
    assert isinstance(result.output, str) and result.output
    server.check_no_leaks()
