"""Admission control: how much work the server takes in, in all and per tenant.

A request is admitted after its prompt is tokenized and before it reaches the engine, with a
cost in tokens: `n * (prompt tokens + max_tokens)`, the most K/V it can ever hold. Refused
requests get a 429 with `Retry-After`, so a flood answers itself instead of growing the engine's
waiting queue without bound:
- `max_requests`: requests in the server (running or waiting in the engine), all tenants;
- `max_requests_per_tenant`, `max_tokens_per_tenant`: one tenant's share, so its flood leaves
  room for the others' requests (without API keys every request is the one tenant `None`).
A ticket is released when the response ends (finished, failed, aborted or disconnected).

Rendering and tokenizing come before that, on the one tokenizer thread (tokenizer_queue.py), for
every request including `/v1/messages/count_tokens`, which never reaches the engine:
- `max_render_jobs_per_tenant`: one tenant's jobs waiting for or running on that thread; past it
  a 429 before the job is queued, so a tenant's flood of large bodies is bounded where it costs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from prefixserve.entrypoints.server.errors import OpenAIError, capacity_refusal


@dataclass(slots=True)
class Ticket:
    tenant: str | None
    tokens: int
    released: bool = False


@dataclass(slots=True)
class Admission:
    """Counts what is admitted; `admit` raises OpenAIError(429) when a bound would be passed.
    A bound of None is no bound. Used from the event loop only (no locking needed)."""

    max_requests: int | None = None
    max_requests_per_tenant: int | None = None
    max_tokens_per_tenant: int | None = None
    max_render_jobs_per_tenant: int | None = None
    num_requests: int = 0
    requests_of: dict[str | None, int] = field(default_factory=dict)
    tokens_of: dict[str | None, int] = field(default_factory=dict)
    render_jobs_of: dict[str | None, int] = field(default_factory=dict)

    def admit(self, tenant: str | None, tokens: int) -> Ticket:
        if self.max_requests is not None and self.num_requests >= self.max_requests:
            # No count: how many requests the others have in flight is not a tenant's business.
            raise _busy("the server is at its limit of requests in flight")
        held = self.requests_of.get(tenant, 0)
        if self.max_requests_per_tenant is not None and held >= self.max_requests_per_tenant:
            raise _busy(f"you have {held} requests in flight, the limit per tenant")
        held_tokens = self.tokens_of.get(tenant, 0)
        limit = self.max_tokens_per_tenant
        if limit is not None and held_tokens and held_tokens + tokens > limit:
            # A tenant with nothing in flight is always admitted, however large the request
            # (the engine's own checks bound it), so no request is refused forever.
            raise _busy(
                f"you have {held_tokens} tokens in flight; this request may need {tokens} more "
                f"and the limit per tenant is {limit}"
            )
        self.num_requests += 1
        self.requests_of[tenant] = held + 1
        self.tokens_of[tenant] = held_tokens + tokens
        return Ticket(tenant, tokens)

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        self.num_requests -= 1
        left = self.requests_of[ticket.tenant] - 1
        tokens = self.tokens_of[ticket.tenant] - ticket.tokens
        if left:
            self.requests_of[ticket.tenant], self.tokens_of[ticket.tenant] = left, tokens
        else:  # no entry per tenant that has nothing in flight: bounded by the tenants active
            del self.requests_of[ticket.tenant], self.tokens_of[ticket.tenant]

    def admit_render(self, tenant: str | None) -> None:
        """Count one render or tokenize job of `tenant`; OpenAIError(429) past its bound. The
        caller calls `release_render` once the job is done, however it ends."""
        held = self.render_jobs_of.get(tenant, 0)
        limit = self.max_render_jobs_per_tenant
        if limit is not None and held >= limit:
            raise _busy(
                f"you have {held} prompts waiting to be tokenized, the limit per tenant "
                "(--max-render-jobs-per-tenant)"
            )
        self.render_jobs_of[tenant] = held + 1

    def release_render(self, tenant: str | None) -> None:
        left = self.render_jobs_of[tenant] - 1
        if left:
            self.render_jobs_of[tenant] = left
        else:
            del self.render_jobs_of[tenant]

    async def released_after(
        self, chunks: AsyncIterator[str], ticket: Ticket
    ) -> AsyncIterator[str]:
        """`chunks` (a streamed response), releasing `ticket` when it ends however it ends (a
        response never started is released by its background task: see serving.generate)."""
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.release(ticket)


def _busy(why: str) -> OpenAIError:
    return capacity_refusal(f"too many requests: {why}", "too_many_requests")
