"""Which replica gets a request: the prefix-aware cost, and the baselines it is measured against.

Every policy sees the same candidates: the replicas below their concurrency cap (all of them
when every one is at its cap: the request then queues in an engine), each with its load as the
router counts it and, for the prefix-aware policy, how many of the prompt's leading blocks it
holds (the index) or could load from the shared disk store.

- `prefix` (ours): cost = `MISS_WEIGHT` x tokens to compute there (the prompt minus the blocks
  it holds; a block in the shared store costs `STORE_COST` of computing it) + its load (prefill
  tokens routed and not yet computed, plus `DECODE_TOKENS` per running decode). Lowest cost
  wins; among equals the one holding most of the prompt (a prompt routed a moment ago costs its
  twin the same on either replica, but one copy of a prefix beats two), then a random one, or
  always the same one for the same `prompt_cache_key`.
- `round_robin`, `least_loaded`, `power_of_two` (two random candidates, the less loaded).
- `prefix_tree`: SGLang's approximate idea: remember the prompts routed to each replica (their
  block keys, LRU-bounded), send a prompt where the longest such prefix is when it covers at
  least half of it, else to the least loaded. No events: a guess from routing history alone.
"""

from __future__ import annotations

import collections
import hashlib
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass

# A running decode weighs as much load as this many queued prefill tokens.
DECODE_TOKENS = 16
# A prompt token to compute weighs this many queued tokens: computing a prefix a second time
# costs that replica the compute now and a second copy in the pools, which evicts other
# prefixes and makes later misses (W8 at weight 1: a hit rate well below one engine's, the load
# term spreading tenants over both replicas once queues grew; BENCHMARKS.md, "Replicas on Ray,
# routed by where the prefix is cached").
MISS_WEIGHT = 4
# A block in the shared store costs this fraction of computing it (a read instead of a forward).
STORE_COST = 0.25


@dataclass(slots=True)
class ReplicaLoad:
    """What the router has sent a replica and not yet seen finish."""

    in_flight: int = 0
    queued_prefill_tokens: int = 0  # tokens of routed requests before their first output
    running: int = 0  # requests past their first output

    @property
    def score(self) -> float:
        return self.queued_prefill_tokens + DECODE_TOKENS * self.running


@dataclass(slots=True)
class Candidate:
    replica_id: int
    load: ReplicaLoad
    cached_blocks: int = 0  # leading prompt blocks it holds (events, or pending)
    store_blocks: int = 0  # further leading blocks it could load from the shared store


@dataclass(slots=True)
class RouteInput:
    num_prompt_tokens: int
    block_size: int
    keys: list[bytes]  # the prompt's full blocks' router keys (tenant salt included)
    cache_key: str | None = None  # OpenAI's prompt_cache_key


class RoutingPolicy(ABC):
    name: str

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random()

    @abstractmethod
    def choose(self, request: RouteInput, candidates: list[Candidate]) -> int:
        """The replica id to route to (candidates are never empty)."""

    def routed(self, request: RouteInput, replica_id: int) -> None:  # noqa: B027 - optional hook
        """Told after each routing decision."""

    def forget(self, replica_id: int) -> None:  # noqa: B027 - optional hook
        """The replica restarted empty (or left)."""

    def _tie(self, request: RouteInput, tied: list[Candidate]) -> int:
        if len(tied) == 1:
            return tied[0].replica_id
        tied = sorted(tied, key=lambda c: c.replica_id)
        if request.cache_key is not None:
            digest = hashlib.sha256(request.cache_key.encode("utf-8", "surrogatepass")).digest()
            return tied[int.from_bytes(digest[:8], "little") % len(tied)].replica_id
        return self.rng.choice(tied).replica_id

    def _least_loaded(self, request: RouteInput, candidates: list[Candidate]) -> int:
        best = min(c.load.score for c in candidates)
        return self._tie(request, [c for c in candidates if c.load.score == best])


class PrefixAware(RoutingPolicy):
    name = "prefix"

    def choose(self, request: RouteInput, candidates: list[Candidate]) -> int:
        size = request.block_size
        costs = []
        for c in candidates:
            held = min(request.num_prompt_tokens, c.cached_blocks * size)
            stored = min(request.num_prompt_tokens - held, c.store_blocks * size)
            compute = request.num_prompt_tokens - held - stored
            costs.append(MISS_WEIGHT * (compute + STORE_COST * stored) + c.load.score)
        best = min(costs)
        tied = [c for c, cost in zip(candidates, costs, strict=True) if cost == best]
        # Equal cost: where more of the prompt is already (keeps one copy of a prefix).
        most = max(c.cached_blocks + c.store_blocks for c in tied)
        return self._tie(request, [c for c in tied if c.cached_blocks + c.store_blocks == most])


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, rng: random.Random | None = None) -> None:
        super().__init__(rng)
        self._next = 0

    def choose(self, request: RouteInput, candidates: list[Candidate]) -> int:
        ordered = sorted(c.replica_id for c in candidates)
        choice = ordered[self._next % len(ordered)]
        self._next += 1
        return choice


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def choose(self, request: RouteInput, candidates: list[Candidate]) -> int:
        return self._least_loaded(request, candidates)


class PowerOfTwo(RoutingPolicy):
    name = "power_of_two"

    def choose(self, request: RouteInput, candidates: list[Candidate]) -> int:
        if len(candidates) <= 2:
            return self._least_loaded(request, candidates)
        return self._least_loaded(request, self.rng.sample(candidates, 2))


class PrefixTree(RoutingPolicy):
    """Routing history per replica as an LRU set of block keys: the keys chain, so the set
    answers "longest routed prefix" by walking a prompt's keys."""

    name = "prefix_tree"
    MIN_MATCH = 0.5

    def __init__(self, rng: random.Random | None = None, max_keys: int = 1 << 16) -> None:
        super().__init__(rng)
        self.max_keys = max_keys
        self._seen: dict[int, collections.OrderedDict[bytes, None]] = {}

    def choose(self, request: RouteInput, candidates: list[Candidate]) -> int:
        if request.keys:
            lengths = {c.replica_id: self._matched(c.replica_id, request.keys) for c in candidates}
            best = max(lengths.values())
            if best / len(request.keys) >= self.MIN_MATCH:
                return self._least_loaded(
                    request, [c for c in candidates if lengths[c.replica_id] == best]
                )
        return self._least_loaded(request, candidates)

    def routed(self, request: RouteInput, replica_id: int) -> None:
        seen = self._seen.setdefault(replica_id, collections.OrderedDict())
        for key in request.keys:
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.max_keys:
            seen.popitem(last=False)

    def forget(self, replica_id: int) -> None:
        self._seen.pop(replica_id, None)

    def _matched(self, replica_id: int, keys: list[bytes]) -> int:
        seen = self._seen.get(replica_id)
        if not seen:
            return 0
        for i, key in enumerate(keys):
            if key not in seen:
                return i
        return len(keys)


POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (PrefixAware, RoundRobin, LeastLoaded, PowerOfTwo, PrefixTree)
}
DEFAULT_POLICY = PrefixAware.name


def make_policy(name: str, seed: int | None = None) -> RoutingPolicy:
    """The policy called `name`; ValueError naming the choices for another name."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown routing policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(random.Random(seed))
