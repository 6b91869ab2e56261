"""The engine's adapters: which are loaded, loading on first use, unloading, and the step's rows.

At most `LoRAConfig.max_loras` adapters are loaded at once. A request names its adapter with a
`LoRARequest`; the first request of an adapter loads it, and when every slot is taken the least
recently used adapter that no unfinished request uses is unloaded to make room (an adapter in use
is never unloaded: the request that needs a slot is refused instead). `unload` refuses an
adapter that unfinished requests use. The K/V of an unloaded adapter's blocks stays in the pool
under hashes that carry the adapter's name and the digest of its files: only the same files
loaded again under the same name hit them (they are that adapter's K/V); otherwise they are
evicted like any other free block.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

from prefixserve.config import LoRAConfig
from prefixserve.lora.adapter import LoRAAdapter, load_adapter
from prefixserve.lora.config import (
    LoRAInUseError,
    LoRARequest,
    LoRASlotsBusyError,
    check_lora_name,
)
from prefixserve.lora.layers import batch_of
from prefixserve.model.config import ModelConfig

# Unfinished requests that use the adapter of this name.
InUse = Callable[[str], int]


class LoRAManager:
    def __init__(self, model: nn.Module, model_config: ModelConfig, config: LoRAConfig) -> None:
        self.config = config
        self.model_config = model_config
        self.batch = batch_of(model)
        self.adapters: dict[str, LoRAAdapter] = {}
        self._used: dict[str, int] = {}  # name -> tick of its last request (LRU)
        self._tick = itertools.count()

    def read(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read and check an adapter without installing it: pure, so any thread may run it (the
        async engine does, off the step thread; `load` and `resolve` take its result)."""
        check_lora_name(name)
        return load_adapter(name, path, self.model_config, self.config.max_lora_rank)

    def needs_read(self, request: LoRARequest) -> bool:
        """Whether `resolve` would read this request's adapter from disk."""
        loaded = self.adapters.get(request.lora_name)
        return loaded is None or loaded.path != Path(request.lora_path).expanduser()

    def load(
        self, name: str, path: str | Path, in_use: InUse, read: LoRAAdapter | None = None
    ) -> LoRAAdapter:
        """Load the adapter at `path` as `name` (no-op when that very adapter is loaded under
        that name); `read`: the adapter `read` already made of that path. ValueError for a name
        loaded from another path or with other weights, an adapter that does not fit the model,
        or no free slot (LoRAInUseError)."""
        check_lora_name(name)
        loaded = self.adapters.get(name)
        if read is None or read.name != name or read.path != Path(path).expanduser():
            read = self.read(name, path)
        adapter = read
        if loaded is not None:
            if loaded.digest != adapter.digest:
                raise ValueError(
                    f"a different LoRA adapter is already loaded as {name!r} (from "
                    f"{str(loaded.path)!r}); unload it first"
                )
            self._used[name] = next(self._tick)
            return loaded
        self._make_room(in_use)
        self.adapters[name] = adapter
        self._used[name] = next(self._tick)
        return adapter

    def resolve(
        self, request: LoRARequest, in_use: InUse, read: LoRAAdapter | None = None
    ) -> LoRAAdapter:
        """The adapter a request runs with, loaded from `request.lora_path` if it is not yet
        (from `read` when the caller read it already)."""
        if not self.needs_read(request):
            self._used[request.lora_name] = next(self._tick)
            return self.adapters[request.lora_name]
        return self.load(request.lora_name, request.lora_path, in_use, read)

    def unload(self, name: str, in_use: InUse) -> None:
        """Unload `name`: KeyError if it is not loaded, LoRAInUseError while requests use it."""
        if name not in self.adapters:
            raise KeyError(name)
        count = in_use(name)
        if count:
            raise LoRAInUseError(
                f"LoRA adapter {name!r} is used by {count} unfinished request(s); unload it "
                "when they have finished"
            )
        del self.adapters[name]
        self._used.pop(name, None)

    def _make_room(self, in_use: InUse) -> None:
        if len(self.adapters) < self.config.max_loras:
            return
        for name in sorted(self.adapters, key=self._used.__getitem__):
            if not in_use(name):
                self.unload(name, in_use)
                return
        raise LoRASlotsBusyError(
            f"all max_loras={self.config.max_loras} LoRA adapter slots are used by unfinished "
            "requests; retry when one has finished (or raise max_loras)"
        )

    def begin_step(self, segments: Sequence[tuple[str | None, int, int]]) -> None:
        """This step's rows: `(adapter name or None, first row, end row)` per request."""
        adapters = self.adapters
        self.batch.set(
            [(adapters[name] if name is not None else None, s, e) for name, s, e in segments]
        )

    def end_step(self) -> None:
        self.batch.clear()


async def read_off_thread(
    manager: LoRAManager | None, request: LoRARequest | None
) -> LoRAAdapter | None:
    """The request's adapter read and checked on a worker thread of the running loop, or None
    when there is nothing to read (no LoRA, no request, or the adapter is loaded). For the async
    engine: reading and fusing on the step thread would stall every request's step. ValueError
    when the adapter does not fit."""
    if manager is None or request is None or not manager.needs_read(request):
        return None
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, manager.read, request.lora_name, request.lora_path)
