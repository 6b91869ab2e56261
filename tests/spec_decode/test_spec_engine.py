"""Speculative decoding through the whole engine, with the packaged default model in bf16 (float32
where the native kernels are not built).

Prompts repeat a random run of tokens, so the model continues the repetition and n-gram drafts
are really accepted (each test that depends on it asserts so). The engine is batch-invariant by
default for bf16, so a verification pass gives the logits a plain decode step gives (in float32
too, for these prompts), and outputs must be identical with speculation on and off: greedy,
seeded sampling (acceptance is coupled to the plain sampler's random numbers), with penalties,
logprobs, stop conditions inside an accepted run, caching on and off, eviction and
preemption. Every engine ends with `check_no_leaks()`.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve import LLM, SamplingParams
from prefixserve.core.kv_cache.events import BlockStored
from tests.helpers import random_tokens

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}


def copying_prompt(seed: int, run: int = 24, repeats: int = 3) -> list[int]:
    """A random run of tokens said `repeats` times and begun once more: greedy decoding goes
    on copying it."""
    body = random_tokens(run, seed=seed)
    return body * repeats + body[: run // 3]


def make_llm(model, spec=None, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(dtype=model.config.dtype, loaded_model=model, speculative_config=spec, **kwargs)


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_no_leaks()
    return outputs


def tokens_of(outputs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def model(default_model_exact):
    return default_model_exact


@pytest.fixture(scope="module")
def plain(model):
    return make_llm(model)


@pytest.fixture(scope="module")
def spec(model):
    return make_llm(model, SPEC)


def test_greedy_speculation_accepts_drafts_and_changes_no_token(plain, spec):
    prompts = [copying_prompt(s) for s in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    before = spec.get_metrics()
    assert tokens_of(generate(spec, prompts, params)) == tokens_of(generate(plain, prompts, params))
    after = spec.get_metrics()
    drafts = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    verifications = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
    assert accepted > 0.5 * drafts > 0 and verifications > 0
    total = [after[f"spec_decode_num_{k}"] for k in ("drafts", "draft_tokens", "accepted_tokens")]
    assert after["spec_decode_acceptance_rate"] == pytest.approx(total[2] / total[1])
    assert after["spec_decode_mean_accepted_length"] == pytest.approx(1 + total[2] / total[0])
    # Fewer forward passes than tokens: 3 x 40 tokens in far fewer than 40 steps each.
    assert after["generation_tokens"] - before["generation_tokens"] == 120


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    seeds=st.lists(st.integers(0, 10_000), min_size=1, max_size=4, unique=True),
    k=st.integers(1, 6),
    lookup=st.sampled_from([(1, 1), (2, 4), (3, 5)]),
    caching=st.booleans(),
    pool=st.sampled_from([24, 256]),
    max_tokens=st.integers(1, 30),
)
def test_greedy_outputs_identical_with_speculation_on_and_off(
    model, plain, seeds, k, lookup, caching, pool, max_tokens
):
    """Random copying prompts, random k and lookup bounds, caching on and off, and a pool of 24
    blocks that evicts and preempts (four 80-token prompts need 6 blocks each, and drafts their
    lookahead slots) against a roomy plain engine."""
    prompts = [copying_prompt(s, run=random.Random(s).randint(5, 30)) for s in seeds]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    config = {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": lookup[0],
        "prompt_lookup_max": lookup[1],
    }
    llm = make_llm(model, config, num_kv_blocks=pool, enable_prefix_caching=caching)
    assert tokens_of(generate(llm, prompts, params)) == tokens_of(generate(plain, prompts, params))


def test_preempted_requests_drop_their_drafts_and_outputs_stay_the_same(model, plain):
    # 6 prompts of 40 tokens fit 20 blocks at admission; 60 outputs each do not.
    prompts = [copying_prompt(s, run=12) for s in range(100, 106)]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    small = make_llm(model, SPEC, num_kv_blocks=20)
    assert tokens_of(generate(small, prompts, params)) == tokens_of(
        generate(plain, prompts, params)
    )
    metrics = small.get_metrics()
    assert metrics["num_preemptions"] > 0 and metrics["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.5, seed=11, max_tokens=30, ignore_eos=True),
        SamplingParams(
            temperature=1.0, top_p=0.9, top_k=20, seed=2**40 + 3, max_tokens=30, ignore_eos=True
        ),
        SamplingParams(
            temperature=0.5,
            seed=5,
            repetition_penalty=1.05,
            frequency_penalty=0.1,
            presence_penalty=0.1,
            max_tokens=30,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0.5, seed=8, n=3, max_tokens=20, ignore_eos=True),
    ],
    ids=["temperature", "top-p-top-k-64-bit-seed", "penalties", "n3"],
)
def test_seeded_sampling_gives_the_same_tokens_with_speculation_on_and_off(plain, spec, params):
    """Acceptance is coupled to the uniform number plain decoding would draw at each position,
    so a seeded request emits the same tokens. Only where the draw is robust to float32 noise:
    a verification pass computes its logits with other matmul shapes than a decode step, and a
    uniform landing in a flat tail of tiny probabilities can pick a neighbouring token (plain
    decoding does the same between batches of other sizes: n=1 against n=3). Low temperatures
    or top-k keep the draws out of such tails."""
    prompts = [copying_prompt(s) for s in (21, 22)]
    expected = tokens_of(generate(plain, prompts, params))
    before = spec.get_metrics()["spec_decode_num_accepted_tokens"]
    assert tokens_of(generate(spec, prompts, params)) == expected
    assert tokens_of(generate(spec, prompts, params)) == expected  # and again: reproducible
    assert spec.get_metrics()["spec_decode_num_accepted_tokens"] > before


def _permutation_p_value(a: list[tuple], b: list[tuple], rounds: int, seed: int) -> float:
    """How often relabelling the pooled samples gives a total-variation distance between the
    two groups at least the observed one (a two-sample test needing no distribution)."""

    def distance(x: list[tuple], y: list[tuple]) -> float:
        counts: dict[tuple, list[int]] = {}
        for value in x:
            counts.setdefault(value, [0, 0])[0] += 1
        for value in y:
            counts.setdefault(value, [0, 0])[1] += 1
        return sum(abs(i / len(x) - j / len(y)) for i, j in counts.values()) / 2

    observed = distance(a, b)
    pooled = a + b
    rng = random.Random(seed)
    at_least = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        at_least += distance(pooled[: len(a)], pooled[len(a) :]) >= observed - 1e-12
    return (at_least + 1) / (rounds + 1)


def test_unseeded_sampling_distribution_is_the_target_models(model):
    """Unseeded rows share the engine's generator, and rows after a rejection draw numbers plain
    decoding never draws, so tokens differ run to run; their distribution must not. 300 samples
    each of the first three tokens (pairs of positions), then a permutation test: a wrong
    acceptance rule (e.g. accepting every draft) moves these distributions far beyond what 300
    samples explain, while the right one fails the test with probability about 0.001 per pair."""
    prompts = [copying_prompt(31, run=12)] * 5
    params = SamplingParams(temperature=1.0, n=60, max_tokens=3, ignore_eos=True)
    # Blocks of 13 tokens hold all but the last of the prompt's 40, cached by a first request:
    # the 300 rows then compute one prompt token each (in blocks of 16, eight).
    assert len(prompts[0]) == 3 * 13 + 1
    speculating = make_llm(model, SPEC, seed=1, block_size=13)
    plain = make_llm(model, seed=2, block_size=13)
    for llm in (speculating, plain):
        generate(llm, prompts[:1], SamplingParams(max_tokens=1))
    with_spec = generate(speculating, prompts, params)
    without = generate(plain, prompts, params)
    a = [tuple(c.token_ids) for o in with_spec for c in o.outputs]
    b = [tuple(c.token_ids) for o in without for c in o.outputs]
    for position in (slice(0, 1), slice(1, 2), slice(2, 3)):
        p = _permutation_p_value([x[position] for x in a], [y[position] for y in b], 999, 0)
        assert p > 0.001, (position, p)
    # Drafts were verified, some accepted and some rejected, or this proves nothing.
    metrics = speculating.get_metrics()
    assert 0 < metrics["spec_decode_num_accepted_tokens"] < metrics["spec_decode_num_draft_tokens"]


def test_stop_string_and_stop_token_inside_an_accepted_run_end_the_request_there(plain, spec):
    prompt = copying_prompt(41, run=20)
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    [reference] = generate(plain, [prompt], free)
    ref = reference.outputs[0]
    # A stop string ending mid-output, and a stop token from the middle of the output.
    text = ref.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    stop_token = ref.token_ids[9]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]),
        SamplingParams(
            temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[stop_token]
        ),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
    ):
        [want] = generate(plain, [prompt], params)
        [got] = generate(spec, [prompt], params)
        w, g = want.outputs[0], got.outputs[0]
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == (
            w.text,
            w.token_ids,
            w.finish_reason,
            w.stop_reason,
        )
        assert len(w.token_ids) < 30
    assert spec.get_metrics()["spec_decode_num_accepted_tokens"] > 0


def test_logprobs_of_accepted_tokens_are_the_plain_decoding_logprobs(plain, spec):
    prompt = copying_prompt(51)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=3)
    [want] = generate(plain, [prompt], params)
    [got] = generate(spec, [prompt], params)
    w, g = want.outputs[0], got.outputs[0]
    assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == 20
    for wl, gl in zip(w.logprobs, g.logprobs, strict=True):
        assert wl.keys() == gl.keys()
        for token_id in wl:
            assert gl[token_id].logprob == pytest.approx(wl[token_id].logprob, abs=1e-4)
            assert gl[token_id].rank == wl[token_id].rank


def test_drafts_never_cached_and_accepted_blocks_cached_in_the_step_they_fill(model):
    """Step by step: after every step each running request has every block its computed tokens
    fill cached (blocks accepted drafts completed included), nothing beyond; every stored block
    (KV events) holds tokens of a real sequence at a block-aligned place, never a draft that was
    rejected."""
    llm = make_llm(model, SPEC, enable_kv_events=True, block_size=4)
    engine = llm.llm_engine
    mgr = engine.kv_cache_manager
    prompts = [copying_prompt(s, run=10) for s in (61, 62, 63)]
    # A noisy prompt too, whose drafts get rejected.
    prompts.append(random_tokens(30, seed=64) + random_tokens(30, seed=64)[:5] + [7, 8, 9])
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    stored: list[tuple[int, ...]] = []
    finals: dict[str, list[int]] = {}
    filled_by_drafts = 0
    while engine.has_unfinished_requests():
        computed_before = {r.request_id: r.num_computed_tokens for r in engine.scheduler.running}
        accepted_before = engine.get_metrics()["spec_decode_num_accepted_tokens"]
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.prompt_token_ids + output.outputs[0].token_ids
        mgr.check_invariants()
        accepted = engine.get_metrics()["spec_decode_num_accepted_tokens"] > accepted_before
        for request in engine.scheduler.running:
            for group_id in range(mgr.num_groups):
                cached = mgr.num_cached_blocks(request, group_id)
                assert cached == min(request.num_computed_tokens // 4, len(request.block_hashes))
            before = computed_before.get(request.request_id, 0)
            if accepted and request.num_computed_tokens // 4 > (before + 1) // 4:
                filled_by_drafts += 1
        for event in llm.take_kv_events():
            if isinstance(event, BlockStored):
                ids = event.token_ids
                stored.extend(tuple(ids[j : j + 4]) for j in range(0, len(ids), 4))
    engine.check_no_leaks()
    real = {tuple(seq[j : j + 4]) for seq in finals.values() for j in range(0, len(seq) - 3, 4)}
    assert stored and set(stored) <= real
    metrics = engine.get_metrics()
    assert 0 < metrics["spec_decode_num_accepted_tokens"] < metrics["spec_decode_num_draft_tokens"]
    assert filled_by_drafts > 0


def test_speculation_with_a_disk_tier_saves_blocks_filled_by_accepted_drafts(
    model, tmp_path, plain
):
    """Blocks accepted drafts complete are written through like any other; a later engine on the
    same store loads them and answers the same."""
    prompt = copying_prompt(71)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = make_llm(model, SPEC, enable_kv_store=True, kv_store_dir=str(tmp_path))
    [out] = generate(first, [prompt], params)
    first.llm_engine.close()
    saved = first.get_metrics()["kv_store_saved_blocks"]
    assert saved == (len(prompt) + 40 - 1) // 16
    follow_up = prompt + out.outputs[0].token_ids + random_tokens(5, seed=72)
    second = make_llm(model, enable_kv_store=True, kv_store_dir=str(tmp_path))
    [hit] = generate(second, [follow_up], params)
    assert hit.num_disk_cached_tokens == saved * 16
    assert tokens_of([hit]) == tokens_of(generate(plain, [follow_up], params))


@pytest.mark.slow
def test_gemma3_sliding_window_groups_give_the_same_greedy_tokens_with_speculation(gemma3_fp32):
    """Gemma 3's hybrid cache (full and 512-token sliding-window groups): drafts take lookahead
    slots in both, and past the window the released blocks do not disturb verification."""
    gemma = gemma3_fp32
    body = random_tokens(150, seed=91)
    prompt = [2] + body * 4 + body[:20]  # <bos>, then 620 tokens: past the window
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = generate(make_llm(gemma), [prompt], params)
    spec = make_llm(gemma, SPEC)
    assert tokens_of(generate(spec, [prompt], params)) == tokens_of(plain)
    assert spec.get_metrics()["spec_decode_num_accepted_tokens"] > 0


def _spy_on_plans(engine) -> list:
    """The scheduler's plans, one a step, as the engine's steps make them."""
    planned = []
    schedule = engine.scheduler.schedule

    def spy():
        planned.append(schedule())
        return planned[-1]

    engine.scheduler.schedule = spy
    return planned


def test_drafts_never_starve_the_other_decoders_of_a_tenant_or_of_the_step(model):
    """Fair shares between two tenants and a budget of 10 tokens for 5 requests: a copying
    decoder's drafts leave a token to every request after it, so a step whose running requests
    all decode schedules every one of them."""
    llm = make_llm(model, SPEC, max_num_batched_tokens=10)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"a{i}", copying_prompt(200 + i, run=10), params, tenant="A")
    engine.add_request("b0", copying_prompt(210, run=10), params, tenant="B")
    planned = _spy_on_plans(engine)
    checked = 0
    while engine.has_unfinished_requests():
        running = engine.scheduler.running
        all_decoding = all(r.num_computed_tokens == r.num_tokens - 1 for r in running)
        decoding = {r.request_id for r in running}
        engine.step()
        scheduled = {s.request.request_id for s in planned[-1].scheduled}
        assert planned[-1].total_num_scheduled_tokens <= 10
        if all_decoding and len(decoding) >= 3:
            assert decoding <= scheduled
            checked += 1
    engine.check_no_leaks()
    assert checked > 0 and engine.get_metrics()["spec_decode_num_accepted_tokens"] > 0


def _steps(engine, planned: list, steps: int, finished: dict) -> list[tuple[int, int]]:
    """(draft tokens, prompt tokens beyond one a request) of each of the next steps; the tokens
    of the requests that finish into `finished`."""
    seen = []
    for _ in range(steps):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        plan = planned[-1]
        drafts = sum(len(s.draft_token_ids) for s in plan.scheduled)
        seen.append((drafts, sum(s.num_new_tokens - 1 for s in plan.scheduled)))
    return seen


def _arrival_scenario(model, hold: bool, max_num_seqs: int = 256):
    """Two copying decoders draft, then a third request arrives: each step's (drafts, prompt
    tokens) before, at and after the arrival, and every request's tokens at the end."""
    llm = make_llm(model, {**SPEC, "hold_for_prefill": hold}, max_num_seqs=max_num_seqs)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    planned = _spy_on_plans(engine)
    for i in range(2):
        engine.add_request(f"c{i}", copying_prompt(300 + i), params)
    outputs: dict = {}
    before = _steps(engine, planned, 8, outputs)
    engine.add_request("new", copying_prompt(310), params)
    at = _steps(engine, planned, 1, outputs)[0]
    after = _steps(engine, planned, 6, outputs)
    while engine.has_unfinished_requests():
        _steps(engine, planned, 1, outputs)
    engine.check_no_leaks()
    assert engine.get_metrics()["spec_decode_num_accepted_tokens"] > 0
    return before, at, after, outputs


def test_no_drafts_in_a_step_that_carries_a_prompt_unless_told_to_draft_anyway(model):
    """The step that carries a new request's prompt has no drafts (`hold_for_prefill`, the
    default), so its first token does not wait for the decoders' verification rows; once every
    request decodes, drafts come back. Told not to hold, the decoders draft beside the prompt.
    The tokens are the same either way."""
    held = _arrival_scenario(model, hold=True)
    eager = _arrival_scenario(model, hold=False)
    for before, at, after, _ in (held, eager):
        assert before[-1][0] > 0  # both decode by now, and draft
        assert at[1] > 0  # the step carried the new prompt
        assert any(drafts > 0 for drafts, prompt in after if prompt == 0)
    assert held[1][0] == 0 and eager[1][0] > 0
    assert held[3] == eager[3] and len(held[3]) == 3


def test_a_waiting_request_that_cannot_start_keeps_no_drafts_away(model):
    """With every running slot taken (max_num_seqs 2), the request that arrives waits: the
    decoders keep drafting meanwhile."""
    before, at, after, outputs = _arrival_scenario(model, hold=True, max_num_seqs=2)
    assert at[1] == 0 and at[0] > 0  # nothing admitted, and the decoders drafted
    assert len(outputs) == 3
