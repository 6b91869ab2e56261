"""The HTTP server's app: the shell (server/app.py `build_shell`: the guard, errors, metrics,
admission, the operator routes and the inspector page) with the two dialects' routes on it, the
OpenAI API's (openai/routes.py) and Anthropic's Messages API (anthropic/serving.py).

The one module that imports the shell and both dialects; `prefixserve serve` (cli.py) and the
tests build their app here.
"""

from __future__ import annotations

from fastapi import FastAPI

from prefixserve.engine.client import EngineClient
from prefixserve.entrypoints.anthropic.serving import router as messages_router
from prefixserve.entrypoints.chat.history import GeneratedHistory
from prefixserve.entrypoints.openai.routes import router as openai_router
from prefixserve.entrypoints.server.admission import Admission
from prefixserve.entrypoints.server.app import build_shell
from prefixserve.entrypoints.server.auth import ApiKeys
from prefixserve.entrypoints.server.guard import DEFAULT_TIMEOUT_REQUEST_BODY_S


def build_app(
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
    """The FastAPI app: `build_shell` with these arguments (server/app.py says what each
    bounds), then the OpenAI routes (/v1/models, /v1/completions, /v1/chat/completions) and the
    Messages API's (/v1/messages, /v1/messages/count_tokens). The caller starts and stops
    `engine` (see cli.py). /v1/models names the served model names only, never the weights'
    path."""
    app = build_shell(
        engine,
        served_model_names,
        api_keys=api_keys,
        max_request_body_bytes=max_request_body_bytes,
        admission=admission,
        timeout_request_body_s=timeout_request_body_s,
        max_body_bytes_in_flight=max_body_bytes_in_flight,
        lora_modules=lora_modules,
        history=history,
    )
    app.include_router(openai_router)
    app.include_router(messages_router)
    return app
