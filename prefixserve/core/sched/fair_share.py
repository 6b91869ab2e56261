"""Fair shares between tenants: the waiting queue in per-tenant rounds, and each step's token split.

A tenant is whatever the caller says it is (the server passes the authenticated key's name; the
offline API passes nothing, so everyone is the one tenant None). With a single tenant both
structures reduce to what the scheduler did before they existed: one FIFO queue, no caps.

- `WaitingQueue` keeps one FIFO per tenant and offers the tenants' heads in turn (round robin): a
  tenant that queued a thousand requests gets every other admission while a second tenant has work,
  instead of making it wait behind all thousand. A preempted request goes back to the front of its
  tenant's queue, and its tenant to the front of the turn order, so it resumes first, as before.
- `tenant_shares` (`water_fill`) splits a step's token budget: each tenant gets what it asks for
  up to an equal share, and what the small ones leave is shared by the others (max-min fairness).
  A tenant's long prefill chunk can then no longer push another tenant's decode out of a step.
- `preemption_victim` takes from the tenant with the most running requests when the pool is
  full; `slot_preemption_victim` does when the running slots (`max_num_seqs`) are all taken and a
  waiting tenant has less than an equal share of them, so one tenant's long requests cannot hold
  every slot while another waits. Preemption is cheap with a prefix cache: the victim's blocks
  stay cached (freed, hashes kept), so resuming recomputes little beyond its last partial block.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Container, Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixserve.core.request import Request


class WaitingQueue:
    """Requests waiting to be admitted, one FIFO per tenant, tenants taken in turn.

    `peek()` is the request admission should try next; `pop(request)` takes that request out and
    sends its tenant to the back of the turn order. Iteration lists tenants in turn order and each
    tenant's requests in arrival order (with one tenant: plain FIFO order).
    """

    __slots__ = ("_queues", "_len", "_per_tenant")

    def __init__(self, per_tenant: bool = True) -> None:
        # Insertion order of the dict is the turn order.
        self._queues: OrderedDict[Hashable, deque[Request]] = OrderedDict()
        self._len = 0
        # False: one FIFO for everyone (first come, first served over all tenants).
        self._per_tenant = per_tenant

    def key(self, request: Request) -> Hashable:
        """The queue `request` waits in: its tenant's (one queue for all without tenants)."""
        return request.tenant if self._per_tenant else None

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Request]:
        for queue in self._queues.values():
            yield from queue

    def __getitem__(self, index: int) -> Request:
        """The index-th request in iteration order (0: the one admission tries next)."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("waiting queue index out of range")
        for queue in self._queues.values():
            if index < len(queue):
                return queue[index]
            index -= len(queue)
        raise AssertionError("unreachable: lengths disagree")

    def tenants(self) -> list[Hashable]:
        """Tenants with waiting requests, in turn order."""
        return list(self._queues)

    def requests_of(self, tenant: Hashable, limit: int) -> Iterator[Request]:
        """The first `limit` waiting requests of `tenant`, in arrival order."""
        return itertools.islice(self._queues.get(tenant, ()), limit)

    def append(self, request: Request) -> None:
        """A new arrival: the back of its tenant's queue (a new tenant's turn comes last)."""
        self._queue_of(request).append(request)
        self._len += 1

    def appendleft(self, request: Request, turn_next: bool = True) -> None:
        """A preempted request: the front of its tenant's queue, and (`turn_next`) its tenant's
        turn is next; without, a tenant new to the queue takes its turn last."""
        self._queue_of(request).appendleft(request)
        if turn_next:
            self._queues.move_to_end(self.key(request), last=False)
        self._len += 1

    def promote(self, request: Request) -> None:
        """Move a waiting request to the head of its tenant's queue."""
        queue = self._queues[self.key(request)]
        queue.remove(request)
        queue.appendleft(request)

    def take_turn_next(self, tenant: Hashable) -> None:
        """Give `tenant` (which has waiting requests) the next turn."""
        self._queues.move_to_end(tenant, last=False)

    def peek(
        self, shares: Mapping[Hashable, int] | None = None, skip: Container[Hashable] = ()
    ) -> Request | None:
        """The head of the first tenant in turn order (with `shares`: the first whose share is
        not spent; never one of the queues in `skip`, named by `key`), or None."""
        for tenant, queue in self._queues.items():
            if tenant not in skip and (shares is None or shares.get(tenant, 0) > 0):
                return queue[0]
        return None

    def pop(self, request: Request) -> None:
        """Take out `request`, the head of its tenant's queue; the tenant's next turn comes last."""
        key = self.key(request)
        queue = self._queues[key]
        assert queue[0] is request, (queue[0], request)
        queue.popleft()
        self._len -= 1
        if queue:
            self._queues.move_to_end(key)
        else:
            del self._queues[key]

    def remove(self, request: Request) -> None:
        """Take out any waiting request (an abort). Raises ValueError when it is not here."""
        key = self.key(request)
        queue = self._queues.get(key)
        if queue is None:
            raise ValueError(f"{request!r} is not waiting")
        queue.remove(request)
        self._len -= 1
        if not queue:
            del self._queues[key]

    def _queue_of(self, request: Request) -> deque[Request]:
        key = self.key(request)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        return queue


def water_fill(demands: Mapping[Hashable, int], budget: int) -> dict[Hashable, int]:
    """Max-min fair split of `budget` tokens: every tenant gets min(its demand, a common level).

    The level is the largest that fits the budget, so tenants asking less than an equal share get
    all they ask and the rest share what is left equally (integer shares; the remainder of an
    uneven split goes one token each to the tenants first in `demands`' order). The shares sum to
    min(budget, sum of demands).
    """
    shares = {tenant: 0 for tenant in demands}
    pending = sorted((d, i, t) for i, (t, d) in enumerate(demands.items()) if d > 0)
    left = budget
    while pending and left > 0:
        level, extra = divmod(left, len(pending))
        smallest = pending[0][0]
        if smallest <= level:
            # Everyone asking at most the equal share is served in full; re-level the rest.
            while pending and pending[0][0] <= level:
                demand, _, tenant = pending.pop(0)
                shares[tenant] = demand
                left -= demand
            continue
        for position, (_, _, tenant) in enumerate(sorted(pending, key=lambda p: p[1])):
            shares[tenant] = level + (1 if position < extra else 0)
        left = 0
    return shares


def tenant_shares(
    running: Sequence[Request],
    waiting: WaitingQueue,
    free_seqs: int,
    budget: int,
    chunk: Callable[[Request], int],
) -> dict[Hashable, int] | None:
    """Each tenant's share of a step's `budget` tokens, or None when at most one tenant has work.

    A tenant's demand is what its running requests would compute (`chunk` of each) plus, while
    there are `free_seqs` free running slots, the prompts at the head of its waiting queue
    (counted without their cache hits, which are not looked up before admission: a tenant whose
    hit makes it need less leaves its share to the budget's final round).
    """
    demands: Counter[Hashable] = Counter()
    for request in running:
        demands[request.tenant] += chunk(request)
    if free_seqs > 0:
        for tenant in waiting.tenants():
            if demands[tenant] >= budget:
                continue
            for request in waiting.requests_of(tenant, free_seqs):
                demands[tenant] += chunk(request)
                if demands[tenant] >= budget:
                    break
    if len(demands) <= 1:
        return None
    return water_fill(demands, budget)


def preemption_victim(running: Sequence[Request], first: int, fair: bool) -> Request:
    """The request to preempt when `running[first]` finds no free blocks: the most recently
    admitted of those not yet scheduled this step (`running[first:]`); when `fair`, of those the
    newest of the tenant with the most running requests (with one tenant, or not `fair`: the
    newest running request, as vLLM does)."""
    candidates = running[first:]
    if not fair:
        return candidates[-1]
    counts = Counter(request.tenant for request in running)
    tenant = max((r.tenant for r in reversed(candidates)), key=lambda t: counts[t])
    return next(r for r in reversed(candidates) if r.tenant == tenant)


def slot_preemption_victim(
    running: Sequence[Request], waiting: WaitingQueue, max_num_seqs: int
) -> tuple[Request, Hashable] | None:
    """When every running slot is taken: (the running request to preempt, the waiting tenant
    that gets its slot). The tenant is the first in turn holding less than an equal share of the
    slots (max_num_seqs / tenants with work); the request is the newest of the tenant holding
    the most beyond its share. None when no waiting tenant is short or no one holds extra."""
    if len(running) < max_num_seqs or not waiting:
        return None
    counts = Counter(request.tenant for request in running)
    tenants = set(counts) | set(waiting.tenants())
    share = max(1, max_num_seqs // len(tenants))
    short = next((t for t in waiting.tenants() if counts[t] < share), None)
    over = [tenant for tenant in counts if counts[tenant] > share]
    if short is None or not over:
        return None
    tenant = max(over, key=lambda t: counts[t])
    return next(r for r in reversed(running) if r.tenant == tenant), short
