"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's dynamic LoRA routes).

Operator-only: the request guard lets only operator keys call routes outside its tenant list
(guard.TENANT_PATHS), and loading reads a path on the server's disk. A loaded adapter joins
/v1/models and may be named in `model` by every tenant; unloading one that unfinished requests
use is refused (409) and changes nothing.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from prefixserve.entrypoints.server.errors import OpenAIError
from prefixserve.entrypoints.server.state import server_state
from prefixserve.lora.manager import LoRAInUseError


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (operator-only)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (operator-only); vLLM's optional lora_int_id is ignored."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None


router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    state = server_state(raw)
    name = body.lora_name
    if name in state.served_model_names:
        raise OpenAIError(f"{name!r} is a served name of the base model", param="lora_name")
    try:
        await state.engine.load_lora_adapter(name, body.lora_path)
    except ValueError as exc:
        raise OpenAIError(str(exc), param="lora_path") from exc
    known = state.lora_modules.get(name)
    state.lora_modules[name] = (known[0] if known else next(state.lora_ids), body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    state = server_state(raw)
    name = body.lora_name
    try:
        await state.engine.unload_lora_adapter(name)
    except KeyError:
        if state.lora_modules.pop(name, None) is None:
            raise OpenAIError(
                f"no LoRA adapter {name!r} is loaded",
                status_code=404,
                param="lora_name",
                code="lora_not_found",
            ) from None
    except LoRAInUseError as exc:
        raise OpenAIError(str(exc), status_code=409, param="lora_name") from exc
    state.lora_modules.pop(name, None)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
