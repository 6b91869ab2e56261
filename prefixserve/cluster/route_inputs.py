"""What the router hashes of a request: its tokens (or its embeddings' bits) and extra keys.

The router keys a prompt as the replicas' engines hash it (index.py), so it needs the same
inputs: the tenant's cache salt, the LoRA adapter's name and the digest of its files, and for a
prompt given as embeddings the bits of those embeddings in the model's dtype.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

from prefixserve.engine.client import EngineRequest
from prefixserve.inputs.prompt_embeds import embeds_bits
from prefixserve.lora.adapter import adapter_digest

MAX_LORA_DIGESTS = 256
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


# The keywords of `route_args` that `Router.probe_tiers` takes too (what identifies the blocks).
PROBE_ARGS = frozenset({"token_ids", "cache_salt", "lora_name", "lora_digest", "prompt_embeds"})


def route_args(request: EngineRequest, lora_digest: bytes | None, dtype: Any) -> dict[str, Any]:
    """Router.route's keyword arguments for a request."""
    lora = request.lora_request
    embeds = request.prompt_embeds
    token_ids = request.prompt_token_ids
    bits = None
    if embeds is not None:
        token_ids = [0] * int(embeds.shape[0])
        bits = embeds_bits(embeds.to(dtype))
    return {
        "token_ids": token_ids,
        "cache_salt": request.cache_salt,
        "lora_name": None if lora is None else lora.lora_name,
        "lora_digest": lora_digest,
        "prompt_embeds": bits,
        "cache_key": request.prompt_cache_key,
    }


class LoraDigests:
    """Adapters' digests (as the replicas' cache keys carry them), read once per version of
    their files; the most recent MAX_LORA_DIGESTS are kept. Blocking: call off the event loop."""

    def __init__(self) -> None:
        self._digests: collections.OrderedDict[tuple[Any, ...], bytes] = collections.OrderedDict()

    def get(self, path: str) -> bytes | None:
        root = Path(path).expanduser()
        try:
            stamp = tuple(
                (name, (root / name).stat().st_mtime_ns, (root / name).stat().st_size)
                for name in ADAPTER_FILES
            )
            key = (str(root), stamp)
            if key not in self._digests:
                self._digests[key] = adapter_digest(root)
                while len(self._digests) > MAX_LORA_DIGESTS:
                    self._digests.popitem(last=False)
            return self._digests[key]
        except OSError:
            return None  # the replica reports the unreadable adapter
