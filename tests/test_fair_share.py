"""Fair shares between tenants: the waiting queue's turns, the token split, and the scheduler rules
they make (each test named after its rule), driven with test_scheduler's fake model."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixserve.core.request import Request, RequestStatus
from prefixserve.core.sched.fair_share import WaitingQueue, water_fill
from prefixserve.core.sched.prefix_order import promote_longest_prefix
from tests.helpers.scheduler import (
    assert_no_leak,
    make_request,
    make_scheduler,
    run_to_completion,
    scheduled_tokens,
    step,
)


def _req(request_id: str, tenant: str | None, prompt_len: int = 4, max_tokens: int = 4) -> Request:
    # Different requests, different prompts: no prefix-cache hit between them.
    seed = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "little")
    prompt = [10 + (seed >> (i % 24)) % 90 for i in range(prompt_len)]
    request = make_request(request_id, prompt, max_tokens)
    request.tenant = tenant
    return request


# ----------------------------------------------------------------- WaitingQueue


def test_one_tenant_waiting_queue_is_fifo():
    queue = WaitingQueue()
    reqs = [_req(f"r{i}", None) for i in range(4)]
    for r in reqs:
        queue.append(r)
    assert list(queue) == reqs and queue[0] is reqs[0] and queue[-1] is reqs[-1]
    order = []
    while queue:
        head = queue.peek()
        queue.pop(head)
        order.append(head)
    assert order == reqs and len(queue) == 0


def test_tenants_take_turns_at_the_head_of_the_waiting_queue():
    queue = WaitingQueue()
    for i in range(3):
        queue.append(_req(f"a{i}", "a"))
    queue.append(_req("b0", "b"))
    queue.append(_req("c0", "c"))
    order = []
    while queue:
        head = queue.peek()
        queue.pop(head)
        order.append(head.request_id)
    assert order == ["a0", "b0", "c0", "a1", "a2"]


def test_a_preempted_request_goes_first_in_its_tenants_queue_and_its_tenant_goes_first():
    queue = WaitingQueue()
    queue.append(_req("a0", "a"))
    queue.append(_req("b0", "b"))
    preempted = _req("b-old", "b")
    queue.appendleft(preempted)
    assert queue.peek() is preempted
    assert [r.request_id for r in queue] == ["b-old", "b0", "a0"]


def test_peek_with_shares_skips_tenants_whose_share_is_spent():
    queue = WaitingQueue()
    queue.append(_req("a0", "a"))
    queue.append(_req("b0", "b"))
    assert queue.peek({"a": 0, "b": 5}).request_id == "b0"
    assert queue.peek({"a": 0, "b": 0}) is None


def _queued(*requests: Request) -> WaitingQueue:
    queue = WaitingQueue()
    for request in requests:
        queue.append(request)
    return queue


def test_remove_takes_out_any_waiting_request_and_refuses_a_stranger():
    a0, a1, b0 = _req("a0", "a"), _req("a1", "a"), _req("b0", "b")
    queue = _queued(a0, a1, b0)
    queue.remove(a1)
    queue.remove(b0)
    assert list(queue) == [a0] and queue.tenants() == ["a"]
    with pytest.raises(ValueError):
        queue.remove(_req("x", "x"))


# ----------------------------------------------------------------- water_fill


def test_water_fill_serves_small_demands_in_full_and_splits_the_rest_equally():
    assert water_fill({"a": 100, "b": 3}, 20) == {"a": 17, "b": 3}
    assert water_fill({"a": 100, "b": 100}, 20) == {"a": 10, "b": 10}
    assert water_fill({"a": 100, "b": 100, "c": 100}, 20) == {"a": 7, "b": 7, "c": 6}
    assert water_fill({"a": 5, "b": 6}, 20) == {"a": 5, "b": 6}


@given(
    demands=st.dictionaries(st.text(max_size=2), st.integers(0, 500), max_size=6),
    budget=st.integers(0, 2000),
)
def test_water_fill_is_max_min_fair(demands, budget):
    shares = water_fill(demands, budget)
    assert set(shares) == set(demands)
    assert sum(shares.values()) == min(budget, sum(demands.values()))
    for tenant, share in shares.items():
        assert 0 <= share <= demands[tenant]
        if share < demands[tenant]:  # cut short: nobody else got more than one token more
            assert all(other <= share + 1 for other in shares.values())


# ----------------------------------------------------------------- the scheduler's rules


def test_one_tenant_gets_the_whole_token_budget():
    sched, runner = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(_req("a0", "a", prompt_len=20))
    assert scheduled_tokens(step(sched, runner)) == {"a0": 8}


def test_a_tenants_flood_does_not_queue_another_tenants_request_behind_it():
    sched, runner = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(6):
        sched.add_request(_req(f"a{i}", "a"))
    sched.add_request(_req("b0", "b"))
    first = scheduled_tokens(step(sched, runner))
    assert set(first) == {"a0", "b0"}  # tenants in turn, not arrival order
    run_to_completion(sched, runner)
    assert_no_leak(sched)


def test_a_tenants_long_prefill_cannot_push_another_tenants_decode_out_of_a_step():
    sched, runner = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(_req("a-long", "a", prompt_len=200, max_tokens=2))  # ahead of b in line
    sched.add_request(_req("b0", "b", prompt_len=4, max_tokens=20))
    assert scheduled_tokens(step(sched, runner)) == {"a-long": 12, "b0": 4}
    for _ in range(5):
        tokens = scheduled_tokens(step(sched, runner))
        assert tokens == {"a-long": 15, "b0": 1}  # b decodes every step; a gets the rest
    run_to_completion(sched, runner)
    assert_no_leak(sched)


def test_running_requests_of_a_tenant_past_its_share_wait_for_the_next_step():
    sched, runner = make_scheduler(max_num_batched_tokens=8)
    a0, a1 = _req("a0", "a", prompt_len=40), _req("a1", "a", prompt_len=40)
    b0 = _req("b0", "b", prompt_len=40)
    for r in (a0, a1, b0):
        sched.add_request(r)
    tokens = scheduled_tokens(step(sched, runner))
    assert tokens == {"a0": 4, "b0": 4}  # a's share is 4 tokens, and a0 takes them all
    tokens = scheduled_tokens(step(sched, runner))
    assert tokens == {"a0": 4, "b0": 4}  # a1 waits: a's share goes to its oldest request first
    run_to_completion(sched, runner)
    assert_no_leak(sched)


def test_a_share_left_unused_goes_to_the_next_tenant_in_turn():
    sched, runner = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(_req("a0", "a", prompt_len=40))
    sched.add_request(_req("b0", "b", prompt_len=4))
    tokens = scheduled_tokens(step(sched, runner))
    assert tokens == {"a0": 12, "b0": 4}  # b needs 4 of its 8: a gets the other 4 as well


def test_preemption_takes_from_the_tenant_with_the_most_running_requests():
    # 6 blocks of 4 slots. Tenant a runs two requests, b one, then b's grows past the pool.
    sched, runner = make_scheduler(num_blocks=6, max_num_batched_tokens=64)
    a0, a1 = _req("a0", "a", prompt_len=7, max_tokens=9), _req("a1", "a", prompt_len=7)
    b0 = _req("b0", "b", prompt_len=7, max_tokens=9)
    sched.add_request(a0)
    sched.add_request(a1)
    step(sched, runner)
    sched.add_request(b0)
    step(sched, runner)
    assert sched.running == [a0, a1, b0]
    while not any(r.status == RequestStatus.PREEMPTED for r in (a0, a1, b0)):
        step(sched, runner)
    # b0 is the newest, but a has more running requests: one of a's is preempted.
    assert b0.status == RequestStatus.RUNNING and b0.num_preemptions == 0
    assert a1.num_preemptions + a0.num_preemptions == 1
    run_to_completion(sched, runner)
    assert_no_leak(sched)


def test_fcfs_policy_admits_in_arrival_order_over_all_tenants():
    sched, runner = make_scheduler(max_num_seqs=2, scheduling_policy="fcfs")
    for i in range(6):
        sched.add_request(_req(f"a{i}", "a"))
    sched.add_request(_req("b0", "b"))
    assert set(scheduled_tokens(step(sched, runner))) == {"a0", "a1"}
    run_to_completion(sched, runner)
    assert_no_leak(sched)


def test_fcfs_policy_splits_no_budget_between_tenants():
    sched, runner = make_scheduler(max_num_batched_tokens=16, scheduling_policy="fcfs")
    sched.add_request(_req("a-long", "a", prompt_len=200, max_tokens=2))
    sched.add_request(_req("b0", "b", prompt_len=4, max_tokens=20))
    assert scheduled_tokens(step(sched, runner)) == {"a-long": 16}


def test_a_tenant_without_a_running_slot_takes_one_from_the_tenant_holding_them_all():
    sched, runner = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    a0, a1 = _req("a0", "a", max_tokens=30), _req("a1", "a", max_tokens=30)
    sched.add_request(a0)
    sched.add_request(a1)
    step(sched, runner)
    b0 = _req("b0", "b", max_tokens=3)
    sched.add_request(b0)
    tokens = scheduled_tokens(step(sched, runner))
    # a's newest gave its slot to b at once; a0 runs on.
    assert a1.num_preemptions == 1 and set(tokens) == {"a0", "b0"}
    for _ in range(5):  # b holds its equal share now: no more preemptions while it runs
        step(sched, runner)
    assert a0.num_preemptions == 0 and a1.num_preemptions == 1
    run_to_completion(sched, runner)
    assert_no_leak(sched)  # (the tokens of preempted requests: the property test in
    # test_scheduler.py runs tenants through every schedule against each request run alone)


def test_fcfs_policy_never_preempts_for_running_slots():
    sched, runner = make_scheduler(
        max_num_seqs=2, max_num_batched_tokens=64, scheduling_policy="fcfs"
    )
    a0, a1 = _req("a0", "a", max_tokens=10), _req("a1", "a", max_tokens=10)
    sched.add_request(a0)
    sched.add_request(a1)
    step(sched, runner)
    sched.add_request(_req("b0", "b", max_tokens=3))
    assert set(scheduled_tokens(step(sched, runner))) == {"a0", "a1"}
    assert a1.num_preemptions == 0


def test_while_tenants_share_a_step_no_prefill_chunk_exceeds_the_fair_chunk():
    sched, runner = make_scheduler(max_num_batched_tokens=64, fair_chunk_tokens=8)
    sched.add_request(_req("a-long", "a", prompt_len=100, max_tokens=2))
    assert scheduled_tokens(step(sched, runner)) == {"a-long": 64}  # alone: the whole budget
    sched.add_request(_req("b0", "b", prompt_len=20, max_tokens=30))
    assert scheduled_tokens(step(sched, runner)) == {"a-long": 8, "b0": 8}
    assert scheduled_tokens(step(sched, runner)) == {"a-long": 8, "b0": 8}
    run_to_completion(sched, runner)
    assert_no_leak(sched)


def test_a_request_waits_for_the_blocks_a_running_prefill_is_computing():
    # Prompts of 40 tokens (10 blocks) sharing their first 36, chunks of 8 in a budget of 16:
    # the first computes the shared blocks chunk by chunk; the second, instead of computing them
    # too with the budget left, waits and then hits all of them.
    sched, runner = make_scheduler(
        max_num_batched_tokens=16, long_prefill_token_threshold=8, max_num_seqs=4
    )
    shared = list(range(10, 46))
    first = make_request("first", shared + [60, 61, 62, 63], 2)
    second = make_request("second", shared + [70, 71, 72, 73], 2)
    sched.add_request(first)
    sched.add_request(second)
    tokens = scheduled_tokens(step(sched, runner))
    assert tokens == {"first": 8}  # the second's next block is the first's block 2: it waits
    run_to_completion(sched, runner)
    assert second.num_cached_tokens == 36
    # 40 + 4 prompt tokens computed, not 40 + 40 - 8.
    assert sched.stats.num_computed_prompt_tokens == 44
    assert_no_leak(sched)


def test_promote_moves_a_waiting_request_to_the_head_of_its_tenants_queue():
    a0, a1, b0 = _req("a0", "a"), _req("a1", "a"), _req("b0", "b")
    queue = _queued(a0, a1, b0)
    queue.promote(a1)
    assert list(queue) == [a1, a0, b0]


def test_longest_prefix_admission_takes_the_request_whose_prefix_is_cached_first():
    for order, first in (("fcfs", "cold"), ("longest_prefix", "warm")):
        sched, runner = make_scheduler(max_num_seqs=1)
        sched.config.admission_order = order
        run_to_completion_of = _req("seed", None, prompt_len=24, max_tokens=1)
        sched.add_request(run_to_completion_of)
        run_to_completion(sched, runner)  # its prompt's blocks are cached now
        cold = _req("cold", None, prompt_len=24)
        warm = make_request("warm", run_to_completion_of.prompt_token_ids + [5], 4)
        sched.add_request(cold)
        sched.add_request(warm)
        assert list(scheduled_tokens(step(sched, runner))) == [first], order
        run_to_completion(sched, runner)
        assert_no_leak(sched)


def test_a_request_passed_over_often_enough_is_admitted_first():
    sched, _ = make_scheduler()
    mgr = sched.kv_cache_manager
    queue = WaitingQueue()
    old, newer = _req("old", None), _req("newer", None)
    queue.append(old)
    queue.append(newer)
    newer.prompt_token_ids = old.prompt_token_ids  # (no hit either way: aging decides alone)
    old.cache.num_passed_over = 3
    assert promote_longest_prefix(queue, old, mgr, age_limit=3) is old
    old.cache.num_passed_over = 0
    # Equal hits: arrival order stands, nobody is passed over.
    assert promote_longest_prefix(queue, old, mgr, age_limit=3) is old
    assert newer.cache.num_passed_over == 0
