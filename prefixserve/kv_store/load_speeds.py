"""What loading from each tier below RAM and computing were measured to cost (`LoadSpeeds`):
the load-or-compute decision per tier, and whether a read outlasts a step (the overlap
decision). Pure Python; the connector (`connector.py`) feeds it and asks it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixserve.core.kv_cache.tier_hit import DISK, REMOTE, TierHit

__all__ = ["RETRY_SLOW_TIER_S", "LoadSpeeds"]

# Exponential moving average weight of a new measurement of load or compute speed.
_EWMA = 0.2
# A tier left out as slower than computing is tried again after this many seconds (one load,
# whose measurement replaces the old one): a server that was slow for a while is not lost.
RETRY_SLOW_TIER_S = 60.0


@dataclass(slots=True)
class LoadSpeeds:
    """What loading and computing were measured to cost: seconds per block each tier served
    (by tier name, absent until it served one) and seconds per computed token, each a moving
    average. A tier measured slower than computing is left out, and put on trial again
    `retry_after_s` (monotonic clock) after it was left out: it pays until its next load is
    measured, and that measurement replaces the old average."""

    load_s_per_block: dict[str, float] = field(default_factory=dict)
    compute_s_per_token: float | None = None
    step_s: float | None = None  # a forward pass's seconds, any step
    retry_after_s: float = RETRY_SLOW_TIER_S
    clock: Callable[[], float] = time.monotonic
    _left_out_at: dict[str, float] = field(default_factory=dict)
    _on_trial: set[str] = field(default_factory=set)

    def record_load(self, tier: str, seconds: float, num_blocks: int) -> None:
        previous = None if tier in self._on_trial else self.load_s_per_block.get(tier)
        self._on_trial.discard(tier)
        self.load_s_per_block[tier] = _average(previous, seconds / num_blocks)

    def record_compute(self, seconds: float, num_tokens: int) -> None:
        self.compute_s_per_token = _average(self.compute_s_per_token, seconds / num_tokens)

    def record_step(self, seconds: float) -> None:
        self.step_s = _average(self.step_s, seconds)

    def read_outlasts_a_step(self, hit: TierHit, block_size: int) -> bool:
        """Whether reading `hit`'s blocks was measured to take longer than a step (True until
        the step and each tier it reads from were measured): a shorter read stalls the running
        requests less than waiting a step boundary delays the one that reads."""
        if self.step_s is None:
            return True
        seconds = 0.0
        for tier, tokens in ((DISK, hit.disk_tokens), (REMOTE, hit.remote_tokens)):
            if tokens:
                per_block = self.load_s_per_block.get(tier)
                if per_block is None:
                    return True
                seconds += per_block * tokens / block_size
        return seconds > self.step_s

    def pays(self, tier: str, block_size: int) -> bool:
        """Whether loading a block from `tier` was measured faster than computing its tokens
        (True until both were measured, and while the tier is on trial)."""
        load, compute = self.load_s_per_block.get(tier), self.compute_s_per_token
        if load is None or compute is None:
            return True  # measure first
        if load < compute * block_size:
            self._left_out_at.pop(tier, None)
            return True
        if tier in self._on_trial:
            return True
        now = self.clock()
        if now - self._left_out_at.setdefault(tier, now) < self.retry_after_s:
            return False
        self._left_out_at[tier] = now  # the next trial counts from this one
        self._on_trial.add(tier)
        return True


def _average(previous: float | None, sample: float) -> float:
    return sample if previous is None else (1 - _EWMA) * previous + _EWMA * sample
