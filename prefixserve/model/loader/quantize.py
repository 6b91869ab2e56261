"""8-bit weights at load (`--quantization`, model/quant/weights.py): a converted GGUF file's Q8_0,
Q5_0 and Q4_0 linears as the file has them (as int8 codes), and with "int8" every other linear
per channel, the codes cached
on disk keyed by the checkpoint's files (a second load reads them instead of quantizing again).

The LM head counts as a linear: decode reads it every step, and for a model whose head is tied
to its embedding it takes the embedding's codes (the embedding itself stays bf16 for lookups).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from torch import nn

from prefixserve.config import QUANTIZATIONS
from prefixserve.model.kernels.hugepages import move_to_huge_pages
from prefixserve.model.layers.linear import Linear, link_next_weights
from prefixserve.model.loader.weights import hf_target
from prefixserve.model.quant.weights import (
    BLOCK_FORMATS_KEY,
    GGUF_BLOCKS_FILE,
    Int8Weight,
    fusable,
    fuse,
    quantizable,
    quantize_per_channel,
)
from prefixserve.settings import cache_root, file_lock

# Bump when quantize_per_channel's output changes: older cached codes are then not read.
INT8_CACHE_VERSION = 1


def check_quantization(quantization: str) -> None:
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")


def quantize_model(model: nn.Module, model_dir: Path, quantization: str) -> str | None:
    """Give `model`'s linears their 8-bit weights as `quantization` says; return the weights'
    formats for the disk tier's namespace ("q8_0", "int8", "int8+q8_0", "q5_0+q8_0", ...) or
    None (none 8-bit)."""
    check_quantization(quantization)
    if quantization == "none":
        return None
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    blocks_file = model_dir / GGUF_BLOCKS_FILE
    if blocks_file.is_file():
        blocks = _block_weights(model, blocks_file)
        if quantization == "int8" or _mostly_blocks(blocks, linears):
            for name, weight in blocks.items():
                linears[name].set_int8(weight)
    if quantization == "int8":
        rest = {
            name: m
            for name, m in linears.items()
            if m._int8 is None and m.weight.dtype == torch.bfloat16 and quantizable(m.weight)
        }
        for name, weight in _cached_per_channel(model_dir, rest).items():
            linears[name].set_int8(weight)
    # Decode streams the codes: huge pages, as the bf16 GEMM's packed weights (fewer TLB misses).
    move_to_huge_pages(m._int8[0] for m in linears.values() if m._int8 is not None)
    link_next_weights(model)
    if hasattr(model, "_native"):
        model._native = False  # the linears changed: bind the native layers again
    applied = sorted(
        {fmt for m in linears.values() if m.int8_format for fmt in m.int8_format.split("+")}
    )
    return "+".join(applied) if applied else None


def _mostly_blocks(blocks: dict[str, Int8Weight], linears: dict[str, Linear]) -> bool:
    """Whether a GGUF file's block weights are at least half of the model's linear weights (a
    Q8_0 file: all of them; the default model's Q4_1 file: only its embedding, which is not):
    then "auto" keeps them 8-bit, else only "int8" does."""
    kept = sum(weight.codes.numel() for weight in blocks.values())
    return 2 * kept >= sum(m.in_features * m.out_features for m in linears.values())


def _block_weights(model: nn.Module, path: Path) -> dict[str, Int8Weight]:
    """The block weights of a converted GGUF file (GGUF_BLOCKS_FILE) by our Linear names: shards
    of a fused projection joined when the file has all of them in one type, a tied head given
    the embedding's."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as handle:
        formats = json.loads((handle.metadata() or {}).get(BLOCK_FORMATS_KEY, "{}"))
    tensors = load_file(str(path))
    rename = getattr(model, "hf_rename", {})
    shards: dict[str, dict[int | None, Int8Weight]] = {}
    for hf_name, fmt in formats.items():
        codes, scales = tensors[f"{hf_name}.codes"], tensors[f"{hf_name}.scales"]
        weight = Int8Weight(
            codes,
            scales,
            fmt,
            tensors.get(f"{hf_name}.mins"),
            tensors.get(f"{hf_name}.super_scales"),
        )
        name, shard = hf_target(hf_name, rename)
        shards.setdefault(name.removesuffix(".weight"), {})[shard] = weight
    modules = dict(model.named_modules())
    config = getattr(model, "config", None)
    embed = next((n for n in shards if n.endswith("embed_tokens")), None)
    if embed is not None and getattr(config, "tie_word_embeddings", False):
        shards.setdefault("lm_head", shards[embed])
    found: dict[str, Int8Weight] = {}
    for name, parts in shards.items():
        module = modules.get(name)
        if not isinstance(module, Linear):
            continue
        fused = _fused_shards(name)
        if fused is None:
            found[name] = parts[None]
        elif set(parts) == set(range(fused)) and fusable(list(parts.values())):
            found[name] = fuse([parts[i] for i in range(fused)])
    return {name: w for name, w in found.items() if quantizable(w.codes)}


def _fused_shards(name: str) -> int | None:
    """How many checkpoint tensors make this linear (3 for qkv, 2 for gate_up), None for one."""
    return {"qkv_proj": 3, "gate_up_proj": 2}.get(name.rsplit(".", 1)[-1])


def _cached_per_channel(model_dir: Path, linears: dict[str, Linear]) -> dict[str, Int8Weight]:
    """Per-channel int8 weights of these linears, from the disk cache when an earlier load of the
    same checkpoint wrote them, else quantized now and written there."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file, save_file

    if not linears:
        return {}
    path = _int8_cache_path(model_dir, linears)
    if path.is_file():
        try:
            return _unpack(load_file(str(path)), linears)
        except (OSError, ValueError, KeyError, RuntimeError, SafetensorError):
            pass  # damaged or foreign: quantize again and replace it
    weights = {name: quantize_per_channel(m.weight) for name, m in linears.items()}
    with file_lock(path.parent / ".lock"):
        fd, tmp = tempfile.mkstemp(prefix=".int8-", dir=path.parent)
        os.close(fd)
        try:
            packed = {}
            for name, w in weights.items():
                packed[f"{name}.codes"], packed[f"{name}.scales"] = w.codes, w.scales
            save_file(packed, tmp, metadata={"format": "pt"})
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return weights


def _unpack(tensors: dict[str, torch.Tensor], linears: dict[str, Linear]) -> dict[str, Int8Weight]:
    weights = {}
    for name, module in linears.items():
        weight = Int8Weight(tensors[f"{name}.codes"], tensors[f"{name}.scales"], "int8")
        if tuple(weight.codes.shape) != (module.out_features, module.in_features):
            raise ValueError(f"cached int8 weight of {name} has another shape")
        weights[name] = weight
    return weights


def _int8_cache_path(model_dir: Path, linears: dict[str, Linear]) -> Path:
    """The cache file of a checkpoint's per-channel codes: keyed by the resolved directory, its
    weight files' names, sizes and modification times, the linears taken, and the version."""
    files = sorted(model_dir.glob("*.safetensors"))
    key = [str(model_dir.resolve()), str(INT8_CACHE_VERSION)]
    key += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    key += sorted(linears)
    digest = hashlib.sha256("\n".join(key).encode()).hexdigest()[:24]
    directory = cache_root() / "quantized"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{model_dir.name}-{digest}-int8.safetensors"
