"""Clients that go away free their blocks; 32 concurrent streams share a system prompt cleanly."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import uuid

import httpx

from tests.helpers.server import MODEL_NAME

LONG_RUN = 400  # tokens a request would generate if nobody stopped it


def test_a_client_disconnecting_mid_stream_aborts_its_request_and_frees_its_blocks(server):
    server.wait_idle()
    before = server.metrics()
    body = {
        "model": MODEL_NAME,
        "prompt": f"Disconnect {uuid.uuid4().hex}: tell a very long story.",
        "max_tokens": LONG_RUN,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["text"] is not None
        during = server.metrics()
        assert during["num_running"] + during["num_waiting"] >= 1
        assert during["kv_cache_usage"] > 0
        # Leaving the block closes the connection with the stream unread.
    after = server.wait_idle()
    generated = after["generation_tokens"] - before["generation_tokens"]
    assert 1 <= generated < LONG_RUN, "the request was not aborted when its client left"
    assert after["kv_cache_usage"] == 0
    server.check_no_leaks()


def test_a_client_disconnecting_before_a_full_response_aborts_it(server):
    server.wait_idle()
    before = server.metrics()
    payload = json.dumps(
        {
            "model": MODEL_NAME,
            "prompt": f"Unstreamed {uuid.uuid4().hex}",
            "max_tokens": LONG_RUN,
            "ignore_eos": True,
        }
    ).encode()
    host, port = server.url.removeprefix("http://").split(":")
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(request)
        # Wait until the engine is generating for it, then hang up.
        for _ in range(2400):
            if server.metrics()["generation_tokens"] > before["generation_tokens"]:
                break
            time.sleep(0.05)
    after = server.wait_idle()
    generated = after["generation_tokens"] - before["generation_tokens"]
    assert 1 <= generated < LONG_RUN, "the request was not aborted when its client left"
    server.check_no_leaks()


SYSTEM_PROMPT = (
    "You are a helpful assistant for a bookshop. Answer in one short sentence, politely, "
    "without lists, and never mention that you are an assistant. The shop opens at nine, "
    "closes at six, and sells new and second-hand books in English and French."
)


def test_32_concurrent_streaming_clients_sharing_a_system_prompt(server):
    server.wait_idle()
    num_clients = 32
    max_tokens = 8

    async def one(client, i: int) -> tuple[str, str | None, object]:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"Question {i}: when do you open on day {i}?"},
            ],
            max_tokens=max_tokens,
            temperature=0.7,
            seed=i,
            stream=True,
            stream_options={"include_usage": True},
        )
        text, finish, usage = "", None, None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage is not None:
                usage = chunk.usage
        return text, finish, usage

    async def run_all():
        async with server.async_client() as client:
            # One request first, so the system prompt is in the cache for the rest.
            first = await one(client, 0)
            rest = await asyncio.gather(*(one(client, i) for i in range(1, num_clients)))
            return [first, *rest]

    results = asyncio.run(run_all())
    assert len(results) == num_clients
    for _text, finish, usage in results:
        assert finish in ("stop", "length")
        assert usage is not None
        assert 1 <= usage.completion_tokens <= max_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        if finish == "length":
            assert usage.completion_tokens == max_tokens
    # Everyone after the first shares the system prompt's full blocks.
    assert all(usage.prompt_tokens_details.cached_tokens >= 32 for _, _, usage in results[1:])
    after = server.wait_idle()
    assert after["kv_cache_usage"] == 0
    assert after["num_running"] == 0 and after["num_waiting"] == 0
    server.check_no_leaks()


def test_health_and_models_answer_while_the_engine_is_busy(server):
    async def run():
        async with httpx.AsyncClient(
            base_url=server.url, headers={"Authorization": f"Bearer {server.api_key}"}, timeout=120
        ) as http:
            busy = asyncio.create_task(
                http.post(
                    "/v1/completions",
                    json={
                        "model": MODEL_NAME,
                        "prompt": "Busy",
                        "max_tokens": 16,
                        "ignore_eos": True,
                    },
                )
            )
            await asyncio.sleep(0)
            health = await http.get("/health")
            models = await http.get("/v1/models")
            return health, models, await busy

    health, models, busy = asyncio.run(run())
    assert health.status_code == 200 and models.status_code == 200
    assert busy.json()["usage"]["completion_tokens"] == 16
