"""Grammars compiled off the step thread, and cached per tenant.

One compile thread (llguidance releases the GIL while it compiles): the step thread never
compiles. A compiled grammar is cached under (tenant, tokenizer, canonical constraint): never
shared between tenants, so no tenant can tell from a fast answer that another sent the same
schema. Bounds, each a flag:
- compiles in flight (queued or running) per tenant (`max_compiles_per_tenant`): one more is
  refused with GrammarBusy (the server's 429), so one tenant's thousand distinct schemas queue
  at most that many compiles ahead of another tenant's;
- cached grammars per tenant (`max_cached_per_tenant`), each tenant's least recently used going
  first, and in all (`max_cached`), the least recently used of anyone's going first;
- a caller waits at most `timeout_s` for its compile (GrammarError "timeout"); the compile
  itself is bounded by the backend's parser limits, finishes on the compile thread and is
  dropped, so no thread is left behind.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from prefixserve.sampling_params import StructuredOutputsParams
from prefixserve.structured_output.backend import CompiledGrammar
from prefixserve.structured_output.errors import REJECTION_REASONS, GrammarBusy, GrammarError


class Backend(Protocol):
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar: ...


@dataclass(slots=True)
class CompileStats:
    """Counters since start (the engine's `structured_output_*` metrics)."""

    compiles: int = 0  # grammars compiled (successfully or not)
    cache_hits: int = 0  # requests served by a cached grammar (or a compile already running)
    compile_seconds: float = 0.0
    rejections: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REJECTION_REASONS, 0))


class GrammarCompiler:
    """`get(params, tenant)` -> a Future of the CompiledGrammar (raising GrammarError)."""

    def __init__(
        self,
        backend: Backend,
        *,
        timeout_s: float = 5.0,
        max_compiles_per_tenant: int = 4,
        max_cached_per_tenant: int = 256,
        max_cached: int = 4096,
    ) -> None:
        self._backend = backend
        self.timeout_s = timeout_s
        self.max_compiles_per_tenant = max_compiles_per_tenant
        self.max_cached_per_tenant = max_cached_per_tenant
        self.max_cached = max_cached
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        # (tenant, digest) -> Future, in least recently used order; failed compiles are cached
        # too (the same bad schema is refused again without compiling).
        self._cache: OrderedDict[tuple[Hashable, bytes], Future[CompiledGrammar]] = OrderedDict()
        self._per_tenant: dict[Hashable, int] = {}
        self._in_flight: dict[Hashable, int] = {}
        self.stats = CompileStats()

    def get(self, params: StructuredOutputsParams, tenant: Hashable = None) -> Future:
        """The compile of `params` for `tenant`: cached, already running, or queued now.
        GrammarBusy when the tenant has `max_compiles_per_tenant` compiles in flight."""
        key = (tenant, hashlib.blake2b(params.canonical().encode(), digest_size=16).digest())
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                return future
            if self._in_flight.get(tenant, 0) >= self.max_compiles_per_tenant:
                self.stats.rejections["busy"] += 1
                raise GrammarBusy(
                    f"this client already has {self.max_compiles_per_tenant} grammar compiles "
                    "in flight; retry when they finish"
                )
            self._in_flight[tenant] = self._in_flight.get(tenant, 0) + 1
            future = self._executor.submit(self._compile, params, tenant)
            self._insert(key, future)
            return future

    def wait(self, future: Future, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar, waiting at most `timeout_s` (GrammarError past it)."""
        try:
            return future.result(timeout=self.timeout_s)
        except TimeoutError:
            raise self.timed_out(params) from None
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

    def _compile(self, params: StructuredOutputsParams, tenant: Hashable) -> CompiledGrammar:
        started = time.perf_counter()
        try:
            return self._backend.compile(params)
        finally:
            with self._lock:
                self.stats.compiles += 1
                self.stats.compile_seconds += time.perf_counter() - started
                self._in_flight[tenant] -= 1
                if not self._in_flight[tenant]:
                    del self._in_flight[tenant]

    def _insert(self, key: tuple[Hashable, bytes], future: Future) -> None:
        tenant = key[0]
        self._cache[key] = future
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + 1
        if self._per_tenant[tenant] > self.max_cached_per_tenant:
            oldest = next(k for k in self._cache if k[0] == tenant)
            self._evict(oldest)
        while len(self._cache) > self.max_cached:
            self._evict(next(iter(self._cache)))

    def _evict(self, key: tuple[Hashable, bytes]) -> None:
        del self._cache[key]
        tenant = key[0]
        self._per_tenant[tenant] -= 1
        if not self._per_tenant[tenant]:
            del self._per_tenant[tenant]

    @property
    def num_cached(self) -> int:
        return len(self._cache)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
