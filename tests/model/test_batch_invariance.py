"""Batch invariance in bf16 (`batch_invariant=True`): a request's greedy tokens and logprobs are
bit for bit those of the same request served alone and cold, whether its K/V came from this step,
the RAM pool, the disk tier or a recompute after preemption, however its prompt was chunked,
whatever ran beside it, with or without n-gram speculation.

Three levels: the linear (one path for every row count, each row's result independent of the
others), the paged-attention kernel (a query meets its keys in the same tiles however its rows
are grouped, cascaded or windowed), and the engine (hypothesis over chunk budgets, pool sizes,
batch composition, cache state, the disk tier and speculation, on a random-weight tiny Llama in
bf16; and the packaged default model and Gemma 3 on a fixed scenario).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefixserve.config import CacheConfig, EngineConfig, SchedulerConfig
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.engine_args import EngineArgs
from prefixserve.kv_store import KVStoreConfig
from prefixserve.model.kernels.build import attention_portable_width, paged_attention_kernel
from prefixserve.model.layers.kernel_table import compiled_kernel
from prefixserve.model.layers.linear import Linear, batch_invariant_linears
from prefixserve.model.loader.loading import LoadedModel
from prefixserve.sampling_params import SamplingParams
from prefixserve.worker.model_runner import resolve_batch_invariant
from tests.helpers.models import VOCAB, build_hf_model, build_ours

ROW_COUNTS = (1, 2, 3, 5, 8, 9, 16, 17, 33, 64, 65, 100, 257)


# ------------------------------------------------------------------------------ the linear


def _rows_are_their_own(linear: Linear, x: torch.Tensor) -> torch.Tensor:
    """linear(x), asserting that the first rows of every ROW_COUNTS call, and each last row
    alone, are bit for bit those rows of the whole call."""
    whole = linear(x)
    for rows in ROW_COUNTS:
        assert torch.equal(linear(x[:rows]), whole[:rows]), f"{rows} rows"
        alone = linear(x[rows - 1 : rows])
        assert torch.equal(alone, whole[rows - 1 : rows]), f"row {rows - 1} alone"
    return whole


@pytest.mark.parametrize(("in_features", "out_features"), [(64, 96), (640, 2048), (2048, 640)])
def test_a_batch_invariant_linear_gives_each_row_the_result_it_gets_alone(
    in_features, out_features
):
    torch.manual_seed(0)
    linear = Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(out_features, in_features) / in_features**0.5)
    linear.pack()
    x = torch.randn(max(ROW_COUNTS), in_features, dtype=torch.bfloat16)
    with batch_invariant_linears(True):
        whole = _rows_are_their_own(linear, x)
        # Small steps run on one thread (model_runner's one_thread), large ones on all.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            for rows in (1, 9, 64):
                assert torch.equal(linear(x[:rows]), whole[:rows]), f"{rows} rows, one thread"
        finally:
            torch.set_num_threads(threads)


def _simulate_avx2_only(monkeypatch) -> tuple[list[int], object]:
    """An AVX2-only CPU's linears, simulated: no oneDNN bf16 packing, a CPU table without the
    native GEMM, and the native GEMM's AVX2 tiles for batch-invariant calls. Returns the row
    counts of the AVX2 calls (appended as they happen) and the build's module."""
    from prefixserve.model.kernels import build
    from prefixserve.model.layers import kernel_table
    from prefixserve.model.layers import linear as linear_module

    module = build._module()
    if module is None or module.gemm_bf16_tiles() == "portable":
        pytest.skip("no native kernels, or no AVX2 and FMA here")
    pack, _, gated = build.linear_bf16_packed_kernels()
    calls: list[int] = []

    def avx2(out, x, packed, n, bias, threads, prefetch=None):
        calls.append(x.shape[0])
        module.linear_bf16_packed_on(out, x, packed, n, bias, threads, "avx2")

    monkeypatch.setattr(linear_module, "bf16_packing_supported", lambda: False)
    monkeypatch.setitem(kernel_table._kernels, "gemm", None)
    monkeypatch.setitem(kernel_table._kernels, "gemm_any", (pack, avx2, gated))
    return calls, module


def test_a_batch_invariant_linear_where_onednn_cannot_pack_bf16_takes_the_avx2_tiles(
    monkeypatch,
):
    """Outside the mode the linear keeps its row-count paths; inside it, every call takes the
    native GEMM on the AVX2 tiles (packed at the first such call), each row its result alone,
    the AVX-512 tiles' bits where the build has them."""
    calls, module = _simulate_avx2_only(monkeypatch)
    torch.manual_seed(3)
    linear = Linear(640, 300, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(300, 640) / 640**0.5)
    linear.pack()
    assert linear._packed is None and linear._gemm is None and linear._invariant_packed is None
    x = torch.randn(max(ROW_COUNTS), 640, dtype=torch.bfloat16)
    linear(x[:3])
    assert calls == [] and linear._invariant_packed is None  # outside the mode: no packing
    with batch_invariant_linears(True):
        whole = _rows_are_their_own(linear, x)
    assert len(calls) == 1 + 2 * len(ROW_COUNTS)
    if module.gemm_bf16_tiles() == "avx512":
        out = torch.empty(x.shape[0], 300, dtype=torch.bfloat16)
        packed = module.pack_bf16_gemm(linear.weight.detach())
        module.linear_bf16_packed(out, x, packed, 300, linear.bias.detach(), 2)
        assert torch.equal(whole, out)


@pytest.mark.parametrize(("in_features", "out_features"), [(77, 33), (576, 1536), (2048, 640)])
def test_the_streaming_kernel_sums_each_row_alike_in_any_batch(in_features, out_features):
    """csrc/linear/gemv.cpp: a row's output is the same bits in a call of 1 to 13 rows, wherever the
    row falls in its group of four, with a bias and a K that is no multiple of 32."""
    kernel = compiled_kernel("linear_small")
    if kernel is None:
        pytest.skip("the native linear kernel is not built here")
    torch.manual_seed(2)
    weight = (torch.randn(out_features, in_features) / in_features**0.5).to(torch.bfloat16)
    bias = torch.randn(out_features).to(torch.bfloat16)
    x = torch.randn(64, in_features).to(torch.bfloat16)

    def linear(rows: torch.Tensor) -> torch.Tensor:
        out = rows.new_empty(rows.shape[0], out_features)
        kernel(out, rows.contiguous(), weight, bias, 2)
        return out

    whole = linear(x)
    reference = x.float() @ weight.float().T + bias.float()
    assert (whole.float() - reference).abs().max() < 0.05
    for rows in (1, 2, 3, 5, 8, 13):
        for start in range(0, 40, 3):
            part = linear(x[start : start + rows])
            assert torch.equal(part, whole[start : start + rows]), f"{rows} rows from {start}"


# ------------------------------------------------------------------------------ the kernel


def _kernel_or_skip():
    kernel = paged_attention_kernel()
    if kernel is None:
        pytest.skip("the native paged-attention kernel is not built here")
    return kernel


def _attend(kernel, q, k_cache, v_cache, tables, info, window=0):
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2], dtype=q.dtype)
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    kernel(
        out, q, k_cache, v_cache, table, torch.tensor(info, dtype=torch.int64), 0.125, 0.0, window
    )
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 200])
@pytest.mark.parametrize("head_dim", [64, 16])
def test_the_kernel_gives_a_query_the_same_result_however_its_rows_are_grouped(
    window, head_dim, dtype
):
    """One sequence of 300 positions: its last 40 queries as one chunk, as chunks of 1, 7 and 32
    rows, and as decode rows batched with other sequences sharing its prefix blocks (a cascade):
    every query's output is the same bits. In fp32 too, where a sum taken in another order
    shows in the output (bf16's rounding of the output hides most such differences)."""
    kernel = _kernel_or_skip()
    torch.manual_seed(1)
    block, kv_heads, heads, positions = 16, 2, 4, 300
    num_blocks = 64
    k_cache = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks, block, kv_heads, head_dim).to(dtype)
    table = list(range(1, positions // block + 2))
    q = (2 * torch.randn(positions, heads, head_dim)).to(dtype)
    first = positions - 40
    whole = _attend(kernel, q[first:], k_cache, v_cache, [table], [(0, 40, first)], window)
    for size in (1, 5, 7, 32):
        for lo in range(0, 40, size):
            hi = min(40, lo + size)
            part = _attend(kernel, q[first + lo : first + hi], k_cache, v_cache, [table],
                           [(0, hi - lo, first + lo)], window)  # fmt: skip
            assert torch.equal(part, whole[lo:hi]), f"chunk {lo}:{hi} of {size}"
    if window:
        return  # cascades are for full attention only
    # Decode rows of four sequences whose tables share the first 12 blocks (a cascade).
    tables = [table[:12] + [40 + 2 * i, 41 + 2 * i] for i in range(4)]
    pos = [12 * block + 5 + i for i in range(4)]
    qs = (2 * torch.randn(4, heads, head_dim)).to(dtype)
    batched = _attend(kernel, qs, k_cache, v_cache, tables, [(i, i + 1, pos[i]) for i in range(4)])
    for i in range(4):
        alone = _attend(kernel, qs[i : i + 1], k_cache, v_cache, [tables[i]], [(0, 1, pos[i])])
        assert torch.equal(alone, batched[i : i + 1]), f"sequence {i} in the cascade"


# ------------------------------------------------------------------------------ the engine

BLOCK = 4
MAX_MODEL_LEN = 128
TOKENS = 6
PARAMS = SamplingParams(max_tokens=TOKENS, temperature=0.0, logprobs=2, ignore_eos=True)
# Three shared prefixes of 6-10 blocks, each with three suffixes: nine prompts with hits to take.
PREFIXES = [[(11 * i + 7 * p + 3) % VOCAB for i in range(24 + 8 * p)] for p in range(3)]
PROMPTS = [
    prefix + [(5 * s + 13 * j + 1) % VOCAB for j in range(3 + 2 * s)]
    for prefix in PREFIXES
    for s in range(3)
]


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory, default_model_fp32):
    root = tmp_path_factory.mktemp("batch-invariance")
    hf, config_json = build_hf_model("llama", root / "model")
    model, config = build_ours(hf, config_json, dtype="bfloat16")
    return LoadedModel(
        model=model, tokenizer=default_model_fp32.tokenizer, config=config, path=root / "model"
    )


def _engine(loaded: LoadedModel, **options) -> LLMEngine:
    cache = CacheConfig(
        block_size=BLOCK,
        num_kv_blocks=options.pop("num_kv_blocks", 256),
        enable_prefix_caching=options.pop("caching", True),
    )
    scheduler = SchedulerConfig(
        max_num_seqs=options.pop("max_num_seqs", 8),
        max_num_batched_tokens=options.pop("budget", 512),
    )
    config = EngineConfig(
        dtype="bfloat16",
        max_model_len=MAX_MODEL_LEN,
        cache=cache,
        scheduler=scheduler,
        batch_invariant=True,
        **options,
    )
    return LLMEngine(config, loaded_model=loaded)


def _key(output) -> tuple:
    completion = output.outputs[0]
    logprobs = tuple(
        tuple(sorted((token, lp.logprob) for token, lp in step.items()))
        for step in completion.logprobs
    )
    return tuple(completion.token_ids), logprobs


def _serve(engine: LLMEngine, prompts: list[tuple[str, list[int]]]) -> dict[str, tuple]:
    for request_id, prompt in prompts:
        engine.add_request(request_id, prompt, PARAMS)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = _key(output)
    return finals


@pytest.fixture(scope="module")
def cold(tiny_bf16) -> list[tuple]:
    """Each prompt alone on a cold engine without prefix caching, in one chunk."""
    engine = _engine(tiny_bf16, caching=False)
    return [_serve(engine, [(f"cold-{i}", p)])[f"cold-{i}"] for i, p in enumerate(PROMPTS)]


@dataclasses.dataclass(frozen=True)
class Setup:
    budget: int  # max_num_batched_tokens: the chunking
    max_num_seqs: int  # how many share a step
    num_kv_blocks: int  # small: preemptions and recomputes
    warm: tuple[int, ...]  # prompts served first, so the others hit their prefixes
    disk: bool  # the disk tier on, the RAM pool reset before the batch: hits load from disk
    speculative: bool


SETUPS = st.builds(
    Setup,
    budget=st.sampled_from([8, 13, 32, 512]),
    max_num_seqs=st.sampled_from([1, 3, 8]),
    num_kv_blocks=st.sampled_from([40, 256]),
    warm=st.lists(st.integers(0, len(PROMPTS) - 1), max_size=3, unique=True).map(tuple),
    disk=st.booleans(),
    speculative=st.booleans(),
)


# Nine prompts at once in 40 blocks: requests are preempted and recomputed (asserted below).
PREEMPTING = Setup(512, 8, 40, (1, 2, 3), False, False)


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(setup=SETUPS)
@example(Setup(13, 8, 40, (0, 4), True, True))
@example(PREEMPTING)
def test_every_request_gets_its_cold_alone_output_bit_for_bit(tiny_bf16, cold, tmp_path, setup):
    store = None
    if setup.disk:
        store = KVStoreConfig(dir=tmp_path / f"store-{hash(setup)}", capacity_bytes=1 << 28)
    spec = {"method": "ngram", "num_speculative_tokens": 3} if setup.speculative else None
    engine = _engine(
        tiny_bf16,
        budget=setup.budget,
        max_num_seqs=setup.max_num_seqs,
        num_kv_blocks=setup.num_kv_blocks,
        kv_store=store,
        speculative_config=spec,
    )
    try:
        for i in setup.warm:
            assert _serve(engine, [(f"warm-{i}", PROMPTS[i])])[f"warm-{i}"] == cold[i]
        if setup.disk:
            assert engine.reset_prefix_cache(ram_only=True)  # hits now come from the disk tier
        finals = _serve(engine, [(f"r{i}", p) for i, p in enumerate(PROMPTS)])
        for i in range(len(PROMPTS)):
            assert finals[f"r{i}"] == cold[i], f"prompt {i} ({setup})"
        if setup == PREEMPTING:
            assert engine.get_metrics()["num_preemptions"] > 0
        engine.check_no_leaks()
    finally:
        engine.close()


def test_an_avx2_only_cpu_gives_every_request_its_cold_alone_output(
    tmp_path, monkeypatch, default_model_fp32
):
    """The engine on a simulated AVX2-only CPU in batch-invariant mode: linears on the AVX2 tiles,
    attention on the paged kernel's 256-bit keys-in-lanes tiles (a head dim of 64; no
    AVX512-BF16 there, so no long-chunk kernel). Chunked, batched, warm and speculating, every
    request gets its cold, alone, unchunked bits."""
    from prefixserve.model.kernels.build import paged_attention_avx2_kernel

    calls, _ = _simulate_avx2_only(monkeypatch)
    avx2_tiles = paged_attention_avx2_kernel()
    served = []

    def attention_on_avx2_tiles(*args) -> None:
        served.append(avx2_tiles(*args))

    hf, config_json = build_hf_model("llama", tmp_path / "model", head_dim=64)
    model, config = build_ours(hf, config_json, dtype="bfloat16")
    loaded = LoadedModel(model, default_model_fp32.tokenizer, config, tmp_path / "model")

    def engine(**options) -> LLMEngine:
        eng = _engine(loaded, **options)
        eng.runner.attention_kernel = attention_on_avx2_tiles
        eng.runner.prefill_kernel = None
        return eng

    cold = engine(caching=False)
    alone = [_serve(cold, [(f"c{i}", p)])[f"c{i}"] for i, p in enumerate(PROMPTS)]
    assert calls, "the AVX2 tiles never ran"
    assert served and all(served), "the 256-bit attention tiles did not serve every call"
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    warm = engine(budget=13, max_num_seqs=8, speculative_config=spec)
    for i in (0, 4):
        assert _serve(warm, [(f"w{i}", PROMPTS[i])])[f"w{i}"] == alone[i]
    finals = _serve(warm, [(f"r{i}", p) for i, p in enumerate(PROMPTS)])
    assert [finals[f"r{i}"] for i in range(len(PROMPTS))] == alone
    assert all(served), "the 256-bit tiles did not serve every call of the warm engine"
    warm.check_no_leaks()


# ------------------------------------------------------------------------------ real models


@pytest.fixture(scope="module", params=["default", "gemma3"])
def real_bf16(request, default_model_bf16):
    """The packaged default model (SmolLM2-135M), and Gemma 3 270M (sliding-window layers of
    512 tokens, which these prompts pass)."""
    if request.param == "default":
        return default_model_bf16, 12
    from prefixserve.model.loader.default_model import ensure_gemma3_270m
    from prefixserve.model.loader.loading import load_model

    return load_model(ensure_gemma3_270m(), dtype="bfloat16"), 40


@pytest.mark.parametrize("mode", ["batch_invariant", "default"])
def test_a_real_model_gives_a_cache_hit_the_cold_starts_bf16_output(real_bf16, mode):
    """Two questions over one document, each served cold and alone, then from a warm cache
    (the document's blocks hit), then both in one step, then with a small chunk budget: the
    same tokens and logprobs, bit for bit. With the flag, and in the default configuration,
    which is batch-invariant for bf16 on every CPU kind the native kernels run on."""
    loaded, items = real_bf16
    if mode == "batch_invariant" and loaded.config.sliding_window is not None:
        # The flag and the default run the same kernels (the runner is invariant in both,
        # asserted below); the default model takes both, Gemma's 15 s the default only.
        pytest.skip("Gemma 3 runs the default configuration only")
    tokenizer = loaded.tokenizer
    document = " ".join(
        f"Item {i} weighs {3 * i % 17} kilograms and is {i % 5} years old." for i in range(items)
    )
    questions = ("heaviest", "oldest")
    prompts = [tokenizer.encode(f"{document}\nQuestion: which item is {q}?") for q in questions]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)

    def engine(caching: bool, budget: int = 2048) -> LLMEngine:
        config = EngineConfig(
            dtype="bfloat16",
            max_model_len=2048,
            cache=CacheConfig(num_kv_blocks=256, enable_prefix_caching=caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=budget),
            batch_invariant=True if mode == "batch_invariant" else None,
        )
        eng = LLMEngine(config, loaded_model=loaded)
        assert eng.runner.batch_invariant  # the default: on for bf16 wherever it can be
        return eng

    def serve(eng: LLMEngine, batch: list[tuple[str, list[int]]]) -> dict[str, tuple]:
        for request_id, prompt in batch:
            eng.add_request(request_id, prompt, params)
        finals = {}
        while eng.has_unfinished_requests():
            finals.update({o.request_id: _key(o) for o in eng.step() if o.finished})
        return finals

    cold_engine = engine(False)
    cold_out = [serve(cold_engine, [(f"c{i}", p)])[f"c{i}"] for i, p in enumerate(prompts)]
    warm = engine(True)
    assert serve(warm, [("w0", prompts[0])])["w0"] == cold_out[0]
    assert serve(warm, [("w1", prompts[1])])["w1"] == cold_out[1]  # the document's blocks hit
    assert warm.get_metrics()["prefix_cache_hits"] > 0
    together = serve(warm, [("t0", prompts[0]), ("t1", prompts[1])])
    assert [together["t0"], together["t1"]] == cold_out
    chunked = serve(engine(False, budget=96), [("k0", prompts[0]), ("k1", prompts[1])])
    assert [chunked["k0"], chunked["k1"]] == cold_out


def test_batch_invariant_is_an_engine_option_with_vllms_switch(monkeypatch):
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    assert EngineArgs().create_engine_config().batch_invariant is None  # the runner's default
    assert EngineArgs(batch_invariant=True).create_engine_config().batch_invariant is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineArgs().create_engine_config().batch_invariant is True
    assert EngineArgs(batch_invariant=False).create_engine_config().batch_invariant is False
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")  # type: ignore[arg-type]


def test_batch_invariant_takes_lora(default_model_bf16, tmp_path):
    """An adapter's request in bf16 with the flag: served cold and alone (prefix caching off,
    its 200-token prompt in one chunk, so the update of those rows takes the large-group path
    of a default run), from a warm cache, beside a base-model request and another request of
    its adapter, and in chunks of 32: the same tokens and logprobs, bit for bit."""
    from prefixserve.bench.lora_adapters import ALL_MODULES, write_random_adapter
    from prefixserve.llm import LLM
    from prefixserve.lora.config import LoRARequest

    config = default_model_bf16.config
    lora = LoRARequest("a", 1, str(write_random_adapter(tmp_path / "a", config, 8, ALL_MODULES)))
    document = list(range(1000, 1200))
    prompts = [document + [7, 8, 9], document + [11, 12]]
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=3, ignore_eos=True)

    def llm(caching: bool, budget: int = 2048) -> LLM:
        return LLM(
            dtype="bfloat16",
            loaded_model=default_model_bf16,
            enable_lora=True,
            batch_invariant=True,
            enable_prefix_caching=caching,
            max_num_batched_tokens=budget,
            num_kv_blocks=128,
            enable_kv_store=False,
        )

    def serve(engine: LLM, batch: list, loras: list) -> list[tuple]:
        outs = engine.generate(
            [{"prompt_token_ids": p} for p in batch], params, use_tqdm=False, lora_request=loras
        )
        engine.llm_engine.check_no_leaks()
        return [_key(o) for o in outs]

    cold_engine = llm(False)
    cold = [serve(cold_engine, [p], [lora])[0] for p in prompts]
    base = serve(cold_engine, [prompts[0]], [None])[0]
    assert base != cold[0]  # the adapter changes the answer
    warm = llm(True)
    assert serve(warm, [prompts[0]], [lora]) == [cold[0]]
    assert serve(warm, [prompts[1]], [lora]) == [cold[1]]  # the document's blocks hit
    mixed = serve(warm, [prompts[1], prompts[0], prompts[0]], [lora, None, lora])
    assert mixed == [cold[1], base, cold[0]]
    assert serve(llm(False, budget=32), prompts, [lora, lora]) == cold


def test_a_batch_invariant_engine_keeps_its_disk_blocks_apart(default_model_fp32, tmp_path):
    """K/V computed on the invariant paths round otherwise than the default's: a disk hit across
    the two would break the promise, so the two file their blocks in different namespaces."""
    from prefixserve.llm import LLM

    def namespace(invariant: bool) -> str:
        llm = LLM(
            loaded_model=default_model_fp32,
            dtype="float32",
            kv_store_dir=str(tmp_path),
            kv_store_gb=1,
            batch_invariant=invariant,
        )
        return llm.llm_engine.kv_connector.store.namespace

    assert namespace(True) != namespace(False)


def test_batch_invariance_is_on_by_default_for_bf16_wherever_the_kernels_run(
    default_model_bf16, monkeypatch
):
    """None (the default) resolves to on for a bf16 model with the attention kernel and a bf16
    GEMM of one order, to off without the kernel or for fp32 (MKL's sgemm); an explicit True
    without the kernel is refused, an explicit False is kept."""
    config = default_model_bf16.config
    kernel = paged_attention_kernel()
    if kernel is None:
        pytest.skip("native kernels unavailable")
    assert resolve_batch_invariant(None, config, kernel) is True
    assert resolve_batch_invariant(False, config, kernel) is False
    assert resolve_batch_invariant(None, config, None) is False
    with pytest.raises(ValueError, match="attention kernel"):
        resolve_batch_invariant(True, config, None)
    fp32 = dataclasses.replace(config, dtype="float32")
    assert resolve_batch_invariant(None, fp32, kernel) is False
    assert resolve_batch_invariant(True, fp32, kernel) is True
    from prefixserve.model.layers import kernel_table

    if compiled_kernel("gemm") is not None:  # oneDNN alone: only on request, and named apart
        monkeypatch.setitem(kernel_table._kernels, "gemm", None)
        assert resolve_batch_invariant(None, config, kernel) is False


def portable_name() -> str:
    """The portable attention's name in a namespace: with its vectors' width in this build."""
    return "portable512" if attention_portable_width() == 512 else "portable"


def test_the_disk_tier_keeps_apart_blocks_of_each_linear_path(default_model_bf16, monkeypatch):
    """A batch-invariant engine's K/V carry their linears' order and their attention's: blocks
    of the native GEMM and of oneDNN (PREFIXSERVE_NATIVE_GEMM=0 with the flag), and of the bf16
    lanes kernels (512- or 256-bit tiles, the same bits) and of the portable attention (a build
    without AVX2, on a host that shares the store), never share a namespace; an engine outside
    the mode names nothing."""
    from prefixserve.model.layers import kernel_table
    from prefixserve.worker import model_runner

    if paged_attention_kernel() is None or compiled_kernel("gemm") is None:
        pytest.skip("the native kernels are not built here")
    config = EngineConfig(dtype="bfloat16", cache=CacheConfig(num_kv_blocks=32))
    runner = LLMEngine(config, loaded_model=default_model_bf16).runner
    attention = "lanes" if model_runner.attention_kernels_agree() else portable_name()
    assert runner.kv_numerics() == f"/batch-invariant/native-gemm/{attention}-attention"
    monkeypatch.setattr(model_runner, "attention_kernels_agree", lambda: False)
    assert runner.kv_numerics() == f"/batch-invariant/native-gemm/{portable_name()}-attention"
    monkeypatch.setattr(model_runner, "attention_kernels_agree", lambda: True)
    assert runner.kv_numerics() == "/batch-invariant/native-gemm/lanes-attention"
    monkeypatch.setitem(kernel_table._kernels, "gemm", None)
    assert runner.kv_numerics() == "/batch-invariant/onednn/lanes-attention"
    runner.batch_invariant = False
    assert runner.kv_numerics() == ""


def test_an_int8_cache_of_the_integer_kernel_keeps_its_disk_blocks_apart(
    default_model_bf16, monkeypatch
):
    """An int8 KV cache meets bf16 queries in integer dot products wherever the build has the
    keys-in-lanes tiles (csrc/attention/attn_lanes_int8_avx512.h with AVX512-BF16 and VNNI,
    csrc/attention/attn_lanes_int8_avx2.h with AVX2: the same bits, one name), on the portable path
    elsewhere: two arithmetics, so
    two namespaces for a batch-invariant engine; fp8 and bf16 caches are named apart too."""
    from prefixserve.worker import model_runner

    if paged_attention_kernel() is None or compiled_kernel("gemm") is None:
        pytest.skip("the native kernels are not built here")
    monkeypatch.setattr(model_runner, "attention_kernels_agree", lambda: True)
    cache = CacheConfig(num_kv_blocks=32, kv_cache_dtype="int8")
    runner = LLMEngine(
        EngineConfig(dtype="bfloat16", cache=cache), loaded_model=default_model_bf16
    ).runner
    assert runner.kv_numerics() == "/batch-invariant/native-gemm/lanes-int8-dot-attention"
    # As an engine of another KV dtype would name it (its namespace for cache reports); fp8
    # caches meet queries as exact codes with the row scales after, another arithmetic too.
    assert runner.kv_numerics("bf16") == "/batch-invariant/native-gemm/lanes-attention"
    assert (
        runner.kv_numerics("fp8_e4m3") == "/batch-invariant/native-gemm/lanes-fp8-codes-attention"
    )
    # A build without the keys-in-lanes tiles (no AVX2) attends on the portable path.
    monkeypatch.setattr(model_runner, "attention_kernels_agree", lambda: False)
    portable = f"/batch-invariant/native-gemm/{portable_name()}-attention"
    assert runner.kv_numerics() == portable
    assert runner.kv_numerics("bf16") == portable


@pytest.mark.parametrize(
    "change", [{"head_dim": 96}, {"attn_logit_softcapping": 50.0}], ids=["head-dim-96", "softcap"]
)
def test_a_model_the_lanes_tiles_do_not_serve_is_named_for_the_portable_path(
    default_model_bf16, monkeypatch, change
):
    """Where the build has the keys-in-lanes tiles but they do not serve the model (a head dim
    other than 64, 128 or 256, or logit soft-capping), its attention runs the portable path, whose
    bits depend on the build's vectors: its namespace says the portable path and their width,
    never the lanes (which hosts of every kind share)."""
    from prefixserve.worker import model_runner

    if paged_attention_kernel() is None or compiled_kernel("gemm") is None:
        pytest.skip("the native kernels are not built here")
    monkeypatch.setattr(model_runner, "attention_kernels_agree", lambda: True)
    runner = LLMEngine(
        EngineConfig(dtype="bfloat16", cache=CacheConfig(num_kv_blocks=32)),
        loaded_model=default_model_bf16,
    ).runner
    assert runner.kv_numerics() == "/batch-invariant/native-gemm/lanes-attention"
    runner.config = dataclasses.replace(runner.config, **change)
    expected = f"/batch-invariant/native-gemm/{portable_name()}-attention"
    assert runner.kv_numerics() == expected
    assert runner.kv_numerics("int8") == expected
