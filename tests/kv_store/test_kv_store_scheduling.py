"""The disk tier in the scheduler: rules named after what they pin, and a property test that any
schedule, with blocks coming back from disk (or failing to), gives each request the tokens it
gets alone. Driven with test_scheduler's fake model, whose "K/V" are the token ids themselves, so
a block loaded into the wrong slot, or a wrong count of computed tokens, changes the output."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from prefixserve.core.sched.scheduler import Scheduler
from prefixserve.kv_store.block_write import BlockWrite
from prefixserve.kv_store.connector import KVStoreConnector
from tests.helpers.scheduler import (
    BLOCK,
    FakeRunner,
    assert_no_leak,
    make_request,
    make_scheduler,
    reference_outputs,
)


class FakeStore:
    """DiskKVStore's scheduler-side and worker-side calls over a dict."""

    def __init__(self) -> None:
        self.files: dict[tuple[bytes, int], tuple[tuple[int, ...], bytes, bytes]] = {}
        self.fail_reads: set[tuple[bytes, int]] = set()  # stat says yes, the read says no
        self.reads = 0

    def contains(self, key) -> bool:
        return key in self.files

    def count_prefix(self, block_hashes: Sequence[bytes], groups) -> int:
        for i, block_hash in enumerate(block_hashes):
            if not all((block_hash, g) in self.files for g in groups):
                return i
        return len(block_hashes)

    def get(self, key, token_ids, parent=b"") -> bytes | None:
        self.reads += 1
        entry = self.files.get(key)
        if key in self.fail_reads or entry is None or entry[0] != tuple(token_ids):
            return None
        return entry[1] if entry[2] == parent else None


class FakeWriter:
    """Writes at once (the real one writes on its thread)."""

    def __init__(self, store: FakeStore) -> None:
        self.store = store

    def submit(self, write: BlockWrite) -> bool:
        self.store.files[write.key] = (tuple(write.token_ids), bytes(write.payload), write.parent)
        return True

    def close(self, timeout=None) -> bool:
        return True


class TierRunner(FakeRunner):
    """The fake model, plus the runner's two disk-tier duties: scatter loads, gather saves."""

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for block_id, payload in out.kv_loads:
            self.kv[block_id] = list(struct.unpack(f"<{BLOCK}i", payload))
        return super().execute(out)

    def gather_blocks(self, block_ids: Sequence[int]) -> list[bytes]:
        return [struct.pack(f"<{BLOCK}i", *self.kv[b]) for b in block_ids]


def tier_scheduler(num_blocks: int = 64, **kwargs):
    sched, _ = make_scheduler(num_blocks=num_blocks, **kwargs)
    store = FakeStore()
    connector = KVStoreConnector(store, FakeWriter(store), BLOCK)  # type: ignore[arg-type]
    sched.kv_connector = connector
    return sched, TierRunner(num_blocks), connector, store


def tier_step(sched: Scheduler, runner: TierRunner, connector: KVStoreConnector):
    """One engine step as LLMEngine runs it with a disk tier (the save after the update)."""
    out = sched.schedule()
    runner_out = runner.execute(out)
    sched.update_from_output(out, runner_out)
    saves = connector.blocks_to_save(out, runner_out.failed)
    connector.save(saves, runner.gather_blocks([s.block_id for s in saves]))
    sched.kv_cache_manager.check_invariants()
    return out


def run_alone(sched, runner, connector, request, max_steps: int = 500):
    sched.add_request(request)
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        tier_step(sched, runner, connector)
    raise AssertionError("did not finish")


PROMPT_A = list(range(10, 30))  # 20 tokens: 5 blocks
PROMPT_B = list(range(40, 60))


def _evict_everything(sched, runner, connector) -> None:
    """Fill the pool with other prompts so every cached block of earlier ones is reused."""
    for i in range(4):
        run_alone(sched, runner, connector, make_request(f"filler{i}", [60 + i] * 20, 8))


def test_a_block_evicted_from_the_pool_comes_back_from_disk():
    sched, runner, connector, _ = tier_scheduler(num_blocks=8)
    first = make_request("a1", PROMPT_A, 4)
    run_alone(sched, runner, connector, first)
    _evict_everything(sched, runner, connector)
    again = make_request("a2", PROMPT_A, 4)
    sched.add_request(again)
    out = tier_step(sched, runner, connector)
    # 19 tokens may be reused (the last is computed): 4 full blocks from disk.
    assert again.num_cached_tokens == again.cache.num_disk_cached_tokens == 16
    assert len(out.kv_loads) == 4 and out.scheduled[0].num_new_tokens == 4
    run_alone(sched, runner, connector, make_request("noop", [7], 1))
    assert again.output_token_ids == first.output_token_ids
    assert_no_leak(sched)


def test_the_last_token_is_always_computed_even_when_disk_holds_every_block():
    sched, runner, connector, _ = tier_scheduler(num_blocks=8)
    prompt = list(range(10, 26))  # 16 tokens: exactly 4 blocks, all on disk after one run
    run_alone(sched, runner, connector, make_request("a1", prompt, 4))
    _evict_everything(sched, runner, connector)
    again = make_request("a2", prompt, 4)
    sched.add_request(again)
    out = tier_step(sched, runner, connector)
    assert again.cache.num_disk_cached_tokens == 12 and out.scheduled[0].num_new_tokens == 4


def test_ram_hits_come_first_and_disk_continues_the_chain():
    sched, runner, connector, store = tier_scheduler(num_blocks=64)
    run_alone(sched, runner, connector, make_request("a1", PROMPT_A, 4))
    # Forget blocks 2.. of the chain in RAM only: the pool keeps blocks 0-1, the disk has all.
    pool = sched.kv_cache_manager.block_pool
    hashes = make_request("probe", PROMPT_A, 4).block_hashes
    blocks = [
        pool.get_cached_block(h, 0, PROMPT_A[i * BLOCK : (i + 1) * BLOCK])
        for i, h in enumerate(hashes[:4])
    ]
    pool.uncache_blocks(blocks[2:])
    again = make_request("a2", PROMPT_A, 4)
    sched.add_request(again)
    out = tier_step(sched, runner, connector)
    assert again.num_cached_tokens == 16 and again.cache.num_disk_cached_tokens == 8
    assert len(out.kv_loads) == 2


def test_a_read_that_fails_after_the_lookup_is_computed_instead():
    sched, runner, connector, store = tier_scheduler(num_blocks=8)
    first = make_request("a1", PROMPT_A, 4)
    run_alone(sched, runner, connector, first)
    _evict_everything(sched, runner, connector)
    hashes = make_request("probe", PROMPT_A, 4).block_hashes
    store.fail_reads.add((hashes[2], 0))  # evicted or damaged between the stat and the read
    again = make_request("a2", PROMPT_A, 4)
    sched.add_request(again)
    out = tier_step(sched, runner, connector)
    assert again.cache.num_disk_cached_tokens == 8 and len(out.kv_loads) == 2
    # The step computes its planned chunk from where the loads stopped; the rest comes later.
    assert out.scheduled[0].num_computed_tokens == 8 and out.scheduled[0].num_new_tokens == 4
    assert connector.stats.load_failures == 1
    run_alone(sched, runner, connector, make_request("noop", [7], 1))
    assert again.output_token_ids == first.output_token_ids
    assert_no_leak(sched)


def test_in_memory_retention_writes_nothing_to_disk():
    sched, runner, connector, store = tier_scheduler()
    request = make_request("a1", PROMPT_A, 4)
    request.cache_retention = "in_memory"
    run_alone(sched, runner, connector, request)
    assert store.files == {}
    run_alone(sched, runner, connector, make_request("a2", PROMPT_B, 4))
    assert len(store.files) == 5  # 20 prompt + 3 output tokens with K/V: 5 full blocks


def test_24h_retention_writes_blocks_that_expire_a_day_later():
    sched, runner, connector, store = tier_scheduler()
    connector._clock = lambda: 1000.0
    expiries = []
    writer_submit = connector.writer.submit

    def spy(write: BlockWrite) -> bool:
        expiries.append(write.expires_at)
        return writer_submit(write)

    connector.writer.submit = spy  # type: ignore[method-assign]
    request = make_request("a1", PROMPT_A, 4)
    request.cache_retention = "24h"
    run_alone(sched, runner, connector, request)
    assert expiries and set(expiries) == {1000.0 + 24 * 3600}


def test_blocks_already_on_disk_are_not_written_again():
    sched, runner, connector, store = tier_scheduler()
    run_alone(sched, runner, connector, make_request("a1", PROMPT_A, 4))
    saved = connector.stats.saved_blocks
    _evict_everything(sched, runner, connector)
    saved_fillers = connector.stats.saved_blocks - saved
    run_alone(sched, runner, connector, make_request("a2", PROMPT_A, 4))
    assert connector.stats.saved_blocks == saved + saved_fillers  # nothing new to write


def test_a_request_that_skips_reading_the_cache_loads_nothing_from_disk():
    sched, runner, connector, store = tier_scheduler(num_blocks=8)
    run_alone(sched, runner, connector, make_request("a1", PROMPT_A, 4))
    _evict_everything(sched, runner, connector)
    reads = store.reads
    again = make_request("a2", PROMPT_A, 4, prompt_logprobs=1)
    run_alone(sched, runner, connector, again)
    assert again.cache.num_disk_cached_tokens == 0 and store.reads == reads


@pytest.mark.parametrize(
    ("load_s", "compute_s", "loads"), [(0.001, 0.01, True), (1.0, 0.01, False)]
)
def test_loading_is_skipped_when_computing_the_tokens_is_faster(load_s, compute_s, loads):
    sched, runner, connector, store = tier_scheduler(num_blocks=8)
    run_alone(sched, runner, connector, make_request("a1", PROMPT_A, 4))
    _evict_everything(sched, runner, connector)
    connector._speeds.load_s_per_block = {"disk": load_s}
    connector._speeds.compute_s_per_token = compute_s / BLOCK  # a block's tokens take compute_s
    again = make_request("a2", PROMPT_A, 4)
    sched.add_request(again)
    tier_step(sched, runner, connector)
    assert (again.cache.num_disk_cached_tokens > 0) is loads
    assert connector.stats.skipped_slow == (0 if loads else 1)


def test_blocks_of_a_request_whose_sampling_failed_are_not_written():
    sched, runner, connector, store = tier_scheduler()
    request = make_request("a1", PROMPT_A, 4)
    sched.add_request(request)
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    assert connector.blocks_to_save(out, {"a1"}) == []
    assert len(connector.blocks_to_save(out, set())) == 5


_token = st.integers(10, 99)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prefixes=st.lists(st.lists(_token, min_size=4, max_size=14), min_size=1, max_size=3),
    suffixes=st.lists(
        st.tuples(
            st.integers(0, 2),
            st.lists(_token, min_size=1, max_size=9),
            st.integers(1, 6),
            st.integers(0, 40),
            st.sampled_from([None, None, "in_memory", "24h"]),
        ),
        min_size=2,
        max_size=6,
    ),
    num_blocks=st.integers(6, 16),
    budget=st.integers(2, 24),
    max_num_seqs=st.integers(1, 4),
    fail_reads=st.integers(0, 2**16),
)
def test_any_schedule_with_a_disk_tier_gives_each_request_the_tokens_it_gets_alone(
    prefixes, suffixes, num_blocks, budget, max_num_seqs, fail_reads
):
    # Every prompt is asked again later, after a filler prompt has churned the small pool.
    prompts = [prefixes[p % len(prefixes)] + suffix for p, suffix, _, _, _ in suffixes]
    filler = [100 + i % 50 for i in range((num_blocks - 2) * BLOCK)]
    prompts = [*prompts, filler, *prompts]
    suffixes = [
        *suffixes,
        (0, [], 1, 41, None),
        *[(p, x, n, a + 42, r) for p, x, n, a, r in suffixes],
    ]
    max_tokens = [n for _, _, n, _, _ in suffixes]
    arrivals = [a for _, _, _, a, _ in suffixes]
    longest = max(len(p) + n for p, n in zip(prompts, max_tokens, strict=True))
    num_blocks = max(num_blocks, -(-longest // BLOCK))
    sched, runner, connector, store = tier_scheduler(
        num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget
    )
    requests = []
    for i, (prompt, n, (_, _, _, _, retention)) in enumerate(
        zip(prompts, max_tokens, suffixes, strict=True)
    ):
        request = make_request(f"r{i}", prompt, n)
        request.cache_retention = retention
        requests.append(request)
    for step_index in range(3000):
        # Some stat-then-read races: reads of a few stored blocks fail (bits of fail_reads).
        for j, key in enumerate(list(store.files)[:16]):
            if fail_reads >> j & 1:
                store.fail_reads.add(key)
        for request, arrival in zip(requests, arrivals, strict=True):
            if arrival == step_index:
                sched.add_request(request)
        if step_index > max(arrivals) and not sched.has_unfinished_requests():
            break
        out = tier_step(sched, runner, connector)
        assert out.total_num_scheduled_tokens <= budget
    assert [r.output_token_ids for r in requests] == reference_outputs(prompts, max_tokens)
    assert_no_leak(sched)
