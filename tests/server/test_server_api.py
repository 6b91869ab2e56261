"""The OpenAI-compatible endpoints through the official `openai` client, on the default model."""

from __future__ import annotations

import json
import uuid

import pytest

from tests.helpers.server import BLOCK_SIZE, MAX_MODEL_LEN, MODEL_NAME

# Long enough to fill several blocks, so a repeat hits the prefix cache.
LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when movable type "
    "changed how books were made, sold and read across Europe. Scholars still argue about "
    "which of its effects mattered most. "
)


def fresh() -> dict:
    """A new cache_salt: the request computes its prompt from scratch, as the first one did.

    Greedy text is only compared between requests that take the same numerical path: in bf16 a
    prefix-cache hit (attention over cached blocks) may round differently from a full prefill
    where the engine is not batch-invariant (no native kernels).
    """
    return {"cache_salt": uuid.uuid4().hex}


def test_health_answers_without_a_key(server):
    with server.http(api_key="") as http:
        response = http.get("/health", headers={"Authorization": ""})
    assert response.status_code == 200
    assert response.json() == {"status": "ok"}


def test_models_lists_every_served_name_with_the_context_length(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME, "alias-model"]
    assert models.data[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion_returns_text_and_usage_with_cached_tokens(client, server):
    prompt = "Once upon a time, in a harbour town with seven bridges and one old lighthouse,"
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0)
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0
    )
    choice = response.choices[0]
    assert response.object == "text_completion"
    assert response.model == MODEL_NAME
    assert isinstance(choice.text, str) and choice.text
    assert choice.finish_reason in ("length", "stop")
    usage = response.usage
    assert usage.completion_tokens == 5 or choice.finish_reason == "stop"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    # The second request's full prompt blocks were cached by the first.
    full_blocks = (usage.prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert usage.prompt_tokens_details.cached_tokens == full_blocks > 0
    # This server runs bf16 with the default mode, batch-invariant wherever the native kernels
    # run: the hit gives the cold text bit for bit (tests/model/test_batch_invariance.py).
    assert first.choices[0].finish_reason in ("length", "stop")
    if server.run_in_engine(lambda engine: engine.runner.batch_invariant):
        assert first.choices[0].text == choice.text


def test_a_repeated_prompt_reports_its_full_blocks_as_cached(client):
    prompt = "Cache check one. " + LONG_PROMPT
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt_tokens = second.usage.prompt_tokens
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Every full block but the one holding the last prompt token (it must be recomputed).
    assert cached == ((prompt_tokens - 1) // BLOCK_SIZE) * BLOCK_SIZE
    assert cached > 0


def test_prompt_as_token_ids_and_as_a_list_of_one_give_the_same_greedy_text(client, tokenizer):
    text = "The quick brown fox"
    ids = tokenizer.encode(text)
    outs = [
        client.completions.create(
            model=MODEL_NAME, prompt=p, max_tokens=4, temperature=0, extra_body=fresh()
        )
        for p in (text, [text], ids, [ids])
    ]
    assert len({o.choices[0].text for o in outs}) == 1
    assert {o.usage.prompt_tokens for o in outs} == {len(ids)}


def test_text_prompt_tokens_count_the_text_alone_without_a_bos(client, tokenizer):
    """usage.prompt_tokens of a text prompt is its own token count (the default model's GGUF
    says add_bos_token = False), the same as for those token ids sent directly."""
    ids = tokenizer.encode("Hello", add_special_tokens=False)
    assert tokenizer.encode("Hello") == ids and ids[0] != tokenizer.bos_token_id
    for prompt in ("Hello", ids):
        response = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, extra_body=fresh()
        )
        assert response.usage.prompt_tokens == len(ids)


def test_chat_completion_uses_the_chat_template(client, tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hello."},
    ]
    response = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0
    )
    assert response.object == "chat.completion"
    message = response.choices[0].message
    assert message.role == "assistant"
    assert isinstance(message.content, str) and message.content
    expected_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert response.usage.prompt_tokens == len(expected_prompt)
    assert response.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_content_parts_are_joined_as_text(client):
    as_text = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Name a color."}],
        max_tokens=4,
        temperature=0,
        extra_body=fresh(),
    )
    as_parts = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}],
        max_tokens=4,
        temperature=0,
        extra_body=fresh(),
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content


def test_streamed_completion_equals_the_unstreamed_one_and_ends_with_usage(client):
    kwargs = dict(
        model=MODEL_NAME, prompt="Stream test: " + LONG_PROMPT, max_tokens=8, temperature=0
    )
    client.completions.create(**kwargs)  # caches the prompt: both calls below hit it alike
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and chunks[-1] is usage_chunks[0]
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.completion_tokens == whole.usage.completion_tokens
    # The first call cached the prompt, so the streamed one hits it.
    assert usage.prompt_tokens_details.cached_tokens > 0


def test_streamed_chat_opens_with_the_role_and_carries_usage(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens >= 1
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")


def test_continuous_usage_stats_put_usage_on_every_chunk(server):
    with server.http() as http:
        response = http.post(
            "/v1/completions",
            json={
                "model": MODEL_NAME,
                "prompt": "Every chunk",
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            },
        )
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all("cached_tokens" in c["usage"]["prompt_tokens_details"] for c in chunks)


def test_n_returns_n_choices_with_distinct_indices(client):
    response = client.completions.create(
        model=MODEL_NAME, prompt="Pick a number:", max_tokens=4, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in response.choices) == [0, 1, 2]
    assert 3 <= response.usage.completion_tokens <= 12
    # The prompt is counted once, not once per choice.
    single = client.completions.create(model=MODEL_NAME, prompt="Pick a number:", max_tokens=1)
    assert response.usage.prompt_tokens == single.usage.prompt_tokens


def test_n_streams_every_choice(client):
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="Colors:", max_tokens=3, n=2, stream=True, seed=1
        )
    )
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_seed_makes_sampling_repeatable(client):
    kwargs = dict(
        model=MODEL_NAME, prompt="A random story:", max_tokens=8, temperature=1.0, seed=1234
    )
    a = client.completions.create(**kwargs, extra_body=fresh())
    b = client.completions.create(**kwargs, extra_body=fresh())
    assert a.choices[0].text == b.choices[0].text


def test_stop_string_ends_the_text_before_it(client):
    free = client.completions.create(
        model=MODEL_NAME, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, extra_body=fresh()
    )
    text = free.choices[0].text
    assert len(text) >= 3, f"too little text to pick a stop string from: {text!r}"
    stop = text[1:3]
    stopped = client.completions.create(
        model=MODEL_NAME,
        prompt="1, 2, 3, 4,",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body=fresh(),
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert stop not in choice.text
    assert text.startswith(choice.text)
    assert choice.model_extra["stop_reason"] == stop


def test_completion_logprobs_have_one_entry_per_token(client):
    response = client.completions.create(
        model=MODEL_NAME, prompt="Paris is the capital of", max_tokens=4, temperature=0, logprobs=3
    )
    logprobs = response.choices[0].logprobs
    n = response.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == n
    assert "".join(logprobs.tokens) == response.choices[0].text
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert chosen <= 0.0
        assert 3 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_logprobs_and_top_logprobs(client):
    response = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_extra_fields_are_accepted(client):
    response = client.completions.create(
        model=MODEL_NAME,
        prompt="Extras",
        max_tokens=4,
        temperature=0.8,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={
            "top_k": 20,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "ignore_eos": True,
            "cache_salt": "extras",
        },
    )
    # ignore_eos: the request runs to max_tokens.
    assert response.usage.completion_tokens == 4
    assert response.choices[0].finish_reason == "length"


def test_prompt_logprobs_cover_every_prompt_position(client, tokenizer):
    prompt = "One two three four"
    response = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 1}
    )
    prompt_logprobs = response.choices[0].model_extra["prompt_logprobs"]
    ids = tokenizer.encode(prompt)
    assert len(prompt_logprobs) == len(ids)
    assert prompt_logprobs[0] is None
    for position, token_id in enumerate(ids[1:], start=1):
        assert str(token_id) in prompt_logprobs[position]
    # Prompt logprobs need every position's logits, so nothing is read from the cache.
    assert response.usage.prompt_tokens_details.cached_tokens == 0
