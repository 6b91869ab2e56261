from __future__ import annotations

import re
import zlib

import pytest
from tokenizers import Tokenizer, models

from prefixserve.bench.workloads import (
    DEFAULT_WORKLOADS,
    TEXT_WORKLOADS,
    WORKLOAD_NAMES,
    TextEncoder,
    make_warmup,
    make_workload,
    token_pool_from_tokenizer,
)
from tests.helpers.bench import byte_level_bpe

POOL = list(range(1000, 1600))


def _fake_encode(text: str) -> list[int]:
    """One id per word (or line break), from its crc32: a stand-in tokenizer for shape tests."""
    return [2000 + zlib.crc32(w.encode()) % 5000 for w in re.findall(r"\S+|\n", text)]


# What W7 is made through; the token workloads ignore it.
FAKE_TEXT = TextEncoder(encode=_fake_encode, chat=lambda user: [1, *_fake_encode(user), 2])


@pytest.fixture(scope="module")
def bpe_tokenizer() -> Tokenizer:
    """A byte-level BPE (the SmolLM2/GPT-2 kind) trained here on made-up words."""
    return byte_level_bpe(0, special_tokens=("<|endoftext|>",))


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_workload_is_a_pure_function_of_its_seed(name):
    a = make_workload(name, POOL, seed=3, text=FAKE_TEXT)
    b = make_workload(name, POOL, seed=3, text=FAKE_TEXT)
    c = make_workload(name, POOL, seed=4, text=FAKE_TEXT)
    assert [r.prompt_token_ids for r in a.requests] == [r.prompt_token_ids for r in b.requests]
    assert [r.request_id for r in a.requests] == [r.request_id for r in b.requests]
    assert [r.prompt_token_ids for r in a.requests] != [r.prompt_token_ids for r in c.requests]
    if name not in TEXT_WORKLOADS:
        pool = set(POOL)
        assert all(t in pool for r in a.requests for t in r.prompt_token_ids)


def test_workloads_of_one_seed_share_no_prompt():
    firsts = {
        name: make_workload(name, POOL, seed=0, text=FAKE_TEXT).requests[0].prompt_token_ids[:64]
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
        for r in make_workload(n, POOL, text=FAKE_TEXT).requests
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
    from prefixserve.model.loader.default_model import ensure_default_model

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


def _split_w7(user: str) -> tuple[str, str, str]:
    """A W7 user message split into (document, instruction, quoted paragraph)."""
    *paragraphs, instruction, part = user.split("\n\n")
    return "\n\n".join(paragraphs), instruction, part


def test_w7_is_32_documents_each_with_one_paragraph_quoted_back_for_256_tokens():
    users: list[str] = []
    text = TextEncoder(encode=_fake_encode, chat=lambda u: users.append(u) or _fake_encode(u))
    w = make_workload("W7", POOL, seed=0, text=text)
    assert "W7" in WORKLOAD_NAMES and "W7" not in DEFAULT_WORKLOADS
    assert len(w.requests) == 32 == len(users)
    assert [r.request_id for r in w.requests] == [f"W7-{i:03d}" for i in range(32)]
    assert all(r.max_tokens == 256 and r.after is None for r in w.requests)
    documents = set()
    for i, (req, user) in enumerate(zip(w.requests, users, strict=True)):
        assert req.prompt_token_ids == _fake_encode(user)
        document, instruction, part = _split_w7(user)
        paragraphs = document.split("\n\n")
        documents.add(document)
        assert len(paragraphs) == 3 and part in paragraphs
        # about 1,000 tokens of document; the quoted paragraph alone outlasts the 256 out
        assert 1000 <= len(_fake_encode(document)) <= 1150
        assert len(_fake_encode(part)) > 256
        if i % 4 == 3:  # a light edit: one name of the paragraph for one the document lacks
            m = re.fullmatch(
                r"Rewrite this paragraph .*, writing (.+) instead of (.+):", instruction
            )
            assert m is not None, instruction
            new, old = m.groups()
            assert old in part and new not in document
        else:
            assert instruction.startswith("Repeat this paragraph of the text above exactly")
    assert len(documents) == 32
    assert len(make_workload("W7", POOL, scale=0.25, text=FAKE_TEXT).requests) == 8


def test_w7_needs_the_models_tokenizer():
    with pytest.raises(ValueError, match="W7 is made of text"):
        make_workload("W7", POOL)


def test_w7_prompts_are_the_default_models_chat_turns_and_round_trip_through_text():
    """Through the default model's tokenizer: each prompt is one user turn of its chat template
    (then the assistant's turn opens), its ids are what a server computes from its text, and
    the document is about 1,000 of those tokens."""
    from prefixserve.bench.workloads import load_text_encoder, load_token_pool, prepend_tokens
    from prefixserve.model.loader.default_model import ensure_default_model

    model_dir = ensure_default_model()
    pool, decode, special_prefix = load_token_pool(model_dir)
    text = load_text_encoder(model_dir)
    w = make_workload("W7", pool, seed=1, scale=0.25, decode=decode, text=text)
    assert (
        w.requests
        == make_workload("W7", pool, seed=1, scale=0.25, decode=decode, text=text).requests
    )
    prepend_tokens(w.requests, special_prefix)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    for r in w.requests:
        assert r.prompt_text is not None
        assert tokenizer.encode(r.prompt_text).ids == r.prompt_token_ids
        assert r.prompt_text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        user = r.prompt_text.split("<|im_start|>user\n")[1].removesuffix(
            "<|im_end|>\n<|im_start|>assistant\n"
        )
        document, _, part = _split_w7(user)
        assert 1000 <= len(text.encode(document)) <= 1150
        assert part in document and len(text.encode(part)) > 256


def _bench_w7_copy():
    """benchmarks/bench_w7_copy.py, imported when a test needs it (it sets OMP_WAIT_POLICY)."""
    from benchmarks import bench_w7_copy

    return bench_w7_copy


def test_w7_copy_check_replays_vllms_ngram_proposer():
    copy = _bench_w7_copy()
    # the longest suffix match (up to 5), at its earliest occurrence, then up to k tokens
    assert copy.propose([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2, 2, 5) == [9, 1]
    assert copy.propose([7, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 4, 2, 5) == [8, 1, 2, 3]
    assert copy.propose([1, 2, 3, 4], 4, 2, 5) == []
    prompt = list(range(100, 140))
    # an output that copies the prompt from its 10th token: two steps without a match, then
    # drafts of 4 accepted whole (5 tokens a step) but for the last, cut by the output's end
    r = copy.replay_ngram(prompt, prompt[10:30], k=4, lookup_min=2, lookup_max=5)
    assert (r.output_tokens, r.steps, r.drafts, r.draft_tokens, r.accepted) == (20, 6, 4, 16, 15)
    assert r.acceptance_rate == 15 / 16 and r.tokens_per_step == 20 / 6
    # an output that copies nothing: no draft is ever proposed
    assert copy.replay_ngram(prompt, list(range(500, 520))).acceptance_rate is None
    assert copy.copy_fraction(prompt, prompt[5:25]) == 1.0
    assert copy.copy_fraction(prompt, list(range(500, 520))) == 0.0


def test_text_encoder_leaves_the_bos_to_prepend_tokens(tmp_path, bpe_tokenizer):
    """A tokenizer that puts a BOS before any text and a chat template that writes one too (as
    Gemma's do): W7's prompt ids leave it out, so `prepend_tokens` (token-id servers) and the
    server's own tokenizer (text servers) each put back exactly one."""
    import json

    from tokenizers import processors

    from prefixserve.bench.workloads import load_text_encoder, load_token_pool, prepend_tokens

    tok = Tokenizer.from_str(bpe_tokenizer.to_str())
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|>:0 $A:0", special_tokens=[("<|endoftext|>", bos)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %} answer:"
    config = {"bos_token": "<|endoftext|>", "chat_template": template}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    pool, decode, special_prefix = load_token_pool(tmp_path)
    text = load_text_encoder(tmp_path)
    assert special_prefix == [bos]
    ids = text.chat("some words")
    assert ids[0] != bos and ids == tok.encode("some words answer:", add_special_tokens=False).ids
    w = make_workload("W7", pool, scale=1 / 32, decode=decode, text=text)
    prepend_tokens(w.requests, special_prefix)
    (r,) = w.requests
    assert r.prompt_token_ids[0] == bos and r.prompt_token_ids[1] != bos
    assert tok.encode(r.prompt_text).ids == r.prompt_token_ids
