"""Features composed: hypothesis draws an engine configuration (the dtype: float32, or bf16 in its
default batch-invariant mode with its KV cache in bf16, int8 or fp8 e4m3; pins, the disk tier off,
fresh or shared with earlier engines of other numerics, eviction policy, scheduling policy, chunked
prefill, n-gram speculation, LoRA with one slot, prompt embeddings, small pools) and a workload of
several tenants (a shared system prompt, another tenant's exact prompt, prompts too long for what
the pins leave, aborts, resets of RAM or of every tier, pins and unpins), and checks after every
operation:

- the engine is alive: a step never raises, and a refusal is a ValueError with a known reason;
- the pool's invariants hold, and once everything ends and pins are dropped no block leaked;
- no tenant ever hits another tenant's blocks: a request's cached tokens never exceed the longest
  block-aligned prefix it shares with a prompt of its own namespace (tenant, adapter, embeddings);
  tenants send the same tokens, so a cross-tenant hit would show;
- every request that ran to its length equals a cold reference of its dtype and KV dtype (no
  prefix caching, run alone), whether its K/V came from the pool, the disk, a pin, a recompute
  or speculation; a dtype's or KV dtype's blocks are never another's (the namespace includes
  both).

The model is a random-weight tiny Llama (tests/model/tiny_hf_models.py). `make test` runs a fixed
set of examples (derandomized); PREFIXSERVE_COMBINATIONS_EXAMPLES=N runs N random ones (a soak).
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from prefixserve.bench.lora_adapters import write_random_adapter
from prefixserve.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from prefixserve.core.kv_cache.reports.report import REASONS
from prefixserve.core.kv_cache.salts import derive_cache_salt
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.kv_store import KVStoreConfig
from prefixserve.lora.config import LoRARequest
from prefixserve.model.loader.loading import LoadedModel
from prefixserve.sampling_params import SamplingParams
from tests.helpers import common_prefix
from tests.helpers.models import VOCAB, build_hf_model, build_ours

BLOCK = 4
MAX_MODEL_LEN = 160
SYSTEM = [(7 * i + 3) % VOCAB for i in range(40)]  # 10 blocks every tenant sends
ADAPTERS = ("a", "b")
SOAK_EXAMPLES = os.environ.get("PREFIXSERVE_COMBINATIONS_EXAMPLES")
# What add_request / pin_prefix may refuse in these workloads; anything else is a failure.
KNOWN_REFUSALS = (
    "can hold at most",  # more blocks than the pool less the pins leaves it
    "LoRA adapter slots are used",  # the one adapter slot is busy (a 429 over HTTP)
    "would leave queued request",  # a pin that would strand a queued request
    "pinning",  # past the pinned capacity
    "nothing to pin",  # the prefix was evicted before the pin
    "exists already",  # a pin id in use
)


@dataclass(frozen=True)
class Setup:
    """One engine configuration."""

    num_kv_blocks: int
    eviction_policy: str
    scheduling_policy: str
    long_prefill_token_threshold: int
    speculative: bool
    lora: bool
    embeds: bool
    pins: bool
    disk: str  # "off" | "fresh" | "shared"
    dtype: str = "float32"  # or "bfloat16": batch-invariant by default where the kernels run
    # How the pool stores K/V (bf16 engines only: a float32 engine keeps "auto", its linears
    # not being batch-invariant, so a rounding flip of an 8-bit code could change a token).
    kv_cache_dtype: str = "auto"

    @property
    def numerics(self) -> tuple[str, str]:
        """What sets an engine's bits: its dtype and its KV cache's (a namespace of its own)."""
        return (self.dtype, self.kv_cache_dtype if self.dtype == "bfloat16" else "auto")


@dataclass(frozen=True)
class Send:
    tenant: int
    kind: str  # "system" | "copy" | "long" | "fresh"
    tail: int
    max_tokens: int
    adapter: str | None
    embeds: bool
    in_memory: bool


@dataclass(frozen=True)
class Op:
    name: str  # "send" | "step" | "abort" | "reset" | "pin" | "unpin"
    send: Send | None = None
    count: int = 1
    flag: bool = False


setups = st.builds(
    Setup,
    num_kv_blocks=st.sampled_from([24, 40, 64]),
    eviction_policy=st.sampled_from(["lru", "slru", "cost"]),
    scheduling_policy=st.sampled_from(["fair", "fcfs"]),
    long_prefill_token_threshold=st.sampled_from([0, 12]),
    speculative=st.booleans(),
    lora=st.booleans(),
    embeds=st.booleans(),
    pins=st.booleans(),
    disk=st.sampled_from(["off", "fresh", "shared"]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    kv_cache_dtype=st.sampled_from(["auto", "int8", "fp8_e4m3"]),
)
sends = st.builds(
    Send,
    tenant=st.integers(0, 2),
    kind=st.sampled_from(["system", "system", "copy", "long", "fresh"]),
    tail=st.integers(1, 14),
    max_tokens=st.integers(1, 6),
    adapter=st.sampled_from([None, None, *ADAPTERS]),
    embeds=st.booleans(),
    in_memory=st.booleans(),
)
ops = st.one_of(
    st.builds(Op, name=st.just("send"), send=sends),
    st.builds(Op, name=st.just("send"), send=sends),
    st.builds(Op, name=st.just("step"), count=st.integers(1, 4)),
    st.builds(Op, name=st.just("abort"), count=st.integers(0, 20)),
    st.builds(Op, name=st.just("reset"), flag=st.booleans(), count=st.integers(0, 1)),
    st.builds(Op, name=st.just("pin")),
    st.builds(Op, name=st.just("unpin")),
)


# ------------------------------------------------------------------------------ the model


# Every (dtype, KV cache dtype) a Setup may have.
NUMERICS = [
    ("float32", "auto"),
    ("bfloat16", "auto"),
    ("bfloat16", "int8"),
    ("bfloat16", "fp8_e4m3"),
]


@pytest.fixture(scope="module")
def world(tmp_path_factory, default_model_fp32):
    """The tiny model (its directory has config.json and weights, for the disk tier's
    fingerprint), two adapters, the shared store's directory, and a cold reference engine."""
    root = tmp_path_factory.mktemp("combinations")
    hf, config_json = build_hf_model("llama", root / "model")
    models, references = {}, {}
    for dtype in ("float32", "bfloat16"):
        model, config = build_ours(hf, config_json, dtype=dtype)
        models[dtype] = LoadedModel(
            model=model, tokenizer=default_model_fp32.tokenizer, config=config, path=root / "model"
        )
    for dtype, kv in NUMERICS:
        references[(dtype, kv)] = LLMEngine(
            EngineConfig(
                dtype=dtype,
                max_model_len=MAX_MODEL_LEN,
                cache=CacheConfig(
                    block_size=BLOCK,
                    num_kv_blocks=256,
                    enable_prefix_caching=False,
                    kv_cache_dtype=kv,
                ),
                lora=LoRAConfig(max_loras=2, max_lora_rank=8),
            ),
            loaded_model=models[dtype],
        )
    adapters = {
        name: str(write_random_adapter(root / name, config, rank=4, seed=i + 1, std=0.2))
        for i, name in enumerate(ADAPTERS)
    }
    return World(models, adapters, root / "shared-store", references)


@dataclass
class History:
    """What each namespace sent: (namespace, prompt, epoch, request id); a reset of every tier
    starts a new epoch of the resetting engine's numerics (its disk namespace: the blocks of
    other dtypes and KV dtypes in a shared store stay), and what it left unfinished is entered
    again in it (it recomputes). A namespace's first element is its numerics."""

    entries: list[tuple[tuple, tuple[int, ...], int, str]] = field(default_factory=list)
    epochs: dict = field(default_factory=dict)  # numerics -> epoch

    def epoch(self, numerics: tuple) -> int:
        return self.epochs.get(numerics, 0)

    def add(self, namespace: tuple, prompt: tuple[int, ...], request_id: str) -> None:
        self.entries.append((namespace, prompt, self.epoch(namespace[0]), request_id))

    def reachable(self, namespace: tuple, epoch: int, request_id: str) -> list[tuple[int, ...]]:
        """The prompts whose blocks a request sent in `epoch` could find in some tier."""
        return [
            prompt
            for ns, prompt, e, rid in self.entries
            if ns == namespace and e >= epoch and rid != request_id
        ]


@dataclass
class World:
    models: dict[str, LoadedModel]  # by dtype
    adapters: dict[str, str]
    shared_store: Path
    references: dict[tuple[str, str], LLMEngine]  # by Setup.numerics
    memo: dict = field(default_factory=dict)
    # What was sent into the shared store (it outlives each example's engine).
    shared_history: History = field(default_factory=lambda: History())

    def expected(
        self, prompt: tuple[int, ...], adapter: str | None, max_tokens: int, numerics: tuple
    ) -> list:
        """Greedy tokens of a cold, uncached run of the prompt alone with these numerics
        (dtype, KV cache dtype)."""
        key = (prompt, adapter, max_tokens, numerics)
        if key not in self.memo:
            engine = self.references[numerics]
            engine.add_request(
                "ref", list(prompt), greedy(max_tokens), lora_request=self.lora(adapter)
            )
            final = drain(engine)["ref"]
            assert final.error is None, final.error
            self.memo[key] = list(final.outputs[0].token_ids)
        return self.memo[key]

    def lora(self, adapter: str | None) -> LoRARequest | None:
        if adapter is None:
            return None
        return LoRARequest(adapter, ADAPTERS.index(adapter) + 1, self.adapters[adapter])


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, cache_report=True
    )


def drain(engine: LLMEngine, finals: dict | None = None, max_steps: int | None = None) -> dict:
    finals = {} if finals is None else finals
    steps = 0
    while engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.kv_cache_manager.check_invariants()
        steps += 1
    return finals


def build_engine(world: World, setup: Setup, tmp_path: Path) -> LLMEngine:
    store = None
    if setup.disk != "off":
        directory = world.shared_store if setup.disk == "shared" else tmp_path / "store"
        store = KVStoreConfig(dir=directory, capacity_bytes=1 << 30)
    config = EngineConfig(
        dtype=setup.dtype,
        max_model_len=MAX_MODEL_LEN,
        cache=CacheConfig(
            block_size=BLOCK,
            num_kv_blocks=setup.num_kv_blocks,
            eviction_policy=setup.eviction_policy,
            kv_cache_dtype=setup.numerics[1],
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=4,
            scheduling_policy=setup.scheduling_policy,
            long_prefill_token_threshold=setup.long_prefill_token_threshold,
        ),
        kv_store=store,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3}
        if setup.speculative
        else None,
        lora=LoRAConfig(max_loras=1, max_lora_rank=8) if setup.lora else None,
        enable_prompt_embeds=setup.embeds,
    )
    return LLMEngine(config, loaded_model=world.models[setup.dtype])


# ------------------------------------------------------------------------------ one run


@dataclass
class Sent:
    """A request the engine took."""

    request_id: str
    namespace: tuple
    prompt: tuple[int, ...]
    adapter: str | None
    max_tokens: int
    epoch: int


class Run:
    """One example: the engine, what was sent, and the checks."""

    def __init__(self, world: World, setup: Setup, engine: LLMEngine) -> None:
        self.world, self.setup, self.engine = world, setup, engine
        self.sent: list[Sent] = []
        self.prompts: list[tuple[int, ...]] = []  # every prompt drawn, any tenant
        self.finals: dict = {}
        self.aborted: set[str] = set()
        self.pinned = False
        self.history = world.shared_history if setup.disk == "shared" else History()

    def apply(self, op: Op) -> None:
        getattr(self, f"_{op.name}")(op)
        self.engine.kv_cache_manager.check_invariants()

    def _send(self, op: Op) -> None:
        send = op.send
        assert send is not None
        adapter = send.adapter if self.setup.lora else None
        embeds = send.embeds and self.setup.embeds
        prompt = self._prompt(send)
        namespace = (self.setup.numerics, send.tenant, adapter, embeds)
        request_id = f"r{len(self.prompts)}-{uuid.uuid4().hex[:8]}"  # unique in the store's history
        self.prompts.append(prompt)
        try:
            self.engine.add_request(
                request_id,
                [] if embeds else list(prompt),
                greedy(send.max_tokens),
                cache_salt=salt(send.tenant),
                tenant=f"t{send.tenant}",
                cache_retention="in_memory" if send.in_memory else None,
                lora_request=self.world.lora(adapter),
                prompt_embeds=self._embed(prompt) if embeds else None,
            )
        except ValueError as exc:
            assert any(reason in str(exc) for reason in KNOWN_REFUSALS), str(exc)
            return
        self.sent.append(
            Sent(
                request_id,
                namespace,
                prompt,
                adapter,
                send.max_tokens,
                self.history.epoch(self.setup.numerics),
            )
        )
        self.history.add(namespace, prompt, request_id)

    def _prompt(self, send: Send) -> tuple[int, ...]:
        tail = [(send.tenant * 31 + 11 * i + len(self.prompts)) % VOCAB for i in range(send.tail)]
        if send.kind == "copy" and self.prompts:
            return self.prompts[send.tail % len(self.prompts)]  # maybe another tenant's, exactly
        if send.kind == "long":
            return tuple(SYSTEM + SYSTEM + SYSTEM[: 10 + send.tail * 2] + tail)
        if send.kind == "fresh":
            return tuple(tail * 3)
        return tuple(SYSTEM + tail)

    def _embed(self, prompt: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            return self.engine.runner.model.embed(torch.tensor(prompt)).clone()

    def _step(self, op: Op) -> None:
        drain(self.engine, self.finals, max_steps=op.count)

    def _abort(self, op: Op) -> None:
        if self.sent:
            request_id = self.sent[op.count % len(self.sent)].request_id
            if request_id not in self.finals:
                self.aborted.add(request_id)
            self.engine.abort_request(request_id)

    def _reset(self, op: Op) -> None:
        done = self.engine.reset_prefix_cache(
            reset_running_requests=bool(op.count), ram_only=op.flag
        )
        if not done:
            return
        self.pinned = False  # a reset drops every pin
        if not op.flag:  # every tier forgot: only what is still unfinished can be cached again
            unfinished = [
                sent
                for sent in self.sent
                if sent.request_id not in self.finals and sent.request_id not in self.aborted
            ]
            numerics = self.setup.numerics
            self.history.epochs[numerics] = self.history.epoch(numerics) + 1
            for sent in unfinished:
                self.history.add(sent.namespace, sent.prompt, f"{sent.request_id}-again")

    def _pin(self, op: Op) -> None:
        if not self.setup.pins or self.pinned:
            return
        warm = f"warm-{uuid.uuid4().hex[:8]}"
        self.engine.add_request(warm, SYSTEM + [1], greedy(1), cache_salt=salt(0), tenant="t0")
        prompt = tuple(SYSTEM + [1])
        namespace = (self.setup.numerics, 0, None, False)
        epoch = self.history.epoch(self.setup.numerics)
        self.sent.append(Sent(warm, namespace, prompt, None, 1, epoch))
        self.history.add(namespace, prompt, warm)
        drain(self.engine, self.finals)
        try:
            self.engine.pin_prefix("system", SYSTEM, cache_salt=salt(0))
        except ValueError as exc:
            assert any(reason in str(exc) for reason in KNOWN_REFUSALS), str(exc)
            return
        self.pinned = True

    def _unpin(self, op: Op) -> None:
        if self.pinned:
            assert self.engine.unpin_prefix("system")
            self.pinned = False

    # ---------------------------------------------------------------------- the checks

    def finish(self) -> None:
        drain(self.engine, self.finals)
        for sent in self.sent:
            if sent.request_id in self.aborted:
                continue
            final = self.finals[sent.request_id]
            assert final.error is None, (sent, final.error)
            self._check_isolation(sent, final.num_cached_tokens)
            self._check_report(sent, final)
            tokens = list(final.outputs[0].token_ids)
            assert len(tokens) == sent.max_tokens, (sent, final.outputs[0].finish_reason)
            expected = self.world.expected(
                sent.prompt, sent.adapter, sent.max_tokens, self.setup.numerics
            )
            assert tokens == expected, (sent, tokens, expected)
        if self.pinned:
            self.engine.unpin_prefix("system")
        self.engine.check_no_leaks()

    def _check_report(self, sent: Sent, final) -> None:
        """The cache report agrees with the request's hit, under every combination: tiers add
        up, the hit is whole blocks, and a reason is named from the vocabulary."""
        report = final.cache_report
        assert report is not None and report["reason"] in REASONS, (sent, report)
        tokens = report["tokens"]
        assert tokens["ram"] + tokens["disk"] == final.num_cached_tokens, (sent, report)
        assert tokens["disk"] == final.num_disk_cached_tokens, (sent, report)
        assert sum(tokens.values()) == report["prompt_tokens"] == len(sent.prompt), report
        assert report["hit_blocks"] * BLOCK == final.num_cached_tokens, (sent, report)
        # Each tenant sends one salt, so another salt's prefix is always another tenant's: never
        # named.
        assert report["reason"] != "salt_or_tenant", (sent, report)

    def _check_isolation(self, sent: Sent, cached: int) -> None:
        """Cached tokens never exceed what its own namespace could have left in any tier."""
        best = 0
        for other in self.history.reachable(sent.namespace, sent.epoch, sent.request_id):
            best = max(best, common_prefix(sent.prompt, other))
        bound = min(best // BLOCK * BLOCK, (len(sent.prompt) - 1) // BLOCK * BLOCK)
        assert cached <= bound, (sent, cached, bound)


def salt(tenant: int) -> str:
    return derive_cache_salt(f"t{tenant}", None)


def _setup(**changes) -> Setup:
    base = Setup(40, "lru", "fair", 0, False, False, False, False, "off")
    return dataclasses.replace(base, **changes)


def _send(tenant: int, kind: str = "system", **changes) -> Op:
    send = Send(tenant, kind, 5, 3, None, False, False)
    return Op("send", dataclasses.replace(send, **changes))


# The seams issue 26 found, always among the examples (hypothesis adds its own around them).
SEAMS = [
    # a pin holds part of the pool, then another tenant's long prompt arrives
    (_setup(pins=True), [Op("pin"), _send(1, "long", tail=14), Op("step", count=4)]),
    # a reset of every tier, then the same prefix again: it must be computed, not loaded
    (
        _setup(disk="fresh"),
        [_send(0), Op("step", count=4), Op("reset"), _send(0), Op("step", count=4)],
    ),
    # two tenants, one prompt; then a RAM-only reset and the disk serves its own tenant only
    (
        _setup(disk="fresh", speculative=True),
        [_send(0), Op("step", count=4), _send(1, "copy", tail=0), Op("reset", flag=True)]
        + [_send(1, "copy", tail=0), _send(2, "copy", tail=0)],
    ),
    # one adapter slot: a stream under "a" keeps "b" out (a refusal), then "b" runs
    (
        _setup(lora=True, embeds=True),
        [_send(0, adapter="a"), _send(1, adapter="b"), _send(1, adapter="b", embeds=True)]
        + [Op("step", count=4), _send(2, adapter="b", embeds=True)],
    ),
    # one store shared by a float32 engine, then a bf16 one (batch-invariant by default): the
    # bf16 engine never loads the float32 blocks, and its own hits, pins, drafts and adapter
    # rows give its cold reference's tokens
    (
        _setup(disk="shared"),
        [_send(0), Op("step", count=4), _send(1, "copy", tail=0), Op("step", count=4)],
    ),
    (
        _setup(dtype="bfloat16", disk="shared", speculative=True, lora=True, pins=True),
        [_send(0), Op("step", count=4), Op("pin"), _send(1, "copy", tail=0)]
        + [_send(0, adapter="a"), Op("reset", flag=True), _send(2, "copy", tail=0)]
        + [Op("step", count=4), _send(0, "copy", tail=0)],
    ),
    # then an int8 KV cache on the same store: it never loads the bf16 blocks, and its own hits
    # (pool and disk), pins, drafts, adapter rows and a reset give its cold int8 reference
    (
        _setup(
            dtype="bfloat16",
            kv_cache_dtype="int8",
            disk="shared",
            speculative=True,
            lora=True,
            pins=True,
        ),
        [_send(0), Op("step", count=4), Op("pin"), _send(1, "copy", tail=0)]
        + [_send(0, adapter="a"), Op("reset", flag=True), _send(2, "copy", tail=0)]
        + [Op("step", count=4), _send(0, "copy", tail=0)],
    ),
]


def with_seams(test):
    for setup, workload in SEAMS:
        test = example(setup=setup, workload=workload)(test)
    return test


@settings(
    max_examples=int(SOAK_EXAMPLES or 80),
    deadline=None,
    derandomize=SOAK_EXAMPLES is None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@with_seams
@given(setup=setups, workload=st.lists(ops, min_size=6, max_size=20))
def test_composed_features_keep_every_invariant(world, tmp_path, setup, workload):
    engine = build_engine(world, setup, tmp_path / uuid.uuid4().hex)  # "fresh": a new store
    try:
        # bf16 equals its cold reference only where the engine is batch-invariant (the kernels)
        assume(setup.dtype == "float32" or engine.runner.batch_invariant)
        run = Run(world, setup, engine)
        for op in workload:
            run.apply(op)
        run.finish()
    finally:
        engine.close()
