"""The router: the index, a policy, and the load it has put on each replica.

Pure Python, no Ray: `client.py` feeds it replicas' registrations and event batches, asks it
where each request goes, and reports each request's first output and end. Each decision is
timed (`decision_seconds`), and the prefix-aware policy's view of a request (how many blocks the
chosen replica held) is returned with it, so the benchmark can count what routing expected.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefixserve.cluster.index import PrefixIndex, PromptView
from prefixserve.cluster.messages import RemoteInfo, ReplicaInfo
from prefixserve.cluster.policy import Candidate, ReplicaLoad, RouteInput, RoutingPolicy


class StoreBlocks(Protocol):
    def count_from(self, first: int) -> int:
        """How many of a prompt's blocks from block `first` on the shared store holds."""
        ...


# A prompt's blocks in the replicas' shared disk store (store_probe.py; set by client.py when
# every replica shares one store the router's host can see).
StoreProbe = Callable[[PromptView], StoreBlocks]


class RemoteProbe(Protocol):
    """A prompt's blocks on a shared tier across hosts (remote_probe.py; set by client.py when
    replicas use one): priced for the replicas that registered with that tier."""

    info: RemoteInfo

    def __call__(self, view: PromptView) -> StoreBlocks: ...

    def close(self) -> None:
        """Close its connections (the router stops)."""
        ...


@dataclass(slots=True)
class Probed:
    """A prompt's view and router keys, and its runs in the tiers the router prices (None where
    it has no such tier): what `Router.probe_tiers` computed off the caller's event loop."""

    view: PromptView
    keys: list[bytes]
    disk: StoreBlocks | None = None
    remote: StoreBlocks | None = None


@dataclass(slots=True)
class Route:
    """One routing decision, and what the router counted for it."""

    replica_id: int
    keys: list[bytes]
    num_prompt_tokens: int
    cached_blocks: int  # leading blocks the chosen replica held, per the index
    # The load it was counted in: settled there even if the replica restarted since (a new
    # process gets a new ReplicaLoad, which never saw this request).
    load: ReplicaLoad
    prefill_tokens: int
    started: bool = False  # its first output came
    done: bool = False  # it ended, and its load was taken back


class NoReplicaError(RuntimeError):
    """No replica is registered (all are down, or restarting)."""


class Router:
    def __init__(
        self,
        block_size: int,
        hash_algo: str,
        policy: RoutingPolicy,
        *,
        max_in_flight: int | None = None,
        index: PrefixIndex | None = None,
    ) -> None:
        self.index = index or PrefixIndex(block_size, hash_algo)
        self.policy = policy
        self.max_in_flight = max_in_flight
        self.loads: dict[int, ReplicaLoad] = {}
        self.decisions = 0
        self.decision_seconds = 0.0
        self.store_probe: StoreProbe | None = None
        self.store_lookups = 0
        self.remote_probe: RemoteProbe | None = None
        self.remote_lookups = 0
        self._remotes: dict[int, RemoteInfo | None] = {}  # each replica's shared tier

    # ------------------------------------------------------------------------ replicas
    def register(self, info: ReplicaInfo) -> None:
        """A replica (re)joined; a new epoch starts it empty in the index and the policy."""
        known = info.replica_id in self.index.replica_ids
        new_epoch = not known or self.index.epoch(info.replica_id) != info.epoch
        self.index.register(info)
        self.loads.setdefault(info.replica_id, ReplicaLoad())
        self._remotes[info.replica_id] = info.remote
        if new_epoch:
            self.policy.forget(info.replica_id)

    def remove(self, replica_id: int) -> None:
        """A replica went down: route nothing more to it until it registers again. Its load
        stays: requests sent to it are settled as they end (retried or failed, or run by the
        restarted process that Ray handed them to)."""
        self.index.unregister(replica_id)
        self.policy.forget(replica_id)

    # ------------------------------------------------------------------------ requests
    def route(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_digest: str | None = None,
        prompt_embeds: Any = None,
        cache_key: str | None = None,
        exclude: Collection[int] = (),
        num_prompt_tokens: int | None = None,
        probed: Probed | None = None,
    ) -> Route:
        """Pick a replica for a prompt and count it as sent there. Raises NoReplicaError.
        `probed`: this prompt's `probe_tiers`, made beforehand (off an event loop); without it
        the tiers are probed here."""
        started = time.perf_counter()
        ids = [rid for rid in self.index.replica_ids if rid not in exclude]
        if not ids:
            raise NoReplicaError("no engine replica is up to take the request")
        if probed is None:
            probed = self.probe_tiers(
                token_ids,
                cache_salt=cache_salt,
                lora_name=lora_name,
                lora_digest=lora_digest,
                prompt_embeds=prompt_embeds,
            )
        keys = probed.keys
        now = time.monotonic()
        held = self.index.match(keys, now)
        candidates = [Candidate(rid, self.loads[rid], held.get(rid, 0)) for rid in ids]
        if keys:
            self._price_tiers(probed, candidates)
        if self.max_in_flight is not None:
            below = [c for c in candidates if c.load.in_flight < self.max_in_flight]
            candidates = below or candidates
        num_tokens = len(token_ids) if num_prompt_tokens is None else num_prompt_tokens
        request = RouteInput(num_tokens, self.index.block_size, keys, cache_key)
        replica_id = self.policy.choose(request, candidates)
        self.policy.routed(request, replica_id)
        cached = held.get(replica_id, 0)
        self.index.insert_pending(replica_id, keys, now)
        load = self.loads[replica_id]
        prefill = max(1, num_tokens - cached * self.index.block_size)
        load.in_flight += 1
        load.queued_prefill_tokens += prefill
        self.decisions += 1
        self.decision_seconds += time.perf_counter() - started
        return Route(replica_id, keys, num_tokens, cached, load, prefill)

    @property
    def probes_tiers(self) -> bool:
        """Whether `probe_tiers` does any I/O (a shared disk store or a shared tier to price):
        else an async caller need not leave its event loop for it."""
        return self.store_probe is not None or self.remote_probe is not None

    def probe_tiers(
        self,
        token_ids: Sequence[int],
        *,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        lora_digest: str | None = None,
        prompt_embeds: Any = None,
    ) -> Probed:
        """The prompt's keys and its runs in the tiers the router prices: the shared disk
        store's stats, and the shared tier's one round trip (bounded by its timeout; asked only
        when a replica uses it). Hashing and I/O, and the lookup counters; no routing state
        changed: an async caller runs this in a worker thread and passes the result to
        `route`."""
        view = PromptView(list(token_ids), cache_salt, lora_name, lora_digest, prompt_embeds)
        probed = Probed(view, self.index.keys_of(view))
        if not probed.keys:
            return probed
        if self.store_probe is not None:
            probed.disk = self.store_probe(view)
            self.store_lookups += 1
        remote = self.remote_probe
        if remote is not None and remote.info in self._remotes.values():
            probed.remote = remote(view)
            self.remote_lookups += 1
        return probed

    def _price_tiers(self, probed: Probed, candidates: list[Candidate]) -> None:
        """Each candidate's `store_blocks`: the blocks past those it holds that it could load,
        contiguous, in the order its connector loads them: the shared disk store's run, then
        the shared tier's continuation of it (for the replicas that use that tier)."""
        disk, remote = probed.disk, probed.remote
        tier = None if self.remote_probe is None else self.remote_probe.info
        for c in candidates:
            first = c.cached_blocks
            on_disk = disk.count_from(first) if disk is not None else 0
            on_remote = 0
            if remote is not None and self._remotes[c.replica_id] == tier:
                on_remote = remote.count_from(first + on_disk)
            c.store_blocks = on_disk + on_remote

    def first_output(self, route: Route) -> None:
        """The request's prefill is done: its load becomes a running decode."""
        if route.started or route.done:
            return
        route.started = True
        route.load.queued_prefill_tokens -= route.prefill_tokens
        route.load.running += 1

    def finished(self, route: Route) -> None:
        """The request ended (finished, failed or aborted); idempotent."""
        if route.done:
            return
        route.done = True
        route.load.in_flight -= 1
        if route.started:
            route.load.running -= 1
        else:
            route.load.queued_prefill_tokens -= route.prefill_tokens
