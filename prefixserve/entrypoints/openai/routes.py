"""The OpenAI dialect's routes on the shell's app (server/app.py): /v1/models, /v1/completions
and /v1/chat/completions (tenant routes: guard.TENANT_PATHS).

/v1/models lists the served names and the LoRA adapters' names (server/models.py), each card
with the context length. No card reveals a path: `root` is the served or the adapter's name,
`parent` (an adapter's) the base model's first served name.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from prefixserve.entrypoints.openai import protocol as p
from prefixserve.entrypoints.openai import serving_chat, serving_completion
from prefixserve.entrypoints.server.models import ModelsState
from prefixserve.entrypoints.server.state import server_state

router = APIRouter()


@router.get("/v1/models")
async def list_models(raw: Request) -> p.ModelList:
    # `root` is the served name: the weights' path (--model) is the server's business.
    state = server_state(raw)
    return model_list(state, state.engine.max_model_len)


@router.post("/v1/completions")
async def create_completion(body: p.CompletionRequest, raw: Request) -> Response:
    return await serving_completion.create_completion(
        server_state(raw), body, raw, time.monotonic()
    )


@router.post("/v1/chat/completions")
async def create_chat_completion(body: p.ChatCompletionRequest, raw: Request) -> Response:
    return await serving_chat.create_chat_completion(server_state(raw), body, raw, time.monotonic())


def model_list(state: ModelsState, max_model_len: int) -> p.ModelList:
    base = state.served_model_names[0]
    return p.ModelList(
        data=[
            p.ModelCard(id=name, root=name, max_model_len=max_model_len)
            for name in state.served_model_names
        ]
        + [
            p.ModelCard(id=name, root=name, parent=base, max_model_len=max_model_len)
            for name in state.lora_modules
        ]
    )
