"""Checkpoint tensors -> our parameters: Hugging Face names mapped onto the fused projections.

The families' `load_weights` call `load_hf_weights` with the tensors the loader streams from a
model directory (`hf_dir.iter_safetensors_weights`), then `check_all_loaded`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from prefixserve.model.layers.common import Attention, GatedMLP

# Hugging Face names of the projections we fuse: (our parameter, shard index).
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def hf_target(hf_name: str, rename: dict[str, str] | None = None) -> tuple[str, int | None]:
    """Our parameter for a Hugging Face tensor name, and the shard it fills of a fused
    projection (None for an unfused parameter). `rename` maps leading name prefixes to ours."""
    name = hf_name
    for old, new in (rename or {}).items():
        if name.startswith(old):
            name = new + name[len(old) :]
            break
    parts = name.split(".")
    shard = None
    if len(parts) >= 2 and parts[-2] in FUSED_SHARDS:
        fused, shard = FUSED_SHARDS[parts[-2]]
        parts[-2] = fused
        name = ".".join(parts)
    return name, shard


def load_hf_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    rename: dict[str, str] | None = None,
    skip_prefixes: tuple[str, ...] = (),
    *,
    assign: bool = False,
    given: frozenset[str] | set[str] = frozenset(),
) -> set[str]:
    """Copy Hugging Face-named tensors into `model`, filling fused projections shard by shard.

    `rename` maps leading HF name prefixes to ours. Returns the names of our parameters that were
    loaded; raises ValueError on unknown names or shape mismatches.

    With `assign=True` an unfused parameter takes the given tensor itself (no copy) when its
    dtype and shape match: for tensors nobody else holds, such as the loader's memory-mapped
    safetensors, this skips writing the weights into fresh memory (page faults dominate a load).
    Fused projections are always copied, shard by shard, into their parameter.

    `given`: our parameters that already have their values another way (a linear's 8-bit codes
    from a converted GGUF file): counted as loaded, their tensors skipped.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set(given)
    for hf_name, tensor in weights:
        if "rotary_emb.inv_freq" in hf_name or hf_name.startswith(skip_prefixes):
            continue
        name, shard = hf_target(hf_name, rename)
        if name in given:
            continue
        if name not in params:
            raise ValueError(
                f"checkpoint tensor {hf_name!r} has no place in {type(model).__name__}"
            )
        param = params[name]
        with torch.no_grad():
            if shard is None:
                _check_shape(hf_name, param.shape, tensor.shape)
                if assign and _assignable(param, tensor):
                    param.data = tensor  # ties survive: tied names share this Parameter
                else:
                    param.copy_(tensor)
            else:
                target = _shard_view(model, name, param, shard)
                _check_shape(hf_name, target.shape, tensor.shape)
                target.copy_(tensor)
        loaded.add(f"{name}#{shard}" if shard is not None else name)
    return loaded


def _assignable(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    return (
        tensor.dtype == param.dtype
        and tensor.device == param.device
        and tensor.is_contiguous()
        and not tensor.requires_grad
        and type(tensor) is torch.Tensor
    )


def _shard_view(model: nn.Module, name: str, param: torch.Tensor, shard: int) -> torch.Tensor:
    module = model.get_submodule(name.rsplit(".", 2)[0])
    if isinstance(module, Attention):
        sizes = [module.q_size, module.kv_size, module.kv_size]
    elif isinstance(module, GatedMLP):
        sizes = [module.intermediate, module.intermediate]
    else:  # pragma: no cover - FUSED_SHARDS only names the two modules above
        raise AssertionError(name)
    start = sum(sizes[:shard])
    return param.narrow(0, start, sizes[shard])


def _check_shape(name: str, want: torch.Size, got: torch.Size) -> None:
    if tuple(want) != tuple(got):
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(got)}, expected {tuple(want)}"
        )


def check_all_loaded(model: nn.Module, loaded: set[str], optional: tuple[str, ...] = ()) -> None:
    """Raise ValueError naming the parameters the checkpoint did not provide."""
    missing = []
    for name, param in model.named_parameters():
        if name in optional:
            continue
        if name in loaded:
            continue
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            needed = [f"{name}#{i}" for i in range(3)]
        elif name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
            needed = [f"{name}#{i}" for i in range(2)]
        else:
            needed = [name]
        if not all(n in loaded for n in needed):
            missing.append(name)
        del param
    if missing:
        raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:10])}")
