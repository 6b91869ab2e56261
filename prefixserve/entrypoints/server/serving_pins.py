"""Pinned prefixes, for operators: keep a prefix every request uses (a system prompt) in the RAM
pool, never evicted, until unpinned.

    POST   /pins            {"prompt": "..."} or {"messages": [...]}, optional "tenant",
                            "cache_salt", "id" (letters, digits, "._~-"),
                            "prompt_cache_retention"
                            -> {"id", "num_tokens", "num_prompt_tokens"}
    GET    /pins            -> {"pins": {id: {"num_tokens", "num_blocks"}}, "pinned_blocks",
                                "capacity_blocks"}
    DELETE /pins/{id}       -> {"id", "deleted": true}, or 404

Operator-only (the request guard's deny-by-default: these paths are not tenant routes). A pin
is made in the namespace of one tenant (`tenant`, with `cache_salt` as that tenant's client would
send it), since blocks are salted per tenant; without API keys there is no tenant and the client
salt is taken as a keyless client's (`kv_cache/salts.py`). The prompt is run once (one generated
token) so its blocks are cached, then every full block of it is pinned. The pinned capacity
(`--max-pinned-blocks`, default a quarter of the pool) bounds them all; past it: 400 `pin_capacity`.
An engine client that keeps no pins (replicas) refuses every route: 501 `not_supported`.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from prefixserve.core.kv_cache.salts import derive_cache_salt, validate_cache_salt
from prefixserve.engine.client import EngineRequest
from prefixserve.entrypoints.server.errors import OpenAIError, from_value_error
from prefixserve.entrypoints.server.prompts import check_prompt_text, off_loop
from prefixserve.entrypoints.server.state import ServerState, server_state
from prefixserve.sampling_params import SamplingParams

MAX_PIN_ID_CHARS = 128
# Whose turn a pin's prompt takes on the tokenizer thread: the operators' (the tenant None, which
# with keys no tenant is; without keys every caller is the one user None).
OPERATOR = None
PIN_ID_PATTERN = r"^[A-Za-z0-9._~-]+$"


class PinRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, max_length=256)
    tenant: str | None = Field(None, max_length=256)
    cache_salt: str | None = None
    # What a URL path segment carries as it is, so `DELETE /pins/{id}` can name every pin.
    id: str | None = Field(None, min_length=1, max_length=MAX_PIN_ID_CHARS, pattern=PIN_ID_PATTERN)
    # The warm-up request's retention: "in_memory" keeps the pinned blocks off the disk tier.
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None


router = APIRouter()


@router.post("/pins")
async def create_pin(body: PinRequest, raw: Request) -> dict[str, Any]:
    state = server_state(raw)
    engine = state.engine
    await engine.describe_pins()  # refused here (501) by an engine that keeps no pins
    salt = _salt(state, body)
    ids = await _prompt_ids(state, body)
    pin_id = body.id or f"pin-{uuid.uuid4().hex}"
    # Run the prompt once so every full block of it is cached, then hold those blocks.
    warm = EngineRequest(
        f"{pin_id}-warm-{uuid.uuid4().hex[:8]}",
        ids,
        SamplingParams(max_tokens=1),
        cache_salt=salt,
        # The tenant the pin is for: the summary and the reports name its blocks' owner.
        tenant=body.tenant,
        cache_retention=body.prompt_cache_retention,
    )
    try:
        stream = await engine.add_request(warm)
    except ValueError as exc:
        raise from_value_error(exc, {"prompt": "prompt"}) from exc
    async for output in stream:
        if output.error is not None:
            raise OpenAIError(f"the prompt failed: {output.error}", status_code=500)
    try:
        num_tokens = await engine.pin_prefix(pin_id, ids, salt)
    except ValueError as exc:
        code = "pin_capacity" if "capacity" in str(exc) else "invalid_pin"
        raise OpenAIError(str(exc), code=code) from exc
    return {"id": pin_id, "num_tokens": num_tokens, "num_prompt_tokens": len(ids)}


@router.get("/pins")
async def list_pins(raw: Request) -> dict[str, Any]:
    return await server_state(raw).engine.describe_pins()


@router.delete("/pins/{pin_id}")
async def delete_pin(pin_id: str, raw: Request) -> dict[str, Any]:
    if not await server_state(raw).engine.unpin_prefix(pin_id):
        raise OpenAIError(f"no pin {pin_id!r}", status_code=404, code="pin_not_found")
    return {"id": pin_id, "deleted": True}


def _salt(state: ServerState, body: PinRequest) -> str | None:
    try:
        validate_cache_salt(body.cache_salt)
    except ValueError as exc:
        raise OpenAIError(str(exc), param="cache_salt") from exc
    keys = state.api_keys
    if keys is None:
        if body.tenant is not None:
            raise OpenAIError("this server has no tenants (no API keys)", param="tenant")
        return derive_cache_salt(None, body.cache_salt)
    if body.tenant is None or body.tenant not in keys.tenants:
        raise OpenAIError("tenant must name a tenant of --api-key-file", param="tenant")
    return derive_cache_salt(body.tenant, body.cache_salt)


async def _prompt_ids(state: ServerState, body: PinRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError("give exactly one of prompt and messages", param="prompt")
    tokenizer = state.engine.tokenizer
    if body.prompt is not None:
        if not body.prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
        check_prompt_text(state, [body.prompt], "prompt")
        return await off_loop(state, OPERATOR, tokenizer.encode, body.prompt)
    texts = [m.get("content") for m in body.messages or []]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise OpenAIError("messages must be {role, content} objects with text", param="messages")
    check_prompt_text(state, texts, "messages")  # type: ignore[arg-type]
    try:
        return await off_loop(
            state,
            OPERATOR,
            tokenizer.apply_chat_template,
            body.messages,
            add_generation_prompt=False,
        )
    except Exception as exc:
        raise OpenAIError(f"cannot render messages: {exc}", param="messages") from exc
