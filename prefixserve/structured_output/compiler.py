"""Grammars compiled off the step thread, tenants in turn, and cached per tenant.

One compile thread (llguidance releases the GIL while it compiles): the step thread never
compiles. Its queue is one queue per tenant, taken in turn, so a tenant's compile waits for the
one running and at most one of each other tenant with compiles waiting, never for a tenant's
backlog. A compiled grammar is cached under (tenant, canonical constraint): never shared between
tenants, so no tenant can tell from a fast answer that another sent the same schema.
Bounds, each a flag:
- compiles in flight (queued or running) per tenant (`max_compiles_per_tenant`): one more is
  refused with GrammarBusy (the server's 429);
- cached grammars per tenant (`max_cached_per_tenant`), each tenant's least recently used going
  first; and the constraints' text cached in all (`max_cached_chars`, a proxy for their
  memory: a compiled grammar takes up to ~75 bytes of RSS per character of its schema), the
  least recently used of anyone's going first;
- a compile may run `timeout_s` (GrammarError "timeout" past it), counted from when it starts,
  so that no tenant's request is refused for another's work; the wait in the queue is bounded
  by the turns (and, as a backstop, by `QUEUE_WAIT_FACTOR` times the timeout). A compile past
  its timeout finishes on the thread, bounded by the backend's parser limits, and is dropped.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from prefixserve.sampling_params import StructuredOutputsParams
from prefixserve.structured_output.backend import CompiledGrammar
from prefixserve.structured_output.errors import REJECTION_REASONS, GrammarBusy, GrammarError

# A compile waits at most this many timeouts in the queue (a backstop behind the turns).
QUEUE_WAIT_FACTOR = 4
DEFAULT_MAX_CACHED_CHARS = 16 << 20


class Backend(Protocol):
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar: ...


class CompileJob(Future):
    """A compile's future, with when it was queued and when it started (monotonic seconds)."""

    def __init__(self) -> None:
        super().__init__()
        self.queued_at = time.monotonic()
        self.started_at: float | None = None

    def overdue(self, timeout_s: float, now: float | None = None) -> bool:
        """Running past `timeout_s`, or queued past QUEUE_WAIT_FACTOR times it."""
        now = time.monotonic() if now is None else now
        if self.done():
            return False
        if self.started_at is not None:
            return now - self.started_at > timeout_s
        return now - self.queued_at > QUEUE_WAIT_FACTOR * timeout_s


@dataclass(slots=True)
class CompileStats:
    """Counters since start (the engine's `structured_output_*` metrics)."""

    compiles: int = 0  # grammars compiled (successfully or not)
    cache_hits: int = 0  # requests served by a cached grammar (or a compile already running)
    compile_seconds: float = 0.0
    rejections: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTION_REASONS, 0))


class GrammarCompiler:
    """`get(params, tenant)` -> a CompileJob of the CompiledGrammar (raising GrammarError)."""

    def __init__(
        self,
        backend: Backend,
        *,
        timeout_s: float = 5.0,
        max_compiles_per_tenant: int = 4,
        max_cached_per_tenant: int = 256,
        max_cached_chars: int = DEFAULT_MAX_CACHED_CHARS,
    ) -> None:
        self._backend = backend
        self.timeout_s = timeout_s
        self.max_compiles_per_tenant = max_compiles_per_tenant
        self.max_cached_per_tenant = max_cached_per_tenant
        self.max_cached_chars = max_cached_chars
        self._lock = threading.Condition()
        # (tenant, digest) -> (job, characters), least recently used first; failed compiles are
        # cached too (the same bad schema is refused again without compiling).
        self._cache: OrderedDict[tuple[Hashable, bytes], tuple[CompileJob, int]] = OrderedDict()
        self._cached_chars = 0
        self._per_tenant: dict[Hashable, int] = {}
        self._in_flight: dict[Hashable, int] = {}
        # Tenants with queued compiles, in turn order, and each one's queue.
        self._queues: OrderedDict[Hashable, deque[tuple[CompileJob, Callable[[], Any]]]] = (
            OrderedDict()
        )
        self._closed = False
        self.stats = CompileStats()
        self._thread = threading.Thread(target=self._work, name="grammar-compile", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------ the queue
    def get(self, params: StructuredOutputsParams, tenant: Hashable = None) -> CompileJob:
        """The compile of `params` for `tenant`: cached, already running, or queued now.
        GrammarBusy when the tenant has `max_compiles_per_tenant` compiles in flight."""
        canonical = params.canonical()
        key = (tenant, hashlib.blake2b(canonical.encode(), digest_size=16).digest())
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return cached[0]
            if self._in_flight.get(tenant, 0) >= self.max_compiles_per_tenant:
                self.stats.rejections["busy"] += 1
                raise GrammarBusy(
                    f"this client already has {self.max_compiles_per_tenant} grammar compiles "
                    "in flight; retry when they finish"
                )
            job = self._submit(tenant, lambda: self._compile(params))
            self._insert(key, job, len(canonical))
            return job

    def _submit(self, tenant: Hashable, work: Callable[[], Any]) -> CompileJob:
        """Queue `work` in `tenant`'s turn (the caller holds the lock)."""
        job = CompileJob()
        self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
        self._queues.setdefault(tenant, deque()).append((job, work))
        self._lock.notify()
        return job

    def _next(self) -> tuple[Hashable, CompileJob, Callable[[], Any]] | None:
        """The next job, tenants in turn (None once closed)."""
        with self._lock:
            while not self._queues and not self._closed:
                self._lock.wait()
            if self._closed:
                return None
            tenant, queue = next(iter(self._queues.items()))
            job, work = queue.popleft()
            del self._queues[tenant]
            if queue:
                self._queues[tenant] = queue  # back of the line
            return tenant, job, work

    def _work(self) -> None:
        while (item := self._next()) is not None:
            tenant, job, work = item
            job.started_at = time.monotonic()
            if job.set_running_or_notify_cancel():
                try:
                    job.set_result(work())
                except BaseException as exc:  # noqa: BLE001 - the job's failure, not the thread's
                    job.set_exception(exc)
            with self._lock:
                self._in_flight[tenant] -= 1
                if not self._in_flight[tenant]:
                    del self._in_flight[tenant]

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        started = time.perf_counter()
        try:
            return self._backend.compile(params)
        except GrammarError:
            raise
        except Exception as exc:  # noqa: BLE001 - a library's surprise is the client's 400
            reason = "invalid_schema" if params.kind == "json" else "invalid_grammar"
            raise GrammarError(
                f"structured_outputs.{params.kind} does not compile: {exc}", reason
            ) from None
        finally:
            with self._lock:
                self.stats.compiles += 1
                self.stats.compile_seconds += time.perf_counter() - started

    # ------------------------------------------------------------------------- waiting
    def wait(self, job: Future, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar, blocking until it is done or overdue (GrammarError)."""
        while not job.done():
            if isinstance(job, CompileJob) and job.overdue(self.timeout_s):
                raise self.timed_out(params)
            try:
                job.exception(timeout=0.05)
            except TimeoutError:
                continue
        try:
            return job.result()
        except GrammarError as exc:
            self.count_rejection(exc.reason)
            raise

    def timed_out(self, params: StructuredOutputsParams) -> GrammarError:
        self.count_rejection("timeout")
        return GrammarError(
            f"structured_outputs.{params.kind}: the grammar did not compile within "
            f"{self.timeout_s:g} s (--structured-outputs-compile-timeout)",
            "timeout",
        )

    def count_rejection(self, reason: str) -> None:
        with self._lock:
            self.stats.rejections[reason] += 1

    # --------------------------------------------------------------------------- cache
    def _insert(self, key: tuple[Hashable, bytes], job: CompileJob, chars: int) -> None:
        tenant = key[0]
        self._cache[key] = (job, chars)
        self._cached_chars += chars
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        if self._per_tenant[tenant] > self.max_cached_per_tenant:
            oldest = next(k for k in self._cache if k[0] == tenant)
            self._evict(oldest)
        while len(self._cache) > 1 and self._cached_chars > self.max_cached_chars:
            self._evict(next(iter(self._cache)))

    def _evict(self, key: tuple[Hashable, bytes]) -> None:
        _, chars = self._cache.pop(key)
        self._cached_chars -= chars
        tenant = key[0]
        self._per_tenant[tenant] -= 1
        if not self._per_tenant[tenant]:
            del self._per_tenant[tenant]

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        """Stop the thread after its running compile; queued compiles are cancelled."""
        with self._lock:
            self._closed = True
            for queue in self._queues.values():
                for job, _ in queue:
                    job.cancel()
            self._queues.clear()
            self._lock.notify_all()
