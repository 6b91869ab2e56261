"""W7 copy-heavy, the workload made of text: order-log documents and an instruction that quotes
one of their paragraphs to repeat (or lightly edit), through the model's tokenizer and chat
template (`load_text_encoder`). See `workloads.py` for its shape."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from pathlib import Path

from prefixserve.bench.workload_types import BenchRequest, TextEncoder, Workload, scaled


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
    n = scaled(32, scale)
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
