"""One read of a run of blocks from the tiers below RAM (`TierRun`): the payloads, the tier
that served each, the tokens by tier and the time each tier took; parts of it for a RAM hit
that grew while a background read ran. Pure Python records of `connector.py`."""

from __future__ import annotations

from dataclasses import dataclass, field

from prefixserve.core.kv_cache.tier_hit import TierHit

__all__ = ["TierRun", "TierTiming"]


@dataclass(slots=True)
class TierTiming:
    """One load's reads, by the tier that served them: seconds and blocks."""

    seconds: dict[str, float] = field(default_factory=dict)
    blocks: dict[str, int] = field(default_factory=dict)

    def add(self, tier: str, seconds: float, blocks: int = 1) -> None:
        self.seconds[tier] = self.seconds.get(tier, 0.0) + seconds
        self.blocks[tier] = self.blocks.get(tier, 0) + blocks


@dataclass(slots=True)
class TierRun:
    """One read of a run of blocks from the tiers: the payloads in order (`num_blocks` were
    asked for), the tier that served each, the tokens by tier (`hit`, with the shared tier's
    fault when one ended the run), the time each tier took (a part keeps its whole read's);
    for a background read also its first block and whether `stats` counted a short read yet."""

    num_blocks: int = 0
    payloads: list[bytes] = field(default_factory=list)
    served_by: list[str] = field(default_factory=list)
    hit: TierHit = field(default_factory=TierHit)
    timing: TierTiming = field(default_factory=TierTiming)
    first_block: int = 0
    accounted: bool = False

    def tail(self, offset: int, block_size: int) -> TierRun:
        """The run from its `offset`-th block on."""
        return self._part(offset, len(self.payloads), block_size)

    def head(self, count: int, block_size: int) -> TierRun:
        """The run's first `count` blocks."""
        return self._part(0, min(count, len(self.payloads)), block_size)

    def _part(self, start: int, stop: int, block_size: int) -> TierRun:
        """Blocks start .. stop - 1, their tokens recounted by tier; the fault kept only when
        the part reaches the run's end, where the fault stopped it."""
        part = TierRun(
            num_blocks=stop - start,
            payloads=self.payloads[start:stop],
            served_by=self.served_by[start:stop],
            timing=self.timing,
            first_block=self.first_block + start,
            accounted=self.accounted,
        )
        for tier in part.served_by:
            part.hit.add(tier, block_size)
        if stop == len(self.payloads):
            part.hit.remote_fault = self.hit.remote_fault
        return part
