"""Speculative decoding's derived numbers, from vLLM's three counters (the scheduler counts them
in `step_results.py`, the engine reports them, the benchmark reads them from any server's
/metrics). Here, below the scheduler, so that `core/` imports nothing of `spec_decode/`."""

from __future__ import annotations


def acceptance(
    num_drafts: float, num_draft_tokens: float, num_accepted_tokens: float
) -> tuple[float | None, float | None]:
    """(acceptance rate: accepted / proposed draft tokens, mean accepted length: tokens emitted
    per verification, 1 + accepted / verifications); None where nothing was proposed."""
    rate = num_accepted_tokens / num_draft_tokens if num_draft_tokens > 0 else None
    length = 1.0 + num_accepted_tokens / num_drafts if num_drafts > 0 else None
    return rate, length
