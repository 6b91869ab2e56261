"""The benchmark client against a stub OpenAI server (the subject here is the client)."""

from __future__ import annotations

import asyncio

import pytest

from prefixserve.bench.client import EndpointConfig, build_body, run_workload
from prefixserve.bench.summary import summarize
from prefixserve.bench.workloads import BenchRequest, make_workload
from tests.helpers.stub_openai import FAIL_TOKEN, StubServer

POOL = list(range(1000, 1600))


@pytest.fixture(scope="module")
def stub():
    with StubServer() as server:
        yield server


def _endpoint(stub, **kw) -> EndpointConfig:
    return EndpointConfig(base_url=stub.base_url, model="stub-model", **kw)


def test_records_ttft_gaps_tokens_and_cached_tokens(stub):
    w = make_workload("W1", POOL, seed=11, scale=0.25)  # 8 requests, 2 per prefix
    done = []
    result = asyncio.run(
        run_workload(w.requests, _endpoint(stub), concurrency=1, on_done=done.append)
    )
    assert [r.request_id for r in result.records] == [r.request_id for r in w.requests]
    assert len(done) == 8
    for rec, req in zip(result.records, w.requests, strict=True):
        assert rec.ok, rec.error
        assert rec.ttft is not None and rec.ttft > 0
        assert rec.e2e is not None and rec.e2e >= rec.ttft
        assert len(rec.itl) == req.max_tokens - 1
        assert rec.output_tokens == req.max_tokens and rec.num_chunks == req.max_tokens
        assert rec.prompt_tokens == req.num_prompt_tokens
        assert rec.cached_tokens is not None
    # one at a time: a prefix's second request finds its 1024-token prefix (64 blocks) cached
    seen: set[str] = set()
    for rec, req in zip(result.records, w.requests, strict=True):
        if req.group in seen:
            assert rec.cached_tokens >= 1024
        else:
            assert rec.cached_tokens == 0
        seen.add(req.group)
    assert summarize(result.records, result.duration).hit_rate > 0


def test_body_is_greedy_streaming_with_usage_and_engine_extras():
    req = BenchRequest("r", [5, 6, 7], max_tokens=9, prompt_text=" a b c")
    ep = EndpointConfig(
        "http://x",
        "m",
        prompt_format="text",
        extra_body={"ignore_eos": True},
        min_tokens_equal_max=True,
    )
    body = build_body(req, ep)
    assert body["prompt"] == " a b c" and body["max_tokens"] == 9 and body["min_tokens"] == 9
    assert body["stream"] is True and body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True
    assert build_body(req, EndpointConfig("http://x", "m"))["prompt"] == [5, 6, 7]
    with pytest.raises(ValueError, match="prompt text"):
        build_body(BenchRequest("r", [1], 1), ep)
    with pytest.raises(ValueError, match="prompt_format"):
        EndpointConfig("http://x", "m", prompt_format="ids")


def test_text_prompts_are_sent_as_text(stub):
    reqs = [BenchRequest("t0", [1, 2], 3, prompt_text=" hello world")]
    n_before = len(stub.state.bodies)
    result = asyncio.run(run_workload(reqs, _endpoint(stub, prompt_format="text")))
    assert result.records[0].ok
    assert stub.state.bodies[n_before]["prompt"] == " hello world"


def test_in_flight_requests_never_exceed_the_concurrency(stub):
    stub.state.max_in_flight = 0
    w = make_workload("W0", POOL, seed=12, scale=0.25)  # 16 requests
    result = asyncio.run(run_workload(w.requests, _endpoint(stub), concurrency=4))
    assert all(r.ok for r in result.records)
    assert 2 <= stub.state.max_in_flight <= 4


def test_a_turn_is_sent_only_after_the_previous_turn_finished(stub):
    w = make_workload("W2", POOL, seed=13, scale=0.25)  # 2 conversations x 5 turns
    start = len(stub.state.events)
    result = asyncio.run(run_workload(w.requests, _endpoint(stub), concurrency=8))
    assert all(r.ok for r in result.records)
    events = stub.state.events[start:]
    import json

    key = {r.request_id: json.dumps(r.prompt_token_ids[-8:]) for r in w.requests}
    position = {(kind, k): i for i, (kind, k) in enumerate(events)}
    for r in w.requests:
        if r.after is not None:
            assert position[("start", key[r.request_id])] > position[("end", key[r.after])]


def test_request_rate_mode_sends_everything(stub):
    w = make_workload("W0", POOL, seed=14, scale=0.0625)  # 4 requests
    result = asyncio.run(
        run_workload(w.requests, _endpoint(stub), concurrency=None, request_rate=200.0, seed=1)
    )
    assert len(result.records) == 4 and all(r.ok for r in result.records)
    assert result.request_rate == 200.0


def test_server_errors_are_recorded_not_raised(stub):
    reqs = [BenchRequest("bad", [FAIL_TOKEN], 4), BenchRequest("good", [1, 2, 3], 4)]
    result = asyncio.run(run_workload(reqs, _endpoint(stub), concurrency=2))
    bad, good = result.records
    assert bad.error is not None and "HTTP 400" in bad.error and good.ok
    assert summarize(result.records, result.duration).num_failed == 1


def test_unreachable_server_is_an_error_per_request():
    reqs = [BenchRequest("r", [1], 2)]
    ep = EndpointConfig(base_url="http://127.0.0.1:9", model="m", timeout_s=5)
    result = asyncio.run(run_workload(reqs, ep, concurrency=1))
    assert result.records[0].error is not None


def test_bad_run_arguments_are_named():
    reqs = [BenchRequest("a", [1], 1, after="b"), BenchRequest("b", [1], 1, after="a")]
    ep = EndpointConfig("http://127.0.0.1:9", "m")
    with pytest.raises(ValueError, match="cycle"):
        asyncio.run(run_workload(reqs, ep))
    with pytest.raises(ValueError, match="unknown request"):
        asyncio.run(run_workload([BenchRequest("a", [1], 1, after="zz")], ep))
    with pytest.raises(ValueError, match="concurrency"):
        asyncio.run(run_workload([], ep, concurrency=0))
    with pytest.raises(ValueError, match="unique"):
        asyncio.run(run_workload([BenchRequest("a", [1], 1), BenchRequest("a", [1], 1)], ep))
