"""One engine replica: an LLMEngine on its own step thread, in its own process (a Ray actor).

`ray_cluster.py` wraps this class with `ray.remote`; it needs no Ray itself, so tests may drive
it in-process. Every method is called by the router's process only (operator-internal traffic:
tenants reach a replica through the server in front, never directly).

- `generate` streams a request's outputs (Ray streams an async generator item by item).
- `events(from_seq)` streams this replica's KV-event batches from `from_seq` on, as they are
  made (a drain task takes the engine's events every `event_interval_s`); a subscriber that
  fell behind the ring gets a `Snapshot` in the stream, then the batches after it.
- `replay(from_seq)` and `snapshot()` answer a router that found a gap.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import prefixserve.settings as settings
from prefixserve.cluster.event_log import DEFAULT_RING_BATCHES, EventLog
from prefixserve.cluster.messages import (
    EventBatch,
    Heartbeat,
    RemoteInfo,
    ReplicaInfo,
    Snapshot,
    StoreInfo,
    seed_fingerprint,
)
from prefixserve.config import EngineConfig
from prefixserve.engine.client import EngineRequest
from prefixserve.outputs import RequestOutput

DEFAULT_EVENT_INTERVAL_S = 0.02
HEARTBEAT_S = 1.0


def config_digest(config: EngineConfig, threads: int | None) -> str:
    """A digest of what a replica was started with (a reattaching router compares them)."""
    return hashlib.sha256(repr((config, threads)).encode()).hexdigest()[:16]


def store_info(connector: Any) -> StoreInfo | None:
    """The replica's disk store, or None without one (no tier, or the shared tier alone)."""
    if connector is None or connector.store is None:
        return None
    store = connector.store
    key_file = None if store.tier_key is None else store.tier_key.path
    return StoreInfo(str(store.root), store.namespace, key_file)


def remote_info(connector: Any) -> RemoteInfo | None:
    """The replica's shared tier, or None without one."""
    remote = None if connector is None else connector.remote
    if remote is None:
        return None
    return RemoteInfo(remote.url, remote.namespace, remote.password_file, remote.tier_key.path)


class EngineReplica:
    def __init__(
        self,
        replica_id: int,
        config: EngineConfig,
        *,
        threads: int | None = None,
        ring_batches: int = DEFAULT_RING_BATCHES,
        event_interval_s: float = DEFAULT_EVENT_INTERVAL_S,
    ) -> None:
        import torch

        from prefixserve.engine.async_llm import AsyncLLMEngine
        from prefixserve.engine.llm_engine import LLMEngine

        if threads is not None:
            torch.set_num_threads(threads)
        self.replica_id = replica_id
        self.epoch = time.time_ns()  # a restarted process registers a newer epoch
        engine = LLMEngine(config)
        self.engine = AsyncLLMEngine(engine, collect_kv_events=True, log_stats_interval_s=None)
        self.engine.start()
        self.log = EventLog(replica_id, self.epoch, ring_batches)
        self.event_interval_s = event_interval_s
        self._drain: asyncio.Task[None] | None = None
        self._new_batch: asyncio.Condition | None = None
        self._fingerprint = seed_fingerprint(engine.none_hash)
        self._config_digest = config_digest(config, threads)
        self._cache_config = config.cache
        self._store = store_info(engine.kv_connector)  # fixed once the engine is built
        self._remote = remote_info(engine.kv_connector)

    # --------------------------------------------------------------------- registration
    async def info(self) -> ReplicaInfo:
        self._start_drain()
        return ReplicaInfo(
            replica_id=self.replica_id,
            epoch=self.epoch,
            block_size=self._cache_config.block_size,
            hash_algo=self._cache_config.prefix_caching_hash_algo,
            seed_fingerprint=self._fingerprint,
            num_kv_blocks=self.engine.num_kv_blocks,
            max_model_len=self.engine.max_model_len,
            store=self._store,
            config_digest=self._config_digest,
            remote=self._remote,
        )

    def pid(self) -> int:
        return os.getpid()

    def hash_seed(self) -> str | None:
        """The PYTHONHASHSEED this process was started with: a router that reattaches gives it
        to the replicas it adds, so their hash chains match (operator-internal, like all)."""
        return settings.python_hash_seed()

    # ------------------------------------------------------------------------- requests
    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """None once the engine took the request (its ValueError is raised before), then its
        cumulative outputs until it ends. Their prompt ids are left out (the caller has them)."""
        self._start_drain()
        stream = await self.engine.add_request(request)
        yield None
        async for output in stream:
            output.prompt_token_ids = []
            yield output

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    # --------------------------------------------------------------------------- events
    async def events(self, from_seq: int) -> AsyncIterator[EventBatch | Snapshot | Heartbeat]:
        """Batches from `from_seq` on, as they come; a Snapshot first when the ring no longer
        holds `from_seq`; a Heartbeat after each idle second."""
        self._start_drain()
        assert self._new_batch is not None
        seq = from_seq
        while True:
            batches = self.log.replay(seq)
            if batches is None:
                snapshot = self.log.snapshot()
                seq = snapshot.next_seq
                yield snapshot
                continue
            for batch in batches:
                yield batch
                seq = batch.seq + 1
            try:
                async with self._new_batch:
                    await asyncio.wait_for(
                        self._new_batch.wait_for(lambda s=seq: self.log.next_seq > s), HEARTBEAT_S
                    )
            except TimeoutError:
                yield Heartbeat(self.replica_id, self.epoch, self.log.next_seq)

    def replay(self, from_seq: int) -> list[EventBatch] | None:
        return self.log.replay(from_seq)

    def snapshot(self) -> Snapshot:
        return self.log.snapshot()

    # ------------------------------------------------------------------------ operator
    async def metrics(self) -> dict[str, Any]:
        return await self.engine.get_metrics()

    async def cache_summary(self, include_text: bool = False) -> dict[str, Any]:
        return await self.engine.cache_summary(include_text)

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, ram_only: bool = False
    ) -> bool:
        return await self.engine.reset_prefix_cache(reset_running_requests, ram_only)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        await self.engine.load_lora_adapter(name, path)

    async def unload_lora_adapter(self, name: str) -> None:
        await self.engine.unload_lora_adapter(name)

    async def check_no_leaks(self) -> None:
        await self.engine.check_no_leaks()

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ------------------------------------------------------------------------ internals
    def _start_drain(self) -> None:
        if self._drain is None:
            self._new_batch = asyncio.Condition()
            self._drain = asyncio.get_running_loop().create_task(self._drain_events())

    async def _drain_events(self) -> None:
        assert self._new_batch is not None
        while self.engine.is_running:
            try:
                events = await self.engine.take_kv_events()
            except Exception:  # the engine died: the router sees the replica fail
                return
            if self.log.append(events) is not None:
                async with self._new_batch:
                    self._new_batch.notify_all()
            await asyncio.sleep(self.event_interval_s)
