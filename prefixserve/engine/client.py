"""The engine-client interface: what the server, the CLI and the offline API over replicas may ask
of an engine, and nothing else.

Two implementations: `AsyncLLMEngine` (one engine on a step thread, engine/async_llm.py) and
`ClusterEngine` (replicas on Ray, cluster/client.py). A caller holds an `EngineClient` and never
reaches past it (no `engine.engine.*`, no `getattr` probes): what an implementation cannot do, it
refuses with `NotSupportedByEngine`, which the server answers with 501 `not_supported`.

A request travels as one `EngineRequest`: its id, prompt, sampling parameters and every option
the engine understands, typed. `prompt_cache_key` is a routing hint (replicas route on it; one
engine ignores it); `final_only` says the caller passes on only the final output, so replicas may
start the request over elsewhere, unseen, if the one serving it dies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from prefixserve.core.kv_cache.breakpoint_spec import CacheBreakpoint
from prefixserve.lora.config import LoRARequest
from prefixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from prefixserve.engine.request_stream import RequestStream
    from prefixserve.outputs import RequestOutput


# The most KV events an engine client keeps for `take_kv_events` (the oldest go first past it).
MAX_BUFFERED_KV_EVENTS = 100_000


@dataclasses.dataclass(frozen=True, slots=True)
class EngineRequest:
    """One request as every engine client takes it (`LLMEngine.add_request`'s fields, typed).

    `cache_salt` is the salt the engine hashes with, already derived for the tenant
    (`core/kv_cache/salts.py`); `tenant` is who the request is for (fair scheduling, not a cache
    key); `cache_retention` is OpenAI's `prompt_cache_retention`; `prompt_embeds` replaces the
    token ids, which must then be empty; `prompt` is the prompt's text, echoed in the outputs;
    `cache_breakpoints` are prompt prefixes the tenant asks to keep (Anthropic's
    `cache_control`, `core/kv_cache/breakpoints.py`).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None
    prompt: str | None = None
    tenant: str | None = None
    cache_retention: str | None = None
    lora_request: LoRARequest | None = None
    prompt_embeds: Any = None
    prompt_cache_key: str | None = None
    final_only: bool = False
    cache_breakpoints: tuple[CacheBreakpoint, ...] = ()


@runtime_checkable
class EngineClient(Protocol):
    """What the server and the CLI use of an engine. Coroutines may be awaited from any event
    loop; `abort` is a plain, thread-safe, non-blocking call."""

    # ------------------------------------------------------------- what it serves (fixed)
    @property
    def tokenizer(self) -> Any: ...
    @property
    def model_config(self) -> Any: ...
    @property
    def model_path(self) -> Path: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def enable_prompt_embeds(self) -> bool: ...

    # ------------------------------------------------------------------------ lifecycle
    # Called once, with what killed it, when the engine dies of a failure (never after
    # `shutdown()`); the CLI's death watch sets it before `start()` (supervision.py). Replicas
    # fail one at a time and are replaced, so a cluster keeps it and never calls it.
    on_dead: Callable[[BaseException], None] | None

    def start(self) -> None: ...
    def shutdown(self, timeout: float = 30.0) -> None: ...
    @property
    def is_running(self) -> bool: ...
    @property
    def shutdown_requested(self) -> bool: ...
    async def wait_dead(self) -> BaseException: ...

    # ------------------------------------------------------------------------- requests
    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Validate and queue; the engine's ValueError (a bad request) is raised here."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Add the request and yield its cumulative outputs until it finishes."""
        ...

    def abort(self, request_id: str) -> None: ...

    # ------------------------------------------------------------------------- operator
    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, ram_only: bool = False
    ) -> bool: ...
    async def load_lora_adapter(self, name: str, path: str) -> None: ...
    def load_lora_adapter_now(self, name: str, path: str) -> None:
        """Load an adapter before serving starts (blocking; ValueError if it does not fit)."""
        ...

    async def unload_lora_adapter(self, name: str) -> None: ...
    async def pin_prefix(self, pin_id: str, prompt_token_ids: list[int], salt: str | None) -> int:
        """Pin the cached full blocks of a prompt; their token count (ValueError past capacity
        or for a prefix not cached; NotSupportedByEngine where pins cannot be kept)."""
        ...

    async def unpin_prefix(self, pin_id: str) -> bool: ...
    async def describe_pins(self) -> dict[str, Any]:
        """{"pins": {id: {...}}, "pinned_blocks", "capacity_blocks"}."""
        ...

    async def get_metrics(self) -> dict[str, Any]: ...
    async def cache_summary(self, include_text: bool = False) -> dict[str, Any]:
        """The cache-wide summary for operators (docs/cache_reports.md); prefix text only with
        `include_text`."""
        ...

    async def take_kv_events(self) -> list[Any]: ...
    async def check_no_leaks(self) -> None:
        """Raise AssertionError naming what leaked when no request is in flight (for tests)."""
        ...


async def generate_outputs(
    client: EngineClient, request: EngineRequest
) -> AsyncIterator[RequestOutput]:
    """`EngineClient.generate` for both implementations: add, then stream until the end."""
    stream = await client.add_request(request)
    async for output in stream:
        yield output
