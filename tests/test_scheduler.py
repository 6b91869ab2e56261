"""Scheduler rules, driven against the real KVCacheManager with a fake model
(tests.helpers.scheduler: its sampled tokens hash the history read back through the block
table, so the property test can compare any schedule against each request run alone).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve.config import SchedulerConfig
from prefixserve.core.request import Request, RequestStatus
from prefixserve.core.sched.scheduler import Scheduler
from prefixserve.sampling_params import SamplingParams
from tests.helpers.scheduler import (
    BLOCK,
    EOS,
    MAX_MODEL_LEN,
    FakeRunner,
    assert_no_leak,
    make_request,
    make_scheduler,
    reference_outputs,
    run_to_completion,
    scheduled_tokens,
    step,
)

PROMPT = list(range(10, 30))  # 20 tokens, 5 blocks


# ----------------------------------------------------------------------------- budgets


def test_chunked_prefill_splits_a_long_prompt_across_steps_and_samples_at_the_end():
    sched, runner = make_scheduler(max_num_batched_tokens=8)
    req = make_request("a", PROMPT)
    sched.add_request(req)
    chunks = []
    for _ in range(3):
        out = step(sched, runner)
        chunks.append((out.scheduled[0].num_computed_tokens, out.scheduled[0].num_new_tokens))
    assert chunks == [(0, 8), (8, 8), (16, 4)]
    assert req.num_output_tokens == 1  # sampled only once the last prompt chunk ran
    assert req.num_computed_tokens == 20


def test_token_budget_bounds_each_step_and_running_requests_go_first():
    sched, runner = make_scheduler(max_num_batched_tokens=12)
    sched.add_request(make_request("a", PROMPT[:6], max_tokens=8))
    step(sched, runner)  # a: 6 prompt tokens
    sched.add_request(make_request("b", [50 + i for i in range(20)]))
    out = step(sched, runner)
    # a decodes one token first, then b gets the rest of the budget as a chunk.
    assert [s.request.request_id for s in out.scheduled] == ["a", "b"]
    assert scheduled_tokens(out) == {"a": 1, "b": 11}
    assert out.total_num_scheduled_tokens <= 12


def test_max_num_seqs_bounds_running_requests():
    sched, runner = make_scheduler(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [40 + i] * 5))
    out = step(sched, runner)
    assert set(scheduled_tokens(out)) == {"r0", "r1"}
    assert sched.num_running == 2 and sched.num_waiting == 1


def test_long_prefill_token_threshold_caps_one_requests_chunk():
    sched, runner = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=6)
    sched.add_request(make_request("a", PROMPT))
    sched.add_request(make_request("b", [60 + i for i in range(3)]))
    out = step(sched, runner)
    assert scheduled_tokens(out) == {"a": 6, "b": 3}


# ----------------------------------------------------------------------------- prefix cache


def test_waiting_request_hit_becomes_num_computed_tokens_and_block_table_head():
    sched, runner = make_scheduler()
    first = make_request("a", PROMPT[:17])
    sched.add_request(first)
    run_to_completion(sched, runner)
    second = make_request("b", PROMPT[:17])
    sched.add_request(second)
    out = sched.schedule()
    entry = out.scheduled[0]
    assert entry.num_computed_tokens == 16 and entry.num_new_tokens == 1
    assert second.num_cached_tokens == 16
    sched.update_from_output(out, runner.execute(out))
    run_to_completion(sched, runner)
    assert second.output_token_ids == first.output_token_ids
    assert_no_leak(sched)


def test_hit_leaves_the_last_prompt_token_to_compute_even_when_every_block_is_cached():
    sched, runner = make_scheduler()
    sched.add_request(make_request("a", PROMPT[:16]))
    run_to_completion(sched, runner)
    second = make_request("b", PROMPT[:16])
    sched.add_request(second)
    out = step(sched, runner)
    assert second.num_cached_tokens == 12  # 15 tokens may hit; 3 full blocks of 4
    assert scheduled_tokens(out) == {"b": 4}


def test_identical_prompt_in_the_same_step_hits_blocks_cached_at_allocation():
    sched, runner = make_scheduler()
    a, b = make_request("a", PROMPT[:10]), make_request("b", PROMPT[:10])
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched, runner)
    assert scheduled_tokens(out) == {"a": 10, "b": 10 % BLOCK}
    assert b.num_cached_tokens == 8
    run_to_completion(sched, runner)
    assert a.output_token_ids == b.output_token_ids


def test_prefix_cache_off_never_hits():
    sched, runner = make_scheduler(enable_caching=False)
    sched.add_request(make_request("a", PROMPT))
    run_to_completion(sched, runner)
    second = make_request("b", PROMPT)
    sched.add_request(second)
    out = step(sched, runner)
    assert second.num_cached_tokens == 0 and scheduled_tokens(out) == {"b": 20}


def test_skip_reading_prefix_cache_computes_everything_but_still_writes_blocks():
    sched, runner = make_scheduler()
    sched.add_request(make_request("a", PROMPT))
    run_to_completion(sched, runner)
    skipper = make_request("b", PROMPT, skip_reading_prefix_cache=True)
    sched.add_request(skipper)
    run_to_completion(sched, runner)
    assert skipper.num_cached_tokens == 0
    reader = make_request("c", PROMPT + [77])
    sched.add_request(reader)
    step(sched, runner)
    assert reader.num_cached_tokens == 20


# ----------------------------------------------------------------------------- admission


def test_request_that_cannot_get_slots_stays_waiting_and_later_ones_wait_behind_it():
    sched, runner = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", PROMPT[:16], max_tokens=8))  # 4 blocks
    step(sched, runner)
    sched.add_request(make_request("big", [70 + i for i in range(20)]))  # needs 5 blocks
    sched.add_request(make_request("small", [90, 91]))  # would fit in 1 block
    out = step(sched, runner)
    assert scheduled_tokens(out) == {"a": 1}
    assert [r.request_id for r in sched.waiting] == ["big", "small"]
    run_to_completion(sched, runner)
    assert_no_leak(sched)


# ----------------------------------------------------------------------------- preemption


def _fill_pool_with_three_requests() -> tuple[Scheduler, FakeRunner, list[Request]]:
    # 7 blocks; three 8-token prompts take 2 blocks each; the first decode token of `a`
    # needs a 3rd block for a, which the single free block covers; b's then preempts c.
    sched, runner = make_scheduler(num_blocks=7)
    reqs = [
        make_request(name, [20 + 10 * i + j for j in range(8)], max_tokens=6)
        for i, name in enumerate("abc")
    ]
    for r in reqs:
        sched.add_request(r)
    step(sched, runner)
    assert all(r.num_output_tokens == 1 for r in reqs)
    assert sched.kv_cache_manager.num_free_blocks == 1
    return sched, runner, reqs


def test_preemption_takes_the_most_recently_admitted_running_request():
    sched, runner, (a, b, c) = _fill_pool_with_three_requests()
    out = step(sched, runner)
    assert scheduled_tokens(out) == {"a": 1, "b": 1}
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert list(sched.waiting) == [c] and sched.running == [a, b]
    # Not reported as finished: the runner keeps its seeded generator for when it resumes.
    assert "c" not in out.finished_req_ids


def test_preempted_blocks_are_freed_tail_first_and_keep_their_hashes():
    sched, runner, (a, b, c) = _fill_pool_with_three_requests()
    mgr = sched.kv_cache_manager
    c_blocks = [blk.block_id for blk in mgr.get_blocks(c).blocks[0]]
    step(sched, runner)
    head, tail = c_blocks
    # Freed tail first, so b's new block is c's tail; c's head stays free and hittable.
    assert tail in mgr.get_block_ids(b)[0]
    assert mgr.block_pool.blocks[head].ref_cnt == 0
    assert mgr.block_pool.blocks[head].block_hash is not None
    c_again = make_request("c2", c.prompt_token_ids)
    assert mgr.get_computed_blocks(c_again)[1] == BLOCK


def test_no_waiting_request_is_admitted_in_a_step_that_preempted():
    sched, runner, (a, b, c) = _fill_pool_with_three_requests()
    sched.add_request(make_request("d", [99]))
    out = step(sched, runner)
    assert "d" not in scheduled_tokens(out)
    assert [r.request_id for r in sched.waiting] == ["c", "d"]


def test_resumed_request_hits_its_own_prompt_and_generated_blocks():
    sched, runner = make_scheduler(num_blocks=6)
    a = make_request("a", [11, 12, 13, 14], max_tokens=20)
    c = make_request("c", [21, 22], max_tokens=20)
    sched.add_request(a)
    sched.add_request(c)
    while c.num_preemptions == 0:
        step(sched, runner)
    tokens_before = c.num_tokens
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    out = step(sched, runner)
    entry = next(s for s in out.scheduled if s.request is c)
    assert entry.num_computed_tokens == (tokens_before - 1) // BLOCK * BLOCK
    assert entry.num_computed_tokens > c.num_prompt_tokens  # generated blocks hit too
    assert c.num_cached_tokens == 0  # recorded at its first scheduling only
    run_to_completion(sched, runner)
    alone, runner2 = make_scheduler()
    twin = make_request("twin", [21, 22], max_tokens=20)
    alone.add_request(twin)
    run_to_completion(alone, runner2)
    assert c.output_token_ids == twin.output_token_ids
    assert_no_leak(sched)


def test_running_request_preempts_itself_when_it_is_the_last_one():
    sched, runner = make_scheduler(num_blocks=5)
    a = make_request("a", PROMPT[:8], max_tokens=10)
    b = make_request("b", [60 + i for i in range(8)], max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, runner)  # both prefilled: 2 blocks each, 1 free
    out = step(sched, runner)  # a takes the free block; b finds none and preempts itself
    assert scheduled_tokens(out) == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and sched.running == [a]
    run_to_completion(sched, runner)
    assert a.num_output_tokens == b.num_output_tokens == 10
    assert_no_leak(sched)


# ----------------------------------------------------------------------------- stopping


def _run_one(request: Request, next_token=None, max_model_len: int = MAX_MODEL_LEN) -> Request:
    sched, runner = make_scheduler(max_model_len=max_model_len)
    if next_token is not None:
        runner.next_token = next_token
    sched.add_request(request)
    run_to_completion(sched, runner)
    assert_no_leak(sched)
    return request


def test_eos_stops_the_request():
    req = _run_one(make_request("a", [11, 12], max_tokens=10), lambda h: EOS if len(h) > 4 else 50)
    assert req.output_token_ids == [50, 50, 50, EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    req = _run_one(make_request("a", [11], max_tokens=5, ignore_eos=True), lambda h: EOS)
    assert req.output_token_ids == [EOS] * 5
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_stop_token_ids_stop_and_become_the_stop_reason():
    req = _run_one(
        make_request("a", [11], max_tokens=9, stop_token_ids=[42]),
        lambda h: 42 if len(h) == 3 else 50,
    )
    assert req.output_token_ids == [50, 50, 42]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == 42


def test_max_tokens_caps_the_output():
    req = _run_one(make_request("a", [11, 12, 13], max_tokens=3))
    assert req.num_output_tokens == 3 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_context_length_caps_the_output():
    req = _run_one(make_request("a", [11, 12, 13], max_tokens=100), max_model_len=10)
    assert req.num_tokens == 10 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_abort_frees_the_blocks_of_running_and_waiting_requests():
    sched, runner = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("run", PROMPT, max_tokens=50))
    sched.add_request(make_request("wait", PROMPT[:5]))
    step(sched, runner)
    assert sched.kv_cache_manager.num_free_blocks < sched.kv_cache_manager.num_kv_blocks
    sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().finished_req_ids == {"run", "wait"}
    assert_no_leak(sched)


def test_reset_prefix_cache_fails_while_blocks_are_in_use_unless_running_are_reset():
    sched, runner = make_scheduler()
    req = make_request("a", PROMPT, max_tokens=6)
    sched.add_request(req)
    step(sched, runner)
    assert not sched.reset_prefix_cache()
    assert sched.reset_prefix_cache(reset_running_requests=True)
    assert req.status == RequestStatus.PREEMPTED and list(sched.waiting) == [req]
    run_to_completion(sched, runner)
    assert req.num_output_tokens == 6
    assert sched.reset_prefix_cache()
    assert_no_leak(sched)


# ----------------------------------------------------------------------------- property


_token = st.integers(10, 14)  # a small alphabet so prompts share blocks often


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefixes=st.lists(st.lists(_token, max_size=14), min_size=1, max_size=2),
    suffixes=st.lists(
        st.tuples(
            st.integers(0, 1),
            st.lists(_token, min_size=1, max_size=9),
            st.integers(1, 8),
            st.integers(0, 6),
            st.sampled_from([None, "a", "b"]),
        ),
        min_size=1,
        max_size=6,
    ),
    num_blocks=st.integers(8, 40),
    budget=st.integers(1, 24),
    threshold=st.sampled_from([0, 0, 3, 7]),
    max_num_seqs=st.integers(1, 5),
    enable_caching=st.booleans(),
    admission_order=st.sampled_from(["fcfs", "longest_prefix"]),
)
def test_any_schedule_gives_each_request_the_tokens_it_gets_alone(
    prefixes, suffixes, num_blocks, budget, threshold, max_num_seqs, enable_caching, admission_order
):
    prompts = [prefixes[p % len(prefixes)] + suffix for p, suffix, _, _, _ in suffixes]
    max_tokens = [n for _, _, n, _, _ in suffixes]
    arrival_step = [a for _, _, _, a, _ in suffixes]
    longest = max(len(p) + n for p, n in zip(prompts, max_tokens, strict=True))
    num_blocks = max(num_blocks, -(-longest // BLOCK))
    sched, runner = make_scheduler(num_blocks, max_num_seqs, budget, threshold, enable_caching)
    sched.config.admission_order = admission_order
    requests = [
        make_request(f"r{i}", p, n)
        for i, (p, n) in enumerate(zip(prompts, max_tokens, strict=True))
    ]
    for request, (_, _, _, _, tenant) in zip(requests, suffixes, strict=True):
        request.tenant = tenant  # fair shares between tenants change the plan, never the tokens
    for step_index in range(2000):
        for req, arrival in zip(requests, arrival_step, strict=True):
            if arrival == step_index:
                sched.add_request(req)
        if step_index > max(arrival_step) and not sched.has_unfinished_requests():
            break
        out = step(sched, runner)
        assert out.total_num_scheduled_tokens <= budget
        assert sched.num_running <= max_num_seqs
    assert [r.output_token_ids for r in requests] == reference_outputs(prompts, max_tokens)
    assert_no_leak(sched)


@pytest.mark.parametrize(
    "bad",
    [
        dict(max_num_seqs=0),
        dict(max_num_batched_tokens=-1),
        dict(long_prefill_token_threshold=-2),
        dict(max_num_seqs=1.5),
        dict(scheduling_policy="lifo"),
        dict(fair_chunk_tokens=-1),
    ],
)
def test_invalid_scheduler_config_names_the_field(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        SchedulerConfig(**bad)


def test_a_request_that_cannot_fit_an_idle_pool_is_reported_stuck():
    sched, runner = make_scheduler(num_blocks=3)  # 12 slots; the prompt needs 5 blocks
    sched.add_request(make_request("big", PROMPT))
    out = step(sched, runner)
    assert not out.scheduled
    assert sched.stuck_request().request_id == "big"


def test_a_waiting_request_is_not_stuck_while_others_run():
    sched, runner = make_scheduler(num_blocks=6, max_num_seqs=1)
    sched.add_request(make_request("run", PROMPT[:8], max_tokens=20))
    sched.add_request(make_request("wait", PROMPT[:8]))
    step(sched, runner)
    assert [r.request_id for r in sched.running] == ["run"]
    assert sched.stuck_request() is None


def test_stop_token_ids_are_a_set_built_once_per_request():
    request = Request("r", [1, 2, 3], SamplingParams(stop_token_ids=[9, 5, 9]))
    assert request.stop_token_ids == frozenset({5, 9})
    assert Request("s", [1], SamplingParams()).stop_token_ids == frozenset()


# ----------------------------------------------------------------------------- drafts held back


def _with_proposer(sched: Scheduler, hold: bool = True) -> Scheduler:
    """`sched` given an n-gram proposer (the predicate below is read, no step is drafted)."""
    from prefixserve.config import SpeculativeConfig
    from prefixserve.spec_decode.ngram import NgramProposer

    config = SpeculativeConfig(num_speculative_tokens=2, hold_for_prefill=hold)
    sched.proposer = NgramProposer(config)
    return sched


def test_drafts_are_held_while_a_running_prompt_has_chunks_left():
    sched, runner = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", PROMPT))  # 20 tokens: chunks of 8
    step(sched, runner)
    assert _with_proposer(sched)._prefill_pending()
    assert not _with_proposer(sched, hold=False)._prefill_pending()
    sched.proposer = None
    step(sched, runner)
    step(sched, runner)  # the prompt is computed: it decodes
    assert not _with_proposer(sched)._prefill_pending()


def _three_decoding_and_one_waiting(**config) -> Scheduler:
    """Three 8-token prompts (2 blocks each) computed and decoding, then a request waiting."""
    sched, runner = make_scheduler(**config)
    for name in "abc":
        sched.add_request(make_request(name, [20 + ord(name) + j for j in range(8)]))
    step(sched, runner)
    assert all(r.num_computed_tokens == r.num_tokens - 1 for r in sched.running)
    sched.add_request(make_request("late", [90, 91, 92]))
    return _with_proposer(sched)


def test_a_waiting_request_holds_drafts_only_when_it_can_start():
    """All decoding: a waiting request holds the drafts back while a running slot and a KV
    block are free for it; not when no block is free or every slot is taken (it cannot
    start)."""
    assert _three_decoding_and_one_waiting(num_blocks=8)._prefill_pending()
    no_block = _three_decoding_and_one_waiting(num_blocks=6)
    assert no_block.kv_cache_manager.num_free_blocks == 0
    assert not no_block._prefill_pending()
    assert not _three_decoding_and_one_waiting(max_num_seqs=3)._prefill_pending()
