"""Prompt embeddings as input (vLLM's `prompt_embeds`): the checks, the form a Request keeps, and
the rows a step feeds to the model.

A request that brings embeddings instead of token ids has placeholder prompt token ids (0) and
its embeddings, rounded to the model's dtype, kept as raw bits: a numpy array (int16 for bf16,
int32 for fp32) of shape [num_prompt_tokens, hidden]. The bits are what each full block's hash
digests (`kv_cache/hashing.py`, which imports no torch: a numpy slice has `.tobytes()`), so equal
embeddings share blocks and any other embeddings never do, whatever the placeholder ids. The
embeddings are the model's input embeddings, i.e. what its embedding layer returns for token ids
(for Gemma 3 after its sqrt(hidden) scaling), as transformers' `inputs_embeds`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from prefixserve.model.config import ModelConfig
    from prefixserve.sampling_params import SamplingParams

PLACEHOLDER_TOKEN_ID = 0
_ACCEPTED = (torch.float32, torch.bfloat16, torch.float16)
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
# nn.Parameter is what a model's weights are; other subclasses may redefine any operation.
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def layout_problem(value: torch.Tensor) -> str | None:
    """What keeps `value` from being a plain dense tensor (a subclass, a nested tensor, a sparse
    or other layout), or None. Looks only at its type and layout: shape, storage and even dtype
    raise for some of these, so this comes before anything else is read."""
    kind = type(value)
    if kind not in _PLAIN_TENSORS:
        return f"must be a plain torch.Tensor, got its subclass {kind.__module__}.{kind.__name__}"
    if value.is_nested:
        return "must be a dense tensor (layout torch.strided), got a nested tensor"
    if value.layout != torch.strided:
        return f"must be a dense tensor (layout torch.strided), got layout {value.layout}"
    return None


def check_prompt_embeds(
    value: object, hidden_size: int, dtype: torch.dtype, max_model_len: int
) -> torch.Tensor:
    """A private copy of `value` in the model's dtype, or ValueError naming what is wrong: not a
    plain dense CPU tensor (`layout_problem`), not 2-D [num_tokens, hidden_size], empty or longer
    than max_model_len, not a float tensor (float32, bfloat16 or float16), NaN or infinite
    values."""
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"prompt_embeds must be a torch.Tensor, got {type(value).__name__}")
    if (problem := layout_problem(value)) is not None:
        raise ValueError(f"prompt_embeds {problem}")
    if value.device.type != "cpu" or value.is_quantized:
        raise ValueError("prompt_embeds must be a dense CPU tensor")
    if value.dim() != 2 or value.shape[1] != hidden_size:
        raise ValueError(
            f"prompt_embeds must have shape [num_tokens, {hidden_size}] (the model's hidden "
            f"size), got {list(value.shape)}"
        )
    if not 1 <= value.shape[0] <= max_model_len:
        raise ValueError(
            f"prompt_embeds must have between 1 and max_model_len={max_model_len} rows, got "
            f"{value.shape[0]}"
        )
    if value.dtype not in _ACCEPTED:
        raise ValueError(
            f"prompt_embeds must be float32, bfloat16 or float16, got {str(value.dtype)[6:]}"
        )
    embeds = value.detach().to(dtype=dtype, copy=True).contiguous()
    if not bool(torch.isfinite(embeds).all()):
        raise ValueError(f"prompt_embeds holds NaN or infinite values (in {str(dtype)[6:]})")
    return embeds


def embeds_bits(embeds: torch.Tensor) -> np.ndarray:
    """The raw bits of checked embeddings, as a Request keeps them (shares their memory)."""
    return embeds.view(_BITS[embeds.dtype]).numpy()


def embeds_rows(bits: np.ndarray, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows [start, stop) of a Request's embeddings as a tensor of `dtype` (no copy)."""
    return torch.from_numpy(bits[start:stop]).view(dtype)


def prompt_from_embeds(
    prompt_token_ids: Sequence[int],
    prompt_embeds: object,
    params: SamplingParams,
    model: ModelConfig,
    max_model_len: int,
) -> tuple[list[int], np.ndarray]:
    """Placeholder token ids and the raw bits of checked prompt embeddings, for a request that
    brings embeddings: ValueError as `check_prompt_embeds`, or for token ids given as well, or
    prompt logprobs asked for (there are no prompt tokens to score)."""
    if prompt_token_ids:
        raise ValueError("give prompt token ids or prompt_embeds, not both")
    if params.prompt_logprobs is not None:
        raise ValueError(
            "prompt_logprobs are not available with prompt_embeds (the prompt has no token ids)"
        )
    embeds = check_prompt_embeds(prompt_embeds, model.hidden_size, model.torch_dtype, max_model_len)
    return [PLACEHOLDER_TOKEN_ID] * embeds.shape[0], embeds_bits(embeds)
