"""The offline API: prompt forms, output order, stop conditions, validation, chat, tqdm."""

from __future__ import annotations

import pytest

from prefixserve import LLM, CompletionOutput, RequestOutput, SamplingParams
from tests.helpers import random_tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def llm(default_model_bf16):
    llm = LLM(loaded_model=default_model_bf16, num_kv_blocks=128, max_model_len=256)
    yield llm
    llm.llm_engine.check_no_leaks()


# ----------------------------------------------------------------------------- inputs


def test_prompt_forms_and_outputs_in_input_order(llm):
    text = "The capital of France is"
    ids = llm.get_tokenizer().encode(text)
    other = random_tokens(9, 1)
    outs = llm.generate(
        [text, {"prompt": text}, {"prompt_token_ids": ids}, {"prompt_token_ids": other}],
        GREEDY,
        use_tqdm=False,
    )
    assert all(isinstance(o, RequestOutput) and o.finished for o in outs)
    assert [o.prompt_token_ids for o in outs] == [ids, ids, ids, other]
    assert [o.prompt for o in outs] == [text, text, None, None]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert isinstance(outs[0].outputs[0], CompletionOutput)
    assert outs[0].outputs[0].text == llm.get_tokenizer().decode(outs[0].outputs[0].token_ids)


def test_text_prompt_tokens_are_the_text_alone_without_a_bos(llm):
    """The default model's GGUF says add_bos_token = False: a text prompt is its own tokens,
    the same ones a prompt given as token ids has, and the engine counts exactly those."""
    tokenizer = llm.get_tokenizer()
    text = "Hello"
    ids = tokenizer.encode(text, add_special_tokens=False)
    [out] = llm.generate([text], GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == ids and ids[0] != tokenizer.bos_token_id
    assert llm.get_metrics()["prompt_tokens"] == len(ids)


def test_one_sampling_params_per_prompt(llm):
    prompts = [{"prompt_token_ids": random_tokens(5, i)} for i in range(3)]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (1, 3, 2)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3, 2]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    with pytest.raises(ValueError, match="one per prompt"):
        llm.generate(prompts, params[:2], use_tqdm=False)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ({"prompt_token_ids": []}, GREEDY, "empty prompt"),
        ({"prompt_token_ids": [1, 10**6]}, GREEDY, r"prompt_token_ids must be integers in \[0"),
        ({"prompt_token_ids": list(range(1000, 1256))}, GREEDY, "max_model_len is 256"),
        ({"prompt_token_ids": [5] * 250}, SamplingParams(max_tokens=10), "max_tokens=10"),
        ({"text": "hi"}, GREEDY, "unknown keys"),
        (42, GREEDY, "must be a string or a dict"),
        # The server's salt rules, refused the same way offline.
        ({"prompt": "hi", "cache_salt": "x" * 257}, GREEDY, "at most 256 characters"),
        ({"prompt": "hi", "cache_salt": ""}, GREEDY, "cache_salt must be a non-empty"),
        ({"prompt": "hi", "cache_salt": 7}, GREEDY, "cache_salt must be a string"),
    ],
)
def test_invalid_prompts_raise_and_leave_nothing_behind(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine", prompt], params, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


def test_max_tokens_none_runs_to_the_context_length(llm):
    [out] = llm.generate(
        [{"prompt_token_ids": random_tokens(250, 2)}],
        SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
        use_tqdm=False,
    )
    assert len(out.outputs[0].token_ids) == 6
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=0),
        dict(dtype="float16"),
        dict(num_kv_blocks=0),
        dict(kv_cache_memory_gb=-1.0),
        dict(max_num_seqs=0),
        dict(max_num_batched_tokens=0),
        dict(prefix_caching_hash_algo="md5"),
        dict(max_model_len=1),
        dict(seed=-1),
        dict(num_kv_blocks=8, kv_cache_memory_gb=1.0),
        dict(eviction_policy="lfu"),
        dict(admission_order="random"),
    ],
)
def test_invalid_llm_arguments_raise_value_error_naming_them(kwargs):
    # Validation happens before any model is loaded.
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        LLM(**kwargs)


def test_max_model_len_above_the_models_is_refused(default_model_bf16):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(loaded_model=default_model_bf16, max_model_len=10**6)


@pytest.mark.parametrize("policy", ["lru", "slru", "cost"])
def test_eviction_policy_reaches_the_pool_and_outputs_stay_the_same(default_model_fp32, policy):
    llm = LLM(
        loaded_model=default_model_fp32, dtype="float32", num_kv_blocks=24, eviction_policy=policy
    )
    pool = llm.llm_engine.scheduler.kv_cache_manager.block_pool
    assert pool.eviction_policy == policy
    # Six prompts of 7 blocks in a pool of 24 evict and preempt each other; the policy changes
    # which blocks are reused, never the greedy output (float32).
    prompts = [{"prompt_token_ids": random_tokens(100, s)} for s in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts * 2, params, use_tqdm=False)]
    assert first[:3] == first[3:]


def test_request_longer_than_the_pool_is_refused(default_model_bf16):
    llm = LLM(loaded_model=default_model_bf16, num_kv_blocks=2)
    with pytest.raises(ValueError, match="can hold at most 2"):
        llm.generate([{"prompt_token_ids": random_tokens(40, 3)}], GREEDY, use_tqdm=False)


# ----------------------------------------------------------------------------- stopping


def _greedy_reference(llm: LLM, prompt: list[int], n: int = 12) -> CompletionOutput:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out.outputs[0]


def test_stop_string_spanning_tokens_cuts_the_text_before_it(llm):
    prompt = llm.get_tokenizer().encode("Once upon a time, in a land far away,")
    ref = _greedy_reference(llm, prompt)
    tok = llm.get_tokenizer()
    # Character offsets where each generated token's text ends.
    ends = [len(tok.decode(ref.token_ids[: i + 1])) for i in range(len(ref.token_ids))]
    # A stop string from the middle of token 2 to the middle of token 4 (or its end).
    start = ends[1] + 1 if ends[2] - ends[1] > 1 else ends[1]
    stop = ref.text[start : ends[3] + 1]
    assert len(stop) >= 2 and ref.text.find(stop) == start
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.text == ref.text[:start]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.token_ids == ref.token_ids[: len(c.token_ids)]
    assert len(c.token_ids) <= 5


def test_stop_token_id_stops_and_is_the_stop_reason(llm):
    prompt = random_tokens(12, 4)
    ref = _greedy_reference(llm, prompt)
    stop_id = ref.token_ids[3]
    first = ref.token_ids.index(stop_id)
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id])
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == ref.token_ids[: first + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)


def test_eos_stops_unless_ignored(llm):
    messages = [{"role": "user", "content": "Say hi."}]
    [out] = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=60), use_tqdm=False)
    c = out.outputs[0]
    eos = llm.get_tokenizer().eos_token_ids
    assert c.finish_reason == "stop" and c.token_ids[-1] in eos and c.stop_reason is None
    assert "<|im_end|>" not in c.text and c.text
    assert out.prompt.startswith("<|im_start|>")
    n = len(c.token_ids)
    assert llm.reset_prefix_cache()  # a bf16 cache hit may change greedy tokens; see BENCHMARKS
    [ignored] = llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=n + 2, ignore_eos=True), use_tqdm=False
    )
    assert ignored.outputs[0].token_ids[:n] == c.token_ids
    assert len(ignored.outputs[0].token_ids) == n + 2
    assert ignored.outputs[0].finish_reason == "length"


def test_logprobs_are_returned_per_token(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True)
    [out] = llm.generate([{"prompt_token_ids": random_tokens(8, 5)}], params, use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == 3
    for token_id, position in zip(c.token_ids, c.logprobs, strict=True):
        assert token_id in position and position[token_id].rank == 1  # greedy = top-1
        assert len(position) == 2


def test_tqdm_progress_bar_shows_unless_disabled(llm, capsys):
    llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["a"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_chat_takes_one_or_many_conversations(llm):
    conv = [{"role": "user", "content": "Hello"}]
    params = SamplingParams(temperature=0.0, max_tokens=2)
    one = llm.chat(conv, params, use_tqdm=False)
    many = llm.chat([conv, conv], params, use_tqdm=False)
    assert len(one) == 1 and len(many) == 2
    assert many[1].num_cached_tokens > 0  # the same template prefix is cached
    assert one[0].prompt_token_ids == many[0].prompt_token_ids == many[1].prompt_token_ids
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], params)


def test_streamed_text_holds_back_what_could_start_a_stop_string(default_model_bf16):
    llm = LLM(loaded_model=default_model_bf16, num_kv_blocks=64)
    engine, tok = llm.llm_engine, llm.get_tokenizer()
    stop = "@@never@@"  # 9 characters: up to 8 may be the start of it
    engine.add_request(
        "s",
        tok.encode("The capital of France is"),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=stop),
    )
    streamed = []
    while engine.has_unfinished_requests():
        streamed += [o.outputs[0] for o in engine.step()]
    assert len(streamed) == 6
    for c in streamed[:-1]:
        full = tok.decode(c.token_ids)
        assert c.text == full[: max(0, len(full) - len(stop) + 1)]
    assert streamed[-1].text == tok.decode(streamed[-1].token_ids)
    assert streamed[-1].finish_reason == "length"
    engine.check_no_leaks()
