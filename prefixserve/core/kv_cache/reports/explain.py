"""One request's cache report: what it hit, and why its first missed block missed.

The scheduler calls `CacheExplainer.explain` when it is about to admit a request for the first
time, after its lookups (RAM pool, then disk tier) and before its own allocation can evict
anything, then `commit` once it is admitted and its disk reads are done (a read that failed
turns into `evicted` on the disk tier): only committed reports are counted.
`LLMEngine.explain_prompt` calls `explain_prompt` for a dry run (nothing scheduled, nothing
counted). The checks for a missed block, in order: a fault of the shared tier on this
request's own lookup or read (`tier_fault`), the disk
tier (a stat: live but not loaded -> `disk_load_skipped`, past its expiry -> `expired`), the
eviction ghosts (`evicted`), the same tenant's other namespaces (`salt_or_tenant`, `adapter`),
else `never_seen`.

Without tenants (a keyless server, the offline API) a cache salt is what keeps one client's
blocks from another's, so there other salts are never probed (`salt_or_tenant` needs a tenant)
and each salt's namespaces are remembered apart.

Nothing here looks at another tenant's data: the probes are the request's own hashes (which
chain its tenant's salt) and hashes of its own tokens under namespaces its own tenant used, so a
prefix only another tenant holds reads exactly as one never seen, with the same probes made
(`num_probes` counts them, for the tests that check this).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from prefixserve.core.kv_cache.reports.recorder import BlockRecorder, Namespace
from prefixserve.core.kv_cache.reports.report import REASONS, CacheReport
from prefixserve.core.kv_cache.tier_hit import TierHit

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
    from prefixserve.core.request import Request

RECENT_REPORTS = 50  # the reports the operators' summary shows
NAMESPACES_PER_TENANT = 8  # the other namespaces of a tenant checked for a missed prefix
MAX_TENANTS = 4096  # tenants whose namespaces are remembered (least recently seen forgotten)


class DiskProbe(Protocol):
    """The disk tier's stat-only side (`kv_store/connector.py` `KVStoreConnector`)."""

    def block_state(self, block_hash: bytes) -> str | None:
        """ "live", "expired", or None (no file)."""

    def loading_pays(self, tier: str | None = None) -> bool:
        """Whether loading a block from `tier` ("disk", "remote"; None: any tier) was measured
        faster than computing it."""

    @property
    def shares_tier(self) -> bool:
        """Whether a tier shared across hosts is below the disk (or alone)."""

    def held(self, request: Any, num_computed_tokens: int) -> TierHit:
        """Tokens after a RAM hit the tiers below hold, contiguous (what a load would read)."""


@dataclass(slots=True)
class _Shadow:
    """The fields a block hasher reads, for hashing a request's tokens under another
    namespace."""

    all_token_ids: list[int]
    lora_name: str | None
    lora_digest: Any
    cache_salt: str | None
    prompt_embeds: Any
    block_hashes: list[bytes] = field(default_factory=list)


class CacheExplainer:
    """Cache reports over one KV-cache manager (see the module docstring)."""

    def __init__(
        self,
        manager: KVCacheManager,
        recorder: BlockRecorder,
        block_hasher: Callable[[Any], list[bytes]],
        disk: DiskProbe | None = None,
    ) -> None:
        self.manager = manager
        self.recorder = recorder
        self.block_hasher = block_hasher
        self.disk = disk
        # Reports count the shared tier's tokens apart when the engine has one.
        self.shares_tier = disk is not None and disk.shares_tier
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.num_probes = 0
        # (request id, tenant, unix time, report) of the latest first schedulings, oldest first.
        self.recent: deque[tuple[str, str | None, float, CacheReport]] = deque(
            maxlen=RECENT_REPORTS
        )
        self._namespaces: OrderedDict[Any, OrderedDict[Namespace, None]] = OrderedDict()

    # ------------------------------------------------------------------ entry points

    def explain(self, request: Request, ram_tokens: int, below: TierHit) -> CacheReport:
        """The report of `request` about to be admitted with this hit: `ram_tokens` from the
        pool, `below` found in the tiers under it (nothing counted yet)."""
        waited = request.cache.hit_when_waited is not None and (
            ram_tokens + below.tokens > request.cache.hit_when_waited
        )
        return self._report(request, ram_tokens, below, waited)

    def commit(self, request: Request, report: CacheReport, loaded: TierHit) -> CacheReport:
        """`request` was admitted with `report` and read `loaded` from the tiers below RAM: the
        final report, counted (unless the request is a later sample of a prompt), its lookup in
        the recent window, its namespace remembered for its tenant's later reports. Fewer tokens
        read than found means a block vanished or was damaged between the lookup and the read:
        the first block not read is `evicted` from the tier it was found in (`detail.tier`), or
        a `tier_fault` when the shared tier's fault lost it."""
        found_on_disk, found = report.disk_tokens, report.disk_tokens + (report.remote_tokens or 0)
        report.disk_tokens = loaded.disk_tokens
        if report.remote_tokens is not None:
            report.remote_tokens = loaded.remote_tokens
        if loaded.tokens < found:
            report.hit_blocks = report.cached_tokens // report.block_size
            report.first_miss_block = report.hit_blocks
            report.reason, report.detail = _lost_read(loaded, found_on_disk)
        if request.cache.counted_in_reports:
            self.counts[report.reason] += 1
            self.recent.append((request.request_id, request.tenant, self.recorder.clock(), report))
            self.recorder.on_lookup(report.prompt_tokens, report.cached_tokens)
        self._remember(request)
        return report

    def explain_prompt(self, request: Request) -> CacheReport:
        """What `request` would hit now, without scheduling it or counting anything; a missed
        block that a cached sibling (same parent, same namespace) shares some tokens with gets
        `detail["differs_at_token"]`: the first prompt position where they part."""
        _, ram_tokens = self.manager.get_computed_blocks(request)
        below = TierHit()
        if self.disk is not None and self.manager.enable_caching and self.disk.loading_pays():
            below = self.disk.held(request, ram_tokens)
        report = self._report(request, ram_tokens, below, waited=False)
        if report.first_miss_block is not None and report.reason != "not_full_block":
            differs = self._differs_at(request, report.first_miss_block)
            if differs is not None:
                report.detail["differs_at_token"] = differs
        return report

    # ------------------------------------------------------------------ the reason

    def _report(
        self, request: Request, ram_tokens: int, below: TierHit, waited: bool
    ) -> CacheReport:
        bs = self.manager.block_size
        num_tokens = request.num_prompt_tokens
        hit_blocks = (ram_tokens + below.tokens) // bs
        detail: dict[str, Any] = {}
        first_miss: int | None = hit_blocks
        if not self.manager.enable_caching or request.skip_reading_prefix_cache:
            reason, first_miss = "cache_disabled", None
        elif waited:
            reason = "in_flight_wait"
        elif hit_blocks >= num_tokens // bs:
            reason = "not_full_block"
        elif hit_blocks == num_tokens // bs - 1 and num_tokens % bs == 0:
            # The block of the last token is never served, cached or not; say which.
            reason = "last_token_rule"
            detail["cached"] = self._cached(request, hit_blocks)
        elif below.remote_fault is not None:
            reason = "tier_fault"
            detail.update(tier="remote", fault=below.remote_fault)
        else:
            reason = self._why_missed(request, hit_blocks, detail)
        return CacheReport(
            block_size=bs,
            prompt_tokens=num_tokens,
            hit_blocks=hit_blocks,
            ram_tokens=ram_tokens,
            disk_tokens=below.disk_tokens,
            remote_tokens=below.remote_tokens if self.shares_tier else None,
            reason=reason,
            first_miss_block=first_miss,
            detail=detail,
        )

    def _cached(self, request: Request, index: int, block_hash: bytes | None = None) -> bool:
        """Whether block `index` of the prompt (under `block_hash`, else its own) is in the
        pool, token ids checked (a hash collision is not a hit)."""
        self.num_probes += 1
        bs = self.manager.block_size
        tokens = request.all_token_ids[index * bs : (index + 1) * bs]
        if block_hash is None:
            block_hash = request.block_hashes[index]
        return self.manager.block_pool.get_cached_block(block_hash, 0, tokens) is not None

    def _why_missed(self, request: Request, index: int, detail: dict[str, Any]) -> str:
        block_hash = request.block_hashes[index]
        if self.disk is not None:
            self.num_probes += 1
            state = self.disk.block_state(block_hash)
            if state == "live" and not self.disk.loading_pays("disk"):
                return "disk_load_skipped"
            if state == "expired":
                return "expired"
        self.num_probes += 1
        ghost = self.recorder.ghosts.get(block_hash)
        if ghost is not None:
            when, cause = ghost
            detail["ago_s"] = round(max(0.0, self.recorder.clock() - when), 3)
            detail["policy"] = cause
            if request.cache_retention == "in_memory":
                detail["retention"] = "in_memory"
            return "evicted"
        other = self._other_namespace(request, index)
        if other is not None:
            return other
        if self.disk is not None:
            self.num_probes += 1
            kv_dtype = self.disk.other_kv_dtype(block_hash)
            if kv_dtype is not None:
                detail["kv_dtype"] = kv_dtype
                return "other_kv_dtype"
        return "never_seen"

    def _other_namespace(self, request: Request, index: int) -> str | None:
        """`salt_or_tenant` / `adapter` when block `index` of this prompt is cached under
        another namespace its own tenant (without tenants: its own salt) used; else None."""
        own = Namespace.of(request)
        known = self._namespaces.get(_owner(request))
        if not known:
            return None
        bs = self.manager.block_size
        tokens = request.all_token_ids[: (index + 1) * bs]
        for namespace in list(known):
            if namespace == own:
                continue
            shadow = _Shadow(
                tokens,
                namespace.lora_name,
                namespace.lora_digest,
                namespace.cache_salt,
                request.prompt_embeds,
            )
            if self._cached(request, index, self.block_hasher(shadow)[index]):
                return "salt_or_tenant" if namespace.cache_salt != own.cache_salt else "adapter"
        return None

    def _remember(self, request: Request) -> None:
        owners = self._namespaces
        owner = _owner(request)
        known = owners.get(owner)
        if known is None:
            known = owners[owner] = OrderedDict()
            if len(owners) > MAX_TENANTS:
                owners.popitem(last=False)
        else:
            owners.move_to_end(owner)
        namespace = Namespace.of(request)
        known[namespace] = None
        known.move_to_end(namespace)
        if len(known) > NAMESPACES_PER_TENANT:
            known.popitem(last=False)

    # ------------------------------------------------------------------ dry runs

    def _differs_at(self, request: Request, index: int) -> int | None:
        """The first prompt position where block `index` parts from its closest cached sibling
        (a cached block with the same parent in the same namespace), or None."""
        parent = request.block_hashes[index - 1] if index else None
        own = Namespace.of(request)
        bs = self.manager.block_size
        wanted = request.all_token_ids[index * bs : (index + 1) * bs]
        recorder = self.recorder
        best = -1
        for _, blocks in self.manager.block_pool.cached_block_hash_to_block[0].items():
            block = blocks[0]
            block_id = block.block_id
            if recorder.parent[block_id] != parent:
                continue
            if index == 0 and recorder.namespace[block_id] != own:
                continue
            same = _common_prefix(block.token_ids or [], wanted)
            if same < len(wanted):
                best = max(best, same)
        return None if best < 0 else index * bs + best


def _lost_read(loaded: TierHit, found_on_disk: int) -> tuple[str, dict[str, Any]]:
    """The reason and detail of a run found below RAM that read only `loaded`: the shared
    tier's fault, else `evicted` from the tier the lookup found the first unread block in (the
    disk's run of `found_on_disk` tokens comes first, then the shared tier's)."""
    if loaded.remote_fault is not None:
        return "tier_fault", {"tier": "remote", "fault": loaded.remote_fault}
    return "evicted", {"tier": "disk" if loaded.tokens < found_on_disk else "remote"}


def _owner(request: Request) -> Any:
    """Whose namespaces a request's report may probe: its tenant; without tenants, its salt
    (a keyless client's own namespace)."""
    return request.tenant if request.tenant is not None else ("open", request.cache_salt)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
