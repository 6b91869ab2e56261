"""The benchmark workloads W0–W7, generated from a seed.

Every prompt is a list of token ids drawn from a *token pool*: token ids whose text is one
space-led lowercase word and that the tokenizer encodes back to exactly that id. A prompt made of
such tokens decodes to text ("`` apple river stone``") that re-encodes to the same ids, so a server
that only takes text prompts sees the same tokens, and the same shared prefixes, as one that takes
token ids.

The shapes:

- W0 no sharing (control): 64 requests of random 512-token prompts; 16 output tokens.
- W1 shared system prompts: 4 prefixes of 1,024 tokens x 8 requests, each with its own 64-token
  suffix; 16 output tokens, EOS ignored.
- W2 multi-turn chat: 8 conversations x 5 turns; each turn's prompt is the whole history plus a new
  64-token user message; 32 output tokens. A turn is sent only after the previous turn of its
  conversation has finished. The assistant replies in the history are fixed 32-token texts from
  the seed, not what the server generated, so every engine sees the same prompts.
- W3 document QA: 4 documents of 1,500 tokens, 6 questions each, asked round-robin across the
  documents (d0q0, d1q0, d2q0, d3q0, d0q1, ...), which is the worst order for an LRU cache;
  each question is 32 tokens; 16 output tokens.

- W4 pressure: 12 documents of 1,500 tokens, one 32-token question each per round, 4 rounds
  round-robin over the documents; 16 output tokens. Meant for a RAM pool that holds about 4
  documents: LRU then keeps none of them from one round to the next.
- W5 popularity: 64 system prompts of 1,024 tokens, 256 requests whose prompt is drawn with
  Zipf(1.1) popularity, each with its own 64-token suffix; 16 output tokens. Meant for a pool of
  about 16 of them.
- W6 restart: W1's shape (its own prompts). `prefixserve bench compare` runs it three times per
  engine: on a fresh server with an empty disk tier (cold), again on the same server (warm),
  then once more after the server was stopped and started again on the same store (restart).
  `prefixserve bench run`, which cannot restart the server it is pointed at, refuses it.

- W7 copy-heavy: 32 requests, each its own document of about 1,000 tokens (three paragraphs of
  an order log: names, towns, dates, numbers) followed by an instruction that quotes one of its
  paragraphs and asks for it back word for word, or (every fourth request) with one name
  changed; 256 output tokens. Meant for speculative decoding with n-gram drafts (prompt lookup):
  greedy outputs of the default model copy the quoted paragraph, so drafts found in the prompt
  are accepted. Unlike W0-W6 it is made of text, not of the token pool: each prompt is the
  model's chat template around one user message, tokenized by the model's tokenizer
  (`load_text_encoder`), so `make_workload` needs `text=` for it. Not among the defaults; run at
  the harness's default 8 requests in flight (`--concurrency`).

- W8 multi-tenant (for replicas and their routing): 8 tenants, each with its own 2,000-token
  system prompt; 16 users per tenant, each sending 3 turns (the system prompt, the user's
  history and a new 64-token message; the assistant replies in the history are fixed 32-token
  texts, as in W2), 32 output tokens; a turn waits for the user's previous one. Each request
  carries its tenant as `cache_salt`. First turns come in a shuffled order over all users. Run
  with `--request-rate` (Poisson arrivals) and a pool that holds all 8 system prompts only
  across the replicas' pools together (`--kv-pool-tokens`).

EOS is ignored everywhere so every engine decodes the same number of tokens.

W9 (agents: concurrent sessions of tool turns, each turn built from the server's previous
answer) cannot be a list of requests made in advance: it is `agent_workload`'s driver, which the
harness runs beside these. It does not ignore EOS: an agent's answer ends where the model
ends it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from pathlib import Path

from prefixserve.bench.copy_workload import load_text_encoder, make_w7
from prefixserve.bench.workload_types import BenchRequest, TextEncoder, Workload, scaled

# Re-exported: callers take every workload name from this module.
__all__ = ["BenchRequest", "TextEncoder", "Workload", "load_text_encoder", "make_w7"]

WORKLOAD_NAMES = ("W0", "W1", "W2", "W3", "W4", "W5", "W6", "W7", "W8")
# Run by `bench compare` as cold, warm and after-restart passes, never as one plain run.
RESTART_WORKLOADS = ("W6",)
# What `prefixserve bench run` runs unless told: W4 and W5 need a small KV pool to mean anything.
DEFAULT_WORKLOADS = ("W0", "W1", "W2", "W3")
# Made of text through the model's tokenizer and chat template (a TextEncoder), not of the pool.
TEXT_WORKLOADS = ("W7",)

_WORD = re.compile(r"^ [a-z]{2,}$")


def token_pool_from_tokenizer(tokenizer: object, max_tokens: int = 8192) -> list[int]:
    """Token ids that are one space-led lowercase word and round-trip through `tokenizer`.

    `tokenizer` is a `tokenizers.Tokenizer` (what `Tokenizer.from_file("tokenizer.json")` gives).
    The first `max_tokens` such ids, in id order, are returned; raises ValueError if the
    vocabulary has fewer than 256 of them.
    """
    vocab: dict[str, int] = tokenizer.get_vocab()  # type: ignore[attr-defined]
    candidates: list[tuple[int, str]] = []
    for token_id in sorted(vocab.values()):
        text = tokenizer.decode([token_id], skip_special_tokens=True)  # type: ignore[attr-defined]
        if _WORD.match(text):
            candidates.append((token_id, text))
    encodings = tokenizer.encode_batch(  # type: ignore[attr-defined]
        [text for _, text in candidates], add_special_tokens=False
    )
    pool = [tid for (tid, _), enc in zip(candidates, encodings, strict=True) if enc.ids == [tid]]
    if len(pool) < 256:
        raise ValueError(
            f"the tokenizer has only {len(pool)} round-trip-safe word tokens; at least 256 needed"
        )
    return pool[:max_tokens]


def load_token_pool(
    model_dir: Path,
) -> tuple[list[int], Callable[[list[int]], str], list[int]]:
    """From the model's tokenizer.json: its round-trip-safe word tokens, a decode function, and
    the special tokens its tokenizer puts before a text (a BOS, if it adds one; the default
    model adds none), which token-id prompts then get too, so that servers given text and
    servers given ids compute the same tokens."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.exists():
        raise ValueError(f"{model_dir} has no tokenizer.json; give a Hugging Face model directory")
    tokenizer = Tokenizer.from_file(str(path))

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    plain = tokenizer.encode(" the", add_special_tokens=False).ids
    full = tokenizer.encode(" the").ids
    cut = len(full) - len(plain)
    special_prefix = full[:cut] if full[cut:] == plain else []
    return token_pool_from_tokenizer(tokenizer), decode, special_prefix


class _Gen:
    """Random token sequences from a pool, all drawn from one seeded generator."""

    def __init__(self, pool: Sequence[int], seed: int) -> None:
        if len(pool) < 2:
            raise ValueError(f"the token pool needs at least 2 ids, got {len(pool)}")
        self.pool = list(pool)
        self.rng = random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        return self.rng.choices(self.pool, k=n)


def make_w0(pool: Sequence[int], seed: int = 0, scale: float = 1.0) -> Workload:
    gen = _Gen(pool, seed)
    n = scaled(64, scale)
    reqs = [BenchRequest(f"W0-{i:03d}", gen.tokens(512), max_tokens=16) for i in range(n)]
    return Workload("W0", f"no sharing: {n} random 512-token prompts, 16 out", reqs, seed)


def make_w1(pool: Sequence[int], seed: int = 0, scale: float = 1.0) -> Workload:
    gen = _Gen(pool, seed)
    per_prefix = scaled(8, scale)
    prefixes = [gen.tokens(1024) for _ in range(4)]
    reqs = [
        BenchRequest(f"W1-p{p}-{i:02d}", prefixes[p] + gen.tokens(64), 16, group=f"p{p}")
        for p in range(4)
        for i in range(per_prefix)
    ]
    # Requests arrive in a seeded random order, not grouped by prefix.
    gen.rng.shuffle(reqs)
    return Workload(
        "W1",
        f"shared system prompts: 4 x 1024-token prefixes x {per_prefix}, +64, 16 out",
        reqs,
        seed,
    )


def make_w2(pool: Sequence[int], seed: int = 0, scale: float = 1.0) -> Workload:
    gen = _Gen(pool, seed)
    num_conv = scaled(8, scale)
    turns = 5
    conversations: list[list[BenchRequest]] = []
    for c in range(num_conv):
        history: list[int] = []
        turns_of_c: list[BenchRequest] = []
        for t in range(turns):
            if t > 0:
                history = history + gen.tokens(32)  # the (fixed) assistant reply of turn t-1
            history = history + gen.tokens(64)  # the new user message
            previous = turns_of_c[-1].request_id if turns_of_c else None
            turns_of_c.append(
                BenchRequest(f"W2-c{c}-t{t}", list(history), 32, after=previous, group=f"c{c}")
            )
        conversations.append(turns_of_c)
    # Listed turn by turn (c0t0, c1t0, ..., c0t1, ...); `after` holds each turn back anyway.
    reqs = [conv[t] for t in range(turns) for conv in conversations]
    return Workload(
        "W2",
        f"multi-turn chat: {num_conv} conversations x {turns} turns, +64 per turn, 32 out",
        reqs,
        seed,
    )


def make_w3(pool: Sequence[int], seed: int = 0, scale: float = 1.0) -> Workload:
    gen = _Gen(pool, seed)
    num_q = scaled(6, scale)
    docs = [gen.tokens(1500) for _ in range(4)]
    reqs = [
        BenchRequest(f"W3-d{d}-q{q}", docs[d] + gen.tokens(32), 16, group=f"d{d}")
        for q in range(num_q)
        for d in range(4)
    ]
    return Workload(
        "W3",
        f"document QA: 4 x 1500-token documents x {num_q} questions, round-robin, 16 out",
        reqs,
        seed,
    )


def make_w4(pool: Sequence[int], seed: int = 0, scale: float = 1.0) -> Workload:
    gen = _Gen(pool, seed)
    rounds = scaled(4, scale)
    docs = [gen.tokens(1500) for _ in range(12)]
    reqs = [
        BenchRequest(f"W4-d{d:02d}-r{r}", docs[d] + gen.tokens(32), 16, group=f"d{d}")
        for r in range(rounds)
        for d in range(12)
    ]
    return Workload(
        "W4",
        f"pressure: 12 x 1500-token documents, {rounds} rounds round-robin, +32, 16 out",
        reqs,
        seed,
    )


def make_w5(pool: Sequence[int], seed: int = 0, scale: float = 1.0) -> Workload:
    gen = _Gen(pool, seed)
    n = scaled(256, scale)
    prompts = [gen.tokens(1024) for _ in range(64)]
    weights = [1.0 / (rank + 1) ** 1.1 for rank in range(64)]  # Zipf(1.1) over popularity rank
    picks = gen.rng.choices(range(64), weights=weights, k=n)
    reqs = [
        BenchRequest(f"W5-{i:03d}-s{p:02d}", prompts[p] + gen.tokens(64), 16, group=f"s{p}")
        for i, p in enumerate(picks)
    ]
    return Workload(
        "W5",
        f"popularity: {n} requests over 64 x 1024-token system prompts, Zipf(1.1), +64, 16 out",
        reqs,
        seed,
    )


def make_w6(pool: Sequence[int], seed: int = 0, scale: float = 1.0) -> Workload:
    # W1's maker on W6's own seed: make_workload gives each workload its own stream, so W6's
    # prompts are not W1's (a server that ran W1 would otherwise make W6's cold pass warm).
    w1 = make_w1(pool, seed, scale)
    for req in w1.requests:
        req.request_id = "W6" + req.request_id[2:]
    return Workload("W6", f"restart (cold, warm, after a restart): {w1.description}", w1.requests)


def make_w8(pool: Sequence[int], seed: int = 0, scale: float = 1.0) -> Workload:
    gen = _Gen(pool, seed)
    users = scaled(16, scale)
    systems = [gen.tokens(2000) for _ in range(8)]
    conversations: list[list[BenchRequest]] = []
    for t, system in enumerate(systems):
        for u in range(users):
            history = list(system)
            turns: list[BenchRequest] = []
            for k in range(3):
                if k > 0:
                    history = history + gen.tokens(32)  # the (fixed) reply to turn k-1
                history = history + gen.tokens(64)
                turns.append(
                    BenchRequest(
                        f"W8-t{t}-u{u:02d}-k{k}",
                        list(history),
                        32,
                        after=turns[-1].request_id if turns else None,
                        group=f"t{t}",
                        tenant=f"tenant-{t}",
                    )
                )
            conversations.append(turns)
    order = list(range(len(conversations)))
    gen.rng.shuffle(order)
    reqs = [conversations[i][k] for k in range(3) for i in order]
    return Workload(
        "W8",
        f"multi-tenant: 8 tenants x 2000-token system prompts, {users} users each x 3 turns, "
        "+64 per turn, 32 out",
        reqs,
        seed,
    )


# W7's documents: an order log, sentence by sentence from these templates. Names, towns, dates
# and numbers make most of a paragraph's 4-grams unique in its document, so the default model
# copying it back is copying that paragraph (its induction finds the one place to copy from).
# Each maker takes (pool, seed, scale), and a TextEncoder after them if it is in TEXT_WORKLOADS.
_MAKERS: dict[str, Callable[..., Workload]] = {
    "W0": make_w0,
    "W1": make_w1,
    "W2": make_w2,
    "W3": make_w3,
    "W4": make_w4,
    "W5": make_w5,
    "W6": make_w6,
    "W7": make_w7,
    "W8": make_w8,
}


def make_workload(
    name: str,
    pool: Sequence[int],
    seed: int = 0,
    scale: float = 1.0,
    decode: Callable[[list[int]], str] | None = None,
    text: TextEncoder | None = None,
) -> Workload:
    """Build workload `name` (W0..W7) from `pool` and `seed`.

    `scale` multiplies the number of requests (W0 requests, W1 requests per prefix, W2
    conversations, W3 questions per document, W4 rounds, W5 requests, W7 requests, W8 users
    per tenant), never the
    token lengths. With `decode`, each request also carries its prompt as text for servers that
    only take text. The workloads made of text (TEXT_WORKLOADS: W7) need `text`, the model's
    TextEncoder (`load_text_encoder`); the others ignore it.
    """
    key = name.upper()
    if key not in _MAKERS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    # Each workload gets its own stream so W1's prompts do not depend on which others were built.
    stream = seed * 1000 + WORKLOAD_NAMES.index(key)
    if key in TEXT_WORKLOADS:
        if text is None:
            raise ValueError(
                f"{key} is made of text: it needs the model's tokenizer "
                "(text=load_text_encoder(model_dir))"
            )
        workload = _MAKERS[key](pool, stream, scale, text)
    else:
        workload = _MAKERS[key](pool, stream, scale)
    workload.seed = seed
    if decode is not None:
        for req in workload.requests:
            req.prompt_text = decode(req.prompt_token_ids)
    return workload


def prepend_tokens(requests: Sequence[BenchRequest], prefix_ids: Sequence[int]) -> None:
    """Put `prefix_ids` (whatever special tokens the tokenizer itself adds before a text, as
    `load_token_pool` reads them from tokenizer.json: none for the default model, whose
    GGUF says add_bos_token = False; `<bos>` for Gemma 3) before every token-id prompt, so a
    server given token ids sees what one given the text sees; `prompt_text` is left as is."""
    for req in requests:
        req.prompt_token_ids = [*prefix_ids, *req.prompt_token_ids]


WARMUP_LENGTHS = (64, 512, 1024, 1536)


def make_warmup(pool: Sequence[int], n: int = 4, seed: int = 0) -> list[BenchRequest]:
    """`n` short-output requests of 64 to 1,536 prompt tokens, so the servers have run (and
    compiled, for vLLM) the shapes the workloads need; they share no prefix with any workload
    (their own random stream)."""
    gen = _Gen(pool, 10_000_019 + seed)
    return [
        BenchRequest(f"warmup-{i}", gen.tokens(WARMUP_LENGTHS[i % len(WARMUP_LENGTHS)]), 4)
        for i in range(n)
    ]
