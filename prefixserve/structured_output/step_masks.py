"""The step's token bitmask: filled on the mask thread while the forward pass runs, applied to
the logits before sampling (vLLM v1's grammar bitmask, computed on the CPU beside the model).

Rows follow the runner's sampled rows of each structured request: one row per sampled position,
k + 1 for a request verifying k drafts (row j: the state after its first j drafts). A request
whose grammar forces its next token (without jump-forward) gets no row: the runner emits the
token without sampling it (`forced_token`), drawing no random number, as jump-forward does.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future

import numpy as np
import torch

from prefixserve.core.sched.output import SchedulerOutput
from prefixserve.structured_output.backend import mask_words
from prefixserve.structured_output.request_state import GrammarState


class StepMasks:
    """One step's masks: `forced_token(id)` now, `apply(logits, row_ids)` once they are filled."""

    def __init__(self, output: SchedulerOutput, vocab_size: int, executor: Executor) -> None:
        self.forced: dict[str, int] = {}
        # request id -> (first row in `_bits`, its drafts)
        self._rows: dict[str, tuple[int, list[int]]] = {}
        jobs: list[tuple[GrammarState, int, list[int]]] = []
        num_rows = 0
        for s in output.scheduled:
            state = s.request.structured_output
            if state is None or not s.samples or not state.ready:
                continue
            forced = state.forced_next
            if forced is not None:
                self.forced[s.request.request_id] = forced
                continue
            self._rows[s.request.request_id] = (num_rows, s.draft_token_ids)
            jobs.append((state, num_rows, s.draft_token_ids))
            num_rows += len(s.draft_token_ids) + 1
        self.vocab_size = vocab_size
        self._bits = np.zeros((num_rows, mask_words(vocab_size)), dtype=np.int32)
        self._done: Future | None = executor.submit(self._fill, jobs) if jobs else None

    def _fill(self, jobs: list[tuple[GrammarState, int, list[int]]]) -> torch.Tensor:
        for state, first, drafts in jobs:
            state.fill_masks(self._bits[first : first + len(drafts) + 1], drafts)
        allowed = np.unpackbits(self._bits.view(np.uint8), axis=1, bitorder="little")
        return torch.from_numpy(allowed[:, : self.vocab_size].astype(np.bool_))

    def forced_token(self, request_id: str) -> int | None:
        return self.forced.get(request_id)

    def wait(self) -> None:
        """Until the mask thread is done with this step's matchers (before they advance)."""
        if self._done is not None:
            self._done.exception()

    def apply(self, logits: torch.Tensor, row_request_ids: list[str]) -> None:
        """Mask, in place, the logits rows of structured requests (`row_request_ids[i]` owns row
        i; a request's rows come in draft order): disallowed tokens become -inf."""
        if self._done is None:
            return
        allowed = self._done.result()
        seen: dict[str, int] = {}
        rows, mask_rows = [], []
        for i, request_id in enumerate(row_request_ids):
            entry = self._rows.get(request_id)
            if entry is None:
                continue
            offset = seen.get(request_id, 0)
            seen[request_id] = offset + 1
            rows.append(i)
            mask_rows.append(entry[0] + offset)
        if not rows:
            return
        width = logits.shape[1]
        keep = torch.zeros((len(rows), width), dtype=torch.bool)
        cols = min(width, allowed.shape[1])
        keep[:, :cols] = allowed[torch.tensor(mask_rows)][:, :cols]
        index = torch.tensor(rows)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
