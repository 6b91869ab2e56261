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

    def __init__(
        self, output: SchedulerOutput, vocab_size: int, logits_width: int, executor: Executor
    ) -> None:
        """`vocab_size`: the tokenizer's (the grammar's) vocabulary; `logits_width`: the
        model's output width (often padded past it)."""
        self.forced: dict[str, int] = {}
        # request id -> why its mask could not be made (it fails alone; the others sample).
        self.failed: dict[str, str] = {}
        self._owner: dict[int, str] = {}  # first row -> request id
        # request id -> (first row in `_bits`, its drafts)
        self._rows: dict[str, tuple[int, list[int]]] = {}
        jobs: list[tuple[GrammarState, int, list[int]]] = []
        num_rows = 0
        for s in output.scheduled:
            state = s.request.structured_output
            if state is None or not s.samples or not state.ready or state.finishing:
                continue  # (a finishing request's sample is dropped: no mask)
            forced = state.forced_next
            if forced is not None:
                self.forced[s.request.request_id] = forced
                continue
            self._rows[s.request.request_id] = (num_rows, s.draft_token_ids)
            self._owner[num_rows] = s.request.request_id
            jobs.append((state, num_rows, s.draft_token_ids))
            num_rows += len(s.draft_token_ids) + 1
        self.vocab_size = vocab_size
        self.logits_width = logits_width
        self._bits = np.zeros((num_rows, mask_words(vocab_size)), dtype=np.int32)
        self._done: Future | None = executor.submit(self._fill, jobs) if jobs else None

    def _fill(self, jobs: list[tuple[GrammarState, int, list[int]]]) -> torch.Tensor:
        """The bitmask rows, then what the step thread applies: True where a token is ruled
        out, as wide as the logits (ids past the tokenizer's vocabulary are ruled out)."""
        for state, first, drafts in jobs:
            try:
                state.fill_masks(self._bits[first : first + len(drafts) + 1], drafts)
            except Exception as exc:  # noqa: BLE001 - this request's grammar, not the step's
                self.failed[self._owner[first]] = f"structured output: {exc}"
        allowed = np.unpackbits(self._bits.view(np.uint8), axis=1, bitorder="little")
        ruled_out = np.ones((allowed.shape[0], self.logits_width), dtype=np.bool_)
        width = min(self.vocab_size, self.logits_width)
        np.logical_not(allowed[:, :width], out=ruled_out[:, :width], dtype=np.bool_)
        return torch.from_numpy(ruled_out)

    def forced_token(self, request_id: str) -> int | None:
        return self.forced.get(request_id)

    def wait(self) -> None:
        """Until the mask thread is done with this step's matchers (before they advance)."""
        if self._done is not None:
            self._done.exception()

    def apply(self, logits: torch.Tensor, row_request_ids: list[str]) -> dict[str, str]:
        """Mask, in place, the logits rows of structured requests (`row_request_ids[i]` owns row
        i; a request's rows come in draft order): ruled-out tokens become -inf. One fused fill
        when every row is a structured one in mask order (the usual batch of JSON answers).
        Returns the requests whose masks failed (request id -> why): they fail alone."""
        if self._done is None:
            return {}
        ruled_out = self._done.result()
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
            return self.failed
        if logits.shape[1] != ruled_out.shape[1]:
            raise ValueError(
                f"logits have {logits.shape[1]} columns; the masks were made for "
                f"{ruled_out.shape[1]}"
            )
        everything = list(range(len(row_request_ids)))
        if rows == everything and mask_rows == everything[: ruled_out.shape[0]]:
            logits.masked_fill_(ruled_out[: len(rows)], float("-inf"))
            return self.failed
        index = torch.tensor(rows)
        chosen = ruled_out[torch.tensor(mask_rows)]
        logits[index] = logits[index].masked_fill(chosen, float("-inf"))
        return self.failed
