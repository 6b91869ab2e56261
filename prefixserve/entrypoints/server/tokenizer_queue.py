"""The tokenizer thread and the jobs waiting for it, taken in turn between tenants.

Every prompt is tokenized (or rendered with the chat template) on one thread: a tokenizer is not
safe to call from several at once, and the event loop must go on serving. A first-come queue in
front of that thread lets one tenant's backlog delay everyone: 48 bodies of 10,000 messages each
hold it for seconds. Here the jobs wait per tenant, and the thread takes them by start-time fair
queuing with a cost of one per job: a job's tag is one past its tenant's previous job, and never
earlier than the tag of the job the thread is running; the lowest tag goes next (ties: the first
queued). A tenant's job therefore waits for the job running and at most one job of each other
tenant with jobs waiting, never for one tenant's backlog. How many jobs a tenant may have here is
admission's bound (`Admission.admit_render`, `--max-render-jobs-per-tenant`).

A job is never cut short: a request cancelled while its job runs keeps the thread's turn until
the job ends, so no job is ever handed to the thread while another runs there.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")
Tenant = str | None


@dataclass(slots=True)
class _Job:
    tag: int
    seq: int
    turn: asyncio.Future[None]


class TokenizerQueue:
    """Runs callables on one thread, one at a time, taking tenants in turn (module docstring).
    Used from one event loop at a time (no locking needed)."""

    def __init__(self, executor: ThreadPoolExecutor | None = None) -> None:
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._waiting: dict[Tenant, deque[_Job]] = {}
        self._seq = itertools.count()
        self._busy = False  # a job holds the thread's turn (it runs, or is about to)
        self._running_tenant: Tenant = None
        self._round = 0  # the tag of the job holding the turn

    def num_waiting(self, tenant: Tenant) -> int:
        """How many of `tenant`'s jobs wait for the thread (not counting one running)."""
        return len(self._waiting.get(tenant, ()))

    async def run(self, tenant: Tenant, fn: Callable[[], T]) -> T:
        """`fn()` on the thread once it is `tenant`'s turn; its result or its exception."""
        await self._take_turn(tenant)
        try:
            future = asyncio.get_running_loop().run_in_executor(self.executor, fn)
        except BaseException:  # a shut-down executor, a closed loop: the turn must not stick
            self._pass_turn()
            raise
        try:
            # Shielded: a cancelled caller must not give the turn back while `fn` still runs.
            return await asyncio.shield(future)
        finally:
            if future.done():
                if not future.cancelled():
                    future.exception()  # read, so a cancelled caller's failure is not logged
                self._pass_turn()
            else:
                future.add_done_callback(self._abandoned_job_ended)

    def _abandoned_job_ended(self, future: asyncio.Future[object]) -> None:
        """The job of a cancelled caller ended: nobody reads its outcome; the turn passes on."""
        if not future.cancelled():
            future.exception()  # retrieved, so asyncio does not log it as never retrieved
        self._pass_turn()

    async def _take_turn(self, tenant: Tenant) -> None:
        if not self._busy:
            self._busy, self._running_tenant = True, tenant
            return
        job = self._enqueue(tenant)
        try:
            await job.turn
        except asyncio.CancelledError:
            self._withdraw(tenant, job)
            raise

    def _enqueue(self, tenant: Tenant) -> _Job:
        jobs = self._waiting.setdefault(tenant, deque())
        if jobs:
            previous = jobs[-1].tag
        else:
            previous = self._round if tenant == self._running_tenant else self._round - 1
        job = _Job(
            max(self._round, previous + 1),
            next(self._seq),
            asyncio.get_running_loop().create_future(),
        )
        jobs.append(job)
        return job

    def _withdraw(self, tenant: Tenant, job: _Job) -> None:
        """A cancelled waiter leaves the queue; one already given the turn passes it on."""
        if job.turn.done() and not job.turn.cancelled():
            self._pass_turn()
            return
        jobs = self._waiting.get(tenant)
        if jobs is not None and job in jobs:
            jobs.remove(job)
            if not jobs:
                del self._waiting[tenant]

    def _pass_turn(self) -> None:
        """Give the thread's turn to the waiting job with the lowest (tag, seq), or free it."""
        while self._waiting:
            tenant = min(self._waiting, key=lambda t: _order(self._waiting[t][0]))
            jobs = self._waiting[tenant]
            job = jobs.popleft()
            if not jobs:
                del self._waiting[tenant]
            if job.turn.done():  # cancelled, its task not yet resumed to withdraw it
                continue
            self._round, self._running_tenant = job.tag, tenant
            job.turn.set_result(None)
            return
        self._busy, self._running_tenant = False, None


def _order(job: _Job) -> tuple[int, int]:
    return job.tag, job.seq
