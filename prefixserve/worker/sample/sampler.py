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
     most likely token always stays), then draw from the renormalized distribution by inverse
     CDF with one uniform number from the request's generator, so a seeded request draws the
     same tokens whatever else is batched (uniforms are drawn in row order).
Rows are processed together as tensors: penalties touch only the (row, token) entries a request
has seen; top-k / top-p work on the 256 most likely tokens (a full sort only for a top-p row
whose nucleus is wider); per-row Python work is building penalty indices and one random number.
A batch of greedy rows without penalties or logprobs is a single argmax.
"""

from __future__ import annotations

import torch

from prefixserve.core.request import Request
from prefixserve.core.sched.output import PositionLogprobs

# Temperatures below this are greedy (dividing by them would overflow to inf / nan).
_GREEDY_TEMPERATURE = 1e-5


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without a copy when rows are all of t's rows in order."""
    if len(rows) == t.shape[0] and rows == list(range(len(rows))):
        return t
    return t[torch.tensor(rows)]


def needs_penalties(request: Request) -> bool:
    p = request.sampling_params
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def is_greedy(request: Request) -> bool:
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
            is_greedy(r) and not needs_penalties(r) and r.sampling_params.logprobs is None
            for r in requests
        )
        if plain_greedy:  # the common fast path: no copy, one argmax
            return [(int(t), None) for t in logits.argmax(dim=-1).tolist()]

        penalized_rows = [i for i, r in enumerate(requests) if needs_penalties(r)]
        # Penalties write into the logits: work on a copy, never on the caller's tensor.
        if penalized_rows:
            logits = logits.to(torch.float32, copy=True, memory_format=torch.contiguous_format)
        else:
            logits = logits.float()
        if penalized_rows:
            _apply_penalties(logits, [requests[i] for i in penalized_rows], penalized_rows)
            if not bool((_take(logits, penalized_rows) < float("inf")).all()):
                raise ValueError("the penalties made the logits non-finite (NaN or +inf)")

        sampled = torch.empty(len(requests), dtype=torch.int64)
        greedy_rows = [i for i, r in enumerate(requests) if is_greedy(r)]
        random_rows = [i for i, r in enumerate(requests) if not is_greedy(r)]
        if greedy_rows:
            sampled[torch.tensor(greedy_rows)] = _take(logits, greedy_rows).argmax(dim=-1)
        if random_rows:
            random_logits = _take(logits, random_rows)
            groups = _distributions(random_logits, [requests[i] for i in random_rows])
            # One uniform per random row, drawn in row order (whatever group a row lands in),
            # so rows sharing a generator (a request's draft rows) draw in position order.
            uniforms = torch.cat([draw_uniform(generators[i]) for i in random_rows])
            for rows, probs, ids in groups:
                batch_rows = [random_rows[j] for j in rows]
                picked = _draw(probs, uniforms[torch.tensor(rows)])
                if ids is not None:
                    picked = ids.gather(1, picked.unsqueeze(1)).squeeze(1)
                sampled[torch.tensor(batch_rows)] = picked

        logprob_rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        logprobs: dict[int, PositionLogprobs] = {}
        if logprob_rows:
            entries = gather_logprobs(
                torch.log_softmax(_take(logits, logprob_rows), dim=-1),
                _take(sampled, logprob_rows),
                [requests[i].sampling_params.logprobs or 0 for i in logprob_rows],
            )
            logprobs = dict(zip(logprob_rows, entries, strict=True))
        return [(int(t), logprobs.get(i)) for i, t in enumerate(sampled.tolist())]

    def compute_prompt_logprobs(
        self, logits: torch.Tensor, target_ids: list[int], num_top: int
    ) -> list[PositionLogprobs]:
        return compute_prompt_logprobs(logits, target_ids, num_top)


# What a logprob of -inf (a token with no probability) is reported as, vLLM's convention.
MIN_LOGPROB = -9999.0


def _finite(values: torch.Tensor) -> torch.Tensor:
    if bool(values.isnan().any()):
        raise ValueError("a logprob is NaN (the logits were not finite)")
    return values.clamp(min=MIN_LOGPROB)


def _apply_penalties(logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
    """Repetition, then frequency and presence penalties on `logits[rows]`, in place.

    Only the entries of tokens a request has seen are touched (a flat index per (row, token)),
    so the cost follows the history lengths, not batch x vocabulary.
    """
    vocab = logits.shape[1]
    flat_logits = logits.view(-1)

    repeat = [
        (row, r.sampling_params.repetition_penalty, set(r.history_token_ids))
        for row, r in zip(rows, requests, strict=True)
        if r.sampling_params.repetition_penalty != 1.0
    ]
    if repeat:
        index = torch.tensor(
            [row * vocab + t for row, _, tokens in repeat for t in tokens], dtype=torch.int64
        )
        factor = torch.repeat_interleave(
            torch.tensor([penalty for _, penalty, _ in repeat]),
            torch.tensor([len(tokens) for _, _, tokens in repeat]),
        )
        values = flat_logits[index]
        flat_logits[index] = torch.where(values > 0, values / factor, values * factor)

    counted = [
        (row, r)
        for row, r in zip(rows, requests, strict=True)
        if r.output_token_ids
        and (
            r.sampling_params.frequency_penalty != 0.0 or r.sampling_params.presence_penalty != 0.0
        )
    ]
    if counted:
        flat = torch.tensor(
            [row * vocab + t for row, r in counted for t in r.output_token_ids], dtype=torch.int64
        )
        index, counts = torch.unique(flat, return_counts=True)
        row_of = index // vocab
        frequency = torch.zeros(logits.shape[0])
        presence = torch.zeros(logits.shape[0])
        for row, r in counted:
            frequency[row] = r.sampling_params.frequency_penalty
            presence[row] = r.sampling_params.presence_penalty
        flat_logits[index] -= frequency[row_of] * counts + presence[row_of]


# Top-k / top-p rows work on this many most likely tokens (or top_k, when larger) instead of
# sorting the whole vocabulary; a top-p row whose nucleus is not inside them is sorted in full.
_CANDIDATES = 256

# One group of rows that share a candidate set shape: row i (an index into the batch given to
# `_distributions`) draws ids[j, c] with probability probs[j, c]; ids None = the whole vocabulary.
_Group = tuple[list[int], torch.Tensor, torch.Tensor | None]


def _distributions(logits: torch.Tensor, requests: list[Request]) -> list[_Group]:
    """Temperature, min-p, top-k and top-p on rows of logits -> the distributions to draw from."""
    params = [r.sampling_params for r in requests]
    vocab = logits.shape[1]
    logits = logits / torch.tensor([p.temperature for p in params]).unsqueeze(1)

    min_p = torch.tensor([p.min_p for p in params])
    if (min_p > 0).any():
        probs = torch.softmax(logits, dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))

    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    plain = [i for i in range(len(params)) if top_k[i] == vocab and top_p[i] >= 1.0]
    groups: list[_Group] = []
    if plain:
        groups.append((plain, torch.softmax(_take(logits, plain), dim=-1), None))
    plain_set = set(plain)
    filtered = [i for i in range(len(params)) if i not in plain_set]
    if not filtered:
        return groups

    rows = _take(logits, filtered)
    k_rows = torch.tensor([top_k[i] for i in filtered])
    p_rows = torch.tensor([top_p[i] for i in filtered])
    largest_k = max((k for k in k_rows.tolist() if k < vocab), default=0)
    width = min(vocab, max(_CANDIDATES, largest_k))
    values, ids = rows.topk(width, dim=-1)  # sorted, most likely first
    probs = _top_k_top_p(values, rows, k_rows, p_rows)
    # A top-p-only row whose top `width` tokens hold less than top_p of the mass needs more.
    short = (k_rows >= vocab) & (probs.isnan().any(dim=-1))
    keep = (~short).nonzero().flatten().tolist()
    if keep:
        groups.append(([filtered[j] for j in keep], _take(probs, keep), _take(ids, keep)))
    redo = short.nonzero().flatten().tolist()
    if redo:
        index = torch.tensor(redo)
        values, ids = rows[index].sort(dim=-1, descending=True)
        probs = _top_k_top_p(values, rows[index], k_rows[index], p_rows[index])
        groups.append(([filtered[j] for j in redo], probs, ids))
    return groups


def _top_k_top_p(
    values: torch.Tensor, rows: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Probabilities over the sorted candidate `values` after top-k and top-p.

    Top-p mass is measured against the whole (top-k-limited) distribution of `rows`. A row
    whose candidates hold less than top_p of the mass with more tokens outside them (only
    possible without top-k) comes back as NaN: its caller redoes it over the full vocabulary.
    """
    width = values.shape[1]
    position = torch.arange(width).unsqueeze(0)
    values = values.masked_fill(position >= top_k.unsqueeze(1), float("-inf"))
    limited = top_k.unsqueeze(1) <= width
    log_total = torch.where(
        limited.squeeze(1),
        torch.logsumexp(values, dim=-1),
        torch.logsumexp(rows, dim=-1),
    ).unsqueeze(1)
    probs = torch.exp(values - log_total)
    mass_before = probs.cumsum(dim=-1) - probs
    drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    probs = probs.masked_fill(drop, 0.0)
    incomplete = ~limited.squeeze(1) & ~drop.any(dim=-1) & (width < rows.shape[1])
    incomplete &= probs.sum(dim=-1) < top_p
    probs[incomplete] = float("nan")
    return probs / probs.sum(dim=-1, keepdim=True)


def draw_uniform(generator: torch.Generator | None) -> torch.Tensor:
    """The one uniform number a random row draws from its generator ([1] float64)."""
    return torch.rand(1, generator=generator, dtype=torch.float64)


def _draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token index per row by inverse-CDF sampling with the row's uniform (one number from
    its own generator, so a seeded row's draws do not depend on its neighbours or the
    vocabulary size)."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (uniform * cdf[:, -1]).unsqueeze(1)
    index = torch.searchsorted(cdf, target, right=True).squeeze(1)
    overshoot = index >= probs.shape[1]
    if overshoot.any():  # rounding put the target at the very end: take the last token with mass
        rows = overshoot.nonzero().flatten()
        index[rows] = (probs[rows] > 0).cumsum(dim=-1).argmax(dim=-1)
    return index


def sampling_distribution(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """The dense [rows, vocab] distribution random rows draw from (for tests and debugging)."""
    dense = torch.zeros(logits.shape, dtype=torch.float32)
    for rows, probs, ids in _distributions(logits.float(), requests):
        index = torch.tensor(rows)
        if ids is None:
            dense[index] = probs
        else:
            dense[index] = dense[index].scatter(1, ids, probs)
    return dense


def gather_logprobs(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: list[int]
) -> list[PositionLogprobs]:
    """Per row: (chosen token, its logprob, its 1-based rank), then the top num_top[row] tokens.

    Rank counts the tokens with a strictly larger logprob, plus one. Every logprob given back
    is finite (JSON has no infinities): -inf becomes MIN_LOGPROB, as in vLLM; a NaN is an error.
    """
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    max_top = max(num_top, default=0)
    top_lp_list: list[list[float]] = [[] for _ in num_top]
    top_ids_list: list[list[int]] = [[] for _ in num_top]
    if max_top:
        top_lp, top_ids = logprobs.topk(max_top, dim=-1)
        top_lp_list, top_ids_list = _finite(top_lp).tolist(), top_ids.tolist()
    chosen_list, chosen_lp_list = chosen.tolist(), _finite(chosen_lp).squeeze(1).tolist()
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
