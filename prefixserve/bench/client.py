"""An async streaming client for any OpenAI-compatible `/v1/completions` endpoint.

`run_workload` sends a workload's requests at a fixed concurrency (closed loop: N requests in
flight) or at a Poisson request rate, streams each response, and records per request the time to
first token, the gaps between streamed tokens, the end-to-end latency, the prompt and output token
counts (from `usage` when the server sends it, else the local counts), and
`usage.prompt_tokens_details.cached_tokens` where the server reports it.

A request whose `after` names another request is held back until that one has finished (the turns
of a W2 conversation).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import httpx

from prefixserve.bench.workloads import BenchRequest

PromptFormat = Literal["tokens", "text"]


@dataclass(slots=True)
class RequestRecord:
    """What one request measured. Times are seconds; `start` is relative to the run's start."""

    request_id: str
    start: float
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int | None = None
    num_chunks: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class EndpointConfig:
    """Where and how to send requests.

    `prompt_format` is "tokens" for servers that take a list of token ids as the prompt, "text"
    otherwise. `extra_body` is merged into every request body (e.g. `{"ignore_eos": True}` for
    vLLM, `{"min_tokens": N}`-style fields are added per request via `min_tokens_equal_max`).
    """

    base_url: str
    model: str
    prompt_format: PromptFormat = "tokens"
    extra_body: dict[str, Any] = field(default_factory=dict)
    min_tokens_equal_max: bool = False
    include_usage: bool = True
    timeout_s: float = 600.0
    # A request's `model` by its group (a LoRA adapter per system prompt); others: `model`.
    group_models: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prompt_format not in ("tokens", "text"):
            raise ValueError(
                f"prompt_format must be 'tokens' or 'text', got {self.prompt_format!r}"
            )


def build_body(req: BenchRequest, endpoint: EndpointConfig) -> dict[str, Any]:
    """The JSON body of one streaming completion request (greedy, EOS ignored)."""
    if endpoint.prompt_format == "tokens":
        prompt: Any = req.prompt_token_ids
    else:
        if req.prompt_text is None:
            raise ValueError(
                f"request {req.request_id} has no prompt text; build the workload with a decode "
                "function to send it to a text-only server"
            )
        prompt = req.prompt_text
    body: dict[str, Any] = {
        "model": endpoint.group_models.get(req.group, endpoint.model)
        if req.group is not None
        else endpoint.model,
        "prompt": prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0.0,
        "stream": True,
    }
    if endpoint.include_usage:
        body["stream_options"] = {"include_usage": True}
    if endpoint.min_tokens_equal_max:
        body["min_tokens"] = req.max_tokens
    if req.tenant is not None:
        body["cache_salt"] = req.tenant
    body.update(endpoint.extra_body)
    return body


def _apply_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    if usage.get("prompt_tokens") is not None:
        record.prompt_tokens = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        record.cached_tokens = int(details["cached_tokens"])


async def send_request(
    client: httpx.AsyncClient, req: BenchRequest, endpoint: EndpointConfig, t0: float
) -> RequestRecord:
    """Stream one completion and time it. Never raises for server or network errors: they are
    recorded in `RequestRecord.error`."""
    record = RequestRecord(req.request_id, start=time.perf_counter() - t0)
    record.prompt_tokens = req.num_prompt_tokens
    body = build_body(req, endpoint)
    sent = time.perf_counter()
    last = sent
    text_chunks = 0
    usage_seen = False
    try:
        async with client.stream(
            "POST",
            endpoint.base_url.rstrip("/") + "/v1/completions",
            json=body,
            timeout=endpoint.timeout_s,
        ) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:500]
                record.error = f"HTTP {response.status_code}: {detail}"
                return record
            async for line in response.aiter_lines():
                # SSE: "data: {...}" lines; comments (": ping") and blank lines are skipped.
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {chunk['error']}"
                    return record
                if chunk.get("usage"):
                    _apply_usage(record, chunk["usage"])
                    usage_seen = True
                choices = chunk.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                record.num_chunks += 1
                text_chunks += 1
                if record.ttft is None:
                    record.ttft = now - sent
                else:
                    record.itl.append(now - last)
                last = now
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    record.e2e = time.perf_counter() - sent
    if not usage_seen or record.output_tokens == 0:
        # Without usage, one streamed chunk is taken as one token (what vLLM and llama.cpp send).
        record.output_tokens = text_chunks
    if record.ttft is None:
        record.error = "no token was streamed"
    return record


@dataclass(slots=True)
class RunResult:
    """All records of one workload run against one endpoint, plus its wall time."""

    records: list[RequestRecord]
    duration: float
    concurrency: int | None
    request_rate: float | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "duration": self.duration,
            "concurrency": self.concurrency,
            "request_rate": self.request_rate,
            "records": [r.to_dict() for r in self.records],
        }


def _check_dependencies(requests: list[BenchRequest]) -> dict[str, list[BenchRequest]]:
    ids = {r.request_id for r in requests}
    if len(ids) != len(requests):
        raise ValueError("request ids in a workload must be unique")
    dependents: dict[str, list[BenchRequest]] = {}
    for r in requests:
        if r.after is not None:
            if r.after not in ids:
                raise ValueError(f"request {r.request_id} waits for unknown request {r.after!r}")
            dependents.setdefault(r.after, []).append(r)
    reachable = 0
    frontier = [r for r in requests if r.after is None]
    while frontier:
        reachable += len(frontier)
        frontier = [d for r in frontier for d in dependents.get(r.request_id, [])]
    if reachable != len(requests):
        raise ValueError("the requests' `after` links form a cycle; some would never be sent")
    return dependents


async def run_workload(  # noqa: C901 - the bench loop's pacing modes (closed loop, Poisson) and its one result record; split with the harness rework
    requests: list[BenchRequest],
    endpoint: EndpointConfig,
    concurrency: int | None = 8,
    request_rate: float | None = None,
    seed: int = 0,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> RunResult:
    """Send `requests` and return their records in workload order.

    With `request_rate` (requests/s), arrivals follow a seeded Poisson process and `concurrency`
    (None = unbounded) caps how many are in flight; without it, `concurrency` requests are kept in
    flight. A request with `after` set becomes ready when that request finishes (successfully or
    not), and never before its own arrival time.
    """
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1 or None, got {concurrency!r}")
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 or None, got {request_rate!r}")
    if request_rate is None and concurrency is None:
        raise ValueError("give a concurrency, a request_rate, or both")
    dependents = _check_dependencies(requests)
    num_workers = concurrency if concurrency is not None else len(requests)
    ready: asyncio.Queue[BenchRequest | None] = asyncio.Queue()
    records: dict[str, RequestRecord] = {}
    arrival: dict[str, float] = {}
    if request_rate is not None:
        rng = random.Random(seed)
        t = 0.0
        for r in requests:
            arrival[r.request_id] = t
            t += rng.expovariate(request_rate)
    all_done = asyncio.Event()
    t0 = time.perf_counter()

    async def release(req: BenchRequest) -> None:
        delay = arrival.get(req.request_id, 0.0) - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        await ready.put(req)

    limits = httpx.Limits(max_connections=num_workers + 4, max_keepalive_connections=num_workers)
    async with httpx.AsyncClient(limits=limits, timeout=endpoint.timeout_s) as client:
        pending: set[asyncio.Task[None]] = set()

        def schedule(req: BenchRequest) -> None:
            task = asyncio.create_task(release(req))
            pending.add(task)
            task.add_done_callback(pending.discard)

        async def worker() -> None:
            while True:
                req = await ready.get()
                if req is None:
                    return
                record = await send_request(client, req, endpoint, t0)
                records[req.request_id] = record
                if on_done is not None:
                    on_done(record)
                for nxt in dependents.get(req.request_id, []):
                    schedule(nxt)
                if len(records) == len(requests):
                    all_done.set()

        for r in requests:
            if r.after is None:
                schedule(r)
        workers = [asyncio.create_task(worker()) for _ in range(num_workers)]
        if requests:
            await all_done.wait()
        duration = time.perf_counter() - t0
        for _ in workers:
            await ready.put(None)
        await asyncio.gather(*workers)
    return RunResult([records[r.request_id] for r in requests], duration, concurrency, request_rate)
