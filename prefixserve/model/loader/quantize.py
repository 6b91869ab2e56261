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
from typing import Any

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


def give_block_weights(model: nn.Module, model_dir: Path, quantization: str) -> set[str]:
    """Before the bf16 weights are loaded: the linears a converted GGUF file's block weights go
    to (`GGUF_BLOCKS_FILE`; with "auto" only where they are at least half of the model's linear
    weights, `_mostly_blocks`) get their codes now, one linear at a time, read from the file as
    needed. Returns the names of our parameters they replace, whose bf16 tensors the load then
    skips: no bf16 copy of them is ever made or packed (an 8B Q4_K_M model would otherwise hold
    its 16 GB of bf16 weights, and their packed copies, before the codes replace them)."""
    check_quantization(quantization)
    path = model_dir / GGUF_BLOCKS_FILE
    if quantization == "none" or not path.is_file():
        return set()
    from safetensors import safe_open

    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    given: set[str] = set()
    with safe_open(str(path), "pt") as handle:
        blocks = _BlockFile(handle)
        plan = _block_plan(model, blocks, linears)
        if quantization != "int8" and not _mostly_blocks(blocks, plan, linears):
            return set()
        for name, hf_names in plan.items():
            weight = _read_block_weight(blocks, hf_names)
            if weight is not None:
                linears[name].set_int8(weight)
                given.add(f"{name}.weight")
    return given


def quantize_model(model: nn.Module, model_dir: Path, quantization: str) -> str | None:
    """After the bf16 load: with "int8", every linear `give_block_weights` left in bf16 gets
    per-channel codes; then the codes go to huge pages and the linears are linked. Returns the
    weights' formats for the disk tier's namespace ("q8_0", "int8", "int8+q8_0", "q5_0+q8_0",
    ...) or None (none 8-bit)."""
    check_quantization(quantization)
    if quantization == "none":
        return None
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    if quantization == "int8":
        rest = {
            name: m
            for name, m in linears.items()
            if m._int8 is None and m.weight.dtype == torch.bfloat16 and quantizable(m.weight)
        }
        for name, weight in _cached_per_channel(model_dir, rest).items():
            linears[name].set_int8(weight)
    for m in linears.values():
        m.take_loaded_bias()  # a bias loaded after its codes were given
    # Decode streams the codes: huge pages, as the bf16 GEMM's packed weights (fewer TLB misses).
    move_to_huge_pages(m._int8[0] for m in linears.values() if m._int8 is not None)
    link_next_weights(model)
    if hasattr(model, "_native"):
        model._native = False  # the linears changed: bind the native layers again
    applied = sorted(
        {fmt for m in linears.values() if m.int8_format for fmt in m.int8_format.split("+")}
    )
    return "+".join(applied) if applied else None


class _BlockFile:
    """A converted GGUF file's block weights (`GGUF_BLOCKS_FILE`, open): each HF tensor's format
    and shape, and its weight read only when asked for."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.formats: dict[str, str] = json.loads(
            (handle.metadata() or {}).get(BLOCK_FORMATS_KEY, "{}")
        )
        self._keys = set(handle.keys())

    def numel(self, hf_name: str) -> int:
        rows, cols = self._handle.get_slice(f"{hf_name}.codes").get_shape()
        return rows * cols

    def weight(self, hf_name: str) -> Int8Weight:
        def read(field: str) -> torch.Tensor | None:
            key = f"{hf_name}.{field}"
            return self._handle.get_tensor(key) if key in self._keys else None

        fields = (read(f) for f in ("codes", "scales"))
        return Int8Weight(*fields, self.formats[hf_name], read("mins"), read("super_scales"))


def _block_plan(
    model: nn.Module, blocks: _BlockFile, linears: dict[str, Linear]
) -> dict[str, list[str]]:
    """Our Linear name -> the HF names of the block weights that make its weight, in shard
    order: every shard of a fused projection present, a tied head given the embedding's, K a
    multiple of 64."""
    rename = getattr(model, "hf_rename", {})
    shards: dict[str, dict[int | None, str]] = {}
    for hf_name in blocks.formats:
        name, shard = hf_target(hf_name, rename)
        shards.setdefault(name.removesuffix(".weight"), {})[shard] = hf_name
    config = getattr(model, "config", None)
    embed = next((n for n in shards if n.endswith("embed_tokens")), None)
    if embed is not None and getattr(config, "tie_word_embeddings", False):
        shards.setdefault("lm_head", shards[embed])
    plan: dict[str, list[str]] = {}
    for name, parts in shards.items():
        module = linears.get(name)
        if module is None or module.in_features % 64:
            continue
        fused = _fused_shards(name)
        order = [None] if fused is None else list(range(fused))
        if set(parts) == set(order):
            plan[name] = [parts[i] for i in order]
    return plan


def _mostly_blocks(
    blocks: _BlockFile, plan: dict[str, list[str]], linears: dict[str, Linear]
) -> bool:
    """Whether a GGUF file's block weights are at least half of the model's linear weights (a
    Q8_0 file: all of them; the default model's Q4_1 file: only its embedding, which is not):
    then "auto" keeps them 8-bit, else only "int8" does."""
    kept = sum(blocks.numel(hf_name) for hf_names in plan.values() for hf_name in hf_names)
    return 2 * kept >= sum(m.in_features * m.out_features for m in linears.values())


def _read_block_weight(blocks: _BlockFile, hf_names: list[str]) -> Int8Weight | None:
    """The weight of these shards (fused when there are several), or None when they do not fuse
    (the linear then keeps its bf16 weight)."""
    parts = [blocks.weight(hf_name) for hf_name in hf_names]
    if len(parts) == 1:
        return parts[0]
    return fuse(parts) if fusable(parts) else None


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
