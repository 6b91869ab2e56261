"""Cache breakpoints (core/kv_cache/breakpoints.py): a held breakpoint survives LRU pressure until
its ttl runs out after its last use, each use pushes the expiry on, a tenant's budget ages out
only its own breakpoints, the shared capacity never evicts another tenant's, and the leak and
invariant checks count breakpoints as holders."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.core.kv_cache.breakpoint_spec import (
    CacheBreakpoint,
    HoldStatus,
    check_breakpoints,
    request_breakpoints,
)
from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from tests.helpers.kv_cache import make_manager, make_request, schedule

SYSTEM = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks of 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _manager(num_blocks: int = 13, capacity: int = 6, per_tenant: int = 4) -> tuple:
    mgr = make_manager(num_blocks=num_blocks)
    clock = Clock()
    mgr.held.breakpoints.capacity_blocks = capacity
    mgr.held.breakpoints.tenant_budget_blocks = per_tenant
    mgr.held.breakpoints.clock = clock
    return mgr, clock


def _run_and_hold(
    mgr: KVCacheManager, request_id: str, tokens: list[int], ttl: int = 300, tenant="a", at=None
) -> HoldStatus:
    """Compute `tokens` as a request with one breakpoint at `at` (default: all of it), hold it
    as the scheduler does at its first sample, then free the request."""
    request = make_request(request_id, tokens, tenant=tenant)
    assert schedule(mgr, request) is not None
    bp = CacheBreakpoint(len(tokens) if at is None else at, ttl)
    (status,) = mgr.held.hold_breakpoints(request, (bp,), lambda _: True)
    mgr.free(request)
    return status


def _fill(mgr: KVCacheManager, start: int) -> None:
    """Prompts of new tokens through the whole pool: every unheld cached block is evicted."""
    for i in range(mgr.num_kv_blocks // 2 + 1):
        request = make_request(
            f"fill{start}-{i}", [1000 + start * 1000 + 8 * i + j for j in range(8)]
        )
        assert schedule(mgr, request) is not None
        mgr.free(request)


def _hit(mgr: KVCacheManager, tokens: list[int]) -> int:
    return mgr.get_computed_blocks(make_request("probe", tokens + [99]))[1]


def test_a_held_breakpoint_survives_a_flood_that_evicts_everything_else():
    mgr, _ = _manager()
    assert _run_and_hold(mgr, "sys", SYSTEM + [9]) is HoldStatus.HELD
    other = [50, 51, 52, 53, 54, 55, 56, 57]
    _run_and_hold(mgr, "other", other, at=0)  # no breakpoint blocks: never held
    _fill(mgr, 1)
    assert _hit(mgr, SYSTEM) == 8
    assert _hit(mgr, other) == 0
    mgr.check_no_leaks()


def test_a_breakpoint_is_released_when_its_ttl_runs_out_after_its_last_use():
    mgr, clock = _manager()
    _run_and_hold(mgr, "sys", SYSTEM + [9], ttl=300)
    clock.now += 200
    # A read of the prefix is a use: the expiry moves to now + 300.
    reader = make_request("reader", SYSTEM + [10], tenant="a")
    assert schedule(mgr, reader) == 8
    mgr.held.refresh_breakpoints(reader, 8)
    mgr.free(reader)
    clock.now += 250  # 450 s after the hold, 250 after the read
    assert mgr.held.expire_breakpoints() == 0 and len(mgr.held.breakpoints) == 1
    clock.now += 51
    assert mgr.held.expire_breakpoints() == 1 and len(mgr.held.breakpoints) == 0
    _fill(mgr, 2)
    assert _hit(mgr, SYSTEM) == 0  # an ordinary cached block again, evicted
    mgr.check_no_leaks()


def test_asking_for_a_held_breakpoint_again_refreshes_it_and_writes_nothing():
    mgr, clock = _manager()
    assert _run_and_hold(mgr, "first", SYSTEM + [9], ttl=300) is HoldStatus.HELD
    clock.now += 299
    assert _run_and_hold(mgr, "again", SYSTEM + [9], ttl=300) is HoldStatus.REFRESHED
    clock.now += 299
    assert mgr.held.expire_breakpoints() == 0
    assert mgr.held.breakpoints.num_blocks == 2
    mgr.check_no_leaks()


def test_a_tenant_over_its_budget_ages_out_its_own_soonest_expiring_breakpoint():
    mgr, clock = _manager(per_tenant=4, capacity=8)
    first, second, third = ([k * 10 + j for j in range(8)] for k in (1, 2, 3))
    _run_and_hold(mgr, "1", first + [9], ttl=3600)
    clock.now += 1
    _run_and_hold(mgr, "2", second + [9], ttl=300)  # expires first
    assert mgr.held.breakpoints.tenant_blocks("a") == 4
    assert _run_and_hold(mgr, "3", third + [9], ttl=300) is HoldStatus.HELD
    _fill(mgr, 3)
    assert (_hit(mgr, first), _hit(mgr, second), _hit(mgr, third)) == (8, 0, 8)
    mgr.check_no_leaks()


def test_another_tenants_breakpoints_are_never_released_to_make_room():
    mgr, _ = _manager(per_tenant=4, capacity=6)
    tenant_a = [10 + j for j in range(16)]  # four blocks: a's whole budget
    assert _run_and_hold(mgr, "a", tenant_a + [9], tenant="a") is HoldStatus.HELD
    tenant_b = [200 + j for j in range(16)]
    # b's four blocks would pass the shared capacity of 6; a's are not b's to release.
    assert _run_and_hold(mgr, "b", tenant_b + [9], tenant="b") is HoldStatus.REFUSED_BUDGET
    _fill(mgr, 4)
    assert _hit(mgr, tenant_a) == 16
    assert len(mgr.held.breakpoints) == 1
    mgr.check_no_leaks()


def test_a_breakpoint_larger_than_the_tenant_budget_is_refused_and_holds_nothing():
    mgr, _ = _manager(per_tenant=1)
    assert _run_and_hold(mgr, "big", SYSTEM + [9]) is HoldStatus.REFUSED_BUDGET
    assert mgr.held.breakpoints.num_blocks == 0
    mgr.check_no_leaks()


def test_a_breakpoint_larger_than_the_budget_is_refused_first_and_releases_nothing():
    mgr, _ = _manager(per_tenant=2, capacity=8)
    small = [300 + j for j in range(4)]
    assert _run_and_hold(mgr, "small", small + [9], ttl=3600) is HoldStatus.HELD
    big = [400 + j for j in range(12)]  # three blocks: past the budget of two, whatever it frees
    assert _run_and_hold(mgr, "big", big + [9]) is HoldStatus.REFUSED_BUDGET
    assert len(mgr.held.breakpoints) == 1 and mgr.held.breakpoints.tenant_blocks("a") == 1
    _fill(mgr, 8)
    assert _hit(mgr, small) == 4
    mgr.check_no_leaks()


def test_a_breakpoint_refused_for_the_shared_capacity_releases_nothing_of_its_tenant():
    mgr, _ = _manager(per_tenant=4, capacity=6)
    others = [500 + j for j in range(16)]  # four blocks of b's
    assert _run_and_hold(mgr, "b", others + [9], tenant="b") is HoldStatus.HELD
    own = [600 + j for j in range(8)]  # a's 1h breakpoint: the capacity's last two blocks
    assert _run_and_hold(mgr, "a1", own + [9], ttl=3600) is HoldStatus.HELD
    wanted = [700 + j for j in range(16)]  # within a's budget once a's own go, never within 6
    assert _run_and_hold(mgr, "a2", wanted + [9]) is HoldStatus.REFUSED_BUDGET
    assert mgr.held.breakpoints.tenant_blocks("a") == 2 and len(mgr.held.breakpoints) == 2
    _fill(mgr, 9)
    assert (_hit(mgr, own), _hit(mgr, others)) == (8, 16)
    mgr.check_no_leaks()


def test_a_breakpoint_refused_for_the_pool_releases_nothing_of_its_tenant():
    mgr, _ = _manager(per_tenant=2, capacity=8)
    assert _run_and_hold(mgr, "own", SYSTEM + [9], ttl=3600) is HoldStatus.HELD
    request = make_request("r", [800 + j for j in range(8)] + [9], tenant="a")
    assert schedule(mgr, request) is not None
    statuses = mgr.held.hold_breakpoints(request, (CacheBreakpoint(8, 300),), lambda _: False)
    mgr.free(request)
    assert statuses == [HoldStatus.REFUSED_POOL]
    assert mgr.held.breakpoints.tenant_blocks("a") == 2
    _fill(mgr, 10)
    assert _hit(mgr, SYSTEM) == 8
    mgr.check_no_leaks()


def test_a_breakpoint_replacing_its_tenants_own_counts_only_the_net_held_blocks_for_the_pool():
    mgr, _ = _manager(per_tenant=2, capacity=8)
    assert _run_and_hold(mgr, "own", SYSTEM + [9], ttl=300) is HoldStatus.HELD
    request = make_request("r", [900 + j for j in range(8)] + [9], tenant="a")
    assert schedule(mgr, request) is not None
    asked: list[int] = []

    def fits_pool(num_new_held: int) -> bool:
        asked.append(num_new_held)
        return mgr.held.num_blocks + num_new_held <= 2  # room for two held blocks, no more

    statuses = mgr.held.hold_breakpoints(request, (CacheBreakpoint(8, 300),), fits_pool)
    mgr.free(request)
    assert asked == [0]  # two blocks held, two of its own released: no net growth
    assert statuses == [HoldStatus.HELD] and mgr.held.breakpoints.tenant_blocks("a") == 2
    assert mgr.held.num_blocks == 2
    mgr.check_no_leaks()


def test_a_breakpoint_that_would_strand_a_queued_request_is_refused():
    mgr, _ = _manager()
    request = make_request("r", SYSTEM + [9], tenant="a")
    assert schedule(mgr, request) is not None
    statuses = mgr.held.hold_breakpoints(request, (CacheBreakpoint(8, 300),), lambda n: n == 0)
    assert statuses == [HoldStatus.REFUSED_POOL]
    mgr.free(request)
    mgr.check_no_leaks()


def test_a_breakpoint_shorter_than_a_block_holds_nothing():
    mgr, _ = _manager()
    assert _run_and_hold(mgr, "short", SYSTEM + [9], at=3) is HoldStatus.NOT_CACHED
    assert mgr.held.breakpoints.num_blocks == 0


def test_a_breakpoint_holds_full_blocks_only_up_to_its_position():
    mgr, _ = _manager()
    _run_and_hold(mgr, "mid", SYSTEM + [9], at=7)  # one full block before token 7
    assert mgr.held.breakpoints.num_blocks == 1
    _fill(mgr, 5)
    assert _hit(mgr, SYSTEM) == 4


def test_a_cache_reset_releases_every_breakpoint():
    mgr, _ = _manager()
    _run_and_hold(mgr, "sys", SYSTEM + [9])
    assert mgr.reset_prefix_cache()
    assert len(mgr.held.breakpoints) == 0
    mgr.check_no_leaks()


def test_held_breakpoints_shrink_the_blocks_available_to_a_request():
    mgr, _ = _manager()
    _run_and_hold(mgr, "sys", SYSTEM + [9])
    assert mgr.held.blocks_available_to(make_request("x", [500, 501, 502])) == mgr.num_kv_blocks - 2
    # Its own prompt's held blocks cost it nothing.
    assert mgr.held.blocks_available_to(make_request("y", SYSTEM + [9])) == mgr.num_kv_blocks


@pytest.mark.parametrize(
    ("breakpoints", "message"),
    [
        ((CacheBreakpoint(4, 300),) * 5, "at most 4"),
        ((CacheBreakpoint(8, 300), CacheBreakpoint(4, 300)), "prompt order"),
        ((CacheBreakpoint(4, 300), CacheBreakpoint(8, 3600)), "longer ttl"),
        ((CacheBreakpoint(40, 300),), "outside the prompt"),
        ((CacheBreakpoint(4, 7),), "ttl_s must be one of"),
        ((CacheBreakpoint(True, 300),), "must be an int"),
        (("x",), "must be a CacheBreakpoint"),
        (None, "must be a tuple"),
    ],
)
def test_bad_breakpoints_are_refused_naming_the_problem(breakpoints, message):
    with pytest.raises(ValueError, match=message):
        check_breakpoints(breakpoints, 20)


def test_openai_24h_retention_is_a_breakpoint_at_the_prompt_end():
    assert request_breakpoints((), "24h", 20) == (CacheBreakpoint(20, 86400),)
    assert request_breakpoints((), "in_memory", 20) == ()
    own = (CacheBreakpoint(8, 300),)
    assert request_breakpoints(own, "24h", 20) == own


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.integers(0, 5),  # which prompt
            st.sampled_from([300, 3600]),
            st.integers(0, 400),  # seconds before it
        ),
        max_size=25,
    )
)
def test_breakpoints_never_leak_stay_within_their_bounds_and_a_refusal_releases_nothing(ops):
    mgr, clock = _manager(num_blocks=17, capacity=8, per_tenant=4)
    for i, (tenant, prompt, ttl, wait) in enumerate(ops):
        clock.now += wait
        mgr.held.expire_breakpoints()
        tokens = [prompt * 100 + j for j in range(4 * (1 + prompt % 3))] + [9]
        before = (mgr.held.breakpoints.describe(), mgr.held.breakpoints.holders())
        status = _run_and_hold(mgr, f"r{i}", tokens, ttl=ttl, tenant=tenant)
        if status in (HoldStatus.REFUSED_BUDGET, HoldStatus.REFUSED_POOL):
            assert (mgr.held.breakpoints.describe(), mgr.held.breakpoints.holders()) == before
        assert mgr.held.breakpoints.num_blocks <= 8
        for t in "abc":
            assert mgr.held.breakpoints.tenant_blocks(t) <= 4
        mgr.check_no_leaks()
    clock.now += 10**6
    mgr.held.expire_breakpoints()
    assert mgr.held.breakpoints.num_blocks == 0
    mgr.check_no_leaks()


@pytest.mark.parametrize("name", ["max_breakpoint_blocks", "max_breakpoint_blocks_per_tenant"])
@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_the_breakpoint_bounds_refuse_what_is_not_a_block_count(name, bad):
    from prefixserve.config import CacheConfig

    with pytest.raises(ValueError, match=name):
        CacheConfig(**{name: bad})


def test_the_breakpoint_bounds_reach_the_manager():
    from prefixserve.engine_args import EngineArgs

    config = EngineArgs(
        max_breakpoint_blocks=10, max_breakpoint_blocks_per_tenant=3
    ).create_engine_config()
    assert config.cache.max_breakpoint_blocks == 10
    assert config.cache.max_breakpoint_blocks_per_tenant == 3


def test_replicas_held_breakpoints_merge_into_one_view():
    from prefixserve.engine.cache_summary import _merged_breakpoints

    one = {
        "tenants": {"a": {"breakpoints": 1, "blocks": 4, "tokens": 64}},
        "held_blocks": 4,
        "capacity_blocks": 10,
        "tenant_budget_blocks": 5,
        "write_tokens": 64,
    }
    two = {
        "tenants": {
            "a": {"breakpoints": 2, "blocks": 3, "tokens": 48},
            "b": {"breakpoints": 1, "blocks": 1, "tokens": 16},
        },
        "held_blocks": 4,
        "capacity_blocks": 10,
        "tenant_budget_blocks": 5,
        "write_tokens": 16,
    }
    merged = _merged_breakpoints([one, None, two])
    assert merged["tenants"]["a"] == {"breakpoints": 3, "blocks": 7, "tokens": 112}
    assert merged["tenants"]["b"]["blocks"] == 1
    assert (merged["held_blocks"], merged["capacity_blocks"], merged["write_tokens"]) == (8, 20, 80)
    assert _merged_breakpoints([None]) is None


def test_a_pin_and_a_breakpoint_on_one_prefix_each_hold_it_until_both_let_go():
    mgr, clock = _manager()
    mgr.held.pins.capacity_blocks = 4
    _run_and_hold(mgr, "sys", SYSTEM + [9], ttl=300)
    assert mgr.held.pin_prefix("pin", make_request("probe", SYSTEM)) == 8
    assert mgr.held.num_blocks == 2
    assert mgr.held.pins.unpin("pin")
    _fill(mgr, 6)
    assert _hit(mgr, SYSTEM) == 8  # the breakpoint still holds it
    clock.now += 301
    mgr.held.expire_breakpoints()
    mgr.held.pin_prefix("pin2", make_request("probe", SYSTEM))
    _fill(mgr, 7)
    assert _hit(mgr, SYSTEM) == 8  # and now the pin alone
    mgr.check_no_leaks()
