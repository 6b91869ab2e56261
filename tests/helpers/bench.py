"""Made-up text for the benchmark tests: words, and a byte-level BPE (the SmolLM2/GPT-2 kind)
trained on them, which stands in for a model's tokenizer."""

from __future__ import annotations

import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers


def words(seed: int, n: int) -> list[str]:
    """`n` reproducible lowercase words of 3 to 7 letters."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choices(letters, k=rng.randint(3, 7))) for _ in range(n)]


def byte_level_bpe(seed: int, special_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """A byte-level BPE of 3,000 ids trained on 400 words of `words(seed, 400)`."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus_words = words(seed, 400)
    corpus = [" ".join(corpus_words[i : i + 20]) for i in range(0, 400, 20)] * 30
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return tok
