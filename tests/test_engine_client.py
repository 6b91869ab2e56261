"""One engine-client interface: both engine clients offer every member of `EngineClient` with the
Protocol's signature, the server and the CLI reach past it nowhere, and what one client cannot do
is a typed refusal the server answers with 501."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from prefixserve.cluster.client import ClusterEngine
from prefixserve.engine.async_llm import AsyncLLMEngine
from prefixserve.engine.client import EngineClient, EngineRequest
from prefixserve.engine.exceptions import NotSupportedByEngine
from prefixserve.entrypoints.api_server import build_app
from prefixserve.sampling_params import SamplingParams
from tests.helpers.asgi import ADMIN_KEY, FakeEngine, call, keys

PACKAGE = Path(__file__).resolve().parents[1] / "prefixserve"


def _members() -> list[str]:
    names = set()
    for klass in EngineClient.__mro__:
        if klass in (object,) or klass.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n in vars(klass) if not n.startswith("_")}
    return sorted(names)


def _parameters(fn: Any) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("client", [AsyncLLMEngine, ClusterEngine])
def test_every_engine_client_offers_each_member_with_the_protocols_signature(client: type):
    for name in _members():
        expected = inspect.getattr_static(EngineClient, name)
        actual = inspect.getattr_static(client, name, None)
        assert actual is not None, f"{client.__name__} lacks {name}"
        if isinstance(expected, property):
            assert isinstance(actual, property), f"{client.__name__}.{name} is not a property"
            continue
        assert _parameters(actual) == _parameters(expected), f"{client.__name__}.{name}"
        is_async = inspect.iscoroutinefunction(expected)
        assert inspect.iscoroutinefunction(actual) == is_async, f"{client.__name__}.{name}"


def test_the_server_and_the_cli_reach_past_the_engine_client_nowhere():
    reach_in = re.compile(r"\.engine\.engine\b|run_in_engine|supports_pins|getattr\(state\.engine")
    files = [PACKAGE / "cli.py", *sorted((PACKAGE / "entrypoints").rglob("*.py"))]
    offenders = [
        f"{path.relative_to(PACKAGE)}:{n}"
        for path in files
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if reach_in.search(line)
    ]
    assert offenders == []


def test_an_engine_request_is_typed_and_keeps_its_routing_fields():
    request = EngineRequest("r", [1, 2], SamplingParams(), prompt_cache_key="k", final_only=True)
    assert (request.prompt_cache_key, request.final_only) == ("k", True)
    with pytest.raises(TypeError):
        EngineRequest("r", [1], SamplingParams(), options={"x": 1})  # type: ignore[call-arg]


class _NoPinsEngine(FakeEngine):
    async def describe_pins(self) -> dict[str, Any]:
        raise NotSupportedByEngine("pinned prefixes need one engine")


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/pins", None),
        ("POST", "/pins", {"prompt": "a system prompt", "tenant": "tenant"}),
    ],
)
def test_what_an_engine_client_cannot_do_is_a_501_not_a_500(method, path, body):
    app = build_app(_NoPinsEngine(), ["m"], api_keys=keys())  # type: ignore[arg-type]
    result = call(app, method, path, key=ADMIN_KEY, body=body)
    assert result.status == 501, result.body
    assert result.json()["error"]["code"] == "not_supported"
