"""The n-gram proposer (prompt lookup decoding), incremental and adaptive per request.

For each request it keeps a map from every n-gram of its tokens (n in [min_n, max_n]) to the
position where that n-gram's latest occurrence ends. A step indexes only the tokens added since
the last one (the sampled token and accepted drafts), so proposing costs a few dictionary
operations per request whatever the context length; the first proposal indexes the prompt once.

Proposal: for n from max_n down to min_n, the latest earlier occurrence of the request's last n
tokens; the drafts are the (up to k) tokens that followed it. The latest occurrence, not the
first: text being copied continues where it was last seen.

Adaptive: drafts that are rejected cost the verification rows they add. A request's draft length
follows its acceptance (all accepted: one more, up to k; otherwise one more than it accepted),
and after two verifications in a row with nothing accepted it skips its next 2, 4, ... 32
chances to propose (decode steps with room for drafts), so workloads that never copy pay for
little more than the lookups.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from prefixserve.config import SpeculativeConfig
from prefixserve.core.request import Request

# Longest pause after rejected drafts, in decode steps.
MAX_PAUSE_STEPS = 32


@dataclass(slots=True)
class _RequestState:
    index: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending at positions < indexed are in `index`
    num_drafts: int = 0  # this request's current draft length
    misses: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # chances to propose left to skip


class NgramProposer:
    """Per step `start_step(running)`, then `propose_within(request, ...)` -> draft token ids
    (`propose(request, most)` without the step's budget); `record(...)` feeds acceptance back;
    `drop(request_ids)` forgets finished requests (the scheduler calls it on every finish)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self.holds_for_prefill = config.hold_for_prefill
        self._states: dict[str, _RequestState] = {}
        # request id -> (running requests after it, of them its tenant's), for this step
        self._later: dict[str, tuple[int, int]] = {}

    @property
    def num_tracked(self) -> int:
        return len(self._states)

    def start_step(self, running: Sequence[Request]) -> None:
        """A step plans `running` in this order: each request's drafts will leave one token of
        the budget, and of its tenant's share, to every request after it."""
        self._later.clear()
        total = 0
        per_tenant: Counter[Hashable] = Counter()
        for request in reversed(running):
            self._later[request.request_id] = (total, per_tenant[request.tenant])
            total += 1
            per_tenant[request.tenant] += 1

    def propose_within(
        self,
        request: Request,
        token_budget: int,
        share: int | None = None,
        cap: int = 0,
        max_model_len: int = 2**62,
    ) -> list[int]:
        """Drafts for a decoding request (its last token not computed yet, nothing else) that fit
        beside that token in the step's `token_budget` and its tenant's `share` (None: no shares)
        less a token for each running request after it (`start_step`), within `cap` tokens in
        all (the per-request chunk cap; 0: none), and whose acceptance with the token sampled
        after them stays within its max_tokens and `max_model_len`."""
        if request.num_computed_tokens != request.num_tokens - 1:
            return []
        later, later_of_tenant = self._later.get(request.request_id, (0, 0))
        room = token_budget - later
        if share is not None:
            room = min(room, share - later_of_tenant)
        if cap:
            room = min(room, cap)
        room = min(room - 1, max_model_len - request.num_tokens - 1)
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        return self.propose(request, room) if room > 0 else []

    def propose(self, request: Request, most: int) -> list[int]:
        """Up to min(most, the request's draft length) tokens to verify after its last token."""
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _RequestState(num_drafts=self.k)
        if state.pause:
            state.pause -= 1
            return []
        most = min(most, state.num_drafts)
        if most < 1:
            return []
        tokens = request.all_token_ids
        last = len(tokens) - 1
        self._index(state, tokens, last)
        for n in range(min(self.max_n, last), self.min_n - 1, -1):
            end = state.index.get(tuple(tokens[last - n + 1 :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + most]
        return []

    def _index(self, state: _RequestState, tokens: list[int], upto: int) -> None:
        """Index the n-grams ending at positions [state.indexed, upto): never the last token's,
        so a lookup of the request's suffix finds an earlier occurrence, not itself."""
        index, min_n, max_n = state.index, self.min_n, self.max_n
        for end in range(state.indexed, upto):
            for n in range(min_n, min(max_n, end + 1) + 1):
                index[tuple(tokens[end - n + 1 : end + 1])] = end
        state.indexed = max(state.indexed, upto)

    def record(self, request_id: str, num_proposed: int, num_accepted: int) -> None:
        """The verification of `num_proposed` drafts accepted the first `num_accepted`."""
        state = self._states.get(request_id)
        if state is None or num_proposed < 1:
            return
        if num_accepted >= num_proposed:
            state.num_drafts = min(self.k, state.num_drafts + 1)
        else:
            state.num_drafts = max(1, num_accepted + 1)
        if num_accepted:
            state.misses = 0
            return
        state.misses += 1
        if state.misses >= 2:
            state.pause = min(MAX_PAUSE_STEPS, 2 ** (state.misses - 1))

    def drop(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)
