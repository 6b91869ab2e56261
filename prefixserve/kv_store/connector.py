"""The engine's side of the tiers below the RAM pool: what to load at admission, what to save
after a step.

Pure Python (no torch): the scheduler and the engine call it, the runner moves the bytes
(`worker.py`). One KV-cache group of full attention only (models with sliding-window layers run
without the tiers; the engine says so at start-up). The tiers cascade RAM -> local disk (if on:
`DiskKVStore`) -> the tier shared by every host (if on: `remote/redis_tier.py` `RedisTier`);
either may run without the other. Loads and saves reach them through one interface (`tier.py`
`KVTier`: probe, read_run, holds, submit_store, metrics, clear, close; the disk as `DiskTier`).

- Load (`match`, then `load`): after the RAM pool's hit, the request's next block hashes are looked
  up on disk (a stat each: `DiskKVStore.count_prefix`), and the shared tier continues the disk's
  run (one pipelined round trip: `RedisTier.probe`); the answer (`TierHit`) says how many leading
  blocks each tier holds. While other requests run, `start_load` reads that run on a thread
  of its own (`loads.py`) and the request waits; otherwise, or once the read is done, the
  scheduler allocates pool blocks for the run as if it were computed this step, and the bytes
  come from the finished read or from `load`, each tier reading on from where the nearer one
  stopped (`KVTier.read_run`; checksummed, token ids compared). The runner writes them into
  the blocks before the forward pass. A read that fails (a block evicted or damaged since the
  lookup, a shared tier that went down) ends the run there: the scheduler computes the rest.
  Never past `num_tokens - 1`: the last token is always computed, for its logits.
- Whether a load is worth it, per tier: the connector measures the seconds per block each tier
  served (`LoadSpeeds`) and the engine reports the seconds per computed token; a tier whose
  block costs more than computing its tokens is left out of the lookup and the load (a slow
  disk or server must not make requests slower), and the others still serve: a slow server
  does not stop disk loads, nor a slow disk the server's (which then continues the RAM hit).
  A read in the background is timed as the request waited for it (it shares the cores with
  the step), so a tier whose reads only overlap is judged by what they cost the reader.
- Save (`blocks_to_save`, then `save`): write-through. After a step's update, every block that step
  completed (all its tokens computed) goes to every tier unless its request asked for `in_memory`
  retention or the disk holds it already. Payloads go to each tier's bounded writer
  (`BackgroundWriter`, the shared tier's own), which never blocks the step loop: when it falls
  behind, writes are dropped and counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixserve.config import RETENTION_SECONDS
from prefixserve.core.kv_cache.tier_hit import TierHit
from prefixserve.kv_store.block_write import BlockWrite
from prefixserve.kv_store.disk_store import BlockKey, DiskKVStore
from prefixserve.kv_store.load_speeds import LoadSpeeds
from prefixserve.kv_store.loads import BackgroundLoads
from prefixserve.kv_store.lookup import StoreLookup
from prefixserve.kv_store.remote.lookup import RemoteLookup
from prefixserve.kv_store.remote.redis_tier import RedisTier
from prefixserve.kv_store.tier import DISK, GROUP, REMOTE, BlockRead, DiskTier, KVTier
from prefixserve.kv_store.tier_run import TierRun
from prefixserve.kv_store.writer import BackgroundWriter

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
    from prefixserve.core.request import Request
    from prefixserve.core.sched.output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KVStoreStats:
    """What the tier did for this engine, cumulative (the store's and writer's own counters are
    in `DiskKVStore.stats()` and `BackgroundWriter.stats()`)."""

    hit_tokens: int = 0  # tokens loaded from the disk instead of computed
    remote_hit_tokens: int = 0  # tokens loaded from the shared tier instead of computed
    loaded_blocks: int = 0
    load_failures: int = 0  # stat said yes, the read said no (evicted or damaged meanwhile)
    load_seconds: float = 0.0
    skipped_slow: int = 0  # admissions that left a tier out because computing was faster
    saved_blocks: int = 0  # handed to the writer
    dropped_saves: int = 0  # the writer was full


@dataclass(slots=True)
class BlockSave:
    """One block to write: where it sits in the pool and what identifies it on disk."""

    block_id: int
    key: BlockKey
    token_ids: list[int]
    expires_at: float | None
    parent: bytes = b""  # the hash of the block before it (`KVStoreConnector.parent_of`)


class KVStoreConnector:
    """Load and save decisions over the tiers below the RAM pool: a `DiskKVStore` with its
    `BackgroundWriter` (the local disk), a `RedisTier` (shared by every host), or both, in that
    order (at least one)."""

    def __init__(
        self,
        store: DiskKVStore | None,
        writer: BackgroundWriter | None,
        block_size: int,
        default_retention: str = "24h",
        clock: Callable[[], float] = time.time,
        remote: RedisTier | None = None,
        overlap_loads: bool = True,
        *,
        root_parent: bytes = b"",
        other_dtypes: dict[str, StoreLookup] | None = None,
        other_remote_dtypes: dict[str, RemoteLookup] | None = None,
    ) -> None:
        """`root_parent`: the hash chain's seed, a first block's parent (stored with each block
        and checked at each read). `other_dtypes` / `other_remote_dtypes`: lookups, by KV dtype,
        in the namespaces where engines of the other KV dtypes keep the same prompts' blocks,
        on the disk (stat-only) and the shared tier (EXISTS); read by cache reports only,
        never loaded from (`open_tiers.py` opens them)."""
        if default_retention not in RETENTION_SECONDS:
            raise ValueError(f"unknown prompt cache retention {default_retention!r}")
        if (store is None) != (writer is None):
            raise ValueError("the disk tier needs both its store and its writer")
        if store is None and remote is None:
            raise ValueError("a KV store connector needs a disk tier, a shared tier, or both")
        self.store = store
        self.writer = writer
        self.block_size = block_size
        self.default_retention = default_retention
        self.stats = KVStoreStats()
        self._speeds = LoadSpeeds()
        self._clock = clock
        # The tier shared across hosts, after the disk: it continues the disk's run of held
        # blocks, serves what the disk misses, and receives every block the disk would.
        self.remote = remote
        # Every tier on the one interface, nearest first: loads and saves go through these.
        disk = None if store is None or writer is None else DiskTier(store, writer)
        self._tiers: tuple[KVTier, ...] = tuple(t for t in (disk, remote) if t is not None)
        # Reads overlapped with the running requests' compute (`start_load`); off: every read
        # at admission, on the step thread.
        self.overlap_loads = overlap_loads
        self.root_parent = root_parent
        self.other_dtypes = other_dtypes or {}
        self.other_remote_dtypes = other_remote_dtypes or {}
        self._loads: BackgroundLoads[TierRun] = BackgroundLoads()
        # Pins the tiers keep without expiry: (the pinned prompt, its blocks), by pin id.
        self.pinned: dict[str, tuple[Request, int]] = {}

    @property
    def shares_tier(self) -> bool:
        """Whether a tier shared across hosts is below this host's (cache reports then count
        its tokens apart)."""
        return self.remote is not None

    # ------------------------------------------------------------------ load (scheduler side)

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tiers this engine has, nearest first."""
        return tuple(tier.name for tier in self._tiers)

    def paying_tiers(self) -> tuple[str, ...]:
        """The tiers whose loads were measured to pay (or not measured yet), nearest first."""
        return tuple(t for t in self.tiers if self._speeds.pays(t, self.block_size))

    def match(self, request: Request, num_computed_tokens: int) -> TierHit:
        """The run of blocks after the first `num_computed_tokens` (a RAM hit, block-aligned)
        that the tiers whose loads pay hold, contiguous from there (`held`), or what its
        finished background read (`start_load`) got; nothing when the request may not read
        the cache."""
        if request.skip_reading_prefix_cache:
            return TierHit()
        finished = self._finished_read(request, num_computed_tokens)
        if finished is not None:
            return finished.head(self.loadable(request, num_computed_tokens), self.block_size).hit
        tiers = self.paying_tiers()
        if len(tiers) < len(self.tiers):
            self.stats.skipped_slow += int(self.loadable(request, num_computed_tokens) > 0)
        if not tiers:
            return TierHit()
        return self.held(request, num_computed_tokens, tiers)

    def loadable(self, request: Request, num_computed_tokens: int) -> int:
        """Blocks that may be loaded after a RAM hit of `num_computed_tokens`: up to, not
        including, the block of the prompt's last token (always computed)."""
        bs = self.block_size
        return max(0, (request.num_tokens - 1) // bs - num_computed_tokens // bs)

    def held(
        self,
        request: Request,
        num_computed_tokens: int,
        tiers: Container[str] | None = None,
    ) -> TierHit:
        """How many of the `loadable` blocks each of `tiers` holds, contiguous from the RAM hit:
        each tier's `probe` continues the run of the tiers before it (the disk's a stat a
        block, the shared tier's one round trip); what `match` loads, and what a dry-run report
        counts. `tiers` None: the tiers whose loads pay (`paying_tiers`)."""
        tiers = self.paying_tiers() if tiers is None else tiers
        first = num_computed_tokens // self.block_size
        count = self.loadable(request, num_computed_tokens)
        hit = TierHit()
        hashes = request.block_hashes[first : first + count]
        held = 0
        for tier in self._tiers:
            if held == count:
                break
            if tier.name not in tiers:
                continue
            found, fault = tier.probe(hashes[held:], GROUP)
            hit.add(tier.name, found * self.block_size)
            hit.note_miss(tier.name, fault)
            held += found
        return hit

    def load(
        self,
        request: Request,
        first_block: int,
        num_blocks: int,
        tiers: Container[str] | None = None,
    ) -> tuple[list[bytes], TierHit]:
        """Read blocks first_block .. first_block + num_blocks - 1 of `request` on this thread,
        each from the nearest of `tiers` that holds it (disk, then shared; None: the tiers whose
        loads pay, as `match` chose them); stops at the first miss, so the result may be
        shorter (the caller computes the rest). The `TierHit` says which tier served how many
        tokens, and the shared tier's fault if one ended the run. Counted in `stats` and in the
        tiers' load speeds."""
        tiers = self.paying_tiers() if tiers is None else tiers
        run = self._read_run(self._blocks(request, first_block, num_blocks), tiers)
        self._account(run)
        return run.payloads, run.hit

    def _blocks(self, request: Request, first_block: int, num_blocks: int) -> list[BlockRead]:
        """(block hash, token ids, parent hash) of `request`'s blocks first_block .. +
        num_blocks - 1."""
        bs = self.block_size
        return [
            (
                request.block_hashes[i],
                request.all_token_ids[i * bs : (i + 1) * bs],
                self.parent_of(request, i),
            )
            for i in range(first_block, first_block + num_blocks)
        ]

    def parent_of(self, request: Request, index: int) -> bytes:
        """The hash of the block before block `index` of `request`: `root_parent` (the hash
        chain's seed) for its first block. Stored with each block and checked at each read."""
        return request.block_hashes[index - 1] if index else self.root_parent

    def _read_run(self, blocks: Sequence[BlockRead], tiers: Container[str]) -> TierRun:
        """The leading `blocks` the tiers hold: each tier of `tiers`, nearest first, reads on
        from where the one before stopped, in one call (`KVTier.read_run`). Touches no state
        of the connector: it runs on the background loads' thread too."""
        run = TierRun(num_blocks=len(blocks))
        for tier in self._tiers:
            if len(run.payloads) == len(blocks):
                break
            if tier.name not in tiers:
                continue
            start = time.perf_counter()
            payloads, miss = tier.read_run(blocks[len(run.payloads) :], GROUP)
            if payloads:
                run.timing.add(tier.name, time.perf_counter() - start, len(payloads))
                run.hit.add(tier.name, len(payloads) * self.block_size)
                run.payloads.extend(payloads)
                run.served_by.extend([tier.name] * len(payloads))
            if miss is not None:
                run.hit.note_miss(tier.name, miss)
        return run

    def _account(self, run: TierRun) -> None:
        """Count a read in `stats` and in the tiers' load speeds (on the step thread)."""
        self.stats.load_failures += int(len(run.payloads) < run.num_blocks)
        self._count_loaded(run)

    def _count_loaded(self, run: TierRun) -> None:
        """Count the blocks of `run` that go into the pool, and the time of the read they came
        from in the tiers' load speeds."""
        if not run.payloads:
            return
        self.stats.loaded_blocks += len(run.payloads)
        self.stats.hit_tokens += run.hit.disk_tokens
        self.stats.remote_hit_tokens += run.hit.remote_tokens
        self.stats.load_seconds += sum(run.timing.seconds.values())
        for tier, blocks in run.timing.blocks.items():
            self._speeds.record_load(tier, run.timing.seconds[tier], blocks)

    def load_into_pool(
        self,
        kv_cache_manager: KVCacheManager,
        request: Request,
        num_computed: int,
        num_blocks: int,
        kv_loads: list[tuple[int, bytes]],
    ) -> TierHit:
        """After `allocate_slots` made room for them: read the `num_blocks` blocks `match` found
        after the RAM hit of `num_computed` tokens into `kv_loads` as (block id, payload), for
        the runner (the background read's bytes when `match` answered from one, else read
        here; the scheduler drops the read after admission); returns the tokens loaded, by
        tier. A block whose read fails, and every one
        after it, was cached in the pool when its slots were allocated: those hashes are
        forgotten (the request's cached count goes back with them), and the scheduler computes
        them."""
        bs = self.block_size
        first = num_computed // bs
        finished = self._finished_read(request, num_computed)
        if finished is not None:
            used = finished.head(num_blocks, bs)
            self._count_loaded(used)
            payloads, hit = used.payloads, used.hit
        else:
            payloads, hit = self.load(request, first, num_blocks)
        table = kv_cache_manager.get_block_ids(request)[GROUP]
        kv_loads.extend(zip(table[first : first + len(payloads)], payloads, strict=True))
        if len(payloads) < num_blocks:
            kv_cache_manager.uncache_uncomputed_blocks(request, num_computed + hit.tokens)
        return hit

    # ---- reads overlapped with the running requests' compute (loads.py)

    def loading(self, request: Request) -> bool:
        """Whether `request`'s blocks are being read in the background (it waits meanwhile)."""
        return self._loads.pending(request.request_id)

    def wait_for_load(self, request: Request) -> None:
        """Wait until `request`'s background read is done (nothing else to compute meanwhile)."""
        self._loads.result(request.request_id, timeout=None)

    def start_load(self, request: Request, num_computed: int, hit: TierHit) -> bool:
        """Read the blocks of `hit` (what `match` found after a RAM hit of `num_computed`
        tokens) in the background, while the running requests compute; False when the read
        is not started (overlap off, a read measured shorter than a step, the bound reached, a
        read held already): the caller reads at admission instead."""
        if not self.overlap_loads or self._loads.held(request.request_id):
            return False
        if not self._speeds.read_outlasts_a_step(hit, self.block_size):
            return False
        first = num_computed // self.block_size
        blocks = self._blocks(request, first, hit.tokens // self.block_size)
        tiers = self.paying_tiers()

        def read() -> TierRun:
            run = self._read_run(blocks, tiers)
            run.first_block = first
            return run

        return self._loads.submit(request.request_id, read)

    # ---- pins (`LLMEngine.pin_prefix`): the tiers keep a pinned prefix's blocks too

    def pin(self, pin_id: str, probe: Request, num_tokens: int) -> dict[str, int]:
        """Keep the first `num_tokens` (block-aligned) of `probe` on every tier without expiry
        until `release_pins(pin_id)`; how many blocks each tier held, by tier name."""
        num_blocks = num_tokens // self.block_size
        if not num_blocks:
            return {}
        self.pinned[pin_id] = (probe, num_blocks)
        return self._retain(probe, num_blocks, None)

    def release_pins(self, *pin_ids: str) -> None:
        """Let these pins' blocks expire again on every tier, a retention that writes (24 h)
        from now, as if saved again (none named: every pin; a reset dropped them all)."""
        lifetime = max(s for s in RETENTION_SECONDS.values() if s is not None)
        for pin_id in pin_ids or list(self.pinned):
            pinned = self.pinned.pop(pin_id, None)
            if pinned is not None:
                self._retain(*pinned, self._clock() + lifetime)

    def _retain(
        self, request: Request, num_blocks: int, expires_at: float | None
    ) -> dict[str, int]:
        """Every tier keeps `request`'s first `num_blocks` blocks until `expires_at`; how many
        each held."""
        blocks = self._blocks(request, 0, num_blocks)
        return {tier.name: tier.retain(blocks, GROUP, expires_at) for tier in self._tiers}

    def held_loads(self) -> int:
        """Background reads in flight or finished and not taken (none once every request
        ended)."""
        return len(self._loads)

    def forget_load(self, request: Request) -> None:
        """Drop `request`'s background read, if any (it finished, was aborted or preempted)."""
        self._loads.discard(request.request_id)

    def _finished_read(self, request: Request, num_computed: int) -> TierRun | None:
        """`request`'s finished background read, from the block after a RAM hit of
        `num_computed` tokens on (its leading blocks dropped when the RAM hit grew meanwhile),
        its short read counted the first time it is seen (its blocks when they are used); None
        without one, or when the RAM hit shrank below its first block (then it is dropped, and
        a read at admission replaces it)."""
        run = self._loads.result(request.request_id)
        if run is None:
            return None
        if not run.accounted:
            self.stats.load_failures += int(len(run.payloads) < run.num_blocks)
            run.accounted = True
        offset = num_computed // self.block_size - run.first_block
        if offset < 0:
            self._loads.discard(request.request_id)
            return None
        return run.tail(offset, self.block_size)

    def record_compute(self, seconds: float, num_tokens: int) -> None:
        """A forward pass computed `num_tokens` tokens in `seconds` (the engine reports it)."""
        self._speeds.record_step(seconds)
        if num_tokens >= self.block_size:  # decode-only steps say little about prefill speed
            self._speeds.record_compute(seconds, num_tokens)

    def block_state(self, block_hash: bytes) -> str | None:
        """Whether the disk holds this block of the served group: "live", "expired", or None
        (a stat; what a cache report reads; None without a disk tier)."""
        return None if self.store is None else self.store.state((block_hash, GROUP))

    def other_kv_dtype(self, block_hash: bytes) -> str | None:
        """The KV dtype of another engine that stored this block in this directory or on the
        shared tier, or None (a stat per other dtype; on the shared tier, one EXISTS per other
        dtype, a fault a miss). The hash chains the tenant's salt, so only the same tenant's
        block can be found."""
        for name, lookup in self.other_dtypes.items():
            if lookup.contains((block_hash, GROUP)):
                return name
        for name, remote in self.other_remote_dtypes.items():
            if remote.held([block_hash], GROUP)[0][0]:
                return name
        return None

    def loading_pays(self, tier: str | None = None) -> bool:
        """Whether loading a block from `tier` ("disk", "remote"; None: from any tier this
        engine has) was measured faster than computing its tokens (True until both were
        measured)."""
        if tier is None:
            return bool(self.paying_tiers())
        return self._speeds.pays(tier, self.block_size)

    # ------------------------------------------------------------------ save (after a step)

    def blocks_to_save(
        self, scheduler_output: SchedulerOutput, failed: Container[str]
    ) -> list[BlockSave]:
        """Blocks the step completed that belong on the tiers: not of a failed request, not of
        an `in_memory` request, not held by the nearest tier already (`holds`; with a disk
        tier: what the disk holds, it sent to the shared tier when it wrote it). Called after
        `Scheduler.update_from_output`: a request's blocks from its scheduled
        `num_computed_tokens` up to its computed tokens now (accepted drafts included, whose
        hashes the update added; drafts that were not accepted are never computed tokens)."""
        bs = self.block_size
        now = self._clock()
        saves: list[BlockSave] = []
        for entry in scheduler_output.scheduled:
            request = entry.request
            if request.request_id in failed:
                continue
            retention = request.cache_retention or self.default_retention
            lifetime = RETENTION_SECONDS[retention]
            if lifetime is None:
                continue
            first = entry.num_computed_tokens // bs
            end = min(request.num_computed_tokens // bs, len(request.block_hashes))
            table = entry.block_ids[GROUP]
            for index in range(first, end):
                key = (request.block_hashes[index], GROUP)
                if self._tiers[0].holds(*key):
                    continue
                tokens = request.all_token_ids[index * bs : (index + 1) * bs]
                parent = self.parent_of(request, index)
                saves.append(BlockSave(table[index], key, tokens, now + lifetime, parent))
        return saves

    def save(self, saves: Sequence[BlockSave], payloads: Sequence[memoryview]) -> None:
        """Hand the gathered payloads of `saves` to every tier's writer (never blocks); the
        disk's accepted and dropped writes are counted here, the shared tier counts its own."""
        for save, payload in zip(saves, payloads, strict=True):
            write = BlockWrite.at(save.key, save.token_ids, payload, save.expires_at, save.parent)
            for tier in self._tiers:
                stored = tier.submit_store(write)
                if tier.name == DISK:
                    if stored:
                        self.stats.saved_blocks += 1
                    else:
                        self.stats.dropped_saves += 1

    def metrics(self) -> dict[str, int | float]:
        """The tiers' counters, as the engine's metrics name them (`kv_store_hit_tokens`: every
        token loaded from below the RAM pool): each tier's own (`KVTier.metrics`), with the
        blocks handed to the disk's writer and the tokens loaded from the shared tier."""
        stats = self.stats
        metrics: dict[str, int | float] = {
            "kv_store_hit_tokens": stats.hit_tokens,
            "kv_store_loaded_blocks": stats.loaded_blocks,
            "kv_store_load_failures": stats.load_failures,
            "kv_store_load_seconds": stats.load_seconds,
        }
        for tier in self._tiers:
            metrics |= tier.metrics()
            if tier.name == DISK:
                metrics["kv_store_saved_blocks"] = stats.saved_blocks
            elif tier.name == REMOTE:
                metrics["kv_remote_hit_tokens"] = stats.remote_hit_tokens
        return metrics

    def remote_summary(self) -> dict[str, int | bool] | None:
        """The shared tier as the operators' cache summary shows it (None without one): whether
        it is connected, tokens loaded from it, blocks stored, dropped writes, faults, bad
        values."""
        if self.remote is None:
            return None
        prefix = "kv_remote_"
        summary: dict[str, int | bool] = {
            key.removeprefix(prefix): value
            for key, value in self.metrics().items()
            if key.startswith(prefix)
        }
        summary["connected"] = bool(summary["connected"])
        return summary

    def clear(self) -> int:
        """Forget this host's tiers (a prefix-cache reset): the background reads, and each
        tier's blocks as `KVTier.clear` says (the disk's namespace; the shared tier is not
        cleared: other hosts use it); returns how many blocks went."""
        self._loads.clear()
        return sum(tier.clear() for tier in self._tiers)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Release the pins on the tiers (the engine's end), write what each tier has queued
        (up to `timeout` seconds), then stop their writers; background reads are dropped."""
        self._loads.close()
        self.release_pins()
        return all([tier.close(timeout) for tier in self._tiers])
