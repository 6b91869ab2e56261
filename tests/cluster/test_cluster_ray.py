"""Two engine replicas on a local Ray runtime behind one OpenAI endpoint, end to end: routing by
cached prefix, streaming, aggregated metrics, and a replica killed while it serves."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from prefixserve.cluster.policy import make_policy
from prefixserve.cluster.ray_cluster import kill_replica, replica_pids, start_cluster
from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.auth import ApiKeys
from tests.helpers.cluster import replica_config, start_ray
from tests.helpers.server import serve_in_thread

pytestmark = pytest.mark.timeout(600)
MODEL = "tiny"


@pytest.fixture(scope="module")
def cluster(tiny_model: Any) -> Iterator[Any]:
    # One sequence at a time per replica: requests queued behind a running one have not
    # streamed, which the kill test needs.
    start_ray()
    engine = start_cluster(
        replica_config(tiny_model, max_num_seqs=1), 2, threads_per_replica=1, seed=0
    )
    server, thread, url = serve_in_thread(build_app(engine, [MODEL]))
    engine.url = url
    yield engine
    server.should_exit = True
    thread.join(10)
    engine.shutdown()


def complete(url: str, prompt: list[int], max_tokens: int = 8, **extra: Any) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream(url: str, prompt: list[int], max_tokens: int) -> list[dict]:
    """The SSE events of a streamed completion, parsed (the error event included)."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    return events


def cached(response: dict) -> int:
    return response["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_repeats_of_a_prompt_go_to_the_replica_that_cached_it(cluster: Any) -> None:
    prompt = list(range(1000, 1000 + 200))
    first = complete(cluster.url, prompt)
    assert cached(first) == 0
    time.sleep(0.3)  # let the replica's events reach the router (pending keys would do too)
    for _ in range(4):
        assert cached(complete(cluster.url, prompt + [5])) == 192
    assert cluster.router.decisions >= 5


def test_both_replicas_serve_and_give_the_same_tokens(cluster: Any) -> None:
    """Different prompts spread over both replicas (by load); greedy fp32 outputs equal a
    second run whichever replica serves it."""
    prompts = [[2000 + 50 * i + j for j in range(40)] for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        first = list(pool.map(lambda p: complete(cluster.url, p), prompts))
    per_replica = asyncio.run(cluster.get_metrics())["replicas"]
    assert all(per_replica[rid]["prefix_cache_requests"] > 0 for rid in (0, 1))
    again = [complete(cluster.url, p) for p in prompts]
    assert [r["choices"][0]["text"] for r in first] == [r["choices"][0]["text"] for r in again]


def test_streaming_through_the_cluster(cluster: Any) -> None:
    events = stream(cluster.url, list(range(3000, 3030)), max_tokens=12)
    assert sum(1 for e in events if e.get("choices")) >= 1
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_metrics_sum_the_replicas(cluster: Any) -> None:
    complete(cluster.url, list(range(4000, 4040)))
    text = httpx.get(f"{cluster.url}/metrics", timeout=60).text

    def value(prefix: str) -> float:
        lines = [line for line in text.splitlines() if line.startswith(prefix)]
        assert len(lines) == 1, prefix
        return float(lines[0].split()[-1])

    total = value("prefixserve_prefix_cache_queries_total")
    per = [value(f'prefixserve_replica_prefix_cache_queries{{replica="{r}"}}') for r in (0, 1)]
    assert total > 0 and total == sum(per)
    assert value("prefixserve_engine_router_decisions") >= 1


def test_a_replica_killed_mid_run_loses_no_request_that_had_not_streamed(cluster: Any) -> None:
    """Six requests round-robin: each replica runs one (streaming) with two queued behind it
    (max_num_seqs=1). Replica X is killed: its two queued ones are served by the other, the
    streaming one ends with an error, and X comes back, registered again."""
    url = cluster.url
    policy, cluster.router.policy = cluster.router.policy, make_policy("round_robin")
    try:
        results, victim, pids_before = kill_during(cluster, url)
    finally:
        cluster.router.policy = policy
    errors = [r for r in results if any("error" in e for e in r)]
    complete_ones = [
        r for r in results if r and r[-1].get("choices") and r[-1]["choices"][0]["finish_reason"]
    ]
    assert len(errors) <= 1, "only a request that had streamed may fail"
    assert len(complete_ones) + len(errors) == 6
    assert cluster.retried_requests >= 1
    deadline = time.monotonic() + 120
    while victim not in cluster.router.index.replica_ids:
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.2)
    assert replica_pids(cluster)[victim] != pids_before[victim]
    assert all(complete(url, list(range(6000 + i, 6040 + i)))["choices"] for i in range(4))


def kill_during(cluster: Any, url: str) -> tuple[list[list[dict]], int, list[int]]:
    with ThreadPoolExecutor(6) as pool:
        futures = [
            pool.submit(stream, url, list(range(5000 + 100 * i, 5064 + 100 * i)), 400)
            for i in range(6)
        ]
        deadline = time.monotonic() + 60
        while not any(load.running for load in cluster.router.loads.values()):
            assert time.monotonic() < deadline, "no request started streaming"
            time.sleep(0.01)
        victim = next(rid for rid, load in cluster.router.loads.items() if load.running)
        pids_before = replica_pids(cluster)
        kill_replica(cluster, victim)
        results = [f.result(timeout=300) for f in futures]
    return results, victim, pids_before


def test_a_non_streaming_request_whose_replica_is_killed_gets_no_500(cluster: Any) -> None:
    """Its client was sent nothing: the request starts over on the other replica (200) or, its
    outputs already collected by the server, gets a 503 with Retry-After it may retry; never
    the 500 of a request that failed on its own."""
    url = cluster.url
    body = {
        "model": MODEL,
        "prompt": list(range(6500, 6564)),
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
    }
    failed_before = cluster.failed_midstream + cluster.retried_requests
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
        deadline = time.monotonic() + 60
        while not any(load.running for load in cluster.router.loads.values()):
            assert time.monotonic() < deadline, "the request did not start"
            time.sleep(0.01)
        victim = next(rid for rid, load in cluster.router.loads.items() if load.running)
        kill_replica(cluster, victim)
        response = future.result(timeout=300)
    assert response.status_code in (200, 503), response.text
    if response.status_code == 503:
        assert response.headers["retry-after"] == "1"
    assert cluster.failed_midstream + cluster.retried_requests == failed_before + 1
    deadline = time.monotonic() + 120
    while victim not in cluster.router.index.replica_ids:
        assert time.monotonic() < deadline, "the killed replica did not come back"
        time.sleep(0.2)
    assert all(load.in_flight == 0 for load in cluster.router.loads.values())


def test_tenants_through_replicas_never_hit_or_route_by_each_others_blocks(cluster: Any) -> None:
    """Two tenants (API keys) send the same prompt through the replicas: the second tenant
    computes it all (0 cached), its own repeat hits, and the operator-only routes stay closed
    to tenant keys (per-replica /metrics and the replicas' /kv_events included)."""
    keys = ApiKeys()
    keys.add("sk-a", "alpha")
    keys.add("sk-b", "beta")
    keys.add_admin("sk-op", "operator")
    server, thread, url = serve_in_thread(build_app(cluster, [MODEL], api_keys=keys))
    try:
        prompt = list(range(8000, 8200))

        def send(key: str) -> dict:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0}
            response = httpx.post(
                f"{url}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=120,
            )
            assert response.status_code == 200, response.text
            return response.json()

        assert cached(send("sk-a")) == 0
        time.sleep(0.3)
        assert cached(send("sk-b")) == 0
        assert cached(send("sk-a")) == 192

        def metrics(key: str) -> httpx.Response:
            auth = {"Authorization": f"Bearer {key}"}
            return httpx.get(f"{url}/metrics", headers=auth, timeout=30)

        tenant, operator = metrics("sk-a"), metrics("sk-op")
        assert tenant.status_code == 403
        assert operator.status_code == 200 and "prefixserve_replica_" in operator.text

        # The replicas' KV events carry every tenant's token ids: the operator's alone.
        cluster.collect_kv_events = True
        for key, status in (("sk-a", 403), ("sk-op", 200)):
            auth = {"Authorization": f"Bearer {key}"}
            events = httpx.get(f"{url}/kv_events", headers=auth, timeout=30)
            assert events.status_code == status, events.text
    finally:
        cluster.collect_kv_events = False
        server.should_exit = True
        thread.join(10)


def test_pins_are_refused_with_a_clear_error_under_replicas(cluster: Any) -> None:
    response = httpx.get(f"{cluster.url}/pins", timeout=30)
    assert response.status_code == 501 and "replicas" in response.json()["error"]["message"]


def test_the_cache_summary_and_reports_over_replicas(cluster: Any) -> None:
    """Each replica reports its requests; the summary merges both (counts summed, one tree node
    per replica, reports from both)."""
    prompts = [[9000 + 50 * i + j for j in range(40)] for i in range(4)]  # sent by no other test
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: complete(cluster.url, p, cache_report=True), prompts))
    assert {a["cache_report"]["reason"] for a in answers} == {"never_seen"}
    summary = httpx.get(f"{cluster.url}/v1/cache/summary", timeout=60).json()
    per = asyncio.run(cluster.get_metrics())["replicas"]
    assert summary["replicas"] == [0, 1]
    assert [node["hash"] for node in summary["tree"]["children"]] == ["replica-0", "replica-1"]
    total = sum(per[r]["cache_miss_never_seen"] for r in (0, 1))
    assert summary["miss_reasons"]["never_seen"] == total >= 4
    assert summary["pool"]["num_blocks"] == sum(per[r]["num_kv_blocks"] for r in (0, 1))
    ids = {r["request_id"] for r in summary["recent_reports"]}
    assert len(ids) >= 4 and {r["replica"] for r in summary["recent_reports"]} <= {0, 1}
