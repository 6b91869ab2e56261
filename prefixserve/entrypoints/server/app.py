"""The server's shell: the FastAPI app over an engine client (engine/client.py: one engine or
replicas), with what every dialect's routes stand on and the operator's routes.

`build_shell` makes the app and its `ServerState` (state.py, kept in `app.state.server`): the
error handlers (errors.py), the request guard before the body (guard.py: API key -> tenant or
operator, body size and time), /health, /metrics, /reset_prefix_cache, /kv_events, and the
operator routers of serving_pins.py, serving_cache.py (the cache summary and the inspector page)
and serving_lora.py. A dialect (openai/routes.py, anthropic/serving.py) is a router the app
includes; entrypoints/api_server.py `build_app` puts the shell and both dialects together. Every
route is a module function that finds the state through its request (`state.server_state`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, StrictBool

from prefixserve.engine.client import EngineClient
from prefixserve.entrypoints.chat.history import GeneratedHistory
from prefixserve.entrypoints.server.admission import Admission
from prefixserve.entrypoints.server.auth import ApiKeys
from prefixserve.entrypoints.server.errors import OpenAIError, install_error_handlers
from prefixserve.entrypoints.server.guard import (
    BODIES_IN_FLIGHT,
    DEFAULT_TIMEOUT_REQUEST_BODY_S,
    BodyRefused,
    RequestGuard,
    render_refusal,
)
from prefixserve.entrypoints.server.inspector_sessions import InspectorSessions
from prefixserve.entrypoints.server.serving_cache import router as cache_router
from prefixserve.entrypoints.server.serving_lora import router as lora_router
from prefixserve.entrypoints.server.serving_pins import router as pins_router
from prefixserve.entrypoints.server.state import ServerState, server_state

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 << 20
# Bytes of JSON one prompt token may take in a legal request: a token of up to
# prompts.MAX_CHARS_PER_TOKEN characters, each escaped as `\uXXXX`, is 192; a token id is at most 8.
BODY_BYTES_PER_TOKEN = 192


class ResetPrefixCacheRequest(BaseModel):
    # A misspelt option must not pass as a full reset (the disk tier is cleared by default).
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reset_running_requests: StrictBool = False
    ram_only: StrictBool = False  # keep the disk tier (default: it is cleared too)


def default_max_request_body_bytes(max_model_len: int) -> int:
    """The body limit when none is given: room for the longest legal prompt, at least 4 MiB."""
    return max(DEFAULT_MAX_REQUEST_BODY_BYTES, max_model_len * BODY_BYTES_PER_TOKEN)


def build_shell(
    engine: EngineClient,
    served_model_names: list[str],
    api_keys: ApiKeys | None = None,
    max_request_body_bytes: int | None = None,
    admission: Admission | None = None,
    timeout_request_body_s: float | None = DEFAULT_TIMEOUT_REQUEST_BODY_S,
    max_body_bytes_in_flight: int | None = None,
    lora_modules: dict[str, str] | None = None,
    history: GeneratedHistory | None = None,
) -> FastAPI:
    """The FastAPI app with no dialect's route yet; its `ServerState` is `app.state.server`,
    where every route finds it (state.server_state). api_server.py `build_app` adds the
    dialects' routes. The caller starts and stops `engine` (see cli.py).

    With `api_keys`, the operator routes (/kv_events, /reset_prefix_cache, /metrics, /pins, the
    LoRA load and unload routes, /v1/cache/summary, /inspector and the API docs) take an
    operator key only and the others a tenant key only (guard.py); without, every route is open
    to the one trusted user.
    `max_request_body_bytes` defaults to `default_max_request_body_bytes(engine.max_model_len)`;
    `max_body_bytes_in_flight` (bodies of all requests together) to `BODIES_IN_FLIGHT` times
    that, 0 for no bound;
    `timeout_request_body_s` bounds the time a body may take to arrive (None: no bound);
    `admission` bounds the requests in flight (admission.py; default: no bound).
    `lora_modules` (name -> path) are the LoRA adapters a request may name in `model` (loaded in
    the engine by the caller); `history` remembers chat answers' token ids for their tenants'
    next turns (default: its default bounds)."""
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    state = ServerState(
        engine=engine,
        served_model_names=list(served_model_names),
        api_keys=api_keys,
        admission=admission or Admission(),
        inspector_sessions=None if api_keys is None else InspectorSessions(),
        lora_modules={
            name: (i, path) for i, (name, path) in enumerate((lora_modules or {}).items(), 1)
        },
        history=GeneratedHistory() if history is None else history,
    )
    app = FastAPI(title="prefixserve", summary="OpenAI-compatible LLM server with prefix caching")
    app.state.server = state
    install_error_handlers(app)
    app.add_exception_handler(BodyRefused, render_refusal)
    if max_request_body_bytes is None:
        max_request_body_bytes = default_max_request_body_bytes(engine.max_model_len)
    if max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes}")
    if max_body_bytes_in_flight is None:
        max_body_bytes_in_flight = BODIES_IN_FLIGHT * max_request_body_bytes
    if max_body_bytes_in_flight < 0:
        raise ValueError(f"max_body_bytes_in_flight must be >= 0, got {max_body_bytes_in_flight}")
    if timeout_request_body_s is not None and not 0 < timeout_request_body_s < float("inf"):
        raise ValueError(f"timeout_request_body_s must be > 0, got {timeout_request_body_s}")
    app.add_middleware(
        RequestGuard,
        api_keys=api_keys,
        max_body_bytes=max_request_body_bytes,
        metrics=state.metrics,
        timeout_request_body_s=timeout_request_body_s,
        max_body_bytes_in_flight=max_body_bytes_in_flight or None,
        inspector_sessions=state.inspector_sessions,
    )

    app.include_router(router)
    app.include_router(pins_router)
    app.include_router(cache_router)
    app.include_router(lora_router)
    return app


# The request guard decides who may call each route (guard.TENANT_PATHS: tenants; every other
# route but /health: operators only). Module functions that find their app's state through the
# request (state.server_state), never closures over it.
router = APIRouter()


@router.get("/health")
async def health(raw: Request) -> Response:
    # Unauthenticated on purpose: load balancers probe it.
    if not server_state(raw).engine.is_running:
        return JSONResponse({"status": "engine not running"}, status_code=503)
    return JSONResponse({"status": "ok"})


router.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)


@router.get("/metrics")
async def metrics(raw: Request) -> Response:
    state = server_state(raw)
    state.metrics.update_engine(await state.engine.get_metrics())
    return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(
    raw: Request, reset_running_requests: bool | None = None, ram_only: bool | None = None
) -> JSONResponse:
    # The flags may come as query parameters (vLLM) or in a JSON body.
    body = ResetPrefixCacheRequest()
    if await raw.body():
        try:
            body = ResetPrefixCacheRequest.model_validate_json(await raw.body())
        except ValueError as exc:
            raise OpenAIError(
                f"invalid body for /reset_prefix_cache: {exc}", param="reset_running_requests"
            ) from exc
    if reset_running_requests is None:
        reset_running_requests = body.reset_running_requests
    if ram_only is None:
        ram_only = body.ram_only
    ok = await server_state(raw).engine.reset_prefix_cache(reset_running_requests, ram_only)
    return JSONResponse({"success": bool(ok)})


@router.get("/kv_events")
async def kv_events(raw: Request) -> JSONResponse:
    """KV-cache events since the last call (needs --kv-events)."""
    engine = server_state(raw).engine
    if not engine.collect_kv_events:
        raise OpenAIError(
            "KV-cache events are off; start the server with --kv-events",
            status_code=404,
            code="kv_events_disabled",
        )
    events = await engine.take_kv_events()
    return JSONResponse({"events": [_event_json(e) for e in events]})


def _event_json(event: Any) -> dict[str, Any]:
    """A KV-cache event as JSON: its type and fields, hashes as hex; a (replica id, event) pair
    (with --replicas) adds "replica"."""
    if isinstance(event, tuple):
        replica_id, event = event
        return {"replica": replica_id, **_event_json(event)}

    def convert(value: Any) -> Any:
        if isinstance(value, bytes):
            return value.hex()
        if isinstance(value, list | tuple):
            return [convert(v) for v in value]
        if isinstance(value, dict):
            return {str(k): convert(v) for k, v in value.items()}
        if isinstance(value, int | float | str | bool) or value is None:
            return value
        return repr(value)

    fields = (
        {f.name: convert(getattr(event, f.name)) for f in dataclasses.fields(event)}
        if dataclasses.is_dataclass(event)
        else {}
    )
    return {"type": type(event).__name__, **fields}
