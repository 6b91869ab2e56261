from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from prefixserve.bench.workloads import (
    WORKLOAD_NAMES,
    make_warmup,
    make_workload,
    token_pool_from_tokenizer,
)

POOL = list(range(1000, 1600))


def _words(seed: int, n: int) -> list[str]:
    import random

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return ["".join(rng.choices(letters, k=rng.randint(3, 7))) for _ in range(n)]


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE (the SmolLM2/GPT-2 kind) trained here on made-up words."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    words = _words(0, 400)
    corpus = [" ".join(words[i : i + 20]) for i in range(0, 400, 20)] * 30
    trainer = trainers.BpeTrainer(
        vocab_size=3000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_workload_is_a_pure_function_of_its_seed(name):
    a = make_workload(name, POOL, seed=3)
    b = make_workload(name, POOL, seed=3)
    c = make_workload(name, POOL, seed=4)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.request_id for r in a.requests] == [r.request_id for r in b.requests]
    assert [r.prompt_token_ids for r in a.requests] != [r.prompt_token_ids for r in c.requests]
    assert all(t in set(POOL) for r in a.requests for t in r.prompt_token_ids)


def test_workloads_of_one_seed_share_no_prompt():
    firsts = {
        name: make_workload(name, POOL, seed=0).requests[0].prompt_token_ids[:64]
        for name in WORKLOAD_NAMES
    }
    assert len({tuple(v) for v in firsts.values()}) == len(WORKLOAD_NAMES)


def test_w0_is_64_unshared_512_token_prompts():
    w = make_workload("W0", POOL)
    assert len(w.requests) == 64
    assert all(r.num_prompt_tokens == 512 and r.max_tokens == 16 for r in w.requests)
    assert len({tuple(r.prompt_token_ids[:16]) for r in w.requests}) == 64


def test_w1_is_4_prefixes_of_1024_times_8_with_own_64_token_suffixes():
    w = make_workload("W1", POOL)
    assert len(w.requests) == 32
    assert all(r.num_prompt_tokens == 1024 + 64 and r.max_tokens == 16 for r in w.requests)
    by_group: dict[str, list] = {}
    for r in w.requests:
        by_group.setdefault(r.group, []).append(r)
    assert sorted(by_group) == ["p0", "p1", "p2", "p3"]
    for reqs in by_group.values():
        assert len(reqs) == 8
        assert len({tuple(r.prompt_token_ids[:1024]) for r in reqs}) == 1
        assert len({tuple(r.prompt_token_ids[1024:]) for r in reqs}) == 8
    assert len({tuple(r.prompt_token_ids[:1024]) for r in w.requests}) == 4
    # arrivals are mixed, not grouped by prefix
    assert [r.group for r in w.requests] != sorted(r.group for r in w.requests)


def test_w2_turns_extend_the_whole_history_and_wait_for_the_previous_turn():
    w = make_workload("W2", POOL)
    assert len(w.requests) == 40
    by_id = {r.request_id: r for r in w.requests}
    for c in range(8):
        turns = [by_id[f"W2-c{c}-t{t}"] for t in range(5)]
        assert turns[0].after is None and turns[0].num_prompt_tokens == 64
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.after == prev.request_id
            assert cur.prompt_token_ids[: prev.num_prompt_tokens] == prev.prompt_token_ids
            assert cur.num_prompt_tokens == prev.num_prompt_tokens + 32 + 64
            assert cur.max_tokens == 32
    # listed turn by turn across conversations
    assert [r.request_id for r in w.requests[:2]] == ["W2-c0-t0", "W2-c1-t0"]


def test_w3_asks_6_questions_of_4_documents_round_robin():
    w = make_workload("W3", POOL)
    assert len(w.requests) == 24
    assert [r.group for r in w.requests[:8]] == ["d0", "d1", "d2", "d3"] * 2
    docs = {r.group: r.prompt_token_ids[:1500] for r in w.requests}
    assert len({tuple(d) for d in docs.values()}) == 4
    for r in w.requests:
        assert r.prompt_token_ids[:1500] == docs[r.group]
        assert r.num_prompt_tokens == 1500 + 32


def test_scale_changes_request_counts_not_lengths():
    assert len(make_workload("W0", POOL, scale=0.25).requests) == 16
    assert len(make_workload("W1", POOL, scale=0.5).requests) == 16
    assert len(make_workload("W2", POOL, scale=0.25).requests) == 10
    w3 = make_workload("W3", POOL, scale=0.01)
    assert len(w3.requests) == 4 and w3.requests[0].num_prompt_tokens == 1532


def test_bad_workload_arguments_are_named():
    with pytest.raises(ValueError, match="W9"):
        make_workload("W9", POOL)
    with pytest.raises(ValueError, match="scale"):
        make_workload("W0", POOL, scale=0)
    with pytest.raises(ValueError, match="pool"):
        make_workload("W0", [5])


def test_warmup_shares_no_prefix_with_workloads():
    warm = make_warmup(POOL, n=3)
    assert len(warm) == 3
    starts = {
        tuple(r.prompt_token_ids[:16])
        for n in WORKLOAD_NAMES
        for r in make_workload(n, POOL).requests
    }
    assert not starts & {tuple(r.prompt_token_ids[:16]) for r in warm}


def test_token_pool_prompts_round_trip_through_text(bpe_tokenizer):
    pool = token_pool_from_tokenizer(bpe_tokenizer)
    assert len(pool) >= 256
    w = make_workload("W1", pool, scale=0.125, decode=bpe_tokenizer.decode)
    for r in w.requests:
        assert r.prompt_text is not None and r.prompt_text.startswith(" ")
        assert bpe_tokenizer.encode(r.prompt_text, add_special_tokens=False).ids == (
            r.prompt_token_ids
        )


def test_token_pool_refuses_a_vocabulary_without_enough_words():
    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match="round-trip"):
        token_pool_from_tokenizer(tok)


def test_default_model_token_id_prompts_get_what_its_tokenizer_adds_to_text():
    """Token-id prompts get the special tokens the tokenizer itself adds to a text, read from
    tokenizer.json: for the default model none (its GGUF says add_bos_token = False)."""
    from prefixserve.bench.workloads import load_token_pool, prepend_tokens
    from prefixserve.model.default_model import ensure_default_model

    model_dir = ensure_default_model()
    pool, decode, special_prefix = load_token_pool(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert special_prefix == []
    w = make_workload("W3", pool, scale=0.2, decode=decode)
    prepend_tokens(w.requests, special_prefix)
    for r in w.requests:
        # what a server that tokenizes the text computes == what a server given the ids computes
        assert tokenizer.encode(r.prompt_text).ids == r.prompt_token_ids
        assert r.num_prompt_tokens == 1532


def test_load_token_pool_finds_the_bos_a_tokenizer_adds_to_text(tmp_path, bpe_tokenizer):
    """A tokenizer whose post-processor adds a BOS (as Gemma's does): token-id prompts get it."""
    from tokenizers import processors

    from prefixserve.bench.workloads import load_token_pool

    tok = Tokenizer.from_str(bpe_tokenizer.to_str())
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|>:0 $A:0", special_tokens=[("<|endoftext|>", bos)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    _, _, special_prefix = load_token_pool(tmp_path)
    assert special_prefix == [bos]


def test_w6_has_w1s_shape_but_its_own_prompts():
    pool = list(range(1000, 1400))
    w1, w6 = make_workload("W1", pool), make_workload("W6", pool)
    assert [r.num_prompt_tokens for r in w6.requests] == [r.num_prompt_tokens for r in w1.requests]
    assert {tuple(r.prompt_token_ids[:1024]) for r in w6.requests}.isdisjoint(
        tuple(r.prompt_token_ids[:1024]) for r in w1.requests
    )
    assert all(r.request_id.startswith("W6-") for r in w6.requests)
