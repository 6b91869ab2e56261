"""Logits -> next tokens: penalties, greedy or random sampling, and logprobs.

The order, per row (vLLM v1's order):
  1. penalties on the model's logits: repetition (over prompt + output, Hugging Face semantics:
     a positive logit is divided by the penalty, a negative one multiplied), then frequency and
     presence (over output tokens only, OpenAI semantics: `- f * count - p * (count > 0)`);
  2. logprobs, when asked, are log_softmax of these penalized logits: the model's distribution
     after penalties and before temperature, top-k, top-p and min-p, so that they do not depend
     on how a token was drawn (vLLM's "raw" choice, except that vLLM's raw_logprobs are taken
     before penalties too);
  3. greedy rows (temperature 0, or below 1e-5 as in vLLM) take the argmax;
  4. random rows: divide by temperature, min-p (drop tokens below min_p * the top probability),
     top-k, top-p (keep the smallest set of most likely tokens whose mass reaches top_p; the
     most likely token always stays), then draw from the renormalized distribution with the
     request's generator, so a seeded request draws the same tokens whatever else is batched.
Rows are processed together as tensors; per-row Python work is limited to building the penalty
inputs and the draw with each row's own generator. A batch of greedy rows without penalties or
logprobs is a single argmax.
"""

from __future__ import annotations

import torch

from prefixserve.batch import PositionLogprobs
from prefixserve.request import Request

# Temperatures below this are greedy (dividing by them would overflow to inf / nan).
_GREEDY_TEMPERATURE = 1e-5


def _needs_penalties(request: Request) -> bool:
    p = request.sampling_params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _is_greedy(request: Request) -> bool:
    return request.sampling_params.temperature < _GREEDY_TEMPERATURE


class Sampler:
    """`Sampler()(logits, requests, generators)` -> one (token_id, logprobs or None) per row.

    `logits` is [num_reqs, vocab] (any float dtype; computed in float32 and never modified in
    place); `requests[i]` supplies row i's sampling params and token history; `generators[i]`
    is the torch.Generator for row i's random draw (None = torch's default generator).
    """

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        generators: list[torch.Generator | None],
    ) -> list[tuple[int, PositionLogprobs | None]]:
        if logits.dim() != 2 or not logits.shape[0] == len(requests) == len(generators):
            raise ValueError(
                f"logits must be [num_reqs, vocab] with one request and generator per row; got "
                f"{tuple(logits.shape)}, {len(requests)} requests, {len(generators)} generators"
            )
        if not requests:
            return []
        plain_greedy = all(
            _is_greedy(r) and not _needs_penalties(r) and r.sampling_params.logprobs is None
            for r in requests
        )
        if plain_greedy:  # the common fast path: no copy, one argmax
            return [(int(t), None) for t in logits.argmax(dim=-1).tolist()]

        penalized_rows = [i for i, r in enumerate(requests) if _needs_penalties(r)]
        # Penalties write into the logits: work on a copy, never on the caller's tensor.
        logits = logits.to(torch.float32, copy=bool(penalized_rows))
        if penalized_rows:
            _apply_penalties(logits, [requests[i] for i in penalized_rows], penalized_rows)

        sampled = torch.empty(len(requests), dtype=torch.int64)
        greedy_rows = [i for i, r in enumerate(requests) if _is_greedy(r)]
        random_rows = [i for i, r in enumerate(requests) if not _is_greedy(r)]
        if greedy_rows:
            index = torch.tensor(greedy_rows)
            sampled[index] = logits[index].argmax(dim=-1)
        if random_rows:
            index = torch.tensor(random_rows)
            probs = _sampling_probs(logits[index], [requests[i] for i in random_rows])
            draws = [
                torch.multinomial(probs[j], 1, generator=generators[i])
                for j, i in enumerate(random_rows)
            ]
            sampled[index] = torch.cat(draws)

        logprob_rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        logprobs: dict[int, PositionLogprobs] = {}
        if logprob_rows:
            index = torch.tensor(logprob_rows)
            entries = gather_logprobs(
                torch.log_softmax(logits[index], dim=-1),
                sampled[index],
                [requests[i].sampling_params.logprobs or 0 for i in logprob_rows],
            )
            logprobs = dict(zip(logprob_rows, entries, strict=True))
        return [(int(t), logprobs.get(i)) for i, t in enumerate(sampled.tolist())]

    def compute_prompt_logprobs(
        self, logits: torch.Tensor, target_ids: list[int], num_top: int
    ) -> list[PositionLogprobs]:
        return compute_prompt_logprobs(logits, target_ids, num_top)


def _apply_penalties(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """Repetition, frequency and presence penalties on `logits[rows]`, in place."""
    vocab = logits.shape[1]
    index = torch.tensor(rows)
    sub = logits[index]
    params = [r.sampling_params for r in requests]

    # Output-token counts, one row per request: a single flat index_add over all rows.
    out_flat = [j * vocab + t for j, r in enumerate(requests) for t in r.output_token_ids]
    counts = torch.zeros(len(rows) * vocab, dtype=torch.float32)
    if out_flat:
        flat = torch.tensor(out_flat, dtype=torch.int64)
        counts.index_add_(0, flat, torch.ones(len(out_flat)))
    counts = counts.view(len(rows), vocab)

    repetition = torch.tensor([p.repetition_penalty for p in params]).unsqueeze(1)
    if (repetition != 1.0).any():
        seen_flat = [
            j * vocab + t
            for j, r in enumerate(requests)
            if r.sampling_params.repetition_penalty != 1.0
            for t in set(r.all_token_ids)
        ]
        seen = torch.zeros(len(rows) * vocab, dtype=torch.bool)
        seen[torch.tensor(seen_flat, dtype=torch.int64)] = True
        seen = seen.view(len(rows), vocab)
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen, penalized, sub)

    frequency = torch.tensor([p.frequency_penalty for p in params]).unsqueeze(1)
    presence = torch.tensor([p.presence_penalty for p in params]).unsqueeze(1)
    sub = sub - frequency * counts - presence * (counts > 0).float()
    logits[index] = sub


def _sampling_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Temperature, min-p, top-k and top-p on rows of logits -> probabilities to draw from."""
    params = [r.sampling_params for r in requests]
    vocab = logits.shape[1]
    logits = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)

    min_p = torch.tensor([p.min_p for p in params])
    if (min_p > 0).any():
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))

    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params])
    if (top_k < vocab).any() or (top_p < 1.0).any():
        sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
        # top-k: everything below the k-th largest logit goes (ties with it stay).
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        # top-p: drop a token when the mass of the more likely ones already reaches top_p.
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, sorted_ids, sorted_logits)
    return torch.softmax(logits, dim=-1)


def gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int]
) -> list[PositionLogprobs]:
    """Per row: (chosen token, its logprob, its 1-based rank), then the top num_top[row] tokens.

    Rank counts the tokens with a strictly larger logprob, plus one.
    """
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    max_top = max(num_top, default=0)
    top_lp_list: list[list[float]] = [[] for _ in num_top]
    top_ids_list: list[list[int]] = [[] for _ in num_top]
    if max_top:
        top_lp, top_ids = logprobs.topk(max_top, dim=-1)
        top_lp_list, top_ids_list = top_lp.tolist(), top_ids.tolist()
    chosen_list, chosen_lp_list = chosen.tolist(), chosen_lp.squeeze(1).tolist()
    rank_list = ranks.tolist()
    out: list[PositionLogprobs] = []
    for row, n in enumerate(num_top):
        entry: PositionLogprobs = [(chosen_list[row], chosen_lp_list[row], rank_list[row])]
        entry.extend((top_ids_list[row][k], top_lp_list[row][k], k + 1) for k in range(n))
        out.append(entry)
    return out


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: list[int], num_top: int
) -> list[PositionLogprobs]:
    """Logprobs of each prompt token given the tokens before it.

    Row i of `logits` [n, vocab] is the model's output at the position before `target_ids[i]`.
    Each entry is the target's (token, logprob, rank), then the top `num_top` tokens; the
    distribution is the raw model's (no penalties or temperature).
    """
    if logits.shape[0] != len(target_ids):
        raise ValueError(
            f"need one target id per logits row, got {len(target_ids)} for {logits.shape[0]} rows"
        )
    if not target_ids:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(target_ids, dtype=torch.int64)
    return gather_logprobs(logprobs, targets, [num_top] * len(target_ids))
