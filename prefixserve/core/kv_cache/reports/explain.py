"""One request's cache report: what it hit, and why its first missed block missed.

The scheduler calls `CacheExplainer.explain` at a request's first scheduling, with the tokens it
got from the RAM pool and the disk tier; `LLMEngine.explain_prompt` calls `explain_prompt` for a
dry run (nothing scheduled, nothing counted). The checks for a missed block, in order: the disk
tier (a stat: live but not loaded -> `disk_load_skipped`, past its expiry -> `expired`), the
eviction ghosts (`evicted`), the same tenant's other namespaces (`salt_or_tenant`, `adapter`),
else `never_seen`.

Without tenants (a keyless server, the offline API) a cache salt is what keeps one client's
blocks from another's, so there other salts are never probed: `salt_or_tenant` needs a tenant.

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

    def loading_pays(self) -> bool:
        """Whether loading a block was measured faster than computing it."""


@dataclass(slots=True)
class _Shadow:
    """The fields a block hasher reads, for hashing a request's tokens under another
    namespace."""

    all_token_ids: list[int]
    lora_name: str | None
    lora_digest: str | None
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
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self.num_probes = 0
        # (request id, tenant, unix time, report) of the latest first schedulings, oldest first.
        self.recent: deque[tuple[str, str | None, float, CacheReport]] = deque(
            maxlen=RECENT_REPORTS
        )
        self._namespaces: OrderedDict[str | None, OrderedDict[Namespace, None]] = OrderedDict()

    # ------------------------------------------------------------------ entry points

    def explain(
        self, request: Request, ram_tokens: int, disk_tokens: int, waited: bool
    ) -> CacheReport:
        """The report of `request` at its first scheduling, counted in `counts`, its lookup in
        the recent window, and its namespace remembered for its tenant's later reports."""
        report = self._report(request, ram_tokens, disk_tokens, waited)
        self.counts[report.reason] += 1
        self.recent.append((request.request_id, request.tenant, self.recorder.clock(), report))
        self.recorder.on_lookup(report.prompt_tokens, ram_tokens + disk_tokens)
        self._remember(request)
        return report

    def explain_prompt(self, request: Request) -> CacheReport:
        """What `request` would hit now, without scheduling it or counting anything; a missed
        block that a cached sibling (same parent, same namespace) shares some tokens with gets
        `detail["differs_at_token"]`: the first prompt position where they part."""
        manager = self.manager
        _, ram_tokens = manager.get_computed_blocks(request)
        disk_tokens = 0
        if self.disk is not None and manager.enable_caching:
            disk_tokens = self._disk_run(request, ram_tokens)
        report = self._report(request, ram_tokens, disk_tokens, waited=False)
        if report.first_miss_block is not None and report.reason not in (
            "not_full_block",
            "last_token_rule",
        ):
            differs = self._differs_at(request, report.first_miss_block)
            if differs is not None:
                report.detail["differs_at_token"] = differs
        return report

    # ------------------------------------------------------------------ the reason

    def _report(
        self, request: Request, ram_tokens: int, disk_tokens: int, waited: bool
    ) -> CacheReport:
        bs = self.manager.block_size
        num_tokens = request.num_prompt_tokens
        hit_blocks = (ram_tokens + disk_tokens) // bs
        detail: dict[str, Any] = {}
        first_miss: int | None = hit_blocks
        if not self.manager.enable_caching or request.skip_reading_prefix_cache:
            reason, first_miss = "cache_disabled", None
        elif waited:
            reason = "in_flight_wait"
        elif hit_blocks >= num_tokens // bs:
            reason = "not_full_block"
        elif (
            hit_blocks == num_tokens // bs - 1
            and num_tokens % bs == 0
            and self._cached_before(request, hit_blocks)
        ):
            reason = "last_token_rule"  # cached, but never served: it holds the last token
        else:
            reason = self._why_missed(request, hit_blocks, detail)
        return CacheReport(
            block_size=bs,
            prompt_tokens=num_tokens,
            hit_blocks=hit_blocks,
            ram_tokens=ram_tokens,
            disk_tokens=disk_tokens,
            reason=reason,
            first_miss_block=first_miss,
            detail=detail,
        )

    def _cached_before(self, request: Request, index: int) -> bool:
        """Whether block `index` of the prompt was cached before this request: found in the
        pool, and not as the request's own block (allocate_slots caches a step's full blocks
        before the report is made)."""
        self.num_probes += 1
        lookup = self.manager.block_pool.cached_block_hash_to_block[0].get_one_block
        block = lookup(request.block_hashes[index])
        if block is None:
            return False
        own = self.manager.get_block_ids(request)[0]
        return index >= len(own) or own[index] != block.block_id

    def _why_missed(self, request: Request, index: int, detail: dict[str, Any]) -> str:
        block_hash = request.block_hashes[index]
        if self.disk is not None:
            self.num_probes += 1
            state = self.disk.block_state(block_hash)
            if state == "live" and not self.disk.loading_pays():
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
        return self._other_namespace(request, index) or "never_seen"

    def _other_namespace(self, request: Request, index: int) -> str | None:
        """`salt_or_tenant` / `adapter` when block `index` of this prompt is cached under
        another namespace its own tenant used; else None."""
        own = Namespace.of(request)
        known = self._namespaces.get(request.tenant)
        if not known:
            return None
        bs = self.manager.block_size
        tokens = request.all_token_ids[: (index + 1) * bs]
        lookup = self.manager.block_pool.cached_block_hash_to_block[0].get_one_block
        for namespace in list(known):
            if namespace == own:
                continue
            if request.tenant is None and namespace.cache_salt != own.cache_salt:
                continue  # without tenants a salt is what keeps one client from another
            shadow = _Shadow(
                tokens,
                namespace.lora_name,
                namespace.lora_digest,
                namespace.cache_salt,
                request.prompt_embeds,
            )
            self.num_probes += 1
            if lookup(self.block_hasher(shadow)[index]) is not None:
                return "salt_or_tenant" if namespace.cache_salt != own.cache_salt else "adapter"
        return None

    def _remember(self, request: Request) -> None:
        tenants = self._namespaces
        known = tenants.get(request.tenant)
        if known is None:
            known = tenants[request.tenant] = OrderedDict()
            if len(tenants) > MAX_TENANTS:
                tenants.popitem(last=False)
        else:
            tenants.move_to_end(request.tenant)
        known[Namespace.of(request)] = None
        known.move_to_end(Namespace.of(request))
        if len(known) > NAMESPACES_PER_TENANT:
            known.popitem(last=False)

    # ------------------------------------------------------------------ dry runs

    def _disk_run(self, request: Request, ram_tokens: int) -> int:
        """Tokens the disk tier would serve after a RAM hit of `ram_tokens` (a stat per block)."""
        assert self.disk is not None
        bs = self.manager.block_size
        first, last = ram_tokens // bs, (request.num_tokens - 1) // bs
        count = 0
        for block_hash in request.block_hashes[first:last]:
            if self.disk.block_state(block_hash) != "live":
                break
            count += 1
        return count * bs if self.disk.loading_pays() else 0

    def _differs_at(self, request: Request, index: int) -> int | None:
        """The first prompt position where block `index` parts from its closest cached sibling
        (a cached block with the same parent in the same namespace), or None."""
        parent = request.block_hashes[index - 1] if index else None
        own = Namespace.of(request)
        bs = self.manager.block_size
        wanted = request.all_token_ids[index * bs : (index + 1) * bs]
        recorder = self.recorder
        best = -1
        for block in self.manager.block_pool.blocks[1:]:
            block_id = block.block_id
            if block.block_hash is None or recorder.parent[block_id] != parent:
                continue
            if index == 0 and recorder.namespace[block_id] != own:
                continue
            same = _common_prefix(block.token_ids or [], wanted)
            if same < len(wanted):
                best = max(best, same)
        return None if best < 0 else index * bs + best


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
