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

EOS is ignored everywhere so every engine decodes the same number of tokens.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

WORKLOAD_NAMES = ("W0", "W1", "W2", "W3", "W4", "W5", "W6", "W7")
# Run by `bench compare` as cold, warm and after-restart passes, never as one plain run.
RESTART_WORKLOADS = ("W6",)
# What `prefixserve bench run` runs unless told: W4 and W5 need a small KV pool to mean anything.
DEFAULT_WORKLOADS = ("W0", "W1", "W2", "W3")
# Made of text through the model's tokenizer and chat template (a TextEncoder), not of the pool.
TEXT_WORKLOADS = ("W7",)

_WORD = re.compile(r"^ [a-z]{2,}$")


@dataclass(slots=True)
class BenchRequest:
    """One request of a workload.

    `after` names the request that must finish before this one is sent (the previous turn of a
    W2 conversation); `group` names what it shares a prefix with (a W1 system prompt, a W2
    conversation, a W3 document), or is None.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    prompt_text: str | None = None
    after: str | None = None
    group: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class Workload:
    name: str
    description: str
    requests: list[BenchRequest] = field(default_factory=list)
    seed: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.num_prompt_tokens for r in self.requests)


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


@dataclass(frozen=True, slots=True)
class TextEncoder:
    """What a workload made of text (W7) needs of the model's tokenizer.

    `encode`: text -> token ids, no special tokens added. `chat`: one user message -> the ids of
    a whole prompt (the chat template's turn markers around it and the assistant's generation
    prompt; a model without a template gets the text and a blank line), less the special
    tokens its tokenizer puts before any text (`load_token_pool`'s special prefix), which
    `prepend_tokens` adds back to token-id prompts and text-taking servers add themselves.
    """

    encode: Callable[[str], list[int]]
    chat: Callable[[str], list[int]]


def load_text_encoder(model_dir: Path) -> TextEncoder:
    """The TextEncoder of the model in `model_dir` (its tokenizer and chat template)."""
    from prefixserve.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    plain = encode(" the")
    full = tokenizer.encode(" the")
    cut = len(full) - len(plain)
    special_prefix = full[:cut] if full[cut:] == plain else []

    def chat(user: str) -> list[int]:
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": user}])
        else:
            ids = encode(user + "\n\n")
        if special_prefix and ids[: len(special_prefix)] == special_prefix:
            ids = ids[len(special_prefix) :]
        return ids

    return TextEncoder(encode=encode, chat=chat)


class _Gen:
    """Random token sequences from a pool, all drawn from one seeded generator."""

    def __init__(self, pool: Sequence[int], seed: int) -> None:
        if len(pool) < 2:
            raise ValueError(f"the token pool needs at least 2 ids, got {len(pool)}")
        self.pool = list(pool)
        self.rng = random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        return self.rng.choices(self.pool, k=n)


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def make_w0(pool: Sequence[int], seed: int = 0, scale: float = 1.0) -> Workload:
    gen = _Gen(pool, seed)
    n = _scaled(64, scale)
    reqs = [BenchRequest(f"W0-{i:03d}", gen.tokens(512), max_tokens=16) for i in range(n)]
    return Workload("W0", f"no sharing: {n} random 512-token prompts, 16 out", reqs, seed)


def make_w1(pool: Sequence[int], seed: int = 0, scale: float = 1.0) -> Workload:
    gen = _Gen(pool, seed)
    per_prefix = _scaled(8, scale)
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
    num_conv = _scaled(8, scale)
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
    num_q = _scaled(6, scale)
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
    rounds = _scaled(4, scale)
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
    n = _scaled(256, scale)
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


# W7's documents: an order log, sentence by sentence from these templates. Names, towns, dates
# and numbers make most of a paragraph's 4-grams unique in its document, so the default model
# copying it back is copying that paragraph (its induction finds the one place to copy from).
_FIRST = (
    "Anna Ben Clara David Emma Felix Grace Henry Iris Jonas Laura Martin Nora Oscar Paula Simon "
    "Tara Victor Wendy Yusuf Alice Bruno Carmen Daniel Elena Frank Greta Hugo Ines Jack Karen Leo "
    "Maria Nina Omar Peter Rosa Sam Tom Ulla Vera"
).split()
_LAST = (
    "Berg Cole Dunn Ellis Fox Grant Hale Irwin Jensen Klein Lopez Moore Nash Ortiz Price Quinn "
    "Reed Stone Turner Vance Walsh Young Brooks Carter Diaz Evans Fisher Gray Hayes Kim"
).split()
_TOWNS = (
    "Oslo Lyon Porto Dublin Vienna Krakow Bergen Malaga Turin Leeds Ghent Basel Bremen Genoa "
    "Seville Utrecht Tampere Split Riga Zagreb"
).split()
_ITEMS = (
    "lamps chairs tables bicycles kettles blankets lanterns clocks mirrors rugs books maps "
    "jackets boots umbrellas teapots baskets candles radios desks"
).split()
_COLORS = "green red blue white black yellow orange silver golden brown grey purple".split()
_MONTHS = (
    "January February March April May June July August September October November December"
).split()
_DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday".split()
_STREETS = "King Mill Bridge Church Station Market Garden River Park Castle Hill Lake".split()
_SHOPS = (
    "the bakery|the library|the museum shop|the town hall|the hotel|the school|the hospital|"
    "the theatre|the harbour office|the market hall"
).split("|")
_VEHICLES = ("a small van", "a truck", "the night train", "a cargo ship", "a courier on a bicycle")


def _person(r: random.Random) -> str:
    return f"{r.choice(_FIRST)} {r.choice(_LAST)}"


def _date(r: random.Random) -> str:
    return f"{r.randint(1, 28)} {r.choice(_MONTHS)}"


def _goods(r: random.Random) -> str:
    return f"{r.randint(2, 90)} {r.choice(_COLORS)} {r.choice(_ITEMS)}"


_SENTENCES: tuple[Callable[[random.Random], str], ...] = (
    lambda r: (
        f"On {_date(r)}, {_person(r)} from {r.choice(_TOWNS)} ordered {_goods(r)} for "
        f"{r.choice(_SHOPS)} on {r.choice(_STREETS)} Street."
    ),
    lambda r: (
        f"The order left {r.choice(_TOWNS)} on {r.choice(_DAYS)} with {r.choice(_VEHICLES)}, "
        f"and {_person(r)} paid {r.randint(10, 999)} euros for it."
    ),
    lambda r: (
        f"{_person(r)} called from {r.choice(_TOWNS)} to say that {r.randint(2, 40)} of the "
        f"{r.choice(_ITEMS)} had arrived broken."
    ),
    lambda r: (
        f"A refund of {r.randint(5, 500)} euros went to {_person(r)} in {r.choice(_TOWNS)}, "
        f"and {_goods(r)} were sent again on {_date(r)}."
    ),
    lambda r: (
        f"Because the road to {r.choice(_TOWNS)} was closed, {_person(r)} waited "
        f"{r.randint(2, 9)} days for {_goods(r)}."
    ),
    lambda r: (
        f"{_person(r)} wrote a letter asking whether {r.choice(_SHOPS)} could pay for the "
        f"{r.choice(_ITEMS)} in {r.randint(2, 6)} parts."
    ),
    lambda r: (
        f"The warehouse in {r.choice(_TOWNS)} counted {r.randint(100, 999)} {r.choice(_ITEMS)} "
        f"on {r.choice(_DAYS)}, which is {r.randint(2, 60)} fewer than in {r.choice(_MONTHS)}."
    ),
    lambda r: (
        f"Last {r.choice(_DAYS)}, {_person(r)} and {_person(r)} packed {_goods(r)} at the store "
        f"on {r.choice(_STREETS)} Street."
    ),
    lambda r: (
        f"{_person(r)} asked for {r.choice(_COLORS)} {r.choice(_ITEMS)} instead of "
        f"{r.choice(_COLORS)} ones, so the order was changed on {_date(r)}."
    ),
    lambda r: (
        f"The invoice number {r.randint(1000, 9999)} for {r.choice(_SHOPS)} in "
        f"{r.choice(_TOWNS)} was sent to {_person(r)} by mail."
    ),
    lambda r: (
        f"When the ferry from {r.choice(_TOWNS)} was late, {_person(r)} drove the "
        f"{r.choice(_ITEMS)} to {r.choice(_SHOPS)} in {r.randint(2, 9)} hours."
    ),
    lambda r: (
        f"Nobody could find the receipt for {_goods(r)}, so {_person(r)} checked every box in "
        f"the cellar until {r.randint(2, 11)} o'clock."
    ),
    lambda r: (
        f"In {r.choice(_MONTHS)} the price of {r.choice(_COLORS)} {r.choice(_ITEMS)} rose from "
        f"{r.randint(5, 60)} to {r.randint(61, 120)} euros, and {_person(r)} complained."
    ),
    lambda r: (
        f"Her cousin {_person(r)} repaired {r.randint(2, 30)} old {r.choice(_ITEMS)} for "
        f"{r.choice(_SHOPS)} without asking for money."
    ),
    lambda r: (
        f"After a long phone call with {r.choice(_TOWNS)}, {_person(r)} agreed to keep "
        f"{_goods(r)} until {r.choice(_DAYS)}."
    ),
    lambda r: (
        f"Twelve years ago {_person(r)} opened a small shop in {r.choice(_TOWNS)} that sold only "
        f"{r.choice(_COLORS)} {r.choice(_ITEMS)}."
    ),
)

W7_DOC_TOKENS = 1000
W7_PARAGRAPHS = 3


def _paragraph(r: random.Random, encode: Callable[[str], list[int]], min_tokens: int) -> str:
    """Sentences until the paragraph has `min_tokens` tokens (counted sentence by sentence), no
    template twice in a row of len(_SENTENCES) (a template repeated close by is where the model
    loses its place)."""
    sentences: list[str] = []
    deck: list[Callable[[random.Random], str]] = []
    n = 0
    while n < min_tokens:
        if not deck:
            deck = list(_SENTENCES)
            r.shuffle(deck)
        sentence = deck.pop()(r)
        sentences.append(sentence)
        n += len(encode(" " + sentence))
    return " ".join(sentences)


def _w7_request(r: random.Random, text: TextEncoder, edit: bool) -> str:
    """One W7 user message: a document, then an instruction quoting one of its paragraphs."""
    paragraphs = [
        _paragraph(r, text.encode, W7_DOC_TOKENS // W7_PARAGRAPHS) for _ in range(W7_PARAGRAPHS)
    ]
    document = "\n\n".join(paragraphs)
    part = r.choice(paragraphs)
    if not edit:
        ask = "Repeat this paragraph of the text above exactly, word for word:"
        return f"{document}\n\n{ask}\n\n{part}"
    # The light edit: one name of the paragraph swapped for a name the document does not hold.
    words = part.split()
    old = next(f"{a} {b.rstrip('.,')}" for a, b in itertools.pairwise(words) if a in _FIRST)
    new = old
    while new in document:
        new = _person(r)
    return (
        f"{document}\n\nRewrite this paragraph of the text above, writing {new} instead of "
        f"{old}:\n\n{part}"
    )


def make_w7(pool: Sequence[int], seed: int, scale: float, text: TextEncoder) -> Workload:
    """W7 (see the module's docstring). `pool` is not used: W7 is made of text."""
    del pool
    rng = random.Random(seed)
    n = _scaled(32, scale)
    reqs = [
        BenchRequest(f"W7-{i:03d}", text.chat(_w7_request(rng, text, edit=i % 4 == 3)), 256)
        for i in range(n)
    ]
    return Workload(
        "W7",
        f"copy-heavy: {n} x ~{W7_DOC_TOKENS}-token documents, a paragraph of each quoted back "
        "(every 4th edited), 256 out",
        reqs,
        seed,
    )


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
    conversations, W3 questions per document, W4 rounds, W5 requests, W7 requests), never the
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
