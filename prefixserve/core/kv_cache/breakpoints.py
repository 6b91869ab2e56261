"""Cache breakpoints: prompt prefixes a client asked to keep for a while (Anthropic's
`cache_control` breakpoints, OpenAI's `prompt_cache_retention: "24h"`).

A held breakpoint takes one reference on each cached block of its prefix, as a pin does
(`pins.py`), so the pool's LRU never evicts it, and drops them when its time-to-live runs out
after its last use: each request that reads the prefix, or asks for the same breakpoint again,
pushes the expiry to `now + ttl` (never earlier than it was).

Bounds, and what happens at them (docs/anthropic.md, "Breakpoints"):
- each tenant holds at most `tenant_budget_blocks` distinct blocks, and all tenants together at
  most `capacity_blocks`;
- a breakpoint that does not fit ages out the *same tenant's* held breakpoints, soonest expiry
  first, until it fits; another tenant's breakpoints are never released to make room;
- one that would not fit even then (larger than the budget alone, or the capacity is held by
  other tenants), or whose blocks would leave a queued request unable to ever get its KV blocks,
  is refused: the request runs as usual and its blocks stay ordinary cached blocks;
- the refusal is decided first: a refused breakpoint releases none of its tenant's held ones.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

from prefixserve.core.kv_cache.block import KVCacheBlock
from prefixserve.core.kv_cache.block_pool import BlockPool
from prefixserve.core.kv_cache.breakpoint_spec import HoldStatus

if TYPE_CHECKING:
    from prefixserve.core.request import Request


def breakpoint_report(request: Request) -> dict[str, Any]:
    """The cache report's part on breakpoints: per breakpoint its tokens (full blocks), ttl,
    whether the request read it from the cache, and what became of it (`HoldStatus`, None until
    the prompt is computed); `miss_at_breakpoint`: the index of the first one not read."""
    block_size = request.cache.report.block_size if request.cache.report is not None else 1
    cached = max(0, request.num_cached_tokens)
    statuses = request.cache.breakpoint_statuses or [None] * len(request.cache_breakpoints)
    entries = []
    miss_at = None
    for index, (bp, status) in enumerate(zip(request.cache_breakpoints, statuses, strict=True)):
        tokens = bp.num_tokens - bp.num_tokens % block_size
        read = 0 < tokens <= cached
        if not read and miss_at is None:
            miss_at = index
        entries.append(
            {
                "index": index,
                "tokens": tokens,
                "ttl_s": bp.ttl_s,
                "read": read,
                "status": None if status is None else status.value,
            }
        )
    return {"breakpoints": entries, "miss_at_breakpoint": miss_at}


def _subtract(holders: Counter[int], blocks: list[KVCacheBlock]) -> None:
    """Take one hold of each of `blocks` off `holders` (block id -> holds), dropping zeros."""
    for block in blocks:
        holders[block.block_id] -= 1
        if holders[block.block_id] <= 0:
            del holders[block.block_id]


class _Hold:
    __slots__ = ("tenant", "blocks", "num_tokens", "ttl_s", "expires_at")

    def __init__(
        self,
        tenant: Hashable,
        blocks: list[KVCacheBlock],
        num_tokens: int,
        ttl_s: float,
        now: float,
    ) -> None:
        self.tenant = tenant
        self.blocks = blocks
        self.num_tokens = num_tokens
        self.ttl_s = ttl_s
        self.expires_at = now + ttl_s


class HeldBreakpoints:
    """Held breakpoints over one block pool, keyed by (tenant, hash of the prefix's last block).

    The block hash chains the whole prefix (and the tenant's cache salt), so one key is one
    prefix of one tenant. `clock` is injectable for tests (seconds, monotonic)."""

    def __init__(
        self,
        block_pool: BlockPool,
        capacity_blocks: int,
        tenant_budget_blocks: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (
            ("capacity_blocks", capacity_blocks),
            ("tenant_budget_blocks", tenant_budget_blocks),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self.block_pool = block_pool
        self.capacity_blocks = capacity_blocks
        self.tenant_budget_blocks = tenant_budget_blocks
        self.clock = clock
        self._holds: dict[tuple[Hashable, Hashable], _Hold] = {}
        self._by_hash: dict[Hashable, list[tuple[Hashable, Hashable]]] = {}
        self._holders: Counter[int] = Counter()  # block id -> holds holding it
        self._tenant_holders: dict[Hashable, Counter[int]] = {}
        self._next_expiry = float("inf")

    def __len__(self) -> int:
        return len(self._holds)

    @property
    def num_blocks(self) -> int:
        """Distinct blocks held by breakpoints."""
        return len(self._holders)

    def holders(self) -> Counter[int]:
        """Block id -> number of breakpoints holding it (a copy)."""
        return Counter(self._holders)

    def tenant_blocks(self, tenant: Hashable) -> int:
        """Distinct blocks held by `tenant`'s breakpoints."""
        return len(self._tenant_holders.get(tenant, ()))

    # ------------------------------------------------------------------ holding
    def hold(
        self,
        tenant: Hashable,
        key: Hashable,
        blocks: Sequence[KVCacheBlock],
        num_tokens: int,
        ttl_s: float,
        fits_pool: Callable[[int], bool] = lambda _: True,
    ) -> HoldStatus:
        """Hold `blocks` (the prefix's cached blocks, every group) for `ttl_s` after now, under
        (tenant, key). `fits_pool(n)` says whether n more held blocks (the net change, after the
        tenant's own holds aged out to make room; 0 or less when those free as many) leave every
        queued request room; a hold that would not is refused. Both refusals are decided before
        anything is released."""
        now = self.clock()
        existing = self._holds.get((tenant, key))
        if existing is not None:
            existing.ttl_s = max(existing.ttl_s, ttl_s)
            existing.expires_at = max(existing.expires_at, now + ttl_s)
            return HoldStatus.REFRESHED
        blocks = [block for block in blocks if not block.is_null]
        if not blocks or any(block.block_hash is None for block in blocks):
            return HoldStatus.NOT_CACHED
        victims = self._victims_to_fit(tenant, blocks)
        if victims is None:
            return HoldStatus.REFUSED_BUDGET
        if not fits_pool(self._net_new_held(victims, blocks)):
            return HoldStatus.REFUSED_POOL
        for victim in victims:
            self._release(victim)
        self.block_pool.touch(blocks)
        hold = _Hold(tenant, blocks, num_tokens, ttl_s, now)
        self._holds[(tenant, key)] = hold
        self._by_hash.setdefault(key, []).append((tenant, key))
        self._count(hold, +1)
        self._next_expiry = min(self._next_expiry, hold.expires_at)
        return HoldStatus.HELD

    def _victims_to_fit(
        self, tenant: Hashable, blocks: list[KVCacheBlock]
    ) -> list[tuple[Hashable, Hashable]] | None:
        """The keys of `tenant`'s own holds, soonest expiry first, whose release lets `blocks`
        fit the tenant's budget and the shared capacity (empty when they fit already); None
        when even releasing all of them would not. Releases nothing: a breakpoint that will be
        refused costs its tenant none of its held ones."""
        own = Counter(self._tenant_holders.get(tenant, ()))
        overall = Counter(self._holders)
        candidates = sorted(
            (k for k, hold in self._holds.items() if hold.tenant == tenant),
            key=lambda k: self._holds[k].expires_at,
        )
        victims: list[tuple[Hashable, Hashable]] = []
        while not self._fits(blocks, own, overall):
            if len(victims) == len(candidates):
                return None
            victim = candidates[len(victims)]
            victims.append(victim)
            _subtract(own, self._holds[victim].blocks)
            _subtract(overall, self._holds[victim].blocks)
        return victims

    def _fits(self, blocks: list[KVCacheBlock], own: Counter[int], overall: Counter[int]) -> bool:
        """Whether `blocks` fit the tenant's budget and the shared capacity, with the tenant
        holding `own` and all tenants `overall` (block id -> holds)."""
        ids = {block.block_id for block in blocks}
        return (
            len(own) + len(ids - own.keys()) <= self.tenant_budget_blocks
            and len(overall) + len(ids - overall.keys()) <= self.capacity_blocks
        )

    def _net_new_held(
        self, victims: list[tuple[Hashable, Hashable]], blocks: list[KVCacheBlock]
    ) -> int:
        """How many more blocks stay held once `victims` are released and `blocks` held (less
        than 0 when the release frees more than the hold takes). A victim's block counts as
        freed only where nothing else references it (no pin, request or other hold), so the
        pool check never counts on room the release would not give."""
        victim_refs: Counter[int] = Counter()
        victim_blocks: dict[int, KVCacheBlock] = {}
        for victim in victims:
            for block in self._holds[victim].blocks:
                victim_refs[block.block_id] += 1
                victim_blocks[block.block_id] = block
        ids = {block.block_id for block in blocks}
        freed = sum(
            1
            for i, block in victim_blocks.items()
            if i not in ids and block.ref_cnt == victim_refs[i]
        )
        return len(ids - self._holders.keys()) - freed

    # ------------------------------------------------------------------ refreshing, expiring
    def refresh_read(self, block_hashes: Sequence[Hashable]) -> int:
        """A request read these leading blocks: every breakpoint ending at one of them was used,
        so its expiry moves to now + its own ttl. Returns how many were refreshed."""
        if not self._by_hash:
            return 0
        now = self.clock()
        refreshed = 0
        for block_hash in block_hashes:
            for hold_key in self._by_hash.get(block_hash, ()):
                hold = self._holds[hold_key]
                hold.expires_at = max(hold.expires_at, now + hold.ttl_s)
                refreshed += 1
        return refreshed

    def expire(self) -> int:
        """Release every breakpoint past its expiry; returns how many."""
        now = self.clock()
        if now < self._next_expiry:
            return 0
        expired = [k for k, hold in self._holds.items() if hold.expires_at <= now]
        for hold_key in expired:
            self._release(hold_key)
        self._next_expiry = min((h.expires_at for h in self._holds.values()), default=float("inf"))
        return len(expired)

    def clear(self) -> None:
        """Release every breakpoint (a cache reset)."""
        for hold_key in list(self._holds):
            self._release(hold_key)
        self._next_expiry = float("inf")

    def _release(self, hold_key: tuple[Hashable, Hashable]) -> None:
        hold = self._holds.pop(hold_key)
        keys = self._by_hash[hold_key[1]]
        keys.remove(hold_key)
        if not keys:
            del self._by_hash[hold_key[1]]
        self._count(hold, -1)
        self.block_pool.free_blocks(reversed(hold.blocks))

    def _count(self, hold: _Hold, sign: int) -> None:
        own = self._tenant_holders.setdefault(hold.tenant, Counter())
        for block in hold.blocks:
            for counter in (self._holders, own):
                counter[block.block_id] += sign
                if counter[block.block_id] <= 0:
                    del counter[block.block_id]
        if not own:
            del self._tenant_holders[hold.tenant]

    def describe(self) -> dict[str, dict[str, int]]:
        """tenant -> {"breakpoints", "blocks", "tokens"} (tenant None as "")."""
        out: dict[str, dict[str, int]] = {}
        for hold in self._holds.values():
            entry = out.setdefault(
                "" if hold.tenant is None else str(hold.tenant),
                {"breakpoints": 0, "blocks": 0, "tokens": 0},
            )
            entry["breakpoints"] += 1
            entry["tokens"] += hold.num_tokens
        for tenant, counter in self._tenant_holders.items():
            out["" if tenant is None else str(tenant)]["blocks"] = len(counter)
        return out
