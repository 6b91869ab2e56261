"""Structured outputs through the whole engine, with the packaged default model.

Every rule gets a test named after it: answers follow their grammar and stop when it is
complete; jump-forward changes the number of steps and never a token (greedy and seeded
sampling, logprobs, n > 1, drafts, preemption); a prefix-cache hit gives the cold start's
answer; a bad grammar fails its own request and nothing else; compiles are bounded per tenant
and cached per tenant. Every engine ends with `check_no_leaks()`.
"""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.sampling_params import StructuredOutputsParams
from prefixserve.structured_output.errors import GrammarBusy, GrammarError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "hobbies": {
            "type": "array",
            "items": {"enum": ["chess", "football", "reading", "painting"]},
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "city": {"enum": ["Paris", "London", "Berlin"]},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "hobbies", "address"],
    "additionalProperties": False,
}
PROMPTS = [f"Person number {i}, described as JSON: " for i in range(4)]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
# The largest kind of schema the size bound lets through: slow to compile.
SLOW_SCHEMA = {
    "anyOf": [
        {
            "type": "object",
            "properties": {f"p{i}_{j}": {"type": "integer"} for j in range(20)},
            "required": [f"p{i}_0"],
        }
        for i in range(380)
    ]
}


def occupy(compiler, seconds: float, tenant: str = "gate"):
    """Keep the compile thread busy for `seconds` in `tenant`'s turn (a real job on it)."""
    with compiler._lock:
        return compiler._submit(tenant, lambda: time.sleep(seconds))


def person(**kwargs) -> SamplingParams:
    kwargs.setdefault("max_tokens", 120)
    kwargs.setdefault("temperature", 0.0)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=PERSON), **kwargs)


def make_llm(model, **kwargs) -> LLM:
    kwargs.setdefault("num_kv_blocks", 256)
    return LLM(dtype=model.config.dtype, loaded_model=model, **kwargs)


def run(llm: LLM, prompts, params: SamplingParams):
    outputs = llm.generate(prompts, params, use_tqdm=False)
    llm.llm_engine.check_no_leaks()
    return outputs


def answers(outputs) -> list[list[tuple[list[int], str | None]]]:
    return [[(list(c.token_ids), c.finish_reason) for c in o.outputs] for o in outputs]


@pytest.fixture(scope="module")
def model(default_model_exact):
    return default_model_exact


@pytest.fixture(scope="module")
def jump(model):
    return make_llm(model)


@pytest.fixture(scope="module")
def stepwise(model):
    return make_llm(model, structured_outputs_jump_forward=False)


def test_every_finished_answer_validates_against_its_schema(jump):
    outputs = run(jump, PROMPTS, person())
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), PERSON)


def test_an_answer_stops_when_its_grammar_is_complete_without_an_eos(jump):
    completion = run(jump, PROMPTS[:1], person())[0].outputs[0]
    eos = jump.llm_engine.scheduler.eos_token_ids
    assert completion.text.endswith("}") and completion.token_ids[-1] not in eos


def test_max_tokens_cuts_a_structured_answer_with_finish_reason_length(jump):
    completion = run(jump, PROMPTS[:1], person(max_tokens=5))[0].outputs[0]
    assert completion.finish_reason == "length" and len(completion.token_ids) == 5


def test_regex_choice_grammar_and_json_object_constrain_the_answer(jump):
    cases = [
        (StructuredOutputsParams(regex=r"\d{3}-\d{4}"), r"^\d{3}-\d{4}$"),
        (StructuredOutputsParams(choice=["yes", "no", "maybe"]), r"^(yes|no|maybe)$"),
        (StructuredOutputsParams(grammar='start: "a" "b"+ "c"'), r"^ab+c$"),
        (StructuredOutputsParams(grammar='root ::= "x" [0-9] [0-9]'), r"^x[0-9]{2}$"),
    ]
    import re

    for constraint, pattern in cases:
        params = SamplingParams(
            max_tokens=30, temperature=0.7, seed=5, structured_outputs=constraint
        )
        text = run(jump, ["Answer: "], params)[0].outputs[0].text
        assert re.match(pattern, text), (constraint, text)
    params = SamplingParams(
        max_tokens=80, structured_outputs=StructuredOutputsParams(json_object=True)
    )
    completion = run(jump, ["A JSON object: "], params)[0].outputs[0]
    if completion.finish_reason == "stop":
        assert isinstance(json.loads(completion.text), dict)
    else:
        assert completion.text.startswith("{")


@pytest.mark.parametrize(
    "params",
    [
        person(),
        person(temperature=0.9, seed=11),
        person(temperature=0.8, seed=3, logprobs=2, top_p=0.9),
        person(temperature=1.0, seed=7, n=3),
    ],
    ids=["greedy", "seeded", "seeded-logprobs", "n3"],
)
def test_jump_forward_emits_the_tokens_the_step_by_step_path_emits(jump, stepwise, params):
    before = jump.get_metrics()["generation_tokens"]
    fast = run(jump, PROMPTS, params)
    slow = run(stepwise, PROMPTS, params)
    assert answers(fast) == answers(slow)
    assert jump.get_metrics()["generation_tokens"] > before
    if params.logprobs is not None:
        for a, b in zip(fast, slow, strict=True):
            assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_jump_forward_takes_fewer_steps_for_the_same_answer(model):
    steps = {}
    for jf in (True, False):
        llm = make_llm(model, structured_outputs_jump_forward=jf)
        engine = llm.llm_engine
        engine.add_request("r", engine.tokenizer.encode(PROMPTS[0]), person())
        count = 0
        while engine.has_unfinished_requests():
            engine.step()
            count += 1
        steps[jf] = count
        engine.check_no_leaks()
    assert steps[True] < steps[False] * 0.8, steps


def test_forced_tokens_land_in_the_prefix_cache_and_a_hit_gives_the_cold_answer(model):
    llm = make_llm(model)
    long_prompt = ["You describe people in JSON, one object each. " * 4 + PROMPTS[0]]
    cold = run(llm, long_prompt, person())
    first = cold[0].outputs[0]
    # The prompt + the whole answer as a new prompt: its blocks (forced tokens among them) hit.
    prompt = {"prompt_token_ids": list(cold[0].prompt_token_ids) + list(first.token_ids)}
    again = run(llm, [prompt], SamplingParams(max_tokens=1, temperature=0.0))
    block = llm.llm_engine.block_size
    assert again[0].num_cached_tokens >= (len(prompt["prompt_token_ids"]) - 1) // block * block
    warm = run(llm, long_prompt, person())
    assert answers(warm) == answers(cold)
    assert warm[0].num_cached_tokens > 0


def test_structured_answers_are_the_same_with_speculative_drafts(model, jump):
    spec = make_llm(model, speculative_config=SPEC)
    # A schema whose answer repeats itself, so that n-gram drafts come up.
    params = person(temperature=0.0)
    assert answers(run(spec, PROMPTS, params)) == answers(run(jump, PROMPTS, params))
    for out in run(spec, PROMPTS, params):
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_a_draft_outside_the_grammar_is_cut_before_verification(jump):
    engine = jump.llm_engine
    constraint = StructuredOutputsParams(regex=r"[0-9]{6}")
    engine.add_request(
        "d",
        engine.tokenizer.encode("Code: "),
        SamplingParams(max_tokens=8, structured_outputs=constraint),
    )
    request = engine.scheduler.requests["d"]
    grammar = request.structured_output
    while grammar.poll() is None:
        time.sleep(0.01)
    digit = engine.tokenizer.encode("7")[-1]
    letter = engine.tokenizer.encode("x")[-1]
    assert grammar.valid_drafts([digit, digit, letter, digit]) == [digit, digit]
    assert grammar.valid_drafts([letter]) == []
    engine.abort_request("d")
    engine.check_no_leaks()


def test_preemption_and_resumption_keep_the_grammar_state(model, jump):
    # A pool too small for all four at once: requests are preempted and resume mid-answer.
    small = make_llm(model, num_kv_blocks=9, max_num_seqs=4)
    params = person(temperature=0.9, seed=21, max_tokens=100)
    tight = run(small, PROMPTS, params)
    assert small.get_metrics()["num_preemptions"] > 0
    assert answers(tight) == answers(run(jump, PROMPTS, params))


def test_a_bad_schema_is_refused_with_its_reason_and_the_engine_goes_on(jump):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "strin"}))
    with pytest.raises(ValueError, match="not a valid JSON Schema"):
        run(jump, ["x"], bad)
    unsupported = StructuredOutputsParams(json={"type": "object", "if": {}, "then": {}})
    with pytest.raises(GrammarError, match="does not support") as info:
        run(jump, ["x"], SamplingParams(structured_outputs=unsupported))
    assert info.value.reason == "unsupported"
    for grammar in ("start: x", "root ::= (("):
        with pytest.raises(GrammarError, match="structured_outputs.grammar") as info:
            run(
                jump,
                ["x"],
                SamplingParams(structured_outputs=StructuredOutputsParams(grammar=grammar)),
            )
        assert info.value.reason == "invalid_grammar"
    metrics = jump.get_metrics()
    assert metrics["structured_output_rejections_invalid_schema"] >= 1
    assert metrics["structured_output_rejections_unsupported"] >= 1
    assert run(jump, PROMPTS[:1], person())[0].outputs[0].finish_reason == "stop"


def test_a_request_waits_for_its_compile_while_the_others_run(model):
    llm = make_llm(model)
    engine = llm.llm_engine
    compiler = engine.structured_outputs.compiler
    gate = occupy(compiler, 0.5)  # the compile thread busy for a moment
    engine.add_request("json", engine.tokenizer.encode(PROMPTS[0]), person())
    engine.add_request("plain", engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=4))
    outputs = {}
    while "plain" not in outputs or not outputs["plain"].finished:
        for out in engine.step():
            outputs[out.request_id] = out
    assert "json" not in outputs  # it arrived first, and waits apart while the other ran
    assert engine.scheduler.waiting_for_grammar
    gate.result()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    jsonschema.validate(json.loads(outputs["json"].outputs[0].text), PERSON)
    engine.check_no_leaks()


def test_a_failed_compile_fails_only_its_own_request(model):
    llm = make_llm(model)
    engine = llm.llm_engine
    engine.add_request("ok", engine.tokenizer.encode("Hello"), SamplingParams(max_tokens=3))
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a(b"))
    engine.add_request("bad", engine.tokenizer.encode("x"), bad)  # still compiling: queued
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["bad"].error and "regex" in outputs["bad"].error
    assert outputs["ok"].outputs[0].finish_reason == "length"
    engine.check_no_leaks()


def test_compiles_in_flight_are_bounded_per_tenant(model):
    llm = make_llm(model, max_grammar_compiles_per_tenant=1)
    compiler = llm.llm_engine.structured_outputs.compiler
    gate = occupy(compiler, 0.5)  # the compile thread busy for a moment
    compiler.get(StructuredOutputsParams(regex="a+"), "alice")
    with pytest.raises(GrammarBusy):
        compiler.get(StructuredOutputsParams(regex="b+"), "alice")
    compiler.get(StructuredOutputsParams(regex="b+"), "bob")  # another tenant is not held up
    gate.result()
    assert llm.get_metrics()["structured_output_rejections_busy"] == 1


def test_compiled_grammars_are_cached_per_tenant_and_never_shared(model):
    llm = make_llm(model, max_cached_grammars_per_tenant=2)
    compiler = llm.llm_engine.structured_outputs.compiler
    a = StructuredOutputsParams(json={"type": "integer"})
    first = compiler.get(a, "alice")
    assert compiler.get(StructuredOutputsParams(json='{"type":"integer"}'), "alice") is first
    assert compiler.get(a, "bob") is not first  # bob compiles his own
    for pattern in ("x+", "y+"):
        compiler.get(StructuredOutputsParams(regex=pattern), "alice")
    assert compiler.get(a, "alice") is not first  # alice's oldest went first past her bound
    hits = llm.get_metrics()["structured_output_cache_hits"]
    assert hits == 1


def test_a_compile_past_the_timeout_is_refused_and_its_thread_finishes(model):
    llm = make_llm(model, structured_outputs_compile_timeout=0.3)
    compiler = llm.llm_engine.structured_outputs.compiler
    compiler.get(StructuredOutputsParams(regex="warm"), None).result()  # the tokenizer, once
    params = StructuredOutputsParams(json=SLOW_SCHEMA)  # ~1.7 s to compile on one core
    started = time.monotonic()
    with pytest.raises(GrammarError, match="did not compile within") as info:
        compiler.wait(compiler.get(params, None), params)
    assert info.value.reason == "timeout" and time.monotonic() - started < 1.5
    assert compiler.get(params, None).result(timeout=30) is not None  # finished and cached
    assert llm.get_metrics()["structured_output_rejections_timeout"] == 1


def test_compiles_are_taken_tenants_in_turn(model):
    llm = make_llm(model)
    compiler = llm.llm_engine.structured_outputs.compiler
    compiler.get(StructuredOutputsParams(regex="warm"), None).result()
    flood = [occupy(compiler, 0.3, tenant="mallory") for _ in range(4)]
    bob = compiler.get(StructuredOutputsParams(regex="b+"), "bob")
    bob.result(timeout=5)
    # Bob waited for mallory's running compile at most, never for her backlog.
    assert sum(job.done() for job in flood) <= 2
    for job in flood:
        job.result(timeout=5)


def test_aborting_a_request_that_waits_for_its_grammar_leaks_nothing(model):
    llm = make_llm(model)
    engine = llm.llm_engine
    gate = occupy(engine.structured_outputs.compiler, 0.3)
    engine.add_request("w", engine.tokenizer.encode(PROMPTS[0]), person())
    assert engine.scheduler.waiting_for_grammar and engine.get_metrics()["num_waiting"] == 1
    engine.abort_request("w")
    assert not engine.scheduler.waiting_for_grammar
    gate.result()
    engine.check_no_leaks()


def test_a_grammar_that_fails_mid_answer_fails_only_its_own_request(model):
    llm = make_llm(model)
    engine = llm.llm_engine
    for name in ("a", "b"):
        engine.add_request(name, engine.tokenizer.encode(PROMPTS[0]), person())
    outputs = {}
    while len(outputs) < 2:  # until both answers have begun
        for out in engine.step():
            outputs[out.request_id] = out
    broken = engine.scheduler.requests["a"].structured_output.matcher
    broken.consume([engine.tokenizer.encode("zzz")[-1]])  # refused: its matcher is in error
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["a"].error and "structured output" in outputs["a"].error
    jsonschema.validate(json.loads(outputs["b"].outputs[0].text), PERSON)
    engine.check_no_leaks()


def test_prompt_logprobs_beside_a_forced_row_are_the_requests_own(model):
    stepwise = make_llm(model, structured_outputs_jump_forward=False)
    engine = stepwise.llm_engine
    tok = engine.tokenizer
    alone = run(
        stepwise,
        ["The prompt whose logprobs we want"],
        SamplingParams(max_tokens=1, prompt_logprobs=0),
    )
    forced = StructuredOutputsParams(choice=["hello wonderful world of forced tokens"])
    engine.add_request(
        "a", tok.encode("Say it: "), SamplingParams(max_tokens=20, structured_outputs=forced)
    )
    while not any(r.structured_output.forced_next for r in engine.scheduler.running):
        engine.step()  # until a's next token is forced
    engine.add_request(
        "b",
        tok.encode("The prompt whose logprobs we want"),
        SamplingParams(max_tokens=1, prompt_logprobs=0),
    )
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["b"].prompt_logprobs == alone[0].prompt_logprobs
    engine.check_no_leaks()


@pytest.mark.parametrize("constraint", [dict(choice=["yes"]), dict(json={"const": "hello world"})])
def test_a_grammar_its_forced_start_completes_gives_the_same_answer_in_both_modes(
    jump, stepwise, constraint
):
    for ignore_eos in (False, True):
        params = SamplingParams(
            max_tokens=10,
            ignore_eos=ignore_eos,
            structured_outputs=StructuredOutputsParams(**constraint),
        )
        fast = run(jump, ["Answer: "], params)[0].outputs[0]
        slow = run(stepwise, ["Answer: "], params)[0].outputs[0]
        assert (fast.token_ids, fast.finish_reason) == (slow.token_ids, slow.finish_reason)
        assert fast.finish_reason == "stop"
        assert fast.token_ids[-1] not in jump.llm_engine.scheduler.eos_token_ids


def test_cached_tokens_never_count_forced_output_as_prompt(jump):
    params = SamplingParams(
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(
            json={"const": "a b c d e f g h i j k l m n o p q r"}
        ),
    )
    for _ in range(2):
        out = run(jump, ["Hi"], params)[0]
        assert out.num_cached_tokens <= len(out.prompt_token_ids)


def test_a_schema_jsonschema_chokes_on_is_a_grammar_error(jump):
    for schema in ({"$schema": []}, {"$schema": 5}):
        with pytest.raises(GrammarError) as info:
            run(
                jump, ["x"], SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
            )
        assert info.value.reason == "invalid_schema"


def test_a_draft_past_the_grammars_vocabulary_is_cut(jump):
    engine = jump.llm_engine
    constraint = StructuredOutputsParams(regex=r"[0-9]{6}")
    engine.add_request(
        "v",
        engine.tokenizer.encode("Code: "),
        SamplingParams(max_tokens=8, structured_outputs=constraint),
    )
    grammar = engine.scheduler.requests["v"].structured_output
    while grammar.poll() is None:
        time.sleep(0.01)
    digit = engine.tokenizer.encode("7")[-1]
    assert grammar.valid_drafts([digit, engine.tokenizer.vocab_size + 5, digit]) == [digit]
    assert grammar.matcher.error is None
    engine.abort_request("v")
    engine.check_no_leaks()


def test_an_ambiguous_grammar_built_to_blow_up_fails_alone_and_fast(jump):
    hostile = StructuredOutputsParams(grammar='start: s\ns: s s s | s s | "a" | "ab" | "b"')
    started = time.monotonic()
    outputs = jump.generate(
        ["aaaa", PROMPTS[0]],
        [SamplingParams(max_tokens=400, ignore_eos=True, structured_outputs=hostile), person()],
        use_tqdm=False,
    )
    assert outputs[0].error or outputs[0].outputs[0].finish_reason in ("stop", "length")
    jsonschema.validate(json.loads(outputs[1].outputs[0].text), PERSON)
    assert time.monotonic() - started < 60
    jump.llm_engine.check_no_leaks()
