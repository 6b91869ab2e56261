"""The one error a model path can cause: ModelLoadError, whose message names the path, the
problem and the architectures prefixserve supports."""

from __future__ import annotations

from pathlib import Path

from prefixserve.model.models.registry import SUPPORTED_ARCHITECTURES


class ModelLoadError(ValueError):
    """A model path that cannot be loaded: missing, unreadable, or an unsupported architecture."""


def load_error(path: Path | str, problem: str) -> ModelLoadError:
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    return ModelLoadError(
        f"cannot load model {str(path)!r}: {problem}. Expected a Hugging Face model directory "
        f"(config.json + *.safetensors) or a .gguf file of a supported architecture: {supported}"
    )
