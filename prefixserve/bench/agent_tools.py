"""The world of W9's agents (`agent_workload`): the four function tools every request carries,
the system prompt every session shares, the users' questions, the results the harness's tools
return, and the check that a call parses.

A call parses when it names one of the tools and its `function.arguments` is a JSON object string
that validates against that tool's schema (jsonschema). A tool's result is made from the call's
arguments alone, so the same call gets the same result from every server's session.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import jsonschema

CITIES = ("Paris", "Rome", "Oslo", "Lima", "Tokyo", "Cairo", "Quito", "Perth")
CURRENCIES = ("USD", "EUR", "GBP", "JPY")


def _function(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


TOOLS: list[dict[str, Any]] = [
    _function(
        "get_weather",
        "The weather forecast for a city, some days from today.",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": list(CITIES)},
                "day": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "day"],
            "additionalProperties": False,
        },
    ),
    _function(
        "search_web",
        "Search the web; returns titles and links.",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1, "maxLength": 40},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["query"],
            "additionalProperties": False,
        },
    ),
    _function(
        "create_event",
        "Put an event in the user's calendar.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "minLength": 1, "maxLength": 32},
                "date": {"type": "string", "pattern": "^2025-[0-1][0-9]-[0-3][0-9]$"},
                "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            },
            "required": ["title", "date", "hour"],
            "additionalProperties": False,
        },
    ),
    _function(
        "convert_currency",
        "Convert an amount of money from one currency to another.",
        {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "minimum": 0},
                "from": {"type": "string", "enum": list(CURRENCIES)},
                "to": {"type": "string", "enum": list(CURRENCIES)},
            },
            "required": ["amount", "from", "to"],
            "additionalProperties": False,
        },
    ),
]
SCHEMAS: dict[str, dict[str, Any]] = {
    t["function"]["name"]: t["function"]["parameters"] for t in TOOLS
}

_PREAMBLE = (
    "You are Atlas, the assistant of a small travel and events office. You help the staff plan "
    "trips, check the weather, find things on the web, keep their calendars and convert money. "
    "Follow these rules."
)
# The system prompt's rules; `system_prompt(n)` takes the first n (24: about 600 tokens).
_RULES = (
    "Use a tool whenever the answer depends on facts you cannot know: the weather, prices, "
    "exchange rates, opening hours or anything that changes from day to day.",
    "Call one tool at a time and wait for its result before you answer.",
    "Give a tool exactly the arguments its schema describes, with no extra fields.",
    "When a tool returns a result, answer from that result in one or two short sentences.",
    "Never invent a tool result. If a tool fails, say so and suggest what the user can do.",
    "Weather: name the city and the day, then the forecast and the high temperature in Celsius.",
    "Search: keep the query short, at most six words, and without quotation marks.",
    "Search: give the user the first result's title and say that more results are available.",
    "Calendar: dates are written as year, month and day with dashes, hours from 0 to 23.",
    "Calendar: repeat the event's title, date and hour back to the user after you create it.",
    "Currency: convert only between US dollars, euros, pounds and yen, with the codes USD, "
    "EUR, GBP and JPY.",
    "Currency: round amounts to two decimals and name both currencies in your answer.",
    "Be polite and brief. The staff read your answers on their phones between meetings.",
    "Do not use lists or tables unless the user asks for them; plain sentences are better.",
    "If the user's request is unclear, pick the most likely meaning and say which one you chose.",
    "Do not ask the user for information a tool can give you; call the tool instead.",
    "Keep personal data private: never repeat a phone number or an address you were given.",
    "Travel plans: the office books trains before flights when the trip is under five hours.",
    "Travel plans: remind the user to check the weather two days before leaving.",
    "Events: the office's meeting rooms are free from 9 to 17 on working days.",
    "Events: a meeting without a title is called 'Team meeting' in the calendar.",
    "Money: the office's budget is kept in euros; convert other currencies to euros first.",
    "If a question has nothing to do with travel, events, the weather or money, answer it "
    "briefly without a tool.",
    "End every answer with a full stop, never with a question, unless you need the user to "
    "choose between options.",
)
DEFAULT_RULES = len(_RULES)


def system_prompt(rules: int = DEFAULT_RULES) -> str:
    """The system prompt every session shares: the preamble and the first `rules` rules."""
    if not 0 <= rules <= len(_RULES):
        raise ValueError(f"rules must be in 0..{len(_RULES)}, got {rules}")
    lines = [_PREAMBLE, *(f"{i + 1}. {rule}" for i, rule in enumerate(_RULES[:rules]))]
    return "\n".join(lines)


def question(tool: str, rng: random.Random) -> str:
    """A user message that one call of `tool` answers."""
    if tool == "get_weather":
        return f"What will the weather be like in {rng.choice(CITIES)} in {rng.randint(1, 7)} days?"
    if tool == "search_web":
        topic = rng.choice(("night trains to Vienna", "museums open on Monday", "bike rental"))
        return f"Search the web for {topic}."
    if tool == "create_event":
        title = rng.choice(("Budget review", "Client lunch", "Visa appointment", "Team meeting"))
        month, day, hour = rng.randint(1, 12), rng.randint(1, 28), rng.randint(8, 17)
        return f"Add '{title}' to my calendar on 2025-{month:02d}-{day:02d} at {hour}:00."
    amount = rng.choice((25, 120, 480, 1500))
    src, dst = rng.sample(CURRENCIES, 2)
    return f"How much is {amount} {src} in {dst}?"


FOLLOW_UP = "Thanks. Is there anything else I should know? One sentence, please."


def tool_result(name: str, arguments: Any) -> str:
    """The JSON a tool returns for a call: made from the call's arguments (the same call gets
    the same result on every server), or an error for arguments that do not validate."""
    if name not in SCHEMAS or check_arguments(name, arguments) is not None:
        return json.dumps({"error": "invalid arguments"})
    digest = int(hashlib.sha256(json.dumps(arguments, sort_keys=True).encode()).hexdigest(), 16)
    if name == "get_weather":
        forecast = ("sunny", "cloudy", "light rain", "windy")[digest % 4]
        return json.dumps({**arguments, "forecast": forecast, "high_c": 5 + digest % 25})
    if name == "search_web":
        slug = "-".join(str(arguments["query"]).lower().split())[:30] or "result"
        return json.dumps(
            {
                "results": [
                    {"title": f"{arguments['query']} - a guide", "url": f"https://ex.org/{slug}"}
                ]
            }
        )
    if name == "create_event":
        return json.dumps({"event_id": f"evt_{digest % 10_000:04d}", "status": "created"})
    rate = 0.5 + (digest % 150) / 100
    return json.dumps({"amount": round(float(arguments["amount"]) * rate, 2), "rate": rate})


def check_arguments(name: str, arguments: Any) -> str | None:
    """None if `arguments` (parsed) validate against tool `name`'s schema, else why not."""
    schema = SCHEMAS.get(name)
    if schema is None:
        return f"no tool named {name!r}"
    if not isinstance(arguments, dict):
        return "arguments are not a JSON object"
    error = jsonschema.exceptions.best_match(
        jsonschema.Draft202012Validator(schema).iter_errors(arguments)
    )
    return None if error is None else f"schema: {error.message[:160]}"


def check_call(call: dict[str, Any]) -> str | None:
    """None if an answer's tool call parses: it names a tool and its `function.arguments` is a
    JSON object string that validates against that tool's schema; else why not."""
    function = call.get("function") or {}
    text = function.get("arguments")
    if not isinstance(text, str):
        return "arguments are not a string"
    try:
        arguments = json.loads(text)
    except ValueError as exc:
        return f"arguments are not JSON: {exc}"
    return check_arguments(str(function.get("name")), arguments)
