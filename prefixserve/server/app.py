"""The OpenAI-compatible HTTP server: the FastAPI app over an AsyncLLMEngine, its routes and auth.

One request's path: authenticate (API key -> tenant) -> parse and range-check the body
(protocol.py) -> the endpoint's handler (serving_completion.py, serving_chat.py) tokenizes it and
builds SamplingParams -> serving.py derives the engine's cache salt from (tenant, client
cache_salt), adds it to the engine (which validates it) and streams or collects the
RequestOutputs -> OpenAI response with `usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from prefixserve.async_engine import AsyncLLMEngine
from prefixserve.server import protocol as p
from prefixserve.server import serving_chat, serving_completion
from prefixserve.server.auth import ApiKeys, parse_bearer
from prefixserve.server.errors import OpenAIError, install_error_handlers
from prefixserve.server.serving import ServerState


def build_app(
    engine: AsyncLLMEngine,
    served_model_names: list[str],
    api_keys: ApiKeys | None = None,
    model_root: str | None = None,
) -> FastAPI:
    """The FastAPI app. The caller starts and stops `engine` (see cli.py)."""
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    state = ServerState(
        engine=engine,
        served_model_names=list(served_model_names),
        api_keys=api_keys,
        model_root=model_root,
    )
    app = FastAPI(title="prefixserve", summary="OpenAI-compatible LLM server with prefix caching")
    app.state.server = state
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> Response:
        # Unauthenticated on purpose: load balancers probe it.
        if not engine.is_running:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    router = APIRouter(dependencies=[Depends(_authenticate)])

    @router.get("/v1/models")
    async def list_models() -> p.ModelList:
        return p.ModelList(
            data=[
                p.ModelCard(
                    id=name, root=state.model_root or name, max_model_len=engine.max_model_len
                )
                for name in state.served_model_names
            ]
        )

    @router.post("/v1/completions")
    async def create_completion(body: p.CompletionRequest, raw: Request) -> Response:
        return await serving_completion.create_completion(state, body, raw, time.monotonic())

    @router.post("/v1/chat/completions")
    async def create_chat_completion(body: p.ChatCompletionRequest, raw: Request) -> Response:
        return await serving_chat.create_chat_completion(state, body, raw, time.monotonic())

    @router.get("/metrics")
    async def metrics() -> Response:
        state.metrics.update_engine(await engine.get_metrics())
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4")

    @router.post("/reset_prefix_cache")
    async def reset_prefix_cache(
        raw: Request, reset_running_requests: bool | None = None
    ) -> JSONResponse:
        # The flag may come as a query parameter (vLLM) or in a JSON body.
        if reset_running_requests is None:
            reset_running_requests = False
            if await raw.body():
                try:
                    body = p.ResetPrefixCacheRequest.model_validate_json(await raw.body())
                except ValueError as exc:
                    raise OpenAIError(
                        f"invalid body for /reset_prefix_cache: {exc}",
                        param="reset_running_requests",
                    ) from exc
                reset_running_requests = body.reset_running_requests
        ok = await engine.reset_prefix_cache(reset_running_requests)
        return JSONResponse({"success": bool(ok)})

    @router.get("/kv_events")
    async def kv_events() -> JSONResponse:
        """KV-cache events since the last call (needs --kv-events)."""
        if not engine.collect_kv_events:
            raise OpenAIError(
                "KV-cache events are off; start the server with --kv-events",
                status_code=404,
                code="kv_events_disabled",
            )
        events = await engine.take_kv_events()
        return JSONResponse({"events": [_event_json(e) for e in events]})

    app.include_router(router)
    return app


async def _authenticate(request: Request) -> None:
    """Resolve the caller's tenant from `Authorization: Bearer <key>` into request.state."""
    state: ServerState = request.app.state.server
    request.state.tenant = None
    if state.api_keys is None:
        return
    token = parse_bearer(request.headers.get("authorization"))
    tenant = None if token is None else state.api_keys.tenant_for(token)
    if tenant is None:
        message = (
            "missing API key: send 'Authorization: Bearer <key>'"
            if token is None
            else "invalid API key"
        )
        raise OpenAIError(message, status_code=401, code="invalid_api_key")
    request.state.tenant = tenant


def _event_json(event: Any) -> dict[str, Any]:
    """A KV-cache event as JSON: its type and fields, hashes as hex."""

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
