"""What `LLMEngine.add_request` checks before a prompt becomes Requests: each rule raises
ValueError naming the field, so the offline API and the server refuse bad input the same way."""

from __future__ import annotations

from collections.abc import Iterable

from prefixserve.config import RETENTION_SECONDS
from prefixserve.sampling_params import SamplingParams


def check_request_fields(
    request_id: object, params: object, cache_salt: object, cache_retention: object
) -> None:
    """The request id, the params' type, the cache salt and the retention."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError(f"cache_salt must be a non-empty string or None, got {cache_salt!r}")
    if cache_salt is not None and not is_unicode_text(cache_salt):
        raise ValueError("cache_salt must be Unicode text (it holds a lone surrogate)")
    if cache_retention is not None and cache_retention not in RETENTION_SECONDS:
        valid = ", ".join(map(repr, RETENTION_SECONDS))
        raise ValueError(f"prompt_cache_retention must be one of {valid}, got {cache_retention!r}")


def check_prompt(
    prompt_token_ids: Iterable[object], vocab_size: int, max_model_len: int
) -> list[int]:
    """The prompt as a list: not empty, ids in the vocabulary, shorter than max_model_len."""
    prompt = list(prompt_token_ids)
    if not prompt:
        raise ValueError("prompt_token_ids must hold at least one token, got an empty prompt")
    for token_id in prompt:
        if (
            isinstance(token_id, bool)
            or not isinstance(token_id, int)
            or not 0 <= token_id < vocab_size
        ):
            raise ValueError(
                f"prompt_token_ids must be integers in [0, {vocab_size}), got {token_id!r}"
            )
    if len(prompt) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens but max_model_len is {max_model_len}; "
            f"a prompt may have at most {max_model_len - 1} tokens"
        )
    return prompt  # type: ignore[return-value]


def effective_max_tokens(params: SamplingParams, num_prompt: int, max_model_len: int) -> int:
    """`params.max_tokens`, or what the context leaves when it is None; refused past the context."""
    max_tokens = params.max_tokens
    if max_tokens is None:
        return max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens={max_tokens} plus the prompt's {num_prompt} tokens exceeds "
            f"max_model_len={max_model_len}; max_tokens may be at most "
            f"{max_model_len - num_prompt}"
        )
    return max_tokens


def is_unicode_text(text: str) -> bool:
    """False for a str that UTF-8 cannot encode (a lone surrogate, which JSON can carry)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_fits_pool(
    needed: int, num_prompt: int, max_tokens: int, available: int, num_pinned: int = 0
) -> None:
    """Refuse a request that needs more KV blocks than it can ever hold at once: `available`
    blocks (the pool less `num_pinned` pinned blocks, plus the pinned blocks of its own prefix).
    It could never run, so it is the request's error, not a wait."""
    if needed <= available:
        return
    pinned = f" ({num_pinned} of the pool's blocks are pinned)" if num_pinned else ""
    raise ValueError(
        f"the request needs up to {needed} KV blocks ({num_prompt} prompt tokens + "
        f"max_tokens={max_tokens}) but can hold at most {available}{pinned}; "
        "lower max_tokens or shorten the prompt (operators: raise num_kv_blocks / "
        "kv_cache_memory_gb, or unpin)"
    )
