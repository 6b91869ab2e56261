"""A router restart: a second server adopts the detached replicas a first one left running and
rebuilds its index from their snapshots; the replicas' shared disk store priced by the router;
the replicas' KV events at /kv_events."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from prefixserve.cluster.index import PromptView
from prefixserve.cluster.messages import RegistrationError
from prefixserve.cluster.ray_cluster import REPLICA_PREFIX, start_cluster
from prefixserve.entrypoints.api_server import build_app
from prefixserve.kv_store import KVStoreConfig
from tests.helpers.cluster import RAY_NAMESPACE, replica_config, start_ray
from tests.helpers.server import serve_in_thread

pytestmark = pytest.mark.timeout(600)
MODEL = "tiny"
NAMESPACE = RAY_NAMESPACE


@pytest.fixture
def ray_runtime() -> Any:
    """The tests' Ray runtime, which outlives each server started on it."""
    return start_ray()


def store_config(tiny_model: Path, store_dir: Path, **changes: Any) -> Any:
    config = replica_config(tiny_model, max_num_seqs=2)
    return config.__class__(
        **{
            **{f: getattr(config, f) for f in config.__dataclass_fields__},
            "kv_store": KVStoreConfig(dir=store_dir, capacity_bytes=64 << 20),
            **changes,
        }
    )


def serve(engine: Any) -> tuple[Any, Any, str]:
    return serve_in_thread(build_app(engine, [MODEL]))


def stop(server: Any, thread: Any, engine: Any) -> None:
    server.should_exit = True
    thread.join(10)
    engine.shutdown()


def complete(url: str, prompt: list[int], **extra: Any) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def kv_events(url: str) -> list[dict]:
    response = httpx.get(f"{url}/kv_events", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["events"]


def replica_names(ray: Any) -> set[str]:
    return {
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == NAMESPACE and entry["name"].startswith(REPLICA_PREFIX)
    }


def any_stored(events: list[dict]) -> bool:
    return any(e["type"] == "BlockStored" for e in events)


def wait_for(predicate: Any, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_restarted_router_adopts_the_replicas_and_rebuilds_its_index_from_snapshots(
    ray_runtime: Any, tiny_model: Path, tmp_path: Path
) -> None:
    ray = ray_runtime
    config = store_config(tiny_model, tmp_path / "store")
    prompt = list(range(100, 164))  # 4 full blocks of 16
    first = start_cluster(
        config,
        2,
        ray_namespace=NAMESPACE,
        detached=True,
        keep_replicas=True,
        collect_kv_events=True,
        seed=0,
    )
    server, thread, url = serve(first)
    try:
        complete(url, prompt)
        # /kv_events with replicas: each event names its replica; the prompt's blocks are there.
        events: list[dict] = []
        wait_for(lambda: events.extend(kv_events(url)) or any_stored(events))
        stored = [e for e in events if e["type"] == "BlockStored"]
        holder = stored[0]["replica"]
        assert holder in (0, 1)
        assert stored[0]["token_ids"][:16] == prompt[:16]
        # The shared store: the router counts the prompt's blocks there once a replica wrote
        # them, and a tenant's salt keys other files.
        probe = first.router.store_probe
        assert probe is not None
        wait_for(lambda: probe(PromptView(prompt)).count_from(0) == 4)
        assert probe(PromptView(prompt, cache_salt="other-tenant")).count_from(0) == 0
        assert probe(PromptView(list(range(500, 564)))).count_from(0) == 0
    finally:
        stop(server, thread, first)
    assert replica_names(ray) == {f"{REPLICA_PREFIX}0", f"{REPLICA_PREFIX}1"}  # kept

    second = start_cluster(config, 2, ray_namespace=NAMESPACE, detached=True, seed=0)
    server, thread, url = serve(second)
    try:
        # The first request waits for the snapshots, so it is routed by the warm caches.
        other = complete(url, list(range(300, 340)))
        assert other["usage"]["prompt_tokens"] == 40
        index = second.router.index
        keys = index.prompt_keys(prompt)
        assert index.match(keys, time.monotonic())[holder] == 4
        assert index.stats.snapshots >= 2
        before = ray.get(second.handles[holder].metrics.remote())["prompt_tokens"]
        again = complete(url, prompt)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
        after = ray.get(second.handles[holder].metrics.remote())["prompt_tokens"]
        assert after - before == 64  # routed to the replica that held it
    finally:
        stop(server, thread, second)
    wait_for(lambda: not replica_names(ray))  # a clean stop without keep_replicas stops them


def test_replicas_started_with_another_configuration_are_refused_or_replaced(
    ray_runtime: Any, tiny_model: Path, tmp_path: Path
) -> None:
    ray = ray_runtime
    config = replica_config(tiny_model)
    first = start_cluster(config, 1, ray_namespace=NAMESPACE, detached=True, keep_replicas=True)
    first.shutdown()
    other = store_config(tiny_model, tmp_path / "store", max_model_len=512)
    with pytest.raises(RegistrationError, match="another configuration.*--replace-replicas"):
        start_cluster(other, 1, ray_namespace=NAMESPACE, detached=True)
    replaced = start_cluster(
        other, 1, ray_namespace=NAMESPACE, detached=True, replace_replicas=True
    )
    try:
        assert replaced._infos[0].config_digest != ""
        assert replaced._infos[0].max_model_len == 512
    finally:
        replaced.shutdown()
    wait_for(lambda: not replica_names(ray))


def test_keep_replicas_needs_an_address_and_namespaces_are_checked(tiny_model: Path) -> None:
    config = replica_config(tiny_model)
    with pytest.raises(ValueError, match="--keep-replicas needs --ray-address"):
        start_cluster(config, 1, keep_replicas=True)
    with pytest.raises(ValueError, match="--ray-namespace"):
        start_cluster(config, 1, ray_namespace="bad namespace!")


def test_joining_a_cluster_sends_a_token_when_there_is_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefixserve.settings import use_ray_cluster_token

    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    use_ray_cluster_token()
    assert "RAY_AUTH_MODE" not in os.environ  # no token to send: Ray's default
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("t" * 64)
    use_ray_cluster_token()
    assert os.environ["RAY_AUTH_MODE"] == "token"  # what `ray start` left
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    use_ray_cluster_token()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"  # the operator's choice stands
