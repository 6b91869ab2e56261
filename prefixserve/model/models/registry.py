"""The supported architectures, in one table, and building a model ready for `load_weights`.

Each Hugging Face architecture name maps to the transformers `model_type` whose config defaults
apply to it (`hf_config.py` uses them) and to the class implementing it. Adding a model family
is a new module beside `llama.py`, one row here, and its config quirks in `hf_config.py`.
"""

from __future__ import annotations

import torch
from torch import nn

from prefixserve.model.config import ModelConfig
from prefixserve.model.models.gemma3 import Gemma3ForCausalLM
from prefixserve.model.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from prefixserve.model.models.qwen3 import Qwen3ForCausalLM

# architecture -> (transformers model_type, implementing class)
_MODELS: dict[str, tuple[str, type[LlamaForCausalLM]]] = {
    "LlamaForCausalLM": ("llama", LlamaForCausalLM),
    "MistralForCausalLM": ("mistral", MistralForCausalLM),
    "Qwen2ForCausalLM": ("qwen2", Qwen2ForCausalLM),
    "Qwen3ForCausalLM": ("qwen3", Qwen3ForCausalLM),
    "Gemma3ForCausalLM": ("gemma3_text", Gemma3ForCausalLM),
    "Gemma3ForConditionalGeneration": ("gemma3", Gemma3ForCausalLM),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {arch: cls for arch, (_, cls) in _MODELS.items()}


def hf_model_type(architecture: str) -> str:
    """The transformers model_type of a supported architecture (KeyError otherwise)."""
    return _MODELS[architecture][0]


def architecture_of_model_type(model_type: str) -> str | None:
    """The architecture a config.json without `architectures` means by its model_type."""
    for arch, (mt, _) in _MODELS.items():
        if mt == model_type:
            return arch
    return None


def create_model(config: ModelConfig) -> nn.Module:
    """The model for `config.architecture` on the CPU in `config.dtype`, in eval mode.

    Parameters are allocated but not initialized: call `model.load_weights(...)` next.
    """
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ValueError(
            f"unsupported model architecture {config.architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    with torch.device("meta"):
        model = cls(config)
    model = model.to(dtype=config.torch_dtype).to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each module its own copy of a shared parameter
    return model.eval().requires_grad_(False)
