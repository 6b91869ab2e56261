"""What the scheduler asks of the parts above it, as small protocols: the tiers below the RAM
pool (`TierConnector`, which `kv_store/connector.py` `KVStoreConnector` implements), a draft
proposer (`DraftProposer`, which `spec_decode/ngram.py` `NgramProposer` implements), a
structured request's grammar (`RequestGrammar`, defined beside the Request in
`core/request.py`; `structured_output/request_state.py`'s `GrammarState` implements it) and a
step's token masks (`StepGrammar`, `structured_output/step_masks.py`'s `StepMasks`, on
`SchedulerOutput.grammar`).

The scheduler names these and never a concrete class above `core/` (vLLM's scheduler holds its
KV connector and its drafter the same way): `core/` imports nothing of `kv_store/`,
`spec_decode/` or `structured_output/`, and a new tier, proposer or grammar backend is a class
that fits one of them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from prefixserve.core.request import RequestGrammar

__all__ = ["DraftProposer", "RequestGrammar", "StepGrammar", "TierConnector"]

if TYPE_CHECKING:
    from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
    from prefixserve.core.kv_cache.tier_hit import TierHit
    from prefixserve.core.request import Request


class TierConnector(Protocol):
    """The load side of the tiers below the RAM pool, as the scheduler uses it."""

    def match(self, request: Request, num_computed_tokens: int) -> TierHit:
        """The tokens the tiers hold after the RAM hit of `num_computed_tokens`, by tier."""
        ...

    def start_load(self, request: Request, num_computed: int, hit: TierHit) -> bool:
        """Start reading `hit`'s blocks off the step thread; False when it read nothing (the
        request then reads at admission)."""
        ...

    def loading(self, request: Request) -> bool:
        """Whether a background read of `request`'s blocks is held (in flight or done)."""
        ...

    def wait_for_load(self, request: Request) -> None:
        """Block until `request`'s background read is done."""
        ...

    def load_into_pool(
        self,
        kv_cache_manager: KVCacheManager,
        request: Request,
        num_computed: int,
        num_blocks: int,
        kv_loads: list[tuple[int, bytes]],
    ) -> TierHit:
        """After `allocate_slots`: the `num_blocks` blocks after the RAM hit appended to
        `kv_loads` as (block id, payload) for the runner; the tokens loaded, by tier."""
        ...

    def forget_load(self, request: Request) -> None:
        """Drop `request`'s background read (admitted, finished or aborted)."""
        ...


class DraftProposer(Protocol):
    """Speculative drafts for decoding requests, as the scheduler plans them."""

    # No drafts in a step that carries a chunk of several tokens (`Scheduler._prefill_pending`).
    holds_for_prefill: bool

    def start_step(self, running: Sequence[Request]) -> None:
        """A step plans `running` in this order (each request's drafts leave a token of the
        budget to every request after it)."""
        ...

    def propose_within(
        self,
        request: Request,
        token_budget: int,
        share: int | None = None,
        cap: int = 0,
        max_model_len: int = 2**62,
    ) -> list[int]:
        """Drafts for `request` that fit the step's budget, its tenant's share and `cap`."""
        ...

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """The verification of `num_proposed` drafts accepted the first `num_accepted`."""
        ...

    def drop(self, request_ids: Iterable[str]) -> None:
        """Forget finished requests."""
        ...


class StepGrammar(Protocol):
    """A step's token masks, as the model runner applies them."""

    def forced_token(self, request_id: str) -> int | None:
        """The token the request's grammar forces at its sampled row (emitted unsampled)."""
        ...

    def apply(self, logits: Any, row_request_ids: list[str]) -> dict[str, str]:
        """Mask disallowed tokens of the structured requests' rows to -inf, in place; the
        requests whose masks failed (request id -> why)."""
        ...

    def wait(self) -> None:
        """Until the masks are filled (the matchers are the scheduler's again)."""
        ...
