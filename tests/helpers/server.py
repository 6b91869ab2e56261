"""Helpers of the server tests: constants, the live-server handle, uvicorn in a thread."""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn

from prefixserve.engine.async_llm import AsyncLLMEngine
from prefixserve.engine.llm_engine import LLMEngine

MODEL_NAME = "test-model"
MAX_MODEL_LEN = 1024
NUM_KV_BLOCKS = 640
BLOCK_SIZE = 16
KEY_ALPHA = "sk-alpha-1"
KEY_ALPHA_2 = "sk-alpha-2"
KEY_BETA = "sk-beta-1"
KEY_ADMIN = "sk-operator-1"


@functools.cache
def ssl_context() -> ssl.SSLContext:
    """One SSL context for every client the tests make. httpx and openai otherwise load the CA
    bundle for each new client (about 35 ms, most of what a short request to a test server
    costs), though the test servers speak plain HTTP."""
    return ssl.create_default_context()


@dataclass
class LiveServer:
    url: str
    api_key: str | None
    engine: AsyncLLMEngine

    def client(self, api_key: str | None = None, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1",
            api_key=api_key or self.api_key or "unused",
            max_retries=0,
            timeout=120,
            http_client=openai.DefaultHttpxClient(verify=ssl_context()),
            **kwargs,
        )

    def async_client(self, api_key: str | None = None) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.url}/v1",
            api_key=api_key or self.api_key or "unused",
            max_retries=0,
            timeout=300,
            http_client=openai.DefaultAsyncHttpxClient(verify=ssl_context()),
        )

    def http(self, api_key: str | None = None) -> httpx.Client:
        key = api_key or self.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120, verify=ssl_context())

    def run_in_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine's step thread, between two steps."""
        return asyncio.run(asyncio.wait_for(self.engine.run_in_engine(fn), timeout=120))

    def metrics(self) -> dict[str, Any]:
        return self.run_in_engine(lambda e: dict(e.get_metrics()))

    def wait_idle(self, timeout_s: float = 120.0) -> dict[str, Any]:
        """Wait until the engine holds no request; return its metrics then."""
        deadline = time.monotonic() + timeout_s
        while True:
            busy = self.run_in_engine(lambda e: e.has_unfinished_requests())
            if not busy:
                return self.metrics()
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine still has requests after {timeout_s}s")
            time.sleep(0.05)

    def check_no_leaks(self) -> None:
        self.wait_idle()
        self.run_in_engine(lambda e: e.check_no_leaks())


def serve_in_thread(app: Any, **config: Any) -> tuple[uvicorn.Server, threading.Thread, str]:
    """uvicorn serving `app` on a free port in a daemon thread; `config`: more uvicorn.Config
    arguments."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2, **config
        )
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread, f"http://127.0.0.1:{port}"
