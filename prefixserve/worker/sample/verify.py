"""The runner's side of speculation: the sampler rows a request's drafts add, and what they accept.

A request with drafts d_1..d_k is verified at k + 1 rows: row j holds the logits after its tokens
and d_1..d_j. Every row is sampled exactly as a plain decode step samples its one row (penalties
see the drafts before the row as output, as they would once accepted), and the drafts are
accepted while each equals the token sampled at the row before it. The request emits the
sampled tokens up to and including the first that differs from its draft (or the bonus token
after the last draft): exactly the tokens plain decoding would have sampled at those positions
from the same random numbers.

That coupling is the speculative-sampling rule for a draft that puts all its mass on one token:
a draft is accepted with probability p(draft), and a rejected row emits a token drawn from p,
which is then never the draft. So the output distribution is the target model's, and a seeded
request emits the very tokens it emits without speculation. To keep the seeded stream aligned,
the rows after a rejection must not consume random numbers: `GeneratorRewind` restores a seeded
generator after the batch draw and draws again only the rows that were used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixserve.core.request import Request
from prefixserve.worker.sample.sampler import draw_uniform, needs_penalties


@dataclass(slots=True)
class DraftRowView:
    """What the sampler reads of a request at a draft row: the history as if the drafts before
    the row were accepted (for repetition, frequency and presence penalties)."""

    request_id: str
    sampling_params: object
    history_token_ids: list[int]
    output_token_ids: list[int]


def row_views(request: Request, drafts: list[int]) -> list[Request | DraftRowView]:
    """The k + 1 sampler rows of a request with k drafts. Rows see the request itself unless
    penalties read its history: then row j sees the history plus drafts[:j]."""
    if not needs_penalties(request):
        return [request] * (len(drafts) + 1)
    views: list[Request | DraftRowView] = [request]
    for j in range(1, len(drafts) + 1):
        views.append(
            DraftRowView(
                request.request_id,
                request.sampling_params,
                request.history_token_ids + drafts[:j],
                request.output_token_ids + drafts[:j],
            )
        )
    return views


def num_accepted(sampled: list[int], drafts: list[int]) -> int:
    """How many drafts the sampled rows accept: drafts[j] stands while it equals sampled[j]."""
    accepted = 0
    for draft, token in zip(drafts, sampled, strict=False):
        if draft != token:
            break
        accepted += 1
    return accepted


class GeneratorRewind:
    """Seeded generators of requests with drafts: their state before the batch draw, so that
    after it each advances by the rows its request used (one uniform per emitted token, as
    plain decoding draws), not by all its rows."""

    def __init__(self) -> None:
        self._saved: dict[int, tuple[torch.Generator, torch.Tensor]] = {}

    def save(self, generator: torch.Generator | None) -> None:
        if generator is not None and id(generator) not in self._saved:
            self._saved[id(generator)] = (generator, generator.get_state())

    def replay(self, generator: torch.Generator | None, num_rows: int) -> None:
        """Put `generator` where drawing `num_rows` rows from its saved state leaves it."""
        saved = self._saved.get(id(generator)) if generator is not None else None
        if saved is None:
            return
        gen, state = saved
        gen.set_state(state)
        for _ in range(num_rows):
            draw_uniform(gen)
