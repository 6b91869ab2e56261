"""LoRA serving options and the per-request adapter choice (vLLM's names and shapes).

`LoRAConfig` (a record of `prefixserve/config.py`) is the engine's: how many adapters may be
loaded at once (`max_loras`) and the largest rank it accepts (`max_lora_rank`). `LoRARequest`
is a request's: the adapter's name (what the server's `model` field selects, and the first extra
key of every block hash), an integer id (vLLM's `lora_int_id`, kept for API compatibility: the
name identifies the adapter) and the PEFT directory it is loaded from on first use.
"""

from __future__ import annotations

from dataclasses import dataclass

# Names of the adapters a server lists and selects by `model`: no path separators or spaces, so
# a name can never be mistaken for a path and survives URLs and logs unchanged.
MAX_LORA_NAME_CHARS = 128
_NAME_EXTRA = set("-_.:@+")


def check_lora_name(name: object) -> str:
    """Return `name` if it is a usable adapter name; ValueError saying why not otherwise."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a LoRA adapter name must be a non-empty string, got {name!r}")
    if len(name) > MAX_LORA_NAME_CHARS:
        raise ValueError(f"a LoRA adapter name has at most {MAX_LORA_NAME_CHARS} characters")
    if not all(c.isascii() and (c.isalnum() or c in _NAME_EXTRA) for c in name):
        raise ValueError(
            f"LoRA adapter name {name!r} may only hold ASCII letters, digits and -_.:@+"
        )
    return name


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """Which adapter a request runs with (vLLM's `LoRARequest(lora_name, lora_int_id,
    lora_path)`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        check_lora_name(self.lora_name)
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"lora_int_id must be an integer, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1 (vLLM's rule), got {self.lora_int_id}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path must be a non-empty string, got {self.lora_path!r}")


class LoRAInUseError(ValueError):
    """An adapter that unfinished requests use cannot be unloaded (or made room for)."""


class LoRASlotsBusyError(LoRAInUseError):
    """Every adapter slot is held by unfinished requests, so another adapter cannot be loaded
    now: a capacity refusal that passes when one of them finishes (the server's 429 with
    Retry-After), not a bad request."""
