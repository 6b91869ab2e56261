"""One request's grammar state: its matcher, and the tokens its grammar forces next.

Forced tokens are what the grammar allows alone from a state (`{"name":"` after `{` in a schema
whose first property is required), in the tokenizer's canonical tokenization as the backend
gives them. With jump-forward they are appended to the request at once and computed as one
chunk in the next step; without it they are emitted one per step, each step's only allowed
token. Either way the request emits the same tokens: jump-forward changes how many steps they
take, not what they are.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, wait

import numpy as np

from prefixserve.structured_output.backend import GrammarMatcher, clean_message

# The most forced tokens taken from one state (a bound on a grammar that forces a long text).
MAX_FORCED_RUN = 256
# The most one grammar operation may take for one token (a consume with its forced tokens, a
# mask row): past it the request fails, its grammar too slow to follow. A backstop behind the
# backend's parser limits, thousands of times what a schema's token takes (~5-50 us).
GRAMMAR_STEP_BUDGET_S = 0.25


class GrammarState:
    """Per request (`Request.structured_output`): the compile it waits for, then its matcher."""

    __slots__ = (
        "compile",
        "timeout_s",
        "matcher",
        "pending_forced",
        "jump_forward",
        "error",
        "unreported",
        "on_refused",
        "finishing",
        "vocab_size",
    )

    def __init__(
        self,
        compile: Future,
        jump_forward: bool,
        timeout_s: float,
        on_refused: Callable[[str], None] | None = None,
        vocab_size: int = 1 << 31,
    ) -> None:
        self.compile = compile
        self.timeout_s = timeout_s
        self.matcher: GrammarMatcher | None = None
        # Tokens the grammar forces from the matcher's state, not consumed yet (without
        # jump-forward they are emitted one per step).
        self.pending_forced: list[int] = []
        self.jump_forward = jump_forward
        self.error: str | None = None
        # Forced tokens appended before the request's first step (jump-forward from the
        # grammar's start): the scheduler reports them with its first sampled token.
        self.unreported: list[int] = []
        # Told the rejection reason when the compile fails or times out (metrics).
        self.on_refused = on_refused
        # Complete, its forced tail waiting to be computed (the scheduler stops it after).
        self.finishing = False
        # The grammar's vocabulary: a draft past it (a model wider than its tokenizer) is cut
        # before the matcher sees it (llguidance would fall into its error state).
        self.vocab_size = vocab_size

    def poll(self) -> bool | None:
        """True once the grammar is compiled (the matcher starts), None while it compiles,
        False when it failed or outlasted its deadline (`error` says why)."""
        if self.matcher is not None:
            return True
        if self.error is not None:
            return False
        if not self.compile.done():
            overdue = getattr(self.compile, "overdue", None)
            if overdue is None or not overdue(self.timeout_s):
                return None
            return self._refuse("the grammar did not compile in time", "timeout")
        if self.compile.cancelled():
            return self._refuse("the engine stopped before the grammar compiled", "timeout")
        exc = self.compile.exception()
        if exc is not None:
            return self._refuse(str(exc), getattr(exc, "reason", "invalid_grammar"))
        self.matcher = self.compile.result().matcher()
        self.pending_forced = self.matcher.forced_tokens()[:MAX_FORCED_RUN]
        return True

    def wait(self, timeout_s: float) -> None:
        if self.matcher is None:
            wait([self.compile], timeout=timeout_s)

    def _refuse(self, message: str, reason: str) -> bool:
        self.error = message
        if self.on_refused is not None:
            self.on_refused(reason)
        return False

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def accept(self, token_ids: list[int]) -> bool:
        """The request emitted `token_ids` (sampled, accepted drafts or forced): advance. False
        (with `error` set) when the grammar does not allow them."""
        assert self.matcher is not None
        started = time.perf_counter()
        if not self.matcher.consume(token_ids):
            self.error = clean_message(self.matcher.error or "a token the grammar does not allow")
            return False
        for token in token_ids:
            if self.pending_forced and self.pending_forced[0] == token:
                self.pending_forced.pop(0)
            else:
                self.pending_forced = []
        if not self.pending_forced and not self.matcher.stopped:
            self.pending_forced = self.matcher.forced_tokens()[:MAX_FORCED_RUN]
        took = time.perf_counter() - started
        if took > GRAMMAR_STEP_BUDGET_S * max(1, len(token_ids)):
            self.error = f"the grammar took {took * 1000:.0f} ms for {len(token_ids)} token(s)"
            return False
        return True

    def take_forced(self) -> list[int]:
        """With jump-forward: the forced tokens to append now (and forget here)."""
        if not self.jump_forward:
            return []
        forced, self.pending_forced = self.pending_forced, []
        return forced

    @property
    def forced_next(self) -> int | None:
        """The token the next step must emit (without jump-forward), if the grammar forces one."""
        return self.pending_forced[0] if self.pending_forced else None

    @property
    def stopped(self) -> bool:
        """The answer is complete: the grammar allows nothing more."""
        return self.matcher is not None and self.matcher.stopped

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The leading drafts the grammar allows (none while a forced token is due)."""
        if self.matcher is None or self.pending_forced or self.finishing or not drafts:
            return []
        known = next((i for i, t in enumerate(drafts) if not 0 <= t < self.vocab_size), None)
        drafts = drafts[:known]
        return drafts[: self.matcher.num_valid(drafts)] if drafts else []

    def fill_masks(self, rows: np.ndarray, drafts: list[int]) -> None:
        """Row j of `rows` gets the bitmask after drafts[:j] (drafts already validated); the
        matcher ends where it began."""
        matcher = self.matcher
        assert matcher is not None
        consumed = 0
        try:
            for j in range(len(drafts) + 1):
                if j:
                    if not matcher.consume([drafts[j - 1]]):
                        raise RuntimeError(
                            f"the grammar refused a validated draft: {matcher.error}"
                        )
                    consumed += 1
                started = time.perf_counter()
                matcher.fill_mask(rows[j])
                took = time.perf_counter() - started
                if took > GRAMMAR_STEP_BUDGET_S:
                    raise RuntimeError(f"the grammar took {took * 1000:.0f} ms for one mask")
                if matcher.error:  # e.g. a parser limit reached while computing the mask
                    raise RuntimeError(f"the grammar failed: {clean_message(matcher.error)}")
        finally:
            if consumed:
                matcher.rollback(consumed)
