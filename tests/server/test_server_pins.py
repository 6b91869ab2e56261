"""Pinned prefixes over HTTP: operator-only, made in one tenant's namespace (the other tenant never
hits them), listed, deleted, and bounded by the pinned capacity."""

from __future__ import annotations

import pytest

from tests.helpers.asgi import ADMIN_KEY, call, keys, make_app
from tests.helpers.server import KEY_ADMIN, KEY_ALPHA, KEY_BETA, LiveServer

SYSTEM = "You are a careful assistant for the harbour authority. " * 8


def _usage_cached(server: LiveServer, key: str, prompt: str) -> int:
    with server.http(key) as http:
        r = http.post(
            "/v1/completions",
            json={"model": "test-model", "prompt": prompt, "max_tokens": 1},
        )
        assert r.status_code == 200, r.text
        details = r.json()["usage"].get("prompt_tokens_details") or {}
        return details.get("cached_tokens", 0)


def test_only_an_operator_may_pin(server: LiveServer):
    for key, status in ((KEY_ALPHA, 403), (None, 401)):
        with server.http(key) as http:
            if key is None:
                http.headers.pop("Authorization", None)
            assert (
                http.post("/pins", json={"prompt": SYSTEM, "tenant": "alpha"}).status_code == status
            )
            assert http.get("/pins").status_code == status
            assert http.delete("/pins/x").status_code == status


def test_a_pinned_prefix_serves_its_tenant_and_only_its_tenant(server: LiveServer):
    with server.http(KEY_ADMIN) as http:
        r = http.post("/pins", json={"prompt": SYSTEM, "tenant": "alpha", "id": "harbour"})
        assert r.status_code == 200, r.text
        pinned = r.json()
        assert pinned["id"] == "harbour" and pinned["num_tokens"] > 0
        listing = http.get("/pins").json()
        assert listing["pins"]["harbour"]["num_tokens"] == pinned["num_tokens"]
        assert 0 < listing["pinned_blocks"] <= listing["capacity_blocks"]
    try:
        assert _usage_cached(server, KEY_ALPHA, SYSTEM + " Which berth?") >= pinned["num_tokens"]
        assert _usage_cached(server, KEY_BETA, SYSTEM + " Which berth?") == 0
    finally:
        with server.http(KEY_ADMIN) as http:
            assert http.delete("/pins/harbour").json() == {"id": "harbour", "deleted": True}
            assert http.delete("/pins/harbour").status_code == 404
            assert "harbour" not in http.get("/pins").json()["pins"]


def test_a_pin_names_a_known_tenant_and_one_prompt(server: LiveServer):
    with server.http(KEY_ADMIN) as http:
        for body, param in (
            ({"prompt": SYSTEM, "tenant": "nobody"}, "tenant"),
            ({"prompt": SYSTEM}, "tenant"),
            ({"tenant": "alpha"}, "prompt"),
            ({"prompt": "", "tenant": "alpha"}, "prompt"),
        ):
            r = http.post("/pins", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert (
            http.post("/pins", json={"prompt": SYSTEM, "tenant": "alpha", "x": 1}).status_code
            == 400
        )


def test_pins_past_the_capacity_are_refused(server: LiveServer):
    with server.http(KEY_ADMIN) as http:
        capacity = http.get("/pins").json()["capacity_blocks"]
        made = []
        try:
            for i in range(capacity + 1):
                r = http.post(
                    "/pins",
                    json={"prompt": f"{i} " + "tide tables and berths " * 40, "tenant": "alpha"},
                )
                if r.status_code != 200:
                    assert r.status_code == 400 and r.json()["error"]["code"] == "pin_capacity"
                    break
                made.append(r.json()["id"])
            else:
                raise AssertionError("the pinned capacity was never reached")
            assert http.get("/pins").json()["pinned_blocks"] <= capacity
        finally:
            for pin_id in made:
                http.delete(f"/pins/{pin_id}")


def test_a_pin_prompt_longer_than_the_context_is_a_400_and_pins_nothing(server: LiveServer):
    with server.http(KEY_ADMIN) as http:
        before = http.get("/pins").json()["pinned_blocks"]
        r = http.post("/pins", json={"prompt": "harbour " * 2000, "tenant": "alpha"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        r = http.post("/pins", json={"prompt": "x" * 200_000, "tenant": "alpha"})
        assert r.status_code in (400, 413), r.text  # refused before tokenizing
        assert http.get("/pins").json()["pinned_blocks"] == before


def test_a_pin_id_is_what_a_url_path_carries_so_every_pin_can_be_deleted(server: LiveServer):
    with server.http(KEY_ADMIN) as http:
        for bad in ("team/a", "a b", "a%2Fb", "é", "a?b", "a#b"):
            r = http.post("/pins", json={"prompt": SYSTEM, "tenant": "alpha", "id": bad})
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["param"] == "id"
        r = http.post("/pins", json={"prompt": SYSTEM, "tenant": "alpha", "id": "team.a~1_-x"})
        assert r.status_code == 200, r.text
        assert http.delete("/pins/team.a~1_-x").json() == {"id": "team.a~1_-x", "deleted": True}
        assert http.get("/pins").json()["pinned_blocks"] == 0


@pytest.mark.parametrize("retention", ["in_memory", "24h", None])
def test_a_pin_warms_its_prefix_with_the_retention_it_asks_for(retention):
    app, engine = make_app(keys())
    body = {"prompt": "a system prompt", "tenant": "tenant"}
    if retention is not None:
        body["prompt_cache_retention"] = retention
    call(app, "POST", "/pins", key=ADMIN_KEY, body=body)  # the fake engine refuses it: a 400
    [request] = engine.added
    assert request.cache_retention == retention


def test_a_pin_refuses_an_unknown_retention():
    app, engine = make_app(keys())
    body = {"prompt": "x", "tenant": "tenant", "prompt_cache_retention": "forever"}
    result = call(app, "POST", "/pins", key=ADMIN_KEY, body=body)
    assert result.status == 400 and not engine.added


def test_a_pin_made_for_a_tenant_is_that_tenants_in_the_summary_and_its_reports(
    server: LiveServer,
):
    import uuid

    prompt = f"[{uuid.uuid4().hex}] " + "Berth rules for the night shift. " * 12
    with server.http(KEY_ADMIN) as http:
        r = http.post("/pins", json={"prompt": prompt, "tenant": "beta", "id": "night"})
        assert r.status_code == 200, r.text
    try:
        with server.http(KEY_ADMIN) as http:
            summary = http.get("/v1/cache/summary").json()
        reports = [
            entry
            for entry in summary["recent_reports"]
            if entry["request_id"].startswith("night-warm")
        ]
        assert reports and all(entry["tenant"] == "beta" for entry in reports)
        owners = {row["tenant"] for row in summary["pool"]["by_tenant"]}
        assert "beta" in owners
        # Another salt of the same tenant now explains its miss with the pinned prefix: beta's.
        with server.http(KEY_BETA) as http:
            report = http.post(
                "/v1/completions",
                json={
                    "model": "test-model",
                    "prompt": prompt,
                    "max_tokens": 1,
                    "cache_salt": "other",
                    "cache_report": True,
                },
            ).json()["cache_report"]
        assert report["reason"] == "salt_or_tenant"
    finally:
        with server.http(KEY_ADMIN) as http:
            http.delete("/pins/night")
