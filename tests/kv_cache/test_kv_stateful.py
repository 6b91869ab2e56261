"""Property-based test: random admit / chunked prefill / decode / free / reset sequences.

After every step the manager's invariants must hold (ref counts equal holders, a block is free iff
its ref count is 0, map entries carry their hash, free + in use = total), and a model of the KV
contents checks that every hit block really holds the request's tokens at its positions.
The full-attention and hybrid machines run under every eviction policy (core/kv_cache/eviction/).
"""

from __future__ import annotations

import hashlib

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixserve.core.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from tests.helpers.kv_cache import make_manager, make_request, snapshot

BS = 4
# A few shared prefixes plus a short random tail: hits (full and partial) are common.
SHARED_PREFIXES = [[], [0, 1, 2, 0, 1, 2, 0, 1], [1] * 12, [2, 0] * 9]
PROMPTS = st.builds(
    lambda prefix, tail: (prefix + tail) or [0],
    st.sampled_from(SHARED_PREFIXES),
    st.lists(st.integers(0, 2), max_size=8),
)


def tiny_hash(data: bytes) -> bytes:
    """A hash with 16 values: collisions between different blocks are frequent."""
    return bytes([hashlib.sha256(data).digest()[0] & 0x0F])


class CacheMachine(RuleBasedStateMachine):
    groups = [FullAttentionSpec()]
    num_blocks = 17
    hash_fn = "sha256"
    eviction_policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.mgr = make_manager(
            num_blocks=self.num_blocks,
            groups=self.groups,
            events=True,
            eviction_policy=self.eviction_policy,
        )
        self.running: list = []
        self.counter = 0
        # (group, block id) -> tokens written at each slot: what the "GPU" holds.
        self.kv: dict[tuple[int, int], list] = {}

    def _write(self, request, start: int, end: int) -> None:
        block_ids = self.mgr.get_block_ids(request)
        for group, ids in enumerate(block_ids):
            for pos in range(start, end):
                block_id = ids[pos // BS]
                assert block_id != 0, f"writing position {pos} into the null block"
                slots = self.kv.setdefault((group, block_id), [None] * BS)
                slots[pos % BS] = request.all_token_ids[pos]

    def _check_hit(self, request, blocks, num_computed: int) -> None:
        assert num_computed % BS == 0 and num_computed < request.num_tokens
        for group, group_blocks in enumerate(blocks.blocks):
            assert len(group_blocks) * BS == num_computed
            for i, block in enumerate(group_blocks):
                if block.is_null:
                    continue
                expected = request.all_token_ids[i * BS : (i + 1) * BS]
                assert self.kv[(group, block.block_id)] == expected, "a hit on stale content"

    @rule(tokens=PROMPTS, chunk=st.integers(1, 12), salt=st.sampled_from([None, None, "s"]))
    def admit(self, tokens, chunk, salt):
        self.counter += 1
        request = make_request(f"r{self.counter}", tokens, hash_fn=self.hash_fn, cache_salt=salt)
        before = snapshot(self.mgr, self.running)
        blocks, num_computed = self.mgr.get_computed_blocks(request)
        assert snapshot(self.mgr, self.running) == before
        self._check_hit(request, blocks, num_computed)
        num_new = min(chunk, request.num_tokens - num_computed)
        if self.mgr.allocate_slots(request, num_new, num_computed, blocks) is None:
            assert snapshot(self.mgr, self.running) == before
            return
        request.num_computed_tokens = num_computed
        self._write(request, num_computed, num_computed + num_new)
        request.num_computed_tokens += num_new
        self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(
        data=st.data(),
        chunk=st.integers(1, 12),
        token=st.integers(0, 2),
        lookahead=st.sampled_from([0, 0, 2]),
    )
    def step(self, data, chunk, token, lookahead):
        request = data.draw(st.sampled_from(self.running))
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(token)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        before = snapshot(self.mgr, self.running)
        if self.mgr.allocate_slots(request, num_new, num_lookahead_tokens=lookahead) is None:
            assert snapshot(self.mgr, self.running) == before
            return
        start = request.num_computed_tokens
        self._write(request, start, start + num_new)
        request.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def free(self, data, preempt):
        request = data.draw(st.sampled_from(self.running))
        self.running.remove(request)
        self.mgr.free(request)
        assert self.mgr.get_block_ids(request) == tuple([] for _ in self.groups)
        if preempt:  # back to waiting with nothing computed; it may be admitted again
            request.num_computed_tokens = 0
            request.num_preemptions += 1
            blocks, num_computed = self.mgr.get_computed_blocks(request)
            self._check_hit(request, blocks, num_computed)

    @rule()
    def reset(self):
        assert self.mgr.reset_prefix_cache() == (not self.running)

    @invariant()
    def invariants_hold(self):
        self.mgr.check_invariants()
        in_use = self.mgr.num_kv_blocks - self.mgr.num_free_blocks
        assert self.mgr.usage == in_use / self.mgr.num_kv_blocks


class CollidingHashCacheMachine(CacheMachine):
    """Hash collisions everywhere: the token-id check must keep every hit's tokens right."""

    hash_fn = staticmethod(tiny_hash)


class HybridCacheMachine(CacheMachine):
    groups = [FullAttentionSpec(), SlidingWindowSpec(sliding_window=6)]
    num_blocks = 25


class SlidingWindowCacheMachine(CacheMachine):
    groups = [SlidingWindowSpec(sliding_window=9)]
    num_blocks = 9


_settings = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,  # the same examples on every run: CI never flakes
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestFullAttentionStateful = CacheMachine.TestCase
TestFullAttentionStateful.settings = _settings
TestHybridStateful = HybridCacheMachine.TestCase
TestHybridStateful.settings = _settings
TestSlidingWindowStateful = SlidingWindowCacheMachine.TestCase
TestSlidingWindowStateful.settings = _settings
TestCollidingHashStateful = CollidingHashCacheMachine.TestCase
TestCollidingHashStateful.settings = _settings


def _under_policy(machine: type, policy: str) -> type:
    """The machine's TestCase with another eviction policy."""
    test_case = type(f"{machine.__name__}_{policy}", (machine,), {"eviction_policy": policy})
    test_case = test_case.TestCase
    test_case.settings = _settings
    return test_case


TestFullAttentionStatefulSLRU = _under_policy(CacheMachine, "slru")
TestHybridStatefulSLRU = _under_policy(HybridCacheMachine, "slru")
TestFullAttentionStatefulCost = _under_policy(CacheMachine, "cost")
TestHybridStatefulCost = _under_policy(HybridCacheMachine, "cost")
