"""Reading a Hugging Face model directory: config.json and the safetensors files.

Tensors are streamed one at a time, cast to the requested dtype. They are memory maps of the
files, which parameters take as they are where no fusing or cast is needed
(`weights.load_hf_weights(..., assign=True)`), so a later start reads instead of copying.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from prefixserve.model.errors import load_error


def read_hf_config(model_dir: Path) -> dict[str, Any]:
    """config.json of a model directory, as a dict (ModelLoadError if missing or broken)."""
    config_path = model_dir / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise load_error(model_dir, "config.json is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise load_error(model_dir, f"config.json is unreadable ({exc})") from exc
    if not isinstance(config, dict):
        raise load_error(model_dir, "config.json is not a JSON object")
    return config


def safetensors_files(model_dir: Path) -> list[Path]:
    """Weight files: the shards named by model.safetensors.index.json, or every *.safetensors."""
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise load_error(model_dir, f"{index_path.name} is unreadable ({exc})") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise load_error(
                model_dir, f"shards listed in {index_path.name} are missing: {missing}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise load_error(model_dir, "no *.safetensors weight files")
    return files


def iter_safetensors_weights(
    model_dir: Path, dtype: torch.dtype, skip: Callable[[str], bool] = lambda name: False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_param_name, tensor) for every tensor but those `skip` names, floating ones cast
    to `dtype`.

    One tensor is materialized at a time, so peak memory stays near one copy of the model.
    """
    from safetensors import SafetensorError, safe_open

    for path in safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if skip(name):
                        continue
                    tensor = f.get_tensor(name)
                    if tensor.is_floating_point() and tensor.dtype != dtype:
                        tensor = tensor.to(dtype)
                    yield name, tensor
        except (OSError, SafetensorError) as exc:
            raise load_error(model_dir, f"{path.name} is unreadable ({exc})") from exc
