"""Eviction policies of the free queue (prefixserve/core/kv_cache/eviction/: policies.py, lru.py,
slru.py, cost_aware.py).

Exact cases pin each policy's order, named after its rule; a recording policy pins when the pool
calls the hooks; a stateful property test holds every policy to what no policy may do: hand out
a block in use or pinned, or break the pool's invariants.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixserve.core.kv_cache.block import KVCacheBlock
from prefixserve.core.kv_cache.block_pool import BlockPool
from prefixserve.core.kv_cache.eviction.cost_aware import ATTENTION_DEPTH_BLOCKS, CostAwareQueue
from prefixserve.core.kv_cache.eviction.policies import EVICTION_POLICIES, make_free_queue
from prefixserve.core.kv_cache.eviction.slru import SegmentedLRUQueue
from prefixserve.engine_args import EngineArgs
from tests.helpers.kv_cache import free_ids, make_manager, make_request

BS = 4


# Queues built without a pool are sized for block ids below this.
NUM_IDS = 256


def cached(queue, block_id: int, hits: int = 0, depth: int = 0) -> KVCacheBlock:
    """A block as the pool leaves it once cached at table index `depth` and hit `hits` times:
    through `queue`'s hooks, as the pool calls them."""
    block = KVCacheBlock(block_id)
    block.block_hash, block.token_ids = bytes([block_id]), [block_id]
    table = [KVCacheBlock(0)] * depth + [block]
    queue.on_cache(table, [depth])
    for _ in range(hits):
        queue.on_hit([block])
    return block


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def cache_prompt(pool: BlockPool, request_id: str, tokens: list[int]):
    """Allocate and cache the full blocks of a prompt: (request, blocks), all held."""
    request = make_request(request_id, tokens, block_size=BS)
    blocks = pool.get_new_blocks(len(tokens) // BS)
    pool.cache_full_blocks(request, blocks, 0, len(blocks), BS)
    return request, blocks


# ----------------------------------------------------------------------------- every policy


def test_the_policies_are_lru_slru_and_cost_and_an_unknown_name_lists_them():
    assert EVICTION_POLICIES == ("lru", "slru", "cost")
    for make in (
        lambda: BlockPool(4, eviction_policy="lfu"),
        lambda: make_manager(eviction_policy="lfu"),
        # The record holds the name; the options are checked where a config is made.
        lambda: EngineArgs(eviction_policy="lfu").create_engine_config(),
    ):
        with pytest.raises(ValueError, match="one of 'lru', 'slru', 'cost', got 'lfu'"):
            make()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_fresh_pool_hands_out_blocks_in_id_order(policy):
    pool = BlockPool(6, eviction_policy=policy)
    assert free_ids(pool) == [1, 2, 3, 4, 5]
    assert ids(pool.get_new_blocks(2)) == [1, 2]
    pool.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_a_chain_freed_tail_first_is_evicted_tail_first_hit_or_not(policy):
    pool = BlockPool(4, eviction_policy=policy)
    _, blocks = cache_prompt(pool, "a", list(range(12)))
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]
    pool.touch(blocks)  # hit again
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]
    pool.check_invariants()


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_remove_takes_a_block_from_anywhere_and_refuses_one_not_free(policy):
    blocks = [KVCacheBlock(i) for i in range(1, 6)]
    queue = make_free_queue(policy, blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [1, 2, 4, 5] and queue.num_free_blocks == 4
    assert not queue.holds(blocks[2]) and queue.holds(blocks[1])
    with pytest.raises(ValueError, match="not in the free queue"):
        queue.remove(blocks[2])
    assert ids(queue.check()) == [1, 2, 4, 5]


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_popleft_n_never_pops_part(policy):
    queue = make_free_queue(policy, [KVCacheBlock(i) for i in range(1, 4)])
    with pytest.raises(ValueError, match="cannot pop 4 blocks: only 3 are free"):
        queue.popleft_n(4)
    assert queue.block_ids() == [1, 2, 3] and queue.num_free_blocks == 3


@pytest.mark.parametrize("policy", EVICTION_POLICIES)
def test_check_invariants_catches_a_free_block_with_a_reference(policy):
    pool = BlockPool(4, eviction_policy=policy)
    pool.blocks[2].ref_cnt = 1
    with pytest.raises(AssertionError, match="free queue with ref count"):
        pool.check_invariants()


def test_the_policies_count_every_reference_on_their_own_not_on_the_block():
    for policy in EVICTION_POLICIES:
        pool = BlockPool(4, eviction_policy=policy)
        _, (block,) = cache_prompt(pool, "a", [1, 2, 3, 4])
        queue = pool.free_block_queue
        if policy == "slru":
            assert not queue.is_reused(block)
        pool.touch([block])  # a hit while in use
        pool.free_blocks([block, block])
        pool.touch([block])  # a hit on a free block
        if policy == "slru":
            assert queue.is_reused(block)
        if policy == "cost":
            assert queue.hits(block) == 2 and queue.depth(block) == 0
        # KVCacheBlock carries no policy's state: only the pool's fields and the LRU links.
        assert not hasattr(block, "hits") and not hasattr(block, "evict_key")
        # Evicted and cached again for other content, a block starts unhit.
        pool.free_blocks([block])
        _, blocks = cache_prompt(pool, "b", list(range(5, 17)))  # all three blocks
        again = blocks[[b.block_id for b in blocks].index(block.block_id)]
        if policy == "slru":
            assert not queue.is_reused(again)
        if policy == "cost":
            assert queue.hits(again) == 0 and queue.depth(again) == blocks.index(again)
        pool.check_invariants()


# ----------------------------------------------------------------------------- slru


def test_slru_evicts_blocks_never_hit_before_blocks_hit_again():
    pool = BlockPool(4, eviction_policy="slru")
    _, (hit,) = cache_prompt(pool, "a", [1, 2, 3, 4])
    _, (one_off,) = cache_prompt(pool, "b", [5, 6, 7, 8])
    pool.touch([hit])
    pool.free_blocks([hit, hit])  # freed first: LRU would evict it first
    pool.free_blocks([one_off])
    assert free_ids(pool) == [3, one_off.block_id, hit.block_id]


def test_slru_keeps_lru_order_inside_each_segment_and_protected_goes_last():
    queue = SegmentedLRUQueue([], NUM_IDS)
    blocks = [
        cached(queue, 1),
        cached(queue, 2, hits=1),
        cached(queue, 3),
        cached(queue, 4, hits=2),
        KVCacheBlock(5),
    ]
    queue.append_n(blocks)
    assert queue.block_ids() == [1, 3, 5, 2, 4]
    assert ids(queue.popleft_n(4)) == [1, 3, 5, 2]


def test_slru_demotes_the_least_recently_freed_protected_block_past_its_bound():
    queue = SegmentedLRUQueue([KVCacheBlock(i) for i in range(10, 13)], protected_fraction=0.7)
    assert queue.protected_capacity == 2
    queue.popleft_n(3)
    queue.append_n([cached(queue, 1, hits=1), cached(queue, 2, hits=1), cached(queue, 3)])
    queue.append_n([cached(queue, 4, hits=1)])
    # 1 was the protected block freed first: it goes to probation's tail, behind 3.
    assert ids(queue.probation) == [3, 1] and ids(queue.protected) == [2, 4]
    assert queue.block_ids() == [3, 1, 2, 4]
    queue.check()


def test_slru_an_uncached_block_is_never_protected_even_after_hits():
    queue = SegmentedLRUQueue([KVCacheBlock(i) for i in range(10, 20)], NUM_IDS)
    queue.popleft_n(10)
    block = cached(queue, 1, hits=3)
    block.block_hash = None  # uncached since (its K/V was never written)
    queue.append_n([block])
    assert queue.probation.num_free_blocks == 1 and queue.protected.num_free_blocks == 0


def test_slru_protected_bound_is_a_fraction_of_the_pool():
    queue = SegmentedLRUQueue([KVCacheBlock(i) for i in range(10)])
    assert queue.protected_capacity == 8
    with pytest.raises(ValueError, match="protected_fraction"):
        SegmentedLRUQueue([], protected_fraction=1.5)


def test_slru_reset_puts_protected_blocks_back_in_probation_in_order():
    pool = BlockPool(5, eviction_policy="slru")
    _, blocks = cache_prompt(pool, "a", list(range(8)))
    pool.touch(blocks)
    pool.free_blocks(reversed(blocks))
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_queue.protected.num_free_blocks == 2
    assert pool.reset_prefix_cache()
    assert pool.free_block_queue.protected.num_free_blocks == 0
    assert free_ids(pool) == [3, 4, 2, 1]
    pool.check_invariants()


# ----------------------------------------------------------------------------- cost


def test_cost_evicts_uncached_blocks_first():
    queue = CostAwareQueue([], NUM_IDS)
    queue.append_n([cached(queue, 1), KVCacheBlock(2), cached(queue, 3, depth=5), KVCacheBlock(4)])
    assert queue.block_ids() == [2, 4, 1, 3]


def test_cost_a_block_hit_more_often_outlives_one_hit_less():
    queue = CostAwareQueue([], NUM_IDS)
    queue.append_n([cached(queue, 1, hits=2), cached(queue, 2, hits=1), cached(queue, 3, hits=0)])
    assert queue.block_ids() == [3, 2, 1]


def test_cost_a_deeper_block_costs_more_to_recompute():
    queue = CostAwareQueue([], NUM_IDS)
    queue.append_n([cached(queue, 1, depth=int(ATTENTION_DEPTH_BLOCKS))])  # worth 2
    queue.append_n([cached(queue, 2, depth=0, hits=1)])  # worth 2 too, freed later: after it
    queue.append_n([cached(queue, 3, depth=10)])  # worth 1.05
    queue.append_n([cached(queue, 4, depth=0)])  # worth 1
    assert queue.block_ids() == [4, 3, 1, 2]


def test_cost_a_block_is_worth_the_chain_freed_after_it():
    queue = CostAwareQueue([], NUM_IDS)
    # A chain freed tail first (depths 2, 1, 0): worth ~1.01, ~2.02 and ~3.02; a lone block
    # hit once (worth 2) goes after the chain's tail but before its two first blocks.
    queue.append_n(
        [cached(queue, 3, depth=2), cached(queue, 2, depth=1), cached(queue, 1, depth=0)]
    )
    queue.append_n([cached(queue, 9, hits=1)])
    assert queue.block_ids() == [3, 9, 2, 1]
    # Depths that do not follow each other are separate chains: each block is worth itself.
    queue = CostAwareQueue([], NUM_IDS)
    queue.append_n(
        [cached(queue, 5, depth=7), cached(queue, 6, depth=2), cached(queue, 7, depth=1)]
    )
    assert queue.block_ids() == [6, 5, 7]


def test_cost_ages_priorities_like_gdsf():
    queue = CostAwareQueue([], NUM_IDS)
    queue.append_n([cached(queue, 1, hits=3)])  # worth 4: priority 4 at L = 0
    for block_id in (2, 3, 4):  # one-off blocks freed and evicted one after the other
        queue.append_n([cached(queue, block_id)])  # priority L + 1
        assert ids(queue.popleft_n(1)) == [block_id]
    assert queue.inflation == 3.0
    # L has risen to 3: a one-off block freed now (priority 4) ties with the old popular block,
    # which was freed first and goes first. Without ageing it would stay forever.
    queue.append_n([cached(queue, 5)])
    assert [queue.priority(b) for b in queue] == [4.0, 4.0]
    assert queue.block_ids() == [1, 5]


def test_cost_hits_on_free_blocks_blank_entries_and_the_heap_is_rebuilt():
    queue = CostAwareQueue([], NUM_IDS)
    blocks = [cached(queue, i) for i in range(1, 201)]
    queue.append_n(blocks)
    for block in blocks[:150]:
        queue.remove(block)
        queue.check()
    assert len(queue._heap) < 200  # rebuilt once the blanks outnumbered the live entries
    assert queue.block_ids() == list(range(151, 201))
    assert ids(queue.popleft_n(50)) == list(range(151, 201)) and queue.num_free_blocks == 0


def test_cost_reset_makes_every_block_worthless_in_its_current_order():
    pool = BlockPool(4, eviction_policy="cost")
    _, blocks = cache_prompt(pool, "a", list(range(8)))
    pool.touch(blocks)
    pool.free_blocks(reversed(blocks))
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 2, 1]
    assert pool.reset_prefix_cache()
    assert free_ids(pool) == [3, 2, 1] and pool.free_block_queue.inflation == 0.0
    pool.check_invariants()


# ----------------------------------------------------------------------------- property

SHARED = [[], [0, 1, 2, 0, 1, 2, 0, 1], [1] * 12, [2, 0] * 9]
PROMPTS = st.builds(
    lambda prefix, tail: (prefix + tail) or [0],
    st.sampled_from(SHARED),
    st.lists(st.integers(0, 2), max_size=8),
)


class NeverEvictsWhatIsHeld(RuleBasedStateMachine):
    """Admit, decode, free, pin, unpin and reset at random; no fresh block may be held."""

    eviction_policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.mgr = make_manager(
            num_blocks=13, eviction_policy=self.eviction_policy, max_pinned_blocks=4
        )
        self.running: list = []
        self.counter = 0

    def _allocate(self, request, *args) -> bool:
        """allocate_slots, checking that no block it hands out had a holder."""
        held = {b.block_id for b in self.mgr.block_pool.blocks if b.ref_cnt > 0}
        pinned = set(self.mgr.held.pins.holders())
        assert pinned <= held
        new = self.mgr.allocate_slots(request, *args)
        if new is None:
            return False
        for block in new.blocks[0]:
            assert block.block_id not in held, f"{block!r} handed out while held or pinned"
        return True

    @rule(tokens=PROMPTS)
    def admit(self, tokens):
        """Admit a prompt, freeing the oldest running requests until it fits (churn: cached
        blocks are evicted all the time)."""
        self.counter += 1
        request = make_request(f"r{self.counter}", tokens)
        while True:
            blocks, num_computed = self.mgr.get_computed_blocks(request)
            if self._allocate(request, request.num_tokens - num_computed, num_computed, blocks):
                request.num_computed_tokens = request.num_tokens
                self.running.append(request)
                return
            if not self.running:
                return  # pins hold too much of the pool
            self.mgr.free(self.running.pop(0))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data, token):
        request = data.draw(st.sampled_from(self.running))
        request.append_output_token_ids(token)
        if self._allocate(request, 1):
            request.num_computed_tokens += 1
        else:
            request.output_token_ids.pop()
            request.all_token_ids.pop()

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def free(self, data):
        request = data.draw(st.sampled_from(self.running))
        self.running.remove(request)
        self.mgr.free(request)

    @rule(prefix=st.sampled_from(SHARED[1:]), pin_id=st.sampled_from(["p", "q"]))
    def pin(self, prefix, pin_id):
        try:
            self.mgr.held.pin_prefix(pin_id, make_request("pin", prefix))
        except ValueError:
            pass  # nothing cached, the id is used, or past the capacity

    @rule(pin_id=st.sampled_from(["p", "q"]))
    def unpin(self, pin_id):
        self.mgr.held.pins.unpin(pin_id)

    @rule()
    def reset(self):
        assert self.mgr.reset_prefix_cache() == (not self.running)

    @invariant()
    def invariants_hold(self):
        self.mgr.check_invariants()


_settings = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def _machine(policy: str):
    machine = type(f"NeverEvictsWhatIsHeld_{policy}", (NeverEvictsWhatIsHeld,), {})
    machine.eviction_policy = policy
    test_case = machine.TestCase
    test_case.settings = _settings
    return test_case


TestNeverEvictsWhatIsHeldLRU = _machine("lru")
TestNeverEvictsWhatIsHeldSLRU = _machine("slru")
TestNeverEvictsWhatIsHeldCost = _machine("cost")
