"""Stand-ins for the cluster tests: a replica's actor handle whose `generate` streams made-up
outputs (and may die like a killed actor), a ClusterEngine over such replicas, and the engine
config of a real replica over a model directory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from ray.exceptions import RayActorError

from prefixserve.cluster.client import ClusterEngine
from prefixserve.cluster.messages import ReplicaInfo
from prefixserve.cluster.policy import make_policy
from prefixserve.cluster.router import Router
from prefixserve.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixserve.engine.client import EngineRequest
from prefixserve.outputs import CompletionOutput, RequestOutput
from tests.helpers.asgi import FakeTokenizer

BS = 16
# The namespace of the tests' Ray runtime, where detached replicas are named.
RAY_NAMESPACE = "prefixserve-test-cluster"


def start_ray() -> Any:
    """Ray, started here once for the cluster tests (start_cluster joins a running runtime rather
    than starting its own): a start and a shutdown cost seconds. tests/cluster/conftest.py shuts
    it down after the last test of tests/cluster/, so that its idle processes (a few per cent of a
    core) do not stay for the rest of the session. Its CPUs are Ray's bookkeeping only: enough
    for the largest set of replicas the tests hold at once."""
    import ray

    if not ray.is_initialized():
        ray.init(
            num_cpus=4,
            include_dashboard=False,
            object_store_memory=128 << 20,
            log_to_driver=False,
            namespace=RAY_NAMESPACE,
        )
    return ray


class Remote:
    """An actor method as a Ray handle offers it: `.options(...).remote(*args)`."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def options(self, **_: Any) -> Remote:
        return self

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


class FakeReplica:
    """A replica's actor handle: `generate` accepts, streams `num_outputs` cumulative outputs
    (token ids `token_base`, `token_base + 1`, ...); the last is finished unless it is `dying`:
    then it dies (RayActorError) once `kill` is set."""

    def __init__(self, replica_id: int, token_base: int, *, dying: bool, num_outputs: int) -> None:
        self.info = Remote(lambda: ReplicaInfo(replica_id, 1, BS, "sha256", "s", 100, 4096, None))
        self.generate = Remote(self._generate)
        self.abort = Remote(lambda request_id: None)
        self.token_base = token_base
        self.dying = dying
        self.num_outputs = num_outputs
        self.streamed = asyncio.Event()  # a dying one's outputs were all taken by the client
        self.kill = asyncio.Event()
        self.calls = 0

    async def _generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        request_id = request.request_id
        self.calls += 1
        yield ready(None)  # accepted
        for n in range(1, self.num_outputs + 1):
            finished = not self.dying and n == self.num_outputs
            yield ready(self._output(request_id, n, finished))
        self.streamed.set()
        if self.dying:
            await self.kill.wait()
            raise RayActorError()

    def _output(self, request_id: str, n: int, finished: bool) -> RequestOutput:
        ids = [self.token_base + i for i in range(n)]
        completion = CompletionOutput(0, "x" * n, ids, finish_reason="length" if finished else None)
        return RequestOutput(request_id, None, [], None, [completion], finished=finished)


async def ready(value: Any) -> Any:
    return value


def cluster_of(monkeypatch: pytest.MonkeyPatch, *replicas: FakeReplica) -> ClusterEngine:
    """A ClusterEngine over stand-in replicas, round robin from replica 0, with no event feeds."""
    monkeypatch.setattr("ray.get", lambda refs: list(refs))
    model = SimpleNamespace(tokenizer=FakeTokenizer(), config=SimpleNamespace(torch_dtype=None))
    config = SimpleNamespace(enable_prompt_embeds=False)
    router = Router(BS, "sha256", make_policy("round_robin"))
    engine = ClusterEngine(replicas, model, config, router)  # type: ignore[arg-type]
    engine.start()
    monkeypatch.setattr(engine, "_ensure_feeds", lambda: None)
    return engine


def replica_config(model: Path, **scheduler: int) -> EngineConfig:
    return EngineConfig(
        model=str(model),
        dtype="float32",
        max_model_len=1024,
        cache=CacheConfig(num_kv_blocks=256),
        scheduler=SchedulerConfig(**scheduler) if scheduler else SchedulerConfig(),
    )
