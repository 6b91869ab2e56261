"""Pinned prefixes: a pinned block is never evicted, unpinning makes it evictable again, the
pinned capacity is a hard bound, and the leak and invariant checks count pins as holders."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from tests.helpers.kv_cache import make_manager, make_request, schedule

SYSTEM = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks of 4


def _run(mgr: KVCacheManager, request_id: str, tokens: list[int]) -> None:
    request = make_request(request_id, tokens)
    assert schedule(mgr, request) is not None
    mgr.free(request)


def _fill(mgr: KVCacheManager, start: int) -> None:
    """Run prompts of new tokens through the whole pool, so every unheld cached block is evicted."""
    for i in range(mgr.num_kv_blocks // 2 + 1):
        _run(mgr, f"fill{start}-{i}", [100 + start * 100 + 8 * i + j for j in range(8)])


def test_a_pinned_prefix_is_never_evicted():
    mgr = make_manager(num_blocks=9, groups=None)  # 8 allocatable blocks
    mgr.held.pins.capacity_blocks = 4
    _run(mgr, "warm", SYSTEM + [9])
    assert mgr.held.pin_prefix("sys", make_request("probe", SYSTEM)) == 8
    _fill(mgr, 1)
    hit = make_request("again", SYSTEM + [9, 10])
    assert mgr.get_computed_blocks(hit)[1] == 8
    mgr.check_no_leaks()


def test_unpinning_makes_the_blocks_evictable_again():
    mgr = make_manager(num_blocks=9)
    mgr.held.pins.capacity_blocks = 4
    _run(mgr, "warm", SYSTEM + [9])
    mgr.held.pin_prefix("sys", make_request("probe", SYSTEM))
    assert mgr.held.pins.unpin("sys") and not mgr.held.pins.unpin("sys")
    _fill(mgr, 2)
    assert mgr.get_computed_blocks(make_request("again", SYSTEM + [9]))[1] == 0
    mgr.check_no_leaks()


def test_pinning_past_the_capacity_is_refused_and_holds_nothing():
    mgr = make_manager(num_blocks=9)
    mgr.held.pins.capacity_blocks = 1
    _run(mgr, "warm", SYSTEM + [9])
    with pytest.raises(ValueError, match="0 of 1 blocks are pinned"):
        mgr.held.pin_prefix("sys", make_request("probe", SYSTEM))
    assert len(mgr.held.pins) == 0 and mgr.num_free_blocks == mgr.num_kv_blocks


def test_a_prefix_that_is_not_cached_cannot_be_pinned():
    mgr = make_manager(num_blocks=9)
    mgr.held.pins.capacity_blocks = 4
    with pytest.raises(ValueError, match="nothing to pin"):
        mgr.held.pin_prefix("sys", make_request("probe", SYSTEM))


def test_two_pins_of_one_prefix_share_its_blocks_and_ids_are_unique():
    mgr = make_manager(num_blocks=9)
    mgr.held.pins.capacity_blocks = 2
    _run(mgr, "warm", SYSTEM + [9])
    mgr.held.pin_prefix("a", make_request("p1", SYSTEM))
    mgr.held.pin_prefix("b", make_request("p2", SYSTEM))  # the same 2 blocks: within capacity 2
    assert mgr.held.pins.num_blocks == 2
    with pytest.raises(ValueError, match="exists"):
        mgr.held.pin_prefix("a", make_request("p3", SYSTEM))
    mgr.check_invariants()
    mgr.held.pins.unpin("a")
    _fill(mgr, 3)
    assert mgr.get_computed_blocks(make_request("again", SYSTEM + [9]))[1] == 8  # b holds them


def test_a_cache_reset_drops_every_pin():
    mgr = make_manager(num_blocks=9)
    mgr.held.pins.capacity_blocks = 4
    _run(mgr, "warm", SYSTEM + [9])
    mgr.held.pin_prefix("sys", make_request("probe", SYSTEM))
    assert mgr.reset_prefix_cache()
    assert len(mgr.held.pins) == 0 and mgr.num_free_blocks == mgr.num_kv_blocks
    assert mgr.get_computed_blocks(make_request("again", SYSTEM + [9]))[1] == 0


def test_a_reset_refused_while_a_request_holds_blocks_keeps_the_pins():
    mgr = make_manager(num_blocks=9)
    mgr.held.pins.capacity_blocks = 4
    _run(mgr, "warm", SYSTEM + [9])
    mgr.held.pin_prefix("sys", make_request("probe", SYSTEM))
    running = make_request("running", [50, 51, 52, 53, 54])
    schedule(mgr, running)
    assert not mgr.reset_prefix_cache()
    assert len(mgr.held.pins) == 1


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["run", "pin", "unpin"]), st.integers(0, 5)), max_size=40
    )
)
def test_no_sequence_of_requests_evicts_a_pinned_block(ops):
    mgr = make_manager(num_blocks=13)
    mgr.held.pins.capacity_blocks = 6
    prompts = [[10 * p + j for j in range(9)] for p in range(6)]
    pinned: dict[str, list[int]] = {}
    for step, (op, p) in enumerate(ops):
        if op == "run":
            _run(mgr, f"r{step}", prompts[p])
        elif op == "pin":
            probe = make_request(f"probe{step}", prompts[p][:8])
            cached = mgr.get_computed_blocks(make_request(f"c{step}", prompts[p][:8] + [0]))[1]
            try:
                mgr.held.pin_prefix(f"pin{p}", probe)
                pinned[f"pin{p}"] = prompts[p][:8]
            except ValueError as exc:  # only for these reasons, each of them true
                reason = str(exc)
                if "exists already" in reason:
                    assert f"pin{p}" in pinned
                elif "nothing to pin" in reason:
                    assert cached == 0
                else:
                    assert "pinned capacity" in reason, reason
                    assert mgr.held.pins.num_blocks + cached // mgr.block_size > 6
        else:
            mgr.held.pins.unpin(f"pin{p}")
            pinned.pop(f"pin{p}", None)
        mgr.check_invariants()
        for pin_id, tokens in pinned.items():
            tokens_pinned = mgr.held.pins.describe()[pin_id]["num_tokens"]
            hit = mgr.get_computed_blocks(make_request(f"check{step}", tokens + [0]))[1]
            assert hit >= tokens_pinned, (pin_id, hit, tokens_pinned)
        assert mgr.held.pins.num_blocks <= 6
    mgr.held.pins.clear()
    mgr.check_no_leaks()
