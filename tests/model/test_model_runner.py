"""ModelRunner bookkeeping: which rows get logits, prompt-logprob alignment, generators, sizes."""

from __future__ import annotations

import sys

import pytest
import torch

from prefixserve.core.request import Request
from prefixserve.core.sched.output import ScheduledRequest, SchedulerOutput
from prefixserve.model.kernels.build import paged_attention_kernel
from prefixserve.model.layers.kernel_table import _kernel
from prefixserve.sampling_params import SamplingParams
from prefixserve.worker.model_runner import ModelRunner
from tests.helpers.models import assert_close, build_hf_model, build_ours, reference_logits
from tests.helpers.runner import (
    BlockAllocator,
    RecordingSampler,
    greedy_request,
    make_harness,
    step,
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_hf_model("llama", tmp_path_factory.mktemp("llama"))


def test_logits_only_for_chunks_that_reach_their_last_token(llama):
    h = make_harness(*llama)
    alloc = BlockAllocator(1)
    a = greedy_request("a", list(range(10)), prompt_logprobs=None)
    b = greedy_request("b", list(range(20, 26)), prompt_logprobs=None)
    out = step(h, [(a, 0, 4, (alloc.take(0, 3),)), (b, 0, 6, (alloc.take(0, 2),))])
    assert set(out.sampled_token_ids) == {"b"}
    assert set(h.sampler.sampled) == {"b"}
    assert out.prompt_logprobs == {}


def test_prompt_logprobs_score_each_prompt_token_from_the_previous_position(llama):
    hf_model, config_json = llama
    h = make_harness(hf_model, config_json)
    prompt = list(range(3, 14))  # 11 tokens
    req = greedy_request("a", prompt, prompt_logprobs=2)
    ids = (BlockAllocator(1).take(0, 3),)
    first = step(h, [(req, 0, 4, ids)]).prompt_logprobs["a"]
    second = step(h, [(req, 4, 7, ids)]).prompt_logprobs["a"]
    entries = first + second
    assert len(first) == 4 and len(second) == 6  # positions 1..10, none for position 0
    ref = torch.log_softmax(reference_logits(hf_model, prompt), dim=-1)
    for pos in range(1, 11):
        token_id, logprob, _ = entries[pos - 1][0]
        assert token_id == prompt[pos]
        assert logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)


def test_seeded_requests_get_their_own_generator_until_finished(llama):
    hf_model, config_json = llama
    model, config = build_ours(hf_model, config_json)
    seen: list[list[torch.Generator | None]] = []

    def sampler(logits, requests, generators):
        seen.append(list(generators))
        return [(1, None)] * len(requests)

    runner = ModelRunner(model, config, num_blocks=8, block_size=4, sampler=sampler, seed=7)
    seeded = Request("s", [1, 2, 3], SamplingParams(seed=42))
    plain = Request("p", [1, 2, 3], SamplingParams())

    def run(finished=()):
        entries = [ScheduledRequest(r, 0, 3, ([1 + i],)) for i, r in enumerate((seeded, plain))]
        runner.execute(SchedulerOutput(entries, finished_req_ids=set(finished)))

    run()
    run()
    assert seen[0][0] is seen[1][0]  # kept across steps
    assert seen[0][1] is runner.generator  # unseeded: the runner's shared generator
    expected = torch.rand(3, generator=torch.Generator().manual_seed(42))
    run(finished={"s"})  # dropped, then made afresh from the seed
    assert seen[2][0] is not seen[0][0]
    assert torch.equal(torch.rand(3, generator=seen[2][0]), expected)


def test_kv_cache_bytes_per_block_is_what_the_runner_allocates(llama):
    hf_model, config_json = llama
    model, config = build_ours(hf_model, config_json)
    per_block = config.kv_cache_bytes_per_block(16)
    # K and V, 3 layers, 16 slots, 2 KV heads of 16 floats of 4 bytes.
    assert per_block == 2 * 3 * 16 * 2 * 16 * 4
    runner = ModelRunner(model, config, num_blocks=4, block_size=16, sampler=lambda *a: [])
    allocated = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    assert allocated == 4 * per_block
    k, v = runner.kv_caches[0]
    assert k.shape == (4, 16, 2, 16) and len(runner.kv_caches) == 3


def test_bad_schedules_are_refused(llama):
    h = make_harness(*llama)
    req = greedy_request("a", list(range(10)))
    with pytest.raises(ValueError, match=r"\[8, 12\) of 10"):
        step(h, [(req, 8, 4, ([1, 2, 3],))])
    with pytest.raises(ValueError, match="block table of 2 blocks cannot hold 10 tokens"):
        step(h, [(req, 0, 10, ([1, 2],))])
    with pytest.raises(ValueError, match="num_blocks"):
        ModelRunner(h.model, h.config, num_blocks=1, block_size=4, sampler=h.sampler)


def test_decode_rows_may_come_in_any_order_in_the_schedule(llama):
    """The runner puts single-token chunks first; results are still per request."""
    hf_model, config_json = llama
    h = make_harness(hf_model, config_json)
    alloc = BlockAllocator(1)
    a = greedy_request("a", list(range(7)), prompt_logprobs=None)
    b = greedy_request("b", list(range(30, 39)), prompt_logprobs=None)
    c = greedy_request("c", list(range(50, 62)), prompt_logprobs=None)
    ids = {r.request_id: (alloc.take(0, 6),) for r in (a, b, c)}
    step(h, [(a, 0, 6, ids["a"]), (b, 0, 8, ids["b"])])  # both stop one short of the end
    # prefill c between the two single-token chunks
    out = step(h, [(a, 6, 1, ids["a"]), (c, 0, 12, ids["c"]), (b, 8, 1, ids["b"])])
    assert set(out.sampled_token_ids) == {"a", "b", "c"}
    for r in (a, b, c):
        assert_close(
            h.sampler.sampled[r.request_id][-1], reference_logits(hf_model, r.all_token_ids)[-1]
        )


def test_small_steps_and_pool_steps_run_on_one_thread_while_openmp_threads_sleep(
    llama, monkeypatch
):
    """When OMP_WAIT_POLICY is PASSIVE, a step runs on one torch thread where the kernels' stream
    pool takes its heavy work (`pool_takes_every_step`) or it has at most ONE_THREAD_MAX_TOKENS
    tokens, whatever the keys it attends to (attention runs on the pool too); other steps, and
    every step with spinning threads, use them all; the thread count is restored after each
    step, also after a step that raised."""
    from prefixserve.worker import model_runner as runner_module

    h = make_harness(*llama)
    seen: list[int] = []
    real = h.runner._execute

    def spy(scheduler_output):
        seen.append(torch.get_num_threads())
        return real(scheduler_output)

    monkeypatch.setattr(h.runner, "_execute", spy)
    monkeypatch.setattr(runner_module, "ONE_THREAD_MAX_TOKENS", 4)
    monkeypatch.setattr(h.runner, "pool_takes_every_step", False)
    torch.set_num_threads(2)
    alloc = BlockAllocator(1)
    small = greedy_request("s", list(range(4)), prompt_logprobs=None)
    big = greedy_request("b", list(range(10, 15)), prompt_logprobs=None)
    long = greedy_request("l", list(range(40)), prompt_logprobs=None)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    step(h, [(small, 0, 4, (alloc.take(0, 1),))])
    step(h, [(big, 0, 5, (alloc.take(0, 2),))])
    # A decode-sized step over many keys: its attention runs on the pool, the step on one thread.
    step(h, [(long, 36, 4, (alloc.take(0, 10),))])
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    step(h, [(small, 0, 4, (alloc.take(0, 1),))])
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setattr(h.runner, "pool_takes_every_step", True)
    step(h, [(big, 0, 5, (alloc.take(0, 2),))])
    assert seen == [1, 2, 1, 2, 1]
    assert torch.get_num_threads() == 2

    def boom(scheduler_output):
        raise RuntimeError("boom")

    monkeypatch.setattr(h.runner, "_execute", boom)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    with pytest.raises(RuntimeError, match="boom"):
        step(h, [(small, 0, 4, (alloc.take(0, 1),))])
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(
    paged_attention_kernel() is None or _kernel("gemm") is None,
    reason="needs the native kernels",
)
def test_the_stream_pool_takes_every_step_only_where_every_linear_and_chunk_take_the_kernels(
    llama, monkeypatch
):
    """`pool_takes_every_step`: a bf16 model whose linears all take the native GEMM and whose
    every chunk attends through the paged or long-chunk kernel; not an fp32 model (its linears
    run on MKL's threads), nor one whose linears keep an fp32 copy for large batches
    (PREFIXSERVE_FP32_PREFILL=1) or has LoRA updates, nor a runner outside the batch-invariant
    mode without the long-chunk kernel (SDPA serves long chunks there)."""
    from prefixserve.worker import model_runner as runner_module

    hf_model, config_json = llama

    def runner_for(dtype: str, **kwargs) -> ModelRunner:
        model, config = build_ours(hf_model, config_json, dtype)
        return ModelRunner(
            model, config, num_blocks=8, block_size=4, sampler=RecordingSampler(), **kwargs
        )

    assert runner_for("bfloat16").pool_takes_every_step
    assert not runner_for("float32").pool_takes_every_step
    # A linear with LoRA updates (their matmuls run on OpenMP's threads).
    model, config = build_ours(hf_model, config_json, "bfloat16")
    model.model.layers[0].self_attn.qkv_proj.lora = object()
    with_lora = ModelRunner(model, config, num_blocks=8, block_size=4, sampler=RecordingSampler())
    assert not with_lora.pool_takes_every_step
    # Without the long-chunk kernel and outside the batch-invariant mode, long chunks take SDPA.
    monkeypatch.setattr(runner_module, "prefill_attention_kernel", lambda: None)
    sdpa = runner_for("bfloat16", batch_invariant=False)
    assert sdpa.kernel_max_queries != sys.maxsize
    assert not sdpa.pool_takes_every_step
    monkeypatch.undo()
    monkeypatch.setenv("PREFIXSERVE_FP32_PREFILL", "1")
    assert not runner_for("bfloat16").pool_takes_every_step
