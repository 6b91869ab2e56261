"""Architecture name -> model class, and building a model ready for `load_weights`."""

from __future__ import annotations

import torch
from torch import nn

from prefixserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from prefixserve.model.gemma3 import Gemma3ForCausalLM
from prefixserve.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from prefixserve.model.qwen3 import Qwen3ForCausalLM

__all__ = ["SUPPORTED_ARCHITECTURES", "MODEL_CLASSES", "create_model"]

MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,
}
assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)


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
