"""A tiny fake OpenAI /v1/completions server for testing the benchmark client (not an engine).

It streams `max_tokens` chunks of one word each, reports usage with
`prompt_tokens_details.cached_tokens` computed from 16-token blocks it has seen before, and keeps
a log of what it received so tests can check ordering and concurrency. With `--store DIR` the
blocks it has seen outlive the process (one JSON line per block in DIR/blocks.jsonl), like a
disk tier, so a restarted stub hits what its predecessor saw.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

BLOCK = 16
FAIL_TOKEN = 999_999  # a prompt containing this token id gets HTTP 400


@dataclass
class StubState:
    events: list[tuple[str, str]] = field(default_factory=list)  # ("start"|"end", request key)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    seen_blocks: set[tuple[int, ...]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    store: str | None = None

    def load_store(self) -> None:
        path = os.path.join(self.store or "", "blocks.jsonl")
        if self.store is not None and os.path.exists(path):
            with open(path) as f:
                self.seen_blocks |= {tuple(json.loads(line)) for line in f}

    def remember(self, block: tuple[int, ...]) -> None:
        if block in self.seen_blocks:
            return
        self.seen_blocks.add(block)
        if self.store is not None:
            os.makedirs(self.store, exist_ok=True)
            with open(os.path.join(self.store, "blocks.jsonl"), "a") as f:
                f.write(json.dumps(list(block)) + "\n")


def _prompt_ids(prompt: Any) -> list[int]:
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    # Text prompts: one "token" per word, hashed to an int so prefixes still line up.
    return [hash(w) & 0xFFFF for w in str(prompt).split()]


def make_app(
    state: StubState, token_delay_s: float = 0.002, die_after: int | None = None
) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        body = await request.json()
        if die_after is not None and len(state.bodies) >= die_after:
            os._exit(7)  # a crash mid-run, like a native abort in a real server
        ids = _prompt_ids(body["prompt"])
        if FAIL_TOKEN in ids:
            return JSONResponse({"error": {"message": "bad token"}}, status_code=400)
        key = json.dumps(ids[-8:])
        with state.lock:
            state.bodies.append(body)
            cached = 0
            for end in range(BLOCK, len(ids) + 1, BLOCK):
                block = tuple(ids[:end])
                if block in state.seen_blocks:
                    cached = end
                state.remember(block)
        n = int(body.get("max_tokens") or 16)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def stream() -> AsyncIterator[bytes]:
            with state.lock:
                state.events.append(("start", key))
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                yield b": ping\n\n"
                for i in range(n):
                    await asyncio.sleep(token_delay_s)
                    chunk = {
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                if include_usage:
                    usage = {
                        "prompt_tokens": len(ids),
                        "completion_tokens": n,
                        "total_tokens": len(ids) + n,
                        "prompt_tokens_details": {"cached_tokens": cached},
                    }
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                with state.lock:
                    state.in_flight -= 1
                    state.events.append(("end", key))

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


class StubServer:
    """The stub app served by uvicorn in a background thread on a free loopback port."""

    def __init__(self, token_delay_s: float = 0.002) -> None:
        self.state = StubState()
        config = uvicorn.Config(
            make_app(self.state, token_delay_s), host="127.0.0.1", port=0, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> StubServer:
        self.thread.start()
        for _ in range(500):
            if self.server.started:
                break
            threading.Event().wait(0.01)
        assert self.server.started, "stub server did not start"
        return self

    @property
    def base_url(self) -> str:
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--die-after", type=int, default=None, help="exit at request N+1")
    parser.add_argument("--store", default=None, help="keep the seen blocks in this directory")
    parser.add_argument("--ignore-sigint", action="store_true", help="a server that hangs on stop")
    args = parser.parse_args()
    state = StubState(store=args.store)
    state.load_store()
    app = make_app(state, die_after=args.die_after)
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning")
    if args.ignore_sigint:

        class DeafServer(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        signal.signal(signal.SIGINT, signal.SIG_IGN)
        DeafServer(config).run()
    else:
        uvicorn.Server(config).run()
