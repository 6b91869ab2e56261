"""Tier reads off the step thread: `BackgroundLoads` runs each request's read of its blocks
from the tiers below RAM on one thread of its own, so that the read overlaps the forward passes
of the requests already running (the scheduler keeps the request waiting until its read is
done, then admits it with the bytes in hand), as vLLM's asynchronous `submit_load` /
`get_finished_jobs` do.

Bounded: at most `max_jobs` reads in flight or finished and not yet taken, each of one prompt's
blocks (at most `max_model_len` tokens of K/V); a submit past the bound is refused and the
caller reads on its own thread. A read's result is plain bytes already checked by its tier, so
it stays right however long it waits: a block's bytes are named by its hash and tokens."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

__all__ = ["DEFAULT_MAX_JOBS", "BackgroundLoads"]

# Reads in flight or finished and waiting to be taken, each one prompt's blocks.
DEFAULT_MAX_JOBS = 4

T = TypeVar("T")


class BackgroundLoads(Generic[T]):
    """Reads keyed by request id, run one at a time on a thread of their own."""

    def __init__(self, max_jobs: int = DEFAULT_MAX_JOBS) -> None:
        if max_jobs < 1:
            raise ValueError(f"max_jobs must be at least 1, got {max_jobs}")
        self.max_jobs = max_jobs
        self._jobs: dict[str, Future[T]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-load")
        self.submitted = 0  # reads started off the step thread
        self.refused = 0  # reads the bound sent back to the step thread

    def submit(self, key: str, read: Callable[[], T]) -> bool:
        """Start `read` for `key`; False (counted) when `max_jobs` reads are held already or
        the loads are closed; the caller then reads itself."""
        with self._lock:
            if key in self._jobs:
                raise ValueError(f"a load for {key!r} is already held")
            if len(self._jobs) >= self.max_jobs:
                self.refused += 1
                return False
            try:
                self._jobs[key] = self._pool.submit(read)
            except RuntimeError:  # shut down
                self.refused += 1
                return False
            self.submitted += 1
            return True

    def held(self, key: str) -> bool:
        """Whether a read for `key` is in flight or finished and not taken."""
        with self._lock:
            return key in self._jobs

    def pending(self, key: str) -> bool:
        """Whether a read for `key` is still in flight."""
        with self._lock:
            job = self._jobs.get(key)
        return job is not None and not job.done()

    def result(self, key: str, timeout: float | None = 0.0) -> T | None:
        """The finished read for `key` (kept until `take` or `discard`), waiting up to `timeout`
        seconds (None: until it finishes); None when there is none or it is not done. A read
        that raised is re-raised here, on the caller's thread, and forgotten."""
        with self._lock:
            job = self._jobs.get(key)
        if job is None:
            return None
        try:
            return job.result(timeout=timeout)
        except TimeoutError:
            return None
        except BaseException:
            self.discard(key)
            raise

    def discard(self, key: str) -> None:
        """Forget `key`'s read: cancelled if it has not started, its result dropped if it has."""
        with self._lock:
            job = self._jobs.pop(key, None)
        if job is not None:
            job.cancel()

    def clear(self) -> None:
        """Forget every read (a prefix-cache reset: what was read before it is not served)."""
        with self._lock:
            jobs, self._jobs = self._jobs, {}
        for job in jobs.values():
            job.cancel()

    def close(self) -> None:
        """Forget every read and stop the thread (a read in progress ends on its own)."""
        self.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __len__(self) -> int:
        with self._lock:
            return len(self._jobs)
