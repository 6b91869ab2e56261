"""A tiny fake OpenAI /v1/completions server for testing the benchmark client (not an engine).

It streams `max_tokens` chunks of one word each, reports usage with
`prompt_tokens_details.cached_tokens` computed from 16-token blocks it has seen before, and keeps
a log of what it received so tests can check ordering and concurrency. With `--store DIR` the
blocks it has seen outlive the process (one JSON line per block in DIR/blocks.jsonl), like a
disk tier, so a restarted stub hits what its predecessor saw. With `--spec-metrics vllm` (or
`prefixserve`) it serves GET /metrics with that engine's speculative-decoding counters, counting
per streamed token one draft of 4 tokens of which 2 are accepted; without it, /metrics is a 404
(as llama.cpp's server has none).
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
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

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
    # speculative-decoding counters: drafts, draft tokens, accepted tokens
    spec: list[int] = field(default_factory=lambda: [0, 0, 0])

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


SPEC_METRIC_NAMES = {
    "vllm": (
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
    ),
    "prefixserve": (
        "prefixserve_spec_decode_num_drafts",
        "prefixserve_spec_decode_num_draft_tokens",
        "prefixserve_spec_decode_num_accepted_tokens",
    ),
}


def _metrics_page(state: StubState, style: str) -> str:
    """The counters as the engine `style` exposes them (vLLM's with labels and _created)."""
    lines = ["# HELP python_gc_objects_collected_total Objects collected during gc"]
    lines.append('python_gc_objects_collected_total{generation="0"} 123.0')
    labels = '{engine="0",model_name="stub-model"}' if style == "vllm" else ""
    for name, value in zip(SPEC_METRIC_NAMES[style], state.spec, strict=True):
        lines += [f"# TYPE {name} counter", f"{name}_total{labels} {float(value)}"]
        if style == "vllm":
            lines.append(f"{name}_created{labels} 1.7e+09")
    return "\n".join(lines) + "\n"


def make_app(
    state: StubState,
    token_delay_s: float = 0.002,
    die_after: int | None = None,
    spec_metrics: str | None = None,
) -> FastAPI:
    app = FastAPI()

    if spec_metrics is not None:

        @app.get("/metrics", response_model=None)
        async def metrics() -> Any:
            with state.lock:
                return PlainTextResponse(_metrics_page(state, spec_metrics))

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
                    with state.lock:
                        for j, inc in enumerate((1, 4, 2)):
                            state.spec[j] += inc
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

    def __init__(self, token_delay_s: float = 0.002, spec_metrics: str | None = None) -> None:
        self.state = StubState()
        app = make_app(self.state, token_delay_s, spec_metrics=spec_metrics)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
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
    parser.add_argument("--spec-metrics", choices=sorted(SPEC_METRIC_NAMES), default=None)
    args = parser.parse_args()
    state = StubState(store=args.store)
    state.load_store()
    app = make_app(state, die_after=args.die_after, spec_metrics=args.spec_metrics)
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
