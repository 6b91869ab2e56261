"""Server configurations composed: hypothesis draws a server (API keys for two tenants and an
operator or none, a pinned system prompt, the disk tier off, fresh or shared with every earlier
server of this module, LoRA with one adapter slot, a small KV pool, few running requests, the fair
or fcfs policy) and a small multi-tenant workload sent over real HTTP (a shared system prompt,
repeats, the other tenant's exact request, prompts too long for the context or the pool, chat and
completions, streams, streams closed after their first chunk, plain requests whose client stops
waiting, `prompt_cache_retention` "in_memory", a client `cache_salt` equal to another tenant's
derived salt, concurrent requests, pins and operator resets (RAM only, every tier, preempting
what runs) beside them, a request on one adapter while a stream holds the other), and checks:

- every answer is a 200, or a 4xx with an OpenAI error body naming its reason, or a 429/503 with
  Retry-After; never a 5xx or a broken connection; a stream ends with `[DONE]`; beyond that, what
  the workload makes certain: a legal request succeeds (a 429 only for an adapter while another
  adapter runs beside it, and always while the other's stream holds the one slot), a prompt too
  long is a 400, an unknown model a 404, a tenant's reset a 403; an operator's reset succeeds
  when nothing runs or when it preempts what runs; a pin made while nothing runs holds every
  full block of its prompt;
- no namespace hits another's blocks: a request's cached tokens never exceed the longest prefix
  it shares with a prompt its own namespace (tenant or keyless client salt, adapter) sent before
  or beside it, pins included; namespaces send the same tokens, so a cross-tenant hit would show.
  With the shared disk tier the history is the module's, since the store outlives each server;
- the cache still hits where it must (so the check above has teeth): a repeat right after its
  original hits every full block of its prompt, and a pinned prefix is hit by its own tenant;
- the server is whole after: /health is 200, a plain request succeeds, the engine runs, and once
  the pins are deleted no block or request leaked.

The model is a random-weight 2-layer Llama with the default model's tokenizer, loaded once. Keys
and the disk tier are the test's parameters (so every run covers each pair); the rest is drawn.
`make test` runs a fixed set of examples per pair (derandomized);
PREFIXSERVE_COMBINATIONS_EXAMPLES=N runs N random ones per pair (a soak). The engine-level half
is tests/test_feature_combinations.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from prefixserve.bench.lora_adapters import write_random_adapter
from prefixserve.config import CacheConfig, EngineConfig, LoRAConfig, SchedulerConfig
from prefixserve.core.kv_cache.salts import derive_cache_salt
from prefixserve.engine.async_llm import AsyncLLMEngine
from prefixserve.engine.llm_engine import LLMEngine
from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.auth import ApiKeys
from prefixserve.kv_store import KVStoreConfig
from prefixserve.model.loader.loading import LoadedModel, load_model
from tests.helpers import common_prefix, random_tokens
from tests.helpers.models import tiny_llama_dir
from tests.helpers.server import LiveServer, serve_in_thread

pytestmark = pytest.mark.timeout(900)

SOAK_EXAMPLES = os.environ.get("PREFIXSERVE_COMBINATIONS_EXAMPLES")
MODEL = "tiny-llama"
ADAPTERS = ("a", "b")
BLOCK = 16
MAX_MODEL_LEN = 1024
TENANT_KEYS = {"t0": "sk-combo-t0", "t1": "sk-combo-t1"}
OPERATOR_KEY = "sk-combo-operator"
# The salt t0's blocks carry: a client sending it as its own cache_salt must not reach them.
FOREIGN_SALT = derive_cache_salt("t0", None)
CLIENT_SALTS = (None, "s1", FOREIGN_SALT)
# Ends in a newline so its tokens stay a prefix of every prompt that continues it.
SYSTEM = (
    "You are the support assistant of a small bookshop in Lyon. Answer in two sentences at most, "
    "quote the order number the customer gives, never invent a price or a delivery date, and "
    "when a request is unclear ask exactly one short question before answering. Be polite, be "
    "brief, and sign every answer as the shop.\n"
)
QUESTIONS = (
    "Customer: where is my order 4411? It was due on Monday.",
    "Customer: can I return a damaged atlas bought last week?",
    "Customer: do you ship poetry collections to Geneva?",
    "Customer: my invoice 872 shows the wrong address, please fix it.",
)
OWN = (
    "Write a short note to a neighbour about the noisy heating pipes in the building hallway.",
    "List three reasons why a river town might hold its market on the bridge every Sunday.",
    "Explain to a child how bread rises, in plain words, with one small kitchen experiment.",
    "Describe the sound of rain on a tin roof to someone who has never heard rain at all.",
)
OVERSIZED = ("over_pool", "over_context")
# Long enough that the request still runs when its client leaves (or sends another request).
ABORT_MAX_TOKENS = 160
LEAVE_AFTER_S = 0.05


# ------------------------------------------------------------------------------ the world
class World:
    """What every example shares: the model, the adapters, the prompts' ids, the shared store
    and what was sent over it (it outlives every server, so its history is the module's)."""

    def __init__(
        self,
        model: LoadedModel,
        adapters: dict[str, str],
        tmp: pytest.TempPathFactory,
        shared_dir: Path,
    ) -> None:
        self.model = model
        self.adapters = adapters
        self.tmp = tmp
        self.shared_dir = shared_dir
        self.shared_history: dict[tuple, list[tuple[int, ...]]] = {}  # namespace -> prompts
        self.prompt_ids: dict[tuple[bool, str, int], tuple[int, ...]] = {}
        self.system_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:  # hypothesis prints it with every failing example
        return f"World(model={str(self.model.path)!r})"


def messages(kind: str, index: int) -> list[dict[str, str]]:
    if kind == "system":
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": QUESTIONS[index]},
        ]
    return [{"role": "user", "content": OWN[index]}]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    path = tiny_llama_dir(tmp_path_factory.mktemp("combo-llama"))
    model = load_model(path, dtype="float32")
    root = tmp_path_factory.mktemp("combo-adapters")
    adapters = {
        name: str(write_random_adapter(root / name, model.config, rank=4, seed=seed, std=0.1))
        for seed, name in enumerate(ADAPTERS, 1)
    }
    world = World(model, adapters, tmp_path_factory, tmp_path_factory.mktemp("combo-kv") / "kv")
    # Every prompt's ids, computed here: the tokenizer is not called from two threads at once.
    tokenizer = model.tokenizer
    world.system_ids = tuple(tokenizer.encode(SYSTEM))
    for index in range(len(QUESTIONS)):
        world.prompt_ids[False, "system", index] = tuple(
            tokenizer.encode(SYSTEM + QUESTIONS[index])
        )
        world.prompt_ids[False, "own", index] = tuple(tokenizer.encode(OWN[index]))
        for kind in ("system", "own"):
            ids = tokenizer.apply_chat_template(messages(kind, index), add_generation_prompt=True)
            world.prompt_ids[True, kind, index] = tuple(ids)
    world.prompt_ids[False, "over_context", 0] = tuple(random_tokens(MAX_MODEL_LEN + 8, seed=26))
    return world


# ------------------------------------------------------------------------- what is drawn
@dataclass(frozen=True)
class Setup:
    keys: bool
    pins: bool
    store: str  # "off", "fresh" (a new directory) or "shared" (the module's directory)
    lora: bool
    num_kv_blocks: int
    max_num_seqs: int
    policy: str


@dataclass(frozen=True)
class Send:
    """One request: from tenant t<tenant> (with keys) with client salt CLIENT_SALTS[salt]."""

    tenant: int
    salt: int
    model: str
    kind: str  # "system" (SYSTEM + a question), "own", or one of OVERSIZED
    index: int
    chat: bool
    # "plain", "stream", "abort" (the client leaves a stream after its first chunk) or "leave"
    # (the client of a plain request gives up waiting for it)
    mode: str
    max_tokens: int
    in_memory: bool = False  # prompt_cache_retention "in_memory": never to the disk tier


@dataclass(frozen=True)
class Reset:
    ram_only: bool
    by_tenant: bool  # with keys: a tenant tries the operator route (403, nothing reset)
    running: bool = False  # reset_running_requests: preempt what runs, then reset


@dataclass(frozen=True)
class Pin:
    """The operator pins the system prompt in t0's namespace (keyless: the unsalted one)."""


@dataclass(frozen=True)
class BusySlot:
    """A stream on adapter `first` is open while a request on adapter `second` comes: with one
    adapter slot, another adapter is refused (429 with Retry-After) while the stream's request
    runs, and served once it has ended."""

    first: str
    second: str


@dataclass(frozen=True)
class Repeat:
    """The same request twice in a row: the second must hit the first's full blocks."""

    send: Send


@dataclass(frozen=True)
class Mirror:
    """A request, then the very same request from the other tenant (keyless: with the next
    client salt): the second must not hit what the first cached."""

    send: Send


@dataclass(frozen=True)
class Together:
    """Requests, resets and pins sent at once, each from its own thread."""

    items: tuple[Send | Reset | Pin, ...]


def setups(keys: bool, store: str) -> st.SearchStrategy[Setup]:
    """Servers with these keys and this disk tier (the test's parameters, so that every run
    covers each of them) and the rest drawn."""
    return st.builds(
        Setup,
        keys=st.just(keys),
        pins=st.booleans(),
        store=st.just(store),
        lora=st.booleans(),
        num_kv_blocks=st.integers(24, 56),
        max_num_seqs=st.integers(1, 4),
        policy=st.sampled_from(["fair", "fcfs"]),
    )


sends = st.builds(
    Send,
    tenant=st.integers(0, 1),
    salt=st.sampled_from([0, 0, 1, 2]),  # an index in CLIENT_SALTS; most clients send none
    model=st.sampled_from([MODEL, MODEL, MODEL, *ADAPTERS]),
    kind=st.sampled_from(["system", "system", "system", "own", *OVERSIZED]),
    index=st.integers(0, len(QUESTIONS) - 1),
    chat=st.booleans(),
    mode=st.sampled_from(["plain", "plain", "plain", "stream", "abort", "leave"]),
    max_tokens=st.integers(1, 6),
    in_memory=st.booleans(),
)
resets = st.builds(Reset, ram_only=st.booleans(), by_tenant=st.booleans(), running=st.booleans())
ops = st.one_of(
    sends,
    sends,
    sends,
    resets,
    st.just(Pin()),
    st.builds(Repeat, sends),
    st.builds(Mirror, sends),
    st.builds(BusySlot, st.sampled_from(ADAPTERS), st.sampled_from(ADAPTERS)),
    st.builds(
        Together,
        st.lists(
            st.one_of(sends, sends, sends, sends, resets, st.just(Pin())), min_size=2, max_size=3
        ).map(tuple),
    ),
)


def at_most_requests(workload: list, limit: int = 12) -> list:
    """The workload's first ops that send at most `limit` requests together."""
    sent = {Send: 1, Reset: 0, Pin: 1, Repeat: 2, Mirror: 2, BusySlot: 2}
    kept, total = [], 0
    for op in workload:
        total += len(op.items) if isinstance(op, Together) else sent[type(op)]
        if total > limit:
            break
        kept.append(op)
    return kept


workloads = st.lists(ops, min_size=4, max_size=8).map(at_most_requests)


# ------------------------------------------------------------------------------- helpers
@dataclass
class Outcome:
    status: int
    cached: int | None = None  # cached prompt tokens of a response that ran to its end
    completion_tokens: int | None = None


def most_cacheable(history: list[tuple[int, ...]], ids: tuple[int, ...]) -> int:
    """The most tokens of `ids` a cache filled by `history` can hold: the longest common prefix,
    or all of `ids` when an earlier prompt is a prefix of it (its output may continue it)."""
    best = 0
    for earlier in history:
        n = common_prefix(earlier, ids)
        best = max(best, len(ids) if n == len(earlier) else n)
    return best


def check_error_body(response: httpx.Response, what: str) -> None:
    """A refusal: a 4xx naming its reason, or a 429/503 telling when to retry; never a 5xx."""
    status = response.status_code
    assert 400 <= status < 500 or status == 503, f"{what}: {status} {response.text}"
    error = response.json().get("error")
    assert isinstance(error, dict) and error.get("message"), f"{what}: no reason: {response.text}"
    if status in (429, 503):
        assert response.headers.get("retry-after"), f"{what}: {status} without Retry-After"


def read_events(response: httpx.Response, what: str) -> list[Any]:
    """The SSE data of a whole stream: it ends with [DONE]; an error event names its reason."""
    data = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", f"{what}: the stream ended without [DONE]: {data[-2:]}"
    events = [json.loads(item) for item in data[:-1]]
    for item in events:
        if "error" in item:
            assert item["error"].get("message"), f"{what}: an error event without a reason"
    return events


def usage_outcome(status: int, usage: dict[str, Any] | None, what: str) -> Outcome:
    assert usage is not None, f"{what}: no usage"
    details = usage.get("prompt_tokens_details") or {}
    return Outcome(status, details.get("cached_tokens", 0), usage["completion_tokens"])


# -------------------------------------------------------------------------------- one run
class Run:
    """One server of `setup` and what its namespaces have sent."""

    def __init__(self, world: World, setup: Setup, live: LiveServer) -> None:
        self.world = world
        self.setup = setup
        self.live = live
        self.history = world.shared_history if setup.store == "shared" else {}
        self.pinned: tuple[int, ...] = ()  # the longest prefix a pin holds (in pin_namespace)
        self.pin_namespace: tuple = (
            ("tenant", "t0", None, MODEL) if setup.keys else ("open", None, MODEL)
        )
        self.num_pins = 0

    # ---------------------------------------------------------------------- who and what
    def namespace(self, send: Send) -> tuple:
        who = ("tenant", f"t{send.tenant}") if self.setup.keys else ("open",)
        return (*who, CLIENT_SALTS[send.salt], send.model)

    def ids(self, send: Send) -> tuple[int, ...]:
        if send.kind == "over_pool":
            return tuple(random_tokens((self.setup.num_kv_blocks + 1) * BLOCK, seed=27))
        if send.kind == "over_context":
            return self.world.prompt_ids[False, "over_context", 0]
        return self.world.prompt_ids[send.chat, send.kind, send.index]

    def key(self, send: Send) -> str | None:
        return TENANT_KEYS[f"t{send.tenant}"] if self.setup.keys else None

    def operator_http(self) -> httpx.Client:
        return self.live.http(OPERATOR_KEY if self.setup.keys else None)

    def expected(self, send: Send, together: bool) -> set[int]:
        if send.model != MODEL and not self.setup.lora:
            return {404}  # the model is checked before the prompt
        if send.kind in OVERSIZED:
            return {400}
        if send.model != MODEL and together:
            return {200, 429}  # the one adapter slot may be taken by the other adapter
        return {200}

    def request(self, send: Send) -> tuple[str, dict[str, Any]]:
        max_tokens = ABORT_MAX_TOKENS if send.mode in ("abort", "leave") else send.max_tokens
        body: dict[str, Any] = {
            "model": send.model,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if CLIENT_SALTS[send.salt] is not None:
            body["cache_salt"] = CLIENT_SALTS[send.salt]
        if send.in_memory:
            body["prompt_cache_retention"] = "in_memory"
        if send.mode in ("stream", "abort"):
            body.update(stream=True, stream_options={"include_usage": True})
        if send.kind in OVERSIZED:
            return "/v1/completions", {**body, "prompt": list(self.ids(send))}
        if send.chat:
            return "/v1/chat/completions", {**body, "messages": messages(send.kind, send.index)}
        text = SYSTEM + QUESTIONS[send.index] if send.kind == "system" else OWN[send.index]
        return "/v1/completions", {**body, "prompt": text}

    # ------------------------------------------------------------------------- sending
    def post(self, send: Send, while_open: Callable[[], Any] | None = None) -> Outcome:
        """Send `send`; an "abort" stream calls `while_open` after its first chunk, then leaves."""
        if send.mode == "leave" and 200 not in self.expected(send, together=False):
            # A refusal is read, not left: the client must see it, and on a loaded host it may
            # take longer than LEAVE_AFTER_S (leaving is for requests the server runs).
            send = replace(send, mode="plain")
        path, body = self.request(send)
        what = f"{send} on {self.setup}"
        with self.live.http(self.key(send)) as http:
            if send.mode == "leave":
                try:
                    response = http.post(path, json=body, timeout=LEAVE_AFTER_S)
                except httpx.ReadTimeout:
                    return Outcome(0)  # the client left; the server must abort the request
                if response.status_code != 200:
                    check_error_body(response, what)
                    return Outcome(response.status_code)
                return Outcome(200)  # answered before the client left
            if send.mode == "plain":
                response = http.post(path, json=body)
                if response.status_code != 200:
                    check_error_body(response, what)
                    return Outcome(response.status_code)
                return usage_outcome(200, response.json().get("usage"), what)
            with http.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    response.read()
                    check_error_body(response, what)
                    return Outcome(response.status_code)
                if send.mode == "abort":
                    lines = response.iter_lines()  # held: dropping it closes the response
                    for line in lines:
                        if line.startswith("data: "):
                            break
                    if while_open is not None:
                        while_open()
                    return Outcome(200)  # leaving the block closes the connection mid-stream
                events = read_events(response, what)
        errors = [e["error"] for e in events if "error" in e]
        assert not errors, f"{what}: a legal stream failed: {errors}"
        usage = next((e["usage"] for e in reversed(events) if e.get("usage")), None)
        return usage_outcome(200, usage, what)

    def reset(self, reset: Reset) -> bool | None:
        """POST /reset_prefix_cache; its `success`, or None when a tenant was (rightly) refused."""
        body = {"ram_only": reset.ram_only, "reset_running_requests": reset.running}
        if reset.by_tenant and self.setup.keys:
            with self.live.http(TENANT_KEYS["t1"]) as http:
                response = http.post("/reset_prefix_cache", json=body)
            assert response.status_code == 403, f"a tenant reset the cache: {response.text}"
            check_error_body(response, "a tenant's reset")
            return None
        with self.operator_http() as http:
            response = http.post("/reset_prefix_cache", json=body)
        assert response.status_code == 200, response.text
        success = response.json()["success"]
        # Preempting what runs first leaves nothing holding blocks: such a reset always succeeds.
        assert success or not reset.running, f"{reset} failed on {self.setup}"
        return success

    # ------------------------------------------------------------------------ checking
    def bound(self, send: Send, beside: list[Send]) -> int:
        """The most tokens `send` may find cached: what its namespace sent before or beside it."""
        ns = self.namespace(send)
        history = list(self.history.get(ns, []))
        history += [self.ids(other) for other in beside if self.namespace(other) == ns]
        return most_cacheable(history, self.ids(send))

    def record(self, send: Send) -> None:
        self.history.setdefault(self.namespace(send), []).append(self.ids(send))

    def check(self, send: Send, outcome: Outcome, bound: int, together: bool) -> None:
        what = f"{send} on {self.setup}: {outcome}"
        event(f"answered {outcome.status}")
        expected = self.expected(send, together)
        if send.mode == "leave" and 200 in expected:
            expected = expected | {0}  # the client may leave before the answer comes
        assert outcome.status in expected, what
        if outcome.cached is None:
            return
        assert outcome.cached <= bound, f"{what}: hit another namespace's blocks (bound {bound})"
        assert outcome.completion_tokens == send.max_tokens, what
        ns, ids = self.namespace(send), self.ids(send)
        elsewhere = max(
            (most_cacheable(h, ids) for other, h in self.history.items() if other != ns), default=0
        )
        if elsewhere >= bound + BLOCK:
            event("checked: a prefix only another namespace sent was not hit")
        if self.pinned and self.pin_namespace == ns:
            pinned = self.pinned
            if ids[: len(pinned)] == pinned and len(ids) > len(pinned):
                event("checked: a pinned prefix was hit by its tenant")
                assert outcome.cached >= len(pinned), f"{what}: missed its tenant's pin"

    # -------------------------------------------------------------------------- the ops
    def pin(self, together: bool) -> int:
        """POST /pins of the system prompt; the tokens pinned (0: refused, beside other work)."""
        self.num_pins += 1
        body: dict[str, Any] = {"prompt": SYSTEM, "id": f"system-{self.num_pins}"}
        if self.setup.keys:
            body["tenant"] = "t0"
        self.history.setdefault(self.pin_namespace, []).append(self.world.system_ids)
        with self.operator_http() as http:
            response = http.post("/pins", json=body)
        if response.status_code != 200 and together:
            # Requests beside it may evict the prompt's blocks before they are pinned.
            assert response.status_code == 400, response.text
            check_error_body(response, "a pin beside other requests")
            return 0
        assert response.status_code == 200, response.text
        num_tokens = response.json()["num_tokens"]
        full = len(self.world.system_ids) // BLOCK * BLOCK
        assert 0 < num_tokens <= full and num_tokens % BLOCK == 0, response.text
        if not together:
            assert num_tokens == full, f"a pin with nothing running held less: {response.text}"
        return num_tokens

    def held(self, num_tokens: int) -> None:
        """A pin holds `num_tokens` of the system prompt now."""
        if num_tokens > len(self.pinned):
            self.pinned = self.world.system_ids[:num_tokens]

    def send_one(self, send: Send) -> Outcome:
        bound = self.bound(send, [])
        self.record(send)
        outcome = self.post(send)
        self.check(send, outcome, bound, together=False)
        return outcome

    def apply(self, op: Send | Reset | Pin | BusySlot | Repeat | Mirror | Together) -> None:
        if isinstance(op, Send):
            self.send_one(op)
        elif isinstance(op, Reset):
            success = self.reset(op)
            # Nothing runs between two ops, so a reset by the operator always succeeds.
            assert success in (None, True), f"{op} with nothing running failed"
            if success:
                self.pinned = ()  # a reset drops every pin
        elif isinstance(op, Pin):
            self.held(self.pin(together=False))
        elif isinstance(op, BusySlot):
            self.busy_slot(op)
        elif isinstance(op, Repeat):
            mode = "plain" if op.send.mode in ("abort", "leave") else op.send.mode
            self.repeat(replace(op.send, mode=mode))
        elif isinstance(op, Mirror):
            self.send_one(op.send)
            if self.setup.keys:
                self.send_one(replace(op.send, tenant=1 - op.send.tenant))
            else:
                self.send_one(replace(op.send, salt=(op.send.salt + 1) % len(CLIENT_SALTS)))
        else:
            self.together(op.items)
        self.live.wait_idle()

    def busy_slot(self, op: BusySlot) -> None:
        first = Send(0, 0, op.first, "own", 0, False, "abort", 1)
        second = Send(1, 0, op.second, "own", 1, False, "plain", 2)
        bound = self.bound(second, [first])
        self.record(first)
        self.record(second)
        seen: list[tuple[bool, Outcome]] = []

        def in_use() -> bool:
            return bool(self.live.run_in_engine(lambda e: e.lora_in_use(op.first)))

        def send_second() -> None:
            before = in_use()
            outcome = self.post(second)
            seen.append((before and in_use(), outcome))

        self.check(first, self.post(first, while_open=send_second), 0, together=False)
        if seen:
            first_ran_throughout, outcome = seen[0]
            if first_ran_throughout and op.first != op.second:
                event("checked: an adapter was refused while the other held the one slot")
                assert outcome.status == 429, f"{op} on {self.setup}: two adapters in one slot"
            self.check(second, outcome, bound, together=op.first != op.second)

    def repeat(self, send: Send) -> None:
        first = self.send_one(send)
        second = self.send_one(send)
        if first.cached is not None and second.cached is not None:
            full_blocks = (len(self.ids(send)) - 1) // BLOCK * BLOCK
            event("checked: a repeat hit its original's blocks")
            assert second.cached >= full_blocks, f"{send} on {self.setup}: the repeat missed"

    def together(self, items: tuple[Send | Reset | Pin, ...]) -> None:
        requests = [item for item in items if isinstance(item, Send)]
        if any(isinstance(item, Pin) for item in items):  # its warm-up runs beside the requests
            self.history.setdefault(self.pin_namespace, []).append(self.world.system_ids)
        bounds = [self.bound(s, requests[:i] + requests[i + 1 :]) for i, s in enumerate(requests)]
        for send in requests:
            self.record(send)

        def run(item: Send | Reset | Pin) -> Outcome | bool | int | None:
            if isinstance(item, Send):
                return self.post(item)
            return self.reset(item) if isinstance(item, Reset) else self.pin(together=True)

        with ThreadPoolExecutor(max_workers=len(items)) as pool:
            results = list(pool.map(run, items))
        reset = any(isinstance(i, Reset) and r for i, r in zip(items, results, strict=True))
        # A request beside a reset may have run after it: only the pins held before the group
        # count, and only when no reset beside it succeeded.
        if reset:
            self.pinned = ()
        sent = [r for i, r in zip(items, results, strict=True) if isinstance(i, Send)]
        for send, outcome, bound in zip(requests, sent, bounds, strict=True):
            self.check(send, outcome, bound, together=True)
        # A pin beside a reset may have run before it: held after the group only without one.
        for item, result in zip(items, results, strict=True):
            if isinstance(item, Pin) and not reset:
                self.held(result)

    def finish(self) -> None:
        """The server is whole: /health, a plain request, and no leak once pins are gone."""
        self.live.wait_idle()
        with self.live.http() as http:
            assert http.get("/health").status_code == 200
        # In the pin's namespace, so a pin still held must be hit.
        final = Send(0, 0, MODEL, "system", 0, False, "plain", 3)
        self.send_one(final)
        with self.operator_http() as http:
            for pin_id in http.get("/pins").json()["pins"]:
                response = http.delete(f"/pins/{pin_id}")
                assert response.status_code == 200, response.text
            assert http.get("/pins").json()["pinned_blocks"] == 0
        self.live.check_no_leaks()
        metrics = self.live.metrics()
        if metrics.get("kv_store_hit_tokens"):
            event("the disk tier served hits")
        assert self.live.engine.is_running, self.live.engine.dead_error


# --------------------------------------------------------------------------- the server
def engine_config(world: World, setup: Setup) -> EngineConfig:
    store = None
    if setup.store != "off":
        directory = world.shared_dir
        if setup.store == "fresh":
            directory = world.tmp.mktemp("combo-fresh-kv") / "kv"
        store = KVStoreConfig(dir=directory, capacity_bytes=1 << 30)
    return EngineConfig(
        model=str(world.model.path),
        dtype="float32",
        max_model_len=MAX_MODEL_LEN,
        cache=CacheConfig(block_size=BLOCK, num_kv_blocks=setup.num_kv_blocks),
        scheduler=SchedulerConfig(max_num_seqs=setup.max_num_seqs, scheduling_policy=setup.policy),
        kv_store=store,
        lora=LoRAConfig(max_loras=1, max_lora_rank=8) if setup.lora else None,
    )


def start_server(
    world: World, setup: Setup
) -> tuple[LiveServer, uvicorn.Server, Any, AsyncLLMEngine]:
    engine = LLMEngine(engine_config(world, setup), loaded_model=world.model)
    modules = dict(world.adapters) if setup.lora else None
    for name, path in (modules or {}).items():
        engine.load_lora_adapter(name, path)  # one slot: "b" takes it from "a"
    async_engine = AsyncLLMEngine(engine, log_stats_interval_s=None)
    async_engine.start()
    keys = None
    if setup.keys:
        keys = ApiKeys()
        for tenant, key in TENANT_KEYS.items():
            keys.add(key, tenant)
        keys.add_admin(OPERATOR_KEY, "ops")
    app = build_app(async_engine, [MODEL], api_keys=keys, lora_modules=modules)
    server, thread, url = serve_in_thread(app)
    return LiveServer(url=url, api_key=None, engine=async_engine), server, thread, async_engine


@pytest.mark.parametrize("store", ["off", "fresh", "shared"])
@pytest.mark.parametrize("keys", [False, True], ids=["keyless", "tenants"])
@settings(
    max_examples=int(SOAK_EXAMPLES or 6),
    deadline=None,
    derandomize=SOAK_EXAMPLES is None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_every_server_configuration_keeps_tenants_apart_answers_each_request_and_leaks_nothing(
    world, keys, store, data
):
    setup = data.draw(setups(keys, store), label="setup")
    workload = data.draw(workloads, label="workload")
    live, server, thread, async_engine = start_server(world, setup)
    try:
        run = Run(world, setup, live)
        if setup.pins:
            run.apply(Pin())
        for op in workload:
            run.apply(op)
        run.finish()
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        async_engine.shutdown()
