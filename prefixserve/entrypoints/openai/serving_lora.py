"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's dynamic LoRA routes).

Operator-only: the request guard lets only operator keys call routes outside its tenant list
(guard.TENANT_PATHS), and loading reads a path on the server's disk. A loaded adapter joins
/v1/models and may be named in `model` by every tenant; unloading one that unfinished requests
use is refused (409) and changes nothing.
"""

from __future__ import annotations

import itertools

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from prefixserve.entrypoints.openai import protocol as p
from prefixserve.entrypoints.openai.errors import OpenAIError
from prefixserve.entrypoints.openai.serving import ServerState
from prefixserve.lora.manager import LoRAInUseError


def register_lora_routes(router: APIRouter, state: ServerState) -> None:
    ids = itertools.count(max((i for i, _ in state.lora_modules.values()), default=0) + 1)

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: p.LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if name in state.served_model_names:
            raise OpenAIError(f"{name!r} is a served name of the base model", param="lora_name")
        try:
            await state.engine.load_lora_adapter(name, body.lora_path)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="lora_path") from exc
        known = state.lora_modules.get(name)
        state.lora_modules[name] = (known[0] if known else next(ids), body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: p.UnloadLoRAAdapterRequest) -> PlainTextResponse:
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
