"""One native call per decoder layer (csrc/layer/decoder_layer.cpp, layers/native_layer.py).

The native layer calls the Python layer's kernels in the same order with the same arguments, so
an engine gives the same bits with it and without it: greedy tokens and logprobs over decode
batches, chunks over cached prefixes and n-gram verification steps, for Llama (tied and not),
Qwen2 (q/k/v biases), Mistral (a sliding window), Qwen3 (q/k norms) and Gemma 3 (its (1 + weight)
norms, post norms, and sliding and global layers with their own rotary bases). A step or a model
it cannot serve runs the Python layers: a chunk on the prefill kernel, LoRA, soft-capping.
"""

from __future__ import annotations

import pytest
import torch

from prefixserve.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.model.layers.kernel_table import compiled_kernel
from prefixserve.model.loader.loading import LoadedModel
from prefixserve.sampling_params import SamplingParams
from tests.helpers.models import VOCAB, build_hf_model, build_ours

# Head dim 64 (the paged kernel's keys-in-lanes path), an MLP of 96 (gate_up's 192 columns take
# the gated epilogue).
SHAPE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, intermediate_size=96)
BLOCK = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
SHARED = [(7 * i + 3) % VOCAB for i in range(40)]  # a 5-block prefix every prompt shares
PROMPTS = [SHARED + [(11 * i + j) % VOCAB for j in range(3 + 4 * i)] for i in range(5)]
# Repeats: the drafter finds its n-grams, so verification steps have several rows a request.
PROMPTS.append(SHARED + [5, 6, 7, 8] * 6)


def _native_or_skip() -> None:
    if compiled_kernel("decoder_layer") is None or compiled_kernel("gemm") is None:
        pytest.skip("this CPU does not take the native GEMM (or the kernels are not built)")


@pytest.fixture
def tiny(tmp_path, default_model_fp32):
    """`tiny(family, **changes)`: a random-weight model of that family in bf16, SHAPE."""

    def build(family: str, **changes) -> LoadedModel:
        hf, config_json = build_hf_model(family, tmp_path / family, **{**SHAPE, **changes})
        model, config = build_ours(hf, config_json, dtype="bfloat16")
        tokenizer = default_model_fp32.tokenizer
        return LoadedModel(model=model, tokenizer=tokenizer, config=config, path=tmp_path)

    return build


def _engine(loaded: LoadedModel, native: bool, spec: bool = False) -> LLMEngine:
    config = EngineConfig(
        dtype="bfloat16",
        max_model_len=256,
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=200, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3} if spec else None,
    )
    engine = LLMEngine(config, loaded_model=loaded)
    engine.runner.native_layers = native
    return engine


def _serve(engine: LLMEngine) -> dict[str, tuple]:
    # The first prompt alone fills the shared prefix; the others then hit it in one batch.
    finals = {}
    for batch in (PROMPTS[:1], PROMPTS[1:]):
        for prompt in batch:
            engine.add_request(f"r{PROMPTS.index(prompt)}", prompt, PARAMS)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done = out.outputs[0]
                    logprobs = tuple(
                        tuple(sorted((t, lp.logprob) for t, lp in step.items()))
                        for step in done.logprobs
                    )
                    finals[out.request_id] = (tuple(done.token_ids), logprobs)
    engine.check_no_leaks()
    return finals


class _Counting:
    """A bound native layer that counts its calls."""

    def __init__(self, layer: object, calls: list[int]) -> None:
        self.layer, self.calls = layer, calls

    def forward(self, h: torch.Tensor, *args: object) -> torch.Tensor:
        self.calls.append(h.shape[0])
        return self.layer.forward(h, *args)


def _count_native_calls(model) -> list[int]:
    """Rows of every native layer call `model` makes from now on."""
    calls: list[int] = []
    bound = model.native_layers()
    assert bound is not None, "every layer of this model should have the native form"
    model._native = [_Counting(layer, calls) for layer in bound]
    return calls


@pytest.mark.parametrize(
    ("family", "changes", "spec"),
    [
        ("llama", {}, False),
        ("llama_tied", {}, True),
        ("qwen2", {}, False),  # q/k/v biases
        ("mistral", {"sliding_window": 12}, True),  # chunks and drafts past the window
        ("qwen3", {"head_dim": 64}, False),  # per-head q/k norms
        # (1 + weight) norms, q/k norms, post norms, sliding and global layers
        ("gemma3", {"head_dim": 64, "sliding_window": 12}, True),
    ],
)
def test_native_layers_give_the_python_layers_bits(tiny, family, changes, spec):
    _native_or_skip()
    loaded = tiny(family, **changes)
    python = _serve(_engine(loaded, native=False, spec=spec))
    calls = _count_native_calls(loaded.model)
    native = _serve(_engine(loaded, native=True, spec=spec))
    assert native == python
    layers = loaded.config.num_layers
    assert len(calls) % layers == 0 and calls, "the native layers never ran"
    steps = calls[::layers]
    assert 1 in steps and max(steps) > 1  # lone decode rows, and batches or verifications
    assert any(rows > 4 for rows in steps)  # a chunk over the cached prefix (or a verification)


def test_a_step_with_a_chunk_on_the_prefill_kernel_runs_the_python_layers(tiny):
    """A 40-token prompt from position 0 attends through the prefill kernel, which the native
    layer does not call: that step runs in Python; its decode steps go native."""
    _native_or_skip()
    loaded = tiny("llama")
    calls = _count_native_calls(loaded.model)
    engine = _engine(loaded, native=True)
    engine.add_request("a", PROMPTS[0], PARAMS)
    while engine.has_unfinished_requests():
        engine.step()
    layers = loaded.config.num_layers
    prefill_on_its_kernel = engine.runner.prefill_kernel is not None
    assert len(calls) == layers * (PARAMS.max_tokens - 1 + (0 if prefill_on_its_kernel else 1))
    assert set(calls) == ({1} if prefill_on_its_kernel else {1, len(PROMPTS[0])})


def test_a_step_with_the_pytorch_rmsnorm_swapped_in_runs_the_python_layers(tiny, monkeypatch):
    """The kernel table's swaps (tests, `bench_model.py --baseline`) reach the native layer: with
    the RMSNorm kernel swapped out, every step runs the Python layers."""
    _native_or_skip()
    from prefixserve.model.layers import kernel_table

    loaded = tiny("llama")
    calls = _count_native_calls(loaded.model)
    monkeypatch.setitem(kernel_table._kernels, "rms_norm", None)
    _serve(_engine(loaded, native=True))
    assert calls == []


def test_models_without_the_native_form_bind_nothing(tiny):
    """Linears with LoRA, and attention soft-capping (Gemma 2 style), keep the Python layers."""
    _native_or_skip()
    llama = tiny("llama")
    llama.model.model.layers[1].mlp.down_proj.lora = object()
    assert llama.model.native_layers() is None
    gemma = tiny("gemma3", head_dim=64)
    assert gemma.model.native_layers() is not None
    gemma = tiny("gemma3", head_dim=64, attn_logit_softcapping=30.0)
    assert gemma.model.native_layers() is None


def test_the_native_layer_refuses_a_malformed_hidden_state(tiny):
    _native_or_skip()
    loaded = tiny("llama")
    layer = loaded.model.native_layers()[0]
    caches = torch.zeros(4, BLOCK, 1, 64, dtype=torch.bfloat16)
    args = (
        torch.zeros(1, 64, dtype=torch.bfloat16),  # cos
        torch.zeros(1, 64, dtype=torch.bfloat16),  # sin
        caches,
        caches.clone(),
        torch.zeros(1, dtype=torch.int64),  # slots
        torch.zeros(1, 1, dtype=torch.int32),  # block tables
        torch.tensor([[0, 1, 0]], dtype=torch.int64),  # seq info
        0,
        1,
    )
    with pytest.raises(RuntimeError, match="contiguous bfloat16"):
        layer.forward(torch.zeros(1, 128), *args)  # float32
    with pytest.raises(RuntimeError):
        layer.forward(torch.zeros(1, 96, dtype=torch.bfloat16), *args)  # wrong hidden size
    bad_slots = list(args)
    bad_slots[4] = torch.tensor([10_000], dtype=torch.int64)
    with pytest.raises(RuntimeError, match="not in the cache"):
        layer.forward(torch.zeros(1, 128, dtype=torch.bfloat16), *bad_slots)
    out = layer.forward(torch.ones(1, 128, dtype=torch.bfloat16), *args)
    assert out.shape == (1, 128) and torch.isfinite(out.float()).all()


@pytest.fixture
def every_family():
    """The GEMM's tile families that run here, each selected in turn by the caller (the host's
    own selection restored after)."""
    from prefixserve.model.kernels.build import _module

    module = _module()
    selected = module.gemm_bf16_selected()
    try:
        yield list(module.gemm_bf16_families()), module.gemm_bf16_select
    finally:
        module.gemm_bf16_select(selected[0], selected[1])


def test_an_engine_gives_the_same_bits_on_every_tile_family(tiny, every_family):
    """The same model served with each tile family selected for every call (AVX2's simulates an
    AVX2-only CPU on an AVX-512 host: its tiles and its scalar gated epilogue) gives the same
    tokens and logprobs, with the native layers running."""
    _native_or_skip()
    families, select = every_family
    loaded = tiny("llama")
    calls = _count_native_calls(loaded.model)
    results = {}
    for family in families:
        select(family, family)
        results[family] = _serve(_engine(loaded, native=True))
    assert calls, "the native layers never ran"
    for family in families[1:]:
        assert results[family] == results[families[0]], family
