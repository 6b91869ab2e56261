"""A replica that dies while it serves, on stand-in replicas (no Ray runtime, no model): a
request none of whose outputs reached its reader starts over on another replica, its partial
output dropped; one whose reader took outputs ends with ReplicaDiedError, which the server
answers with a 503 and Retry-After; the router's loads are settled either way."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from prefixserve.cluster.client import ClusterEngine, ReplicaDiedError
from prefixserve.cluster.policy import ReplicaLoad
from prefixserve.engine.client import EngineRequest
from prefixserve.engine.exceptions import EngineDeadError
from prefixserve.entrypoints.api_server import build_app
from prefixserve.lora.config import LoRASlotsBusyError
from prefixserve.outputs import RequestOutput
from prefixserve.sampling_params import SamplingParams
from prefixserve.structured_output.errors import GrammarBusy, GrammarError
from tests.helpers.asgi import acall
from tests.helpers.cluster import FakeReplica, cluster_of

PROMPT = list(range(100, 140))


def settled(engine: ClusterEngine) -> bool:
    return all(load == ReplicaLoad() for load in engine.router.loads.values())


def params() -> SamplingParams:
    return SamplingParams(max_tokens=8, temperature=0.0)


def test_a_request_whose_replica_dies_before_its_outputs_were_read_starts_over_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dying = FakeReplica(0, 500, dying=True, num_outputs=3)
    healthy = FakeReplica(1, 900, dying=False, num_outputs=4)
    engine = cluster_of(monkeypatch, dying, healthy)

    async def scenario() -> list[RequestOutput]:
        stream = await engine.add_request(EngineRequest("r", PROMPT, params()))
        await dying.streamed.wait()  # three outputs put, none read
        dying.kill.set()
        while not settled(engine):  # it started over there and finished, nothing read yet
            await asyncio.sleep(0)
        return [output async for output in stream]

    outputs = asyncio.run(scenario())
    # The reader sees the second replica's outputs alone: none of the dead one's partial ones.
    assert [o.outputs[0].token_ids for o in outputs] == [[900, 901, 902, 903]]
    assert outputs[-1].finished and outputs[-1].error is None
    assert outputs[-1].prompt_token_ids == PROMPT
    assert (dying.calls, healthy.calls) == (1, 1)
    assert (engine.retried_requests, engine.failed_midstream) == (1, 0)
    assert settled(engine)


def test_a_request_whose_reader_took_outputs_ends_with_replica_died_not_an_error_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dying = FakeReplica(0, 500, dying=True, num_outputs=2)
    healthy = FakeReplica(1, 900, dying=False, num_outputs=4)
    engine = cluster_of(monkeypatch, dying, healthy)
    read: list[RequestOutput] = []

    async def scenario() -> None:
        stream = await engine.add_request(EngineRequest("r", PROMPT, params()))
        async for output in stream:
            read.append(output)
            dying.kill.set()

    with pytest.raises(ReplicaDiedError):
        asyncio.run(scenario())
    assert read and all(o.error is None and not o.finished for o in read)
    assert healthy.calls == 0
    assert (engine.retried_requests, engine.failed_midstream) == (0, 1)
    assert settled(engine)


def test_a_request_that_cannot_start_over_for_want_of_a_replica_ends_with_engine_dead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dying = FakeReplica(0, 500, dying=True, num_outputs=2)
    engine = cluster_of(monkeypatch, dying)

    async def scenario() -> list[RequestOutput]:
        stream = await engine.add_request(EngineRequest("r", PROMPT, params()))
        await dying.streamed.wait()
        dying.kill.set()
        while not settled(engine):  # its death handled, still nothing read
            await asyncio.sleep(0)
        return [output async for output in stream]

    # Its unread partial output was dropped: the reader gets the end alone.
    with pytest.raises(EngineDeadError, match="no engine replica is up"):
        asyncio.run(scenario())
    assert settled(engine)


def test_a_caller_of_the_final_output_only_gets_it_from_another_replica_after_reading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dying = FakeReplica(0, 500, dying=True, num_outputs=2)
    healthy = FakeReplica(1, 900, dying=False, num_outputs=3)
    engine = cluster_of(monkeypatch, dying, healthy)

    async def scenario() -> RequestOutput | None:
        stream = await engine.add_request(EngineRequest("r", PROMPT, params(), final_only=True))
        final = None
        async for output in stream:
            final = output
            dying.kill.set()
        return final

    final = asyncio.run(scenario())
    assert final is not None and final.finished and final.error is None
    assert final.outputs[0].token_ids == [900, 901, 902]
    assert (engine.retried_requests, engine.failed_midstream) == (1, 0)
    assert settled(engine)


def _post_while_dying(app: Any, dying: FakeReplica) -> Any:
    async def scenario() -> Any:
        call = asyncio.ensure_future(
            acall(app, "POST", "/v1/completions", body={"model": "m", "prompt": PROMPT})
        )
        await dying.streamed.wait()
        for _ in range(10):  # the server's collect takes the outputs put so far
            await asyncio.sleep(0)
        dying.kill.set()
        return await call

    return asyncio.run(scenario())


def test_over_http_a_non_streaming_request_whose_replica_died_is_served_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server collected outputs it never sent (a non-streaming request is `final_only`):
    the request starts over on the healthy replica, and the client never knows."""
    dying = FakeReplica(0, 500, dying=True, num_outputs=2)
    healthy = FakeReplica(1, 900, dying=False, num_outputs=3)
    engine = cluster_of(monkeypatch, dying, healthy)
    result = _post_while_dying(build_app(engine, ["m"]), dying)  # type: ignore[arg-type]
    assert result.status == 200, result.body
    assert healthy.calls == 1 and engine.retried_requests == 1
    assert settled(engine)


def test_over_http_a_request_whose_only_replica_died_gets_503_with_retry_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nowhere to start over: a 503 the client may retry, not a 500."""
    dying = FakeReplica(0, 500, dying=True, num_outputs=2)
    engine = cluster_of(monkeypatch, dying)
    result = _post_while_dying(build_app(engine, ["m"]), dying)  # type: ignore[arg-type]
    assert result.status == 503, result.body
    assert result.headers[b"retry-after"] == b"1"
    assert result.json()["error"]["type"] == "server_error"
    assert settled(engine)


class RefusingReplica(FakeReplica):
    """A replica whose engine refuses the request before accepting it, as Ray delivers that."""

    def __init__(self, refusal: Exception) -> None:
        super().__init__(0, 0, dying=False, num_outputs=1)
        self.refusal = refusal

    async def _generate(self, *args: Any) -> AsyncIterator[Any]:
        from ray.exceptions import RayTaskError

        raise RayTaskError("generate", "traceback", self.refusal)
        yield  # an async generator, as the replica's is


@pytest.mark.parametrize(
    ("refusal", "kind"),
    [(LoRASlotsBusyError("all max_loras=1 slots are used"), LoRASlotsBusyError),
     (GrammarError("structured_outputs.regex does not compile", "invalid_grammar"), GrammarError),
     (ValueError("max_tokens=9 is too many"), ValueError)],
)  # fmt: skip
def test_a_replica_refusal_keeps_its_kind_so_busy_adapter_slots_stay_a_429(
    monkeypatch: pytest.MonkeyPatch, refusal: ValueError, kind: type
) -> None:
    engine = cluster_of(monkeypatch, RefusingReplica(refusal))

    async def scenario() -> None:
        await engine.add_request(EngineRequest("r", PROMPT, params()))

    with pytest.raises(ValueError) as info:
        asyncio.run(scenario())
    assert type(info.value) is kind and str(refusal) in str(info.value)
    assert getattr(info.value, "reason", None) == getattr(refusal, "reason", None)
    assert settled(engine)


def test_a_replicas_busy_grammar_compiler_reaches_the_server_as_grammar_busy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """GrammarBusy is no ValueError: it comes through as itself, so the server answers a 429."""
    engine = cluster_of(monkeypatch, RefusingReplica(GrammarBusy("4 compiles in flight")))

    async def scenario() -> None:
        await engine.add_request(EngineRequest("r", PROMPT, params()))

    with pytest.raises(GrammarBusy):
        asyncio.run(scenario())
    assert settled(engine)


def test_a_request_whose_second_replica_dies_too_goes_no_further(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request that may be what kills replicas (each death restarts one) starts over once
    (MAX_START_OVERS), then ends with ReplicaDiedError: the third replica never sees it."""
    replicas = [FakeReplica(i, 100 * (i + 1), dying=True, num_outputs=1) for i in range(3)]
    for replica in replicas:
        replica.kill.set()  # each dies right after its output
    engine = cluster_of(monkeypatch, *replicas)

    async def scenario() -> None:
        stream = await engine.add_request(EngineRequest("r", PROMPT, params(), final_only=True))
        async for _ in stream:
            pass

    with pytest.raises(ReplicaDiedError):
        asyncio.run(scenario())
    assert sum(r.calls for r in replicas) == 2
    assert (engine.retried_requests, engine.failed_midstream) == (1, 1)
    assert settled(engine)
