"""SchedulerOutput -> tensors -> one forward over the paged KV cache -> sampled tokens.

The runner owns the KV cache tensors (per layer K and V of `[num_blocks, block_size,
num_kv_heads, head_dim]`; block 0 is the null block) and the per-request random generators. It
never mutates a Request: it reads token ids and sampling params and returns a ModelRunnerOutput.
"""

from __future__ import annotations

import functools
import hashlib
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from prefixserve.core.kv_cache.spec import SlidingWindowSpec
from prefixserve.core.request import Request
from prefixserve.core.sched.interfaces import StepGrammar
from prefixserve.core.sched.output import (
    ModelRunnerOutput,
    PositionLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from prefixserve.core.sched.step_results import forced_logprobs
from prefixserve.inputs.prompt_embeds import embeds_rows
from prefixserve.kv_store.worker import gather_blocks, scatter_blocks
from prefixserve.model.config import ModelConfig
from prefixserve.model.kernels.build import (
    attention_kernels_agree,
    attention_portable_width,
    paged_attention_kernel,
    prefill_attention_kernel,
)
from prefixserve.model.kernels.cpu_paths import bf16_packing_supported
from prefixserve.model.layers.attention import (
    ScheduledSpan,
    build_attention_metadata,
    lanes_serve,
    prefill_kernel_for,
)
from prefixserve.model.layers.common import ForwardContext, one_thread
from prefixserve.model.layers.kernel_table import compiled_kernel
from prefixserve.model.layers.linear import (
    Linear,
    batch_invariant_linears,
    set_stream_threads,
)
from prefixserve.model.layers.native_layer import step_takes_native_layers
from prefixserve.model.quant.kv_cache import kv_format
from prefixserve.model.quant.weights import weights_numerics
from prefixserve.settings import omp_threads_sleep
from prefixserve.worker.sample.sampler import is_greedy
from prefixserve.worker.sample.verify import GeneratorRewind, num_accepted, row_views

# Steps run on one torch thread while OpenMP's threads sleep between parallel regions
# (OMP_WAIT_POLICY=PASSIVE, the default) where the kernels' own stream pool
# (csrc/common/stream_pool.h) does their heavy work: every step where every linear and every
# chunk's attention takes the native kernels (`ModelRunner.pool_takes_every_step`), else steps of
# at most this many tokens. Waking a sleeping thread for each of a step's ~300 regions costs more
# than it brings, and an awake OpenMP thread competes with the pool's helper, which spins between
# a step's jobs, for the same cores. Measured on the default model (AMD EPYC Zen 4, one process,
# steps interleaved): fresh prefills of 40-512 tokens 1.16-1.63x faster on one thread, chunks of
# 5-31 rows over a cached prefix at batch 1-32 1.13-1.45x, decode at batch 4-8 over 512-1,500
# keys 1.20-1.57x (BENCHMARKS.md, the stream pool for attention). With spinning threads
# (OMP_WAIT_POLICY unset or ACTIVE) every step uses them all.
ONE_THREAD_MAX_TOKENS = 8


class LoRARows(Protocol):
    def begin_step(self, segments: Sequence[tuple[str | None, int, int]]) -> None: ...
    def end_step(self) -> None: ...


class SamplerLike(Protocol):
    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        generators: list[torch.Generator | None],
    ) -> list[tuple[int, PositionLogprobs | None]]: ...


@dataclass(slots=True)
class StepInputs:
    """A step's inputs as flat rows: each scheduled request's tokens (then its drafts) in turn."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    spans: list[ScheduledSpan] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_reqs: list[Request] = field(default_factory=list)  # one per sampled row
    drafted: list[tuple[Request, int, list[int]]] = field(
        default_factory=list
    )  # (req, row, drafts)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_owners: list[tuple[Request, int]] = field(default_factory=list)  # (request, rows)
    lora_segments: list[tuple[str | None, int, int]] = field(default_factory=list)
    embed_rows: list[int] = field(default_factory=list)  # rows fed prompt embeddings
    embed_parts: list[torch.Tensor] = field(default_factory=list)

    def add(self, s: ScheduledRequest, with_lora: bool, dtype: torch.dtype) -> None:
        """Append one scheduled request's rows (its tokens [start, end), then its drafts)."""
        req, start, n, drafts = (
            s.request,
            s.num_computed_tokens,
            s.num_new_tokens,
            s.draft_token_ids,
        )
        end, row = start + n, len(self.token_ids)
        self.token_ids.extend(req.all_token_ids[start:end])
        self.token_ids.extend(drafts)
        self.positions.extend(range(start, end + len(drafts)))
        self.spans.append(ScheduledSpan(start, n + len(drafts), s.block_ids))
        if with_lora:
            self.lora_segments.append((req.lora_name, row, row + n + len(drafts)))
        if req.prompt_embeds is not None and start < req.num_prompt_tokens:
            stop = min(end, req.num_prompt_tokens)
            self.embed_rows.extend(range(row, row + stop - start))
            self.embed_parts.append(embeds_rows(req.prompt_embeds, start, stop, dtype))
        if drafts:
            self.drafted.append((req, len(self.sample_reqs), drafts))
            self.sample_rows.extend(range(row + n - 1, row + n + len(drafts)))
            self.sample_reqs.extend(row_views(req, drafts))
        elif s.samples:
            self.sample_rows.append(row + n - 1)
            self.sample_reqs.append(req)
        if req.sampling_params.prompt_logprobs is not None:
            # Logits at position p score prompt token p + 1.
            last = min(end, req.num_prompt_tokens - 1)
            if last > start:
                self.prompt_rows.extend(range(row, row + last - start))
                self.prompt_targets.extend(req.all_token_ids[start + 1 : last + 1])
                self.prompt_owners.append((req, last - start))


def resolve_batch_invariant(
    wanted: bool | None, config: ModelConfig, attention_kernel: object
) -> bool:
    """The batch-invariant mode this runner takes: `wanted` when given (True raises where the
    kernels it needs are missing), else on for a bf16 model wherever the native kernels run (the
    paged attention kernel and the native GEMM, whose invariant path is its fast one), off
    otherwise. fp32 models stay off by default: their linears run MKL's sgemm, whose blocking
    (and so each output's summation order) follows the row count, and the native GEMM is bf16
    only."""
    possible_bf16 = bf16_packing_supported() or compiled_kernel("gemm_any") is not None
    if wanted is None:
        return (
            config.torch_dtype == torch.bfloat16
            and attention_kernel is not None
            and compiled_kernel("gemm") is not None
        )
    if wanted and attention_kernel is None:
        raise ValueError(
            "batch_invariant needs the native attention kernel, which is not available "
            "here (PREFIXSERVE_KERNELS=0, or it failed to build: see the log)"
        )
    if wanted and config.torch_dtype == torch.bfloat16 and not possible_bf16:
        raise ValueError(
            "batch_invariant needs oneDNN's packed bf16 GEMM or the native GEMM's "
            "vector tiles (AVX2 or AVX-512), and this CPU has neither"
        )
    return wanted


class ModelRunner:
    """Runs the model for the scheduler's steps.

    `model` is a model from `prefixserve.model.models.registry.create_model` and `config` its
    ModelConfig. `num_blocks` counts the null block 0.
    """

    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        num_blocks: int,
        block_size: int = 16,
        sampler: SamplerLike | None = None,
        seed: int = 0,
        batch_invariant: bool | None = None,
        kv_cache_dtype: str = "auto",
        lora: LoRARows | None = None,
    ) -> None:
        """`lora`: the engine's LoRAManager when LoRA is on (lora/manager.py), told each step
        which rows run under which adapter."""
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                "num_blocks must be an integer >= 2 (block 0 is the null block), "
                f"got {num_blocks!r}"
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if sampler is None:
            from prefixserve.worker.sample.sampler import Sampler

            sampler = Sampler()
        self.model: nn.Module = model
        self.config = config
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.sampler = sampler
        self.group_windows = [
            spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            for spec in config.kv_cache_groups()
        ]
        # How K/V are stored: the model's dtype, or 8-bit rows with their scales
        # (model/quant/kv_cache.py); `quant` is None for the former.
        self.kv_format = kv_format(kv_cache_dtype, config.torch_dtype)
        self.quant = self.kv_format if self.kv_format.quantized else None
        width = self.kv_format.row_width(config.head_dim)
        shape = (num_blocks, block_size, config.num_kv_heads, width)
        # Zeroed: masked-out slots that were never written are still read, and 0 * NaN = NaN
        # (an 8-bit row of zeros has scale 0: its values are 0 too).
        zeros = functools.partial(torch.zeros, shape, dtype=self.kv_format.storage)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = [
            (zeros(), zeros()) for _ in range(config.num_layers)
        ]
        # The compiled paged-attention kernel (built on first use), or None: PyTorch paths.
        self.attention_kernel = paged_attention_kernel()
        # The long-chunk kernel reads bf16 K/V: an 8-bit cache's chunks go to the paged kernel.
        prefill = prefill_attention_kernel() if self.quant is None else None
        self.prefill_kernel = prefill_kernel_for(config, prefill)
        self.kernel_max_queries: int | None = None
        # Where the long-chunk kernel serves this model, the paged kernel's bf16 path has its
        # arithmetic (csrc/attention/attn_lanes_bf16_avx512.h) and is faster than SDPA at every
        # chunk length (BENCHMARKS.md, "Model speed"): every chunk attends through one of the
        # two, so a query's output does not depend on how its prompt was chunked, cached or
        # batched, in any mode.
        kernels_agree = self.prefill_kernel is not None and attention_kernels_agree()
        if kernels_agree:
            self.kernel_max_queries = sys.maxsize
        # Batch-invariant: every chunk attends through kernels with one arithmetic (each
        # query's keys in the same fixed tiles, whether they were cached or computed this step,
        # whatever the chunk's length), and linears take one path
        # (`linear.batch_invariant_linears`).
        self.batch_invariant = resolve_batch_invariant(
            batch_invariant, config, self.attention_kernel
        )
        if self.batch_invariant:
            if not kernels_agree:
                self.prefill_kernel = None
            self.kernel_max_queries = sys.maxsize
        # Small batches' linears stream on all of torch's threads even in a one-thread step.
        set_stream_threads(torch.get_num_threads())
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype = config.torch_dtype
        self.lora = lora
        # Whether steps whose every row attends through the paged kernel run each decoder
        # layer as one native call where the model has that form (native_layer.py; the same
        # bits as the Python layers; benchmarks turn it off to compare).
        # (The native layer writes K/V through the rotary kernel, which writes 8-bit rows as
        # quantize_rows does.)
        self.native_layers = True
        self._seeded_generators: dict[str, torch.Generator] = {}
        # Whether every step's linears and attention run on the kernels' stream pool, whatever
        # its rows (see ONE_THREAD_MAX_TOKENS): every linear takes the native kernels at every
        # row count and every chunk attends through the paged or the long-chunk kernel.
        self.pool_takes_every_step = (
            self.attention_kernel is not None
            and self.kernel_max_queries == sys.maxsize
            and lora is None
            and all(m.on_stream_pool() for m in model.modules() if isinstance(m, Linear))
        )

    def _generator_for(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self.generator
        gen = self._seeded_generators.get(request.request_id)
        if gen is None:
            gen = seeded_generator(seed)
            self._seeded_generators[request.request_id] = gen
        return gen

    def kv_numerics(self, kv_dtype: str | None = None) -> str:
        """What the disk tier's namespace adds for how this runner computes K/V: in every mode
        the weights' formats and the 8-bit kernel's span order (`weights_numerics`); in the
        batch-invariant mode also its linears' path (the native GEMM's order, or
        oneDNN's where `PREFIXSERVE_NATIVE_GEMM=0`) and its attention's (the bf16 lanes kernels'
        arithmetic, its int8 caches' integer one, the same bits on 512- or 256-bit tiles; or,
        where the build has no such tiles or they do not serve the model, the portable path's,
        named with its vectors' width: a layer's K/V depend on the earlier layers' attention),
        so a hit is a cold start's bits, also from a store that hosts of other CPU kinds share.
        `kv_dtype`: as an engine of that KV dtype would name it (the runner's own by default)."""
        weights = weights_numerics(self.config.quantization)
        if not self.batch_invariant:
            return weights
        linears = "native-gemm" if compiled_kernel("gemm") is not None else "onednn"
        kv = kv_dtype or self.kv_format.name
        if not (attention_kernels_agree() and lanes_serve(self.config)):
            width = attention_portable_width()
            attention = f"portable{width}" if width else "portable"
        elif kv == "int8":  # integer tiles (attn_lanes_int8_avx512.h, attn_lanes_int8_avx2.h)
            attention = "lanes-int8-dot"
        elif kv == "fp8_e4m3":
            attention = "lanes-fp8-codes"  # exact codes, row scales after (lanes::RowScales)
        else:
            attention = "lanes"
        return f"/batch-invariant/{linears}/{attention}-attention{weights}"

    def gather_blocks(self, block_ids: Sequence[int]) -> list[memoryview]:
        """Copies of these blocks' K/V (every layer) for the disk tier (kv_store/worker.py)."""
        return gather_blocks(self.kv_caches, block_ids)

    def release(self, finished_req_ids: Iterable[str]) -> None:
        """Drop what the runner keeps for requests that finished (their seeded generators)."""
        for req_id in finished_req_ids:
            self._seeded_generators.pop(req_id, None)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One forward over all scheduled chunks; sample where a chunk reaches its last token.
        On one torch thread while OpenMP threads sleep between regions, where the stream pool
        takes every step's heavy work or the step has at most ONE_THREAD_MAX_TOKENS tokens."""
        small = scheduler_output.total_num_scheduled_tokens <= ONE_THREAD_MAX_TOKENS
        if (self.pool_takes_every_step or small) and omp_threads_sleep():
            with one_thread():
                return self._execute(scheduler_output)
        return self._execute(scheduler_output)

    @torch.inference_mode()
    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Prepare the step's inputs, run the forward pass, sample (vLLM's model runner's three
        phases)."""
        self.release(scheduler_output.finished_req_ids)
        if scheduler_output.kv_loads:
            block_ids, payloads = zip(*scheduler_output.kv_loads, strict=True)
            scatter_blocks(self.kv_caches, block_ids, payloads)
        output = ModelRunnerOutput()
        scheduled = scheduler_output.scheduled
        if self.lora is not None:  # by adapter: each adapter's decode rows become one slice
            scheduled = sorted(scheduled, key=lambda s: s.request.lora_name or "")
        # Single-token chunks first (stable: adapters stay together): one batched attention call.
        scheduled = sorted(scheduled, key=lambda s: s.num_scheduled_tokens != 1)
        if not scheduled:
            return output
        inputs = self._prepare_inputs(scheduled)
        with batch_invariant_linears(self.batch_invariant):
            hidden = self._forward(inputs)
            rows = inputs.sample_rows + inputs.prompt_rows
            if not rows:
                return output
            logits = self.model.compute_logits(hidden[torch.tensor(rows, dtype=torch.int64)])
        num_sample_rows = len(inputs.sample_reqs)  # (the grammar may take forced rows out)
        if inputs.sample_reqs:
            sample_logits = logits[:num_sample_rows]
            if scheduler_output.grammar is not None:
                sample_logits = _apply_grammar(
                    scheduler_output.grammar, inputs, sample_logits, output
                )
                _emit_forced(scheduler_output.grammar, scheduler_output.scheduled, output)
            if inputs.sample_reqs:
                self._sample(inputs, sample_logits, output)
        if inputs.prompt_owners:
            self._prompt_logprobs(inputs, logits[num_sample_rows:], output)
        return output

    def _prepare_inputs(self, scheduled: Sequence[ScheduledRequest]) -> StepInputs:
        """The step's flat rows: every scheduled request's tokens (and drafts) one after another,
        with the rows to sample and to score as prompt logprobs."""
        inputs = StepInputs()
        num_groups = len(self.group_windows)
        for s in scheduled:
            req, start, n = s.request, s.num_computed_tokens, s.num_new_tokens
            end = start + n
            drafts = s.draft_token_ids
            if n < 1 or end > req.num_tokens or (drafts and end != req.num_tokens):
                raise ValueError(
                    f"request {req.request_id!r}: cannot compute tokens [{start}, {end}) of "
                    f"{req.num_tokens}"
                )
            if len(s.block_ids) != num_groups:
                raise ValueError(
                    f"request {req.request_id!r}: {len(s.block_ids)} block tables for "
                    f"{num_groups} KV-cache groups"
                )
            inputs.add(s, self.lora is not None, self.dtype)
        return inputs

    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        """One forward pass over the step's rows, the paged KV cache and the adapters' slices."""
        metadata = [
            build_attention_metadata(
                inputs.spans,
                g,
                self.block_size,
                window,
                self.attention_kernel,
                self.prefill_kernel,
                self.kernel_max_queries,
            )
            for g, window in enumerate(self.group_windows)
        ]
        for meta in metadata:
            meta.kv_format = self.quant
        ctx = ForwardContext(
            positions=torch.tensor(inputs.positions, dtype=torch.int64),
            kv_caches=self.kv_caches,
            groups=metadata,
        )
        if inputs.embed_rows:
            rows = torch.tensor(inputs.embed_rows, dtype=torch.int64)
            ctx.embeds = (rows, torch.cat(inputs.embed_parts))
        lora = self.lora
        ctx.native_layers = (
            self.native_layers and lora is None and step_takes_native_layers(metadata)
        )
        if lora is not None:
            lora.begin_step(inputs.lora_segments)
        try:
            return self.model(torch.tensor(inputs.token_ids, dtype=torch.int64), ctx)
        finally:
            if lora is not None:
                lora.end_step()

    def _sample(self, inputs: StepInputs, logits: torch.Tensor, output: ModelRunnerOutput) -> None:
        """Sample every sampled row (drafts verified), recording what fails per request."""
        failed, sample_reqs = output.failed, inputs.sample_reqs
        generators: list[torch.Generator | None] = []
        for req in sample_reqs:
            try:
                generators.append(self._generator_for(req))
            except Exception as exc:  # noqa: BLE001 - this request's seed, not the step's
                failed[req.request_id] = f"cannot seed the random generator: {exc}"
                generators.append(None)
        rewind = GeneratorRewind()
        for req, first, _ in inputs.drafted:
            if generators[first] is not self.generator and not is_greedy(req):
                rewind.save(generators[first])
        results: list[SampledRow | None]
        if failed or not _all_finite(logits):
            results = self._sample_rows(logits, sample_reqs, generators, failed)
        else:
            try:
                results = list(self.sampler(logits, sample_reqs, generators))
            except Exception:  # noqa: BLE001 - find the rows that fail, sample the others
                results = self._sample_rows(logits, sample_reqs, generators, failed)
        _collect_samples(results, sample_reqs, inputs.drafted, generators, rewind, output)

    def _prompt_logprobs(
        self, inputs: StepInputs, logits: torch.Tensor, output: ModelRunnerOutput
    ) -> None:
        """Prompt logprobs of the requests that asked (each request's rows, its failure its own)."""
        compute = getattr(self.sampler, "compute_prompt_logprobs", None)
        if compute is None:
            from prefixserve.worker.sample.sampler import compute_prompt_logprobs as compute
        failed, offset = output.failed, 0
        for req, count in inputs.prompt_owners:
            rows = logits[offset : offset + count]
            targets = inputs.prompt_targets[offset : offset + count]
            offset += count
            if req.request_id in failed:
                continue
            try:
                if not _all_finite(rows):
                    raise ValueError("the model produced non-finite logits (NaN or +inf)")
                output.prompt_logprobs[req.request_id] = compute(
                    rows, targets, req.sampling_params.prompt_logprobs
                )
            except Exception as exc:  # noqa: BLE001 - this request's rows only
                failed[req.request_id] = f"prompt logprobs failed: {exc}"

    def _sample_rows(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        generators: list[torch.Generator | None],
        failed: dict[str, str],
    ) -> list[SampledRow | None]:
        """Sample row by row, recording in `failed` the requests whose rows cannot be sampled
        (non-finite logits, a sampler error) and giving None for their rows: the slow path of a
        step where something failed. The sampler checks its rows before it draws, so a retried
        row draws what it would have drawn in the batch; only an error raised after the draws
        shifts seeded streams by one."""
        results: list[SampledRow | None] = []
        for row, (req, gen) in enumerate(zip(requests, generators, strict=True)):
            if req.request_id in failed:
                results.append(None)
                continue
            row_logits = logits[row : row + 1]
            try:
                if not _all_finite(row_logits):
                    raise ValueError("the model produced non-finite logits (NaN or +inf)")
                ((token_id, logprobs),) = self.sampler(row_logits, [req], [gen])
            except Exception as exc:  # noqa: BLE001 - this row fails, the others go on
                failed[req.request_id] = f"sampling failed: {exc}"
                results.append(None)
                continue
            results.append((int(token_id), logprobs))
        return results


SampledRow = tuple[int, PositionLogprobs | None]


def _apply_grammar(
    grammar: StepGrammar, inputs: StepInputs, logits: torch.Tensor, output: ModelRunnerOutput
) -> torch.Tensor:
    """Structured requests' rows: those whose grammar forces the token leave the sampled rows
    (`_emit_forced` emits it, drawing no random number); the others' disallowed tokens become
    -inf (a request whose mask failed is failed alone). Returns the logits of the rows left to
    sample (`inputs` updated to match)."""
    rows = inputs.sample_reqs
    keep = [i for i, r in enumerate(rows) if grammar.forced_token(r.request_id) is None]
    if len(keep) < len(rows):
        new_index = {old: new for new, old in enumerate(keep)}
        logits = logits[torch.tensor(keep, dtype=torch.int64)]
        inputs.sample_reqs = [rows[i] for i in keep]
        inputs.sample_rows = [inputs.sample_rows[i] for i in keep]
        inputs.drafted = [(req, new_index[first], d) for req, first, d in inputs.drafted]
    output.failed.update(grammar.apply(logits, [r.request_id for r in inputs.sample_reqs]))
    return logits


def _emit_forced(
    grammar: StepGrammar, scheduled: Sequence[ScheduledRequest], output: ModelRunnerOutput
) -> None:
    """The tokens structured requests' grammars force at their sampled rows (without
    jump-forward): emitted unsampled, with logprob 0 (the only token allowed) when asked."""
    for s in scheduled:
        request_id = s.request.request_id
        token = grammar.forced_token(request_id) if s.samples else None
        if token is None:
            continue
        output.sampled_token_ids[request_id] = token
        for entry in forced_logprobs(s.request, [token]):
            output.logprobs[request_id] = entry


def _collect_samples(
    results: list[SampledRow | None],
    rows: list[Request],
    drafted: list[tuple[Request, int, list[int]]],
    generators: list[torch.Generator | None],
    rewind: GeneratorRewind,
    output: ModelRunnerOutput,
) -> None:
    """Sampled rows -> the output's tokens and logprobs. A request with drafts emits its
    accepted drafts (`spec_token_ids`) and then the token sampled after them; its seeded
    generator is left as if only the rows it used had drawn."""
    drafts_at = {first: (req, drafts) for req, first, drafts in drafted}
    failed = output.failed
    i = 0
    while i < len(rows):
        entry = drafts_at.get(i)
        if entry is None:
            result, request_id = results[i], rows[i].request_id
            i += 1
            if result is None or request_id in failed:
                continue
            output.sampled_token_ids[request_id] = int(result[0])
            if result[1] is not None:
                output.logprobs[request_id] = result[1]
            continue
        req, drafts = entry
        own = results[i : i + len(drafts) + 1]
        generator = generators[i]
        i += len(drafts) + 1
        if req.request_id in failed or any(r is None for r in own):
            continue
        sampled = [int(r[0]) for r in own if r is not None]
        logprobs = [r[1] for r in own if r is not None]
        accepted = num_accepted(sampled, drafts)
        rewind.replay(generator, accepted + 1)
        output.sampled_token_ids[req.request_id] = sampled[accepted]
        if logprobs[accepted] is not None:
            output.logprobs[req.request_id] = logprobs[accepted]
        if accepted:
            output.spec_token_ids[req.request_id] = drafts[:accepted]
            if logprobs[0] is not None:
                output.spec_logprobs[req.request_id] = [lp for lp in logprobs[:accepted] if lp]


def _all_finite(logits: torch.Tensor) -> bool:
    """No NaN, no +inf, and no row ruling out every token (all -inf: its softmax is NaN). A -inf
    logit alone is a token the model rules out, which is fine. Checked before any draw, so a bad
    row is retried alone without advancing its neighbours' seeded generators."""
    top = logits.amax(dim=-1)
    return bool(((top < float("inf")) & (top > float("-inf"))).all())


_MT_STATE_BYTES = 5056  # torch's CPU generator state: the mt19937 words at bytes 24 .. 5016
_MT_WORDS = 624


def seeded_generator(seed: int) -> torch.Generator:
    """A CPU generator for `seed`, any integer in [0, 2**64).

    torch's `manual_seed` keeps only the low 32 bits, so 1, 2**32 + 1 and 2**33 + 1 would share a
    stream. A seed below 2**32 is `manual_seed(seed)` (the same streams as before); a larger one
    fills the whole mt19937 state from a BLAKE2b counter stream of its 8 bytes, so distinct seeds
    give distinct streams. Same seed, same stream.
    """
    if not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    gen = torch.Generator().manual_seed(seed & 0xFFFFFFFF)
    if seed < 2**32:
        return gen
    state = gen.get_state()
    words = state[24 : 24 + 8 * _MT_WORDS].view(torch.int64)
    if state.numel() != _MT_STATE_BYTES or int(words[0]) != seed & 0xFFFFFFFF:
        raise RuntimeError("unknown torch CPU generator state layout: cannot seed above 2**32")
    key = seed.to_bytes(8, "little")
    digest = b"".join(
        hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=64).digest()
        for i in range(_MT_WORDS * 4 // 64)
    )
    mixed = torch.frombuffer(bytearray(digest), dtype=torch.int32).to(torch.int64) & 0xFFFFFFFF
    words.copy_(mixed)  # left stays 1: the first draw regenerates from these words
    gen.set_state(state)
    return gen
