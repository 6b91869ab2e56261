"""The scheduler tests' harness: the real Scheduler and KVCacheManager with a fake model.

The fake runner keeps a paged "KV cache" of token ids: it writes each scheduled token into the
slot its block table names, then reads the whole history back through the block table and
samples a token that is a hash of it. A wrong block table, a hit on a block whose contents were
overwritten, or a miscounted num_computed_tokens therefore changes the sampled tokens, which lets
a test compare any schedule against each request run alone (`reference_outputs`).
"""

from __future__ import annotations

import hashlib

from prefixserve.config import SchedulerConfig
from prefixserve.core.kv_cache.hashing import get_request_block_hasher
from prefixserve.core.kv_cache.kv_cache_manager import KVCacheManager
from prefixserve.core.kv_cache.spec import KVCacheConfig
from prefixserve.core.request import Request
from prefixserve.core.sched.output import ModelRunnerOutput, SchedulerOutput
from prefixserve.core.sched.scheduler import Scheduler
from prefixserve.sampling_params import SamplingParams

BLOCK = 4
EOS = 1
MAX_MODEL_LEN = 256


def fake_next_token(history: list[int]) -> int:
    """A deterministic "model": the next token is a hash of the whole history (never EOS)."""
    digest = hashlib.blake2b(repr(history).encode(), digest_size=4).digest()
    return 10 + int.from_bytes(digest, "little") % 90


class FakeRunner:
    """Writes token ids into paged slots and samples from what the block table reads back."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks + 1)]
        self.next_token = fake_next_token

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for s in out.scheduled:  # every write lands before any read, like one layer's forward
            table = s.block_ids[0]
            for pos in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens):
                self.kv[table[pos // bs]][pos % bs] = s.request.all_token_ids[pos]
        result = ModelRunnerOutput()
        for s in out.scheduled:
            if s.samples:
                table = s.block_ids[0]
                end = s.num_computed_tokens + s.num_new_tokens
                history = [self.kv[table[p // bs]][p % bs] for p in range(end)]
                result.sampled_token_ids[s.request.request_id] = self.next_token(history)
        return result


def make_scheduler(
    num_blocks: int = 64,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    long_prefill_token_threshold: int = 0,
    enable_caching: bool = True,
    max_model_len: int = MAX_MODEL_LEN,
    scheduling_policy: str = "fair",
    fair_chunk_tokens: int = 512,
) -> tuple[Scheduler, FakeRunner]:
    mgr = KVCacheManager(
        KVCacheConfig(num_blocks=num_blocks + 1, block_size=BLOCK), enable_caching=enable_caching
    )
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        long_prefill_token_threshold=long_prefill_token_threshold,
        scheduling_policy=scheduling_policy,
        fair_chunk_tokens=fair_chunk_tokens,
    )
    return Scheduler(config, mgr, max_model_len, eos_token_ids=[EOS]), FakeRunner(num_blocks)


_HASHER = get_request_block_hasher(BLOCK)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Request(request_id, prompt, sampling, block_hasher=_HASHER)


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out))
    sched.kv_cache_manager.check_invariants()
    return out


def run_to_completion(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return
        step(sched, runner)
    raise AssertionError("requests did not finish")


def assert_no_leak(sched: Scheduler) -> None:
    mgr = sched.kv_cache_manager
    assert not sched.requests and not sched.running and not sched.waiting
    mgr.check_no_leaks()  # no block table left, the invariants, every block free or pinned
    assert mgr.num_free_blocks == mgr.num_kv_blocks


def scheduled_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def reference_outputs(prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Each prompt run alone to its max_tokens on a roomy pool without caching: the outputs any
    schedule of them must give."""
    outputs = []
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
        sched, runner = make_scheduler(num_blocks=256, enable_caching=False)
        req = make_request(f"r{i}", prompt, max_tokens=n)
        sched.add_request(req)
        run_to_completion(sched, runner)
        outputs.append(req.output_token_ids)
    return outputs
