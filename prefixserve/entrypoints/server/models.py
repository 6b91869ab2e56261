"""Which model a request names: a served name of the base model or a LoRA adapter's name
(vLLM's way: `model` selects the adapter). The OpenAI dialect lists both at /v1/models
(openai/routes.py `model_list`).

Adapter names come from `--lora-modules` and `POST /v1/load_lora_adapter` (operator-only,
serving_lora.py); every tenant may use and see them.
"""

from __future__ import annotations

from typing import Protocol

from prefixserve.entrypoints.server.errors import OpenAIError
from prefixserve.lora.config import LoRARequest


class ModelsState(Protocol):
    served_model_names: list[str]
    lora_modules: dict[str, tuple[int, str]]  # name -> (lora_int_id, path)


def check_model(state: ModelsState, model: str | None) -> str:
    """The name the request asked for (the first served name when it names none): a served name
    or an adapter's; 404 naming what the server serves otherwise."""
    if model is None:
        return state.served_model_names[0]
    if model not in state.served_model_names and model not in state.lora_modules:
        names = [*state.served_model_names, *state.lora_modules]
        raise OpenAIError(
            f"the model {model!r} does not exist; this server serves "
            f"{', '.join(repr(n) for n in names)}",
            status_code=404,
            param="model",
            code="model_not_found",
        )
    return model


def lora_request_for(state: ModelsState, model: str) -> LoRARequest | None:
    """The adapter a request runs with when its `model` names one; None for the base model."""
    entry = state.lora_modules.get(model)
    if entry is None:
        return None
    lora_int_id, path = entry
    return LoRARequest(model, lora_int_id, path)
