"""GET /metrics moves as requests run; POST /reset_prefix_cache forgets the cache; KV events.

All three are operator endpoints: the tests call them with the operator key.
"""

from __future__ import annotations

import threading
import uuid

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.server import KEY_ADMIN, MODEL_NAME

PROMPT_TAIL = (
    " and then the story goes on for a while longer, so that the prompt spans a few blocks "
    "of sixteen tokens each and a repeat of it can be served from the prefix cache."
)


def scrape(server) -> dict[str, float]:
    """Every sample of /metrics by name (+ labels), e.g. 'prefixserve_prompt_tokens_total'."""
    with server.http(KEY_ADMIN) as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_metrics_expose_the_required_families(server):
    samples = scrape(server)
    for name in (
        "prefixserve_prefix_cache_queries_total",
        "prefixserve_prefix_cache_hits_total",
        "prefixserve_prefix_cache_requests_total",
        "prefixserve_prompt_tokens_total",
        "prefixserve_generation_tokens_total",
        "prefixserve_num_preemptions_total",
        "prefixserve_kv_cache_usage_perc",
        "prefixserve_num_requests_running",
        "prefixserve_num_requests_waiting",
        "prefixserve_time_to_first_token_seconds_count",
        "prefixserve_inter_token_latency_seconds_count",
        "prefixserve_e2e_request_latency_seconds_count",
    ):
        assert name in samples, name


def test_metrics_move_with_a_request_and_its_cache_hit(server, client):
    server.wait_idle()
    prompt = f"Metrics {uuid.uuid4().hex}" + PROMPT_TAIL
    before = scrape(server)
    first = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    middle = scrape(server)
    second = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = scrape(server)
    n_prompt = first.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0

    assert delta(middle, before, "prefixserve_prompt_tokens_total") == n_prompt
    assert delta(middle, before, "prefixserve_generation_tokens_total") == 4
    assert delta(middle, before, "prefixserve_prefix_cache_queries_total") == n_prompt
    assert delta(middle, before, "prefixserve_prefix_cache_hits_total") == 0
    assert delta(middle, before, "prefixserve_prefix_cache_requests_total") == 1
    assert delta(middle, before, "prefixserve_time_to_first_token_seconds_count") == 1
    assert delta(middle, before, "prefixserve_inter_token_latency_seconds_count") == 3
    assert delta(middle, before, "prefixserve_e2e_request_latency_seconds_count") == 1
    assert delta(middle, before, "prefixserve_request_success_total{finished_reason=length}") == 1

    assert delta(after, middle, "prefixserve_prefix_cache_queries_total") == n_prompt
    assert delta(after, middle, "prefixserve_prefix_cache_hits_total") == cached
    assert delta(after, middle, "prefixserve_request_cached_prompt_tokens_total") == cached
    # Idle again: nothing running or waiting, no block in use.
    assert after["prefixserve_num_requests_running"] == 0
    assert after["prefixserve_num_requests_waiting"] == 0
    assert after["prefixserve_kv_cache_usage_perc"] == 0


def test_reset_prefix_cache_forgets_cached_prompts(server, client):
    server.wait_idle()
    prompt = f"Reset {uuid.uuid4().hex}" + PROMPT_TAIL

    def cached() -> int:
        response = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1)
        return response.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0
    with server.http(KEY_ADMIN) as http:
        response = http.post("/reset_prefix_cache")
    assert response.status_code == 200
    assert response.json() == {"success": True}
    assert cached() == 0


def test_reset_with_running_requests_needs_reset_running_requests(server, client):
    server.wait_idle()
    started = threading.Event()
    result = {}

    def stream() -> None:
        chunks = client.completions.create(
            model=MODEL_NAME,
            prompt=f"Running {uuid.uuid4().hex}" + PROMPT_TAIL,
            max_tokens=64,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        for chunk in chunks:
            started.set()
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        result["text"], result["finish"] = text, finish

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(120)
    with server.http(KEY_ADMIN) as http:
        refused = http.post("/reset_prefix_cache")
        forced = http.post("/reset_prefix_cache", json={"reset_running_requests": True})
    thread.join(300)
    assert refused.json() == {"success": False}
    assert forced.json() == {"success": True}
    # The preempted request was recomputed and still finished whole.
    assert result["finish"] == "length"
    assert result["text"]
    server.check_no_leaks()


def test_reset_accepts_the_flag_as_a_query_parameter(server):
    server.wait_idle()
    with server.http(KEY_ADMIN) as http:
        response = http.post("/reset_prefix_cache", params={"reset_running_requests": "true"})
    assert response.json() == {"success": True}


def test_kv_events_report_stored_blocks(server, client):
    with server.http(KEY_ADMIN) as http:
        http.get("/kv_events")  # drain what earlier tests left
        client.completions.create(
            model=MODEL_NAME, prompt=f"Events {uuid.uuid4().hex}" + PROMPT_TAIL, max_tokens=1
        )
        events = http.get("/kv_events").json()["events"]
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert stored
    assert all(isinstance(h, str) for e in stored for h in e["block_hashes"])
