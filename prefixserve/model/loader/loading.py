"""Loading a model: None (the packaged default), a Hugging Face directory or a GGUF file ->
our model, tokenizer and config.

The order: resolve the dtype, find the directory (a GGUF file is converted into the cache once,
`gguf_convert.py`), read its config (`hf_config.py`), build the model (`registry.py`) and stream
the safetensors into it (`hf_dir.py` -> `weights.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from prefixserve.dtypes import canonical_dtype
from prefixserve.model.config import ModelConfig
from prefixserve.model.errors import ModelLoadError, load_error
from prefixserve.model.loader.default_model import ensure_default_model
from prefixserve.model.loader.gguf_convert import (
    check_gguf_architecture,
    ensure_converted,
    fallback_chat_template,
    gguf_cache_dir,
    is_converted,
)
from prefixserve.model.loader.hf_config import model_config_from_hf
from prefixserve.model.loader.hf_dir import (
    iter_safetensors_weights,
    read_hf_config,
    safetensors_files,
)
from prefixserve.model.loader.quantize import (
    check_quantization,
    give_block_weights,
    quantize_model,
)
from prefixserve.model.loader.weights import hf_target
from prefixserve.model.models.registry import create_model
from prefixserve.model.tokenizer import Tokenizer

__all__ = [
    "LoadedModel",
    "ModelInfo",
    "ModelLoadError",
    "load_hf_dir",
    "load_model",
    "read_model_info",
    "resolve_dtype",
    "resolve_model_dir",
]


@dataclass(slots=True)
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path  # the HF directory the weights came from (the converted one for GGUF)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name (or torch dtype) to torch; fp16 is refused (see prefixserve.dtypes)."""
    return getattr(torch, canonical_dtype(dtype))


@dataclass(slots=True)
class ModelInfo:
    """What serving a model needs besides its weights (a router in front of replicas)."""

    tokenizer: Tokenizer
    config: ModelConfig
    path: Path


def read_model_info(
    model_dir: Path, dtype: torch.dtype, max_model_len: int | None = None
) -> ModelInfo:
    """A HF directory's config and tokenizer, checked as `load_hf_dir` does; no weights read."""
    hf_config = read_hf_config(model_dir)
    try:
        config = model_config_from_hf(hf_config, canonical_dtype(dtype))
    except (ValueError, KeyError, TypeError) as exc:
        names = hf_config.get("architectures") or hf_config.get("model_type")
        raise load_error(model_dir, f"unsupported architecture {names!r} ({exc})") from exc
    safetensors_files(model_dir)  # fail on missing weights before building anything
    if max_model_len is not None:
        limit = config.max_model_len
        if not isinstance(max_model_len, int) or not 0 < max_model_len <= limit:
            raise ValueError(
                f"max_model_len must be an integer in [1, {limit}] for {model_dir}, "
                f"got {max_model_len!r}"
            )
        config.max_model_len = max_model_len
    try:
        tokenizer = Tokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise load_error(model_dir, f"tokenizer files are missing or unreadable ({exc})") from exc
    return ModelInfo(tokenizer, config, model_dir)


def load_hf_dir(
    model_dir: Path,
    dtype: torch.dtype,
    max_model_len: int | None = None,
    quantization: str = "auto",
) -> LoadedModel:
    """Build our model from a HF directory, give the linears a converted GGUF file keeps in
    blocks their codes, stream the rest of its safetensors into it, then quantize what
    `quantization` says (`quantize.py`)."""
    check_quantization(quantization)
    info = read_model_info(model_dir, dtype, max_model_len)
    model = create_model(info.config)
    # A converted GGUF file's block weights first: their linears' bf16 tensors are not read.
    given = give_block_weights(model, model_dir, quantization) if dtype == torch.bfloat16 else set()
    rename = getattr(model, "hf_rename", {})
    tensors = iter_safetensors_weights(
        model_dir, dtype, skip=lambda hf_name: hf_target(hf_name, rename)[0] in given
    )
    # The tensors are fresh memory maps of the files (copy-on-write), so parameters may take
    # them as they are: no copy of the unfused weights (the cache dir is replaced atomically).
    model.load_weights(tensors, assign=True, given=given)
    if dtype == torch.bfloat16:
        info.config.quantization = quantize_model(model, model_dir, quantization)
    elif quantization == "int8":
        raise ValueError(f"quantization='int8' computes in bfloat16, not {dtype}")
    model.eval()
    return LoadedModel(model=model, tokenizer=info.tokenizer, config=info.config, path=model_dir)


def resolve_model_dir(model: str | Path | None = None) -> Path:
    """The HF directory of a model argument: None = the default model, a HF directory, or a
    .gguf file (converted once, cached). Raises ModelLoadError as `load_model` does."""
    if model is None:
        return ensure_default_model()
    path = Path(model).expanduser()
    if not path.exists():
        raise load_error(path, "no such file or directory")
    if path.is_dir():
        return path
    if path.suffix.lower() == ".gguf":
        try:
            target = gguf_cache_dir(path)
            if is_converted(target):  # its architecture was checked before it was converted
                return target
            arch = check_gguf_architecture(path)
            return ensure_converted(path, target, fallback_chat_template(arch))
        except ModelLoadError:
            raise
        # NotImplementedError: what transformers and `gguf` raise for what they cannot read.
        except (OSError, ValueError, KeyError, NotImplementedError) as exc:
            raise load_error(path, f"GGUF conversion failed ({exc})") from exc
    raise load_error(path, "a file that is not .gguf")


def load_model(
    model: str | Path | None = None,
    dtype: str = "bfloat16",
    max_model_len: int | None = None,
    quantization: str = "auto",
) -> LoadedModel:
    """Load a model: None = the default model, a HF directory, or a .gguf file; `quantization`
    as `EngineConfig.quantization`.

    Raises ModelLoadError (a ValueError) naming the path and the supported architectures when
    the path is missing, unreadable or of an unsupported architecture; ValueError for a bad
    dtype or max_model_len.
    """
    torch_dtype = resolve_dtype(dtype)
    return load_hf_dir(resolve_model_dir(model), torch_dtype, max_model_len, quantization)
