"""The Messages API (/v1/messages) through Anthropic's own SDK against a live server: responses,
streams (the SDK's stream helper), the async client, count_tokens, errors as the SDK's error
classes, and `cache_control` breakpoints: what a request wrote is `cache_creation_input_tokens`,
what a later one read of it is `cache_read_input_tokens`, and the three counts add up to the
prompt. The OpenAI SDK on the same server reaches the same retention through
`prompt_cache_retention`."""

from __future__ import annotations

import asyncio
import uuid

import anthropic
import httpx
import pytest

from tests.helpers.server import KEY_ADMIN, KEY_ALPHA, KEY_BETA, MODEL_NAME, ssl_context


@pytest.fixture(scope="module", autouse=True)
def _release_breakpoints(server):
    """These tests hold breakpoints for 5 minutes in the session's shared engine; a reset at the
    end releases them, so later tests find an idle pool idle."""
    yield
    server.wait_idle()
    with httpx.Client(base_url=server.url, timeout=60, verify=ssl_context()) as http:
        reset = http.post("/reset_prefix_cache", headers={"Authorization": f"Bearer {KEY_ADMIN}"})
    assert reset.json() == {"success": True}
    assert server.run_in_engine(lambda e: len(e.kv_cache_manager.held.breakpoints)) == 0


EPHEMERAL = {"type": "ephemeral"}
ONE_HOUR = {"type": "ephemeral", "ttl": "1h"}


def _client(server, key: str = KEY_ALPHA) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.url,
        api_key=key,
        max_retries=0,
        timeout=120,
        http_client=anthropic.DefaultHttpxClient(verify=ssl_context()),
    )


def _system(words: int = 120) -> str:
    """A system prompt no other test sends (a fresh prefix: nothing of it is cached yet)."""
    tag = uuid.uuid4().hex
    return f"[{tag}] " + " ".join(f"rule{i} {tag[i % 32]}" for i in range(words))


def _ask(client, system: str, question: str, ttl: dict = EPHEMERAL, max_tokens: int = 4, **kwargs):
    return client.messages.create(
        model=MODEL_NAME,
        max_tokens=max_tokens,
        system=[{"type": "text", "text": system, "cache_control": ttl}],
        messages=[{"role": "user", "content": question}],
        **kwargs,
    )


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def test_a_message_answers_in_anthropics_shape_with_usage_that_adds_up(server):
    client = _client(server)
    message = client.messages.create(
        model=MODEL_NAME,
        max_tokens=5,
        messages=[{"role": "user", "content": "Say hello."}],
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == MODEL_NAME
    assert message.content[0].type == "text"
    assert message.stop_reason in ("end_turn", "max_tokens")
    counted = client.messages.count_tokens(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Say hello."}]
    )
    assert _prompt_tokens(message.usage) == counted.input_tokens
    assert message.usage.cache_creation_input_tokens == 0  # no breakpoint: nothing written
    assert 1 <= message.usage.output_tokens <= 5


def test_a_breakpoint_is_written_once_then_read_by_the_next_request(server):
    client = _client(server)
    system = _system()
    first = _ask(client, system, "What is rule 3?")
    assert first.usage.cache_read_input_tokens < 16  # at most the template's shared head
    assert first.usage.cache_creation_input_tokens >= 200
    second = _ask(client, system, "And rule 7?")
    written = first.usage.cache_read_input_tokens + first.usage.cache_creation_input_tokens
    assert second.usage.cache_read_input_tokens >= written
    assert second.usage.cache_creation_input_tokens == 0  # held already: a refresh, no write
    assert _prompt_tokens(second.usage) == _prompt_tokens(first.usage) + (
        len(server.engine.tokenizer.encode("And rule 7?", add_special_tokens=False))
        - len(server.engine.tokenizer.encode("What is rule 3?", add_special_tokens=False))
    )


def test_the_cache_report_says_which_breakpoint_a_miss_stopped_at(server):
    client = _client(server)
    system = _system()
    message = client.messages.create(
        model=MODEL_NAME,
        max_tokens=2,
        system=[{"type": "text", "text": system, "cache_control": EPHEMERAL}],
        messages=[{"role": "user", "content": "Q"}],
        extra_body={"cache_report": True},
    )
    report = message.model_extra["cache_report"]
    assert report["miss_at_breakpoint"] == 0
    [entry] = report["breakpoints"]
    assert entry["status"] == "held" and not entry["read"]
    again = client.messages.create(
        model=MODEL_NAME,
        max_tokens=2,
        system=[{"type": "text", "text": system, "cache_control": EPHEMERAL}],
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Another question? " * 20, "cache_control": EPHEMERAL}
                ],
            }
        ],
        extra_body={"cache_report": True},
    )
    report = again.model_extra["cache_report"]
    assert [b["read"] for b in report["breakpoints"]] == [True, False]
    assert report["miss_at_breakpoint"] == 1


def test_the_sdk_stream_helper_gets_text_and_the_usage_in_anthropics_events(server):
    client = _client(server)
    system = _system()
    with client.messages.stream(
        model=MODEL_NAME,
        max_tokens=6,
        extra_body={"temperature": 0.0},
        system=[{"type": "text", "text": system, "cache_control": EPHEMERAL}],
        messages=[{"role": "user", "content": "Count to three."}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text
    assert final.usage.cache_creation_input_tokens >= 200
    assert final.stop_reason in ("end_turn", "max_tokens")
    # The same request, not streamed, gives the same text (greedy), reading the breakpoint.
    again = _ask(client, system, "Count to three.", max_tokens=6, extra_body={"temperature": 0.0})
    assert again.content[0].text == text
    assert again.usage.cache_read_input_tokens >= final.usage.cache_creation_input_tokens


def test_the_raw_event_stream_has_anthropics_event_order(server):
    with httpx.Client(base_url=server.url, timeout=120, verify=ssl_context()) as http:
        with http.stream(
            "POST",
            "/v1/messages",
            headers={"x-api-key": KEY_ALPHA, "anthropic-version": "2023-06-01"},
            json={
                "model": MODEL_NAME,
                "max_tokens": 3,
                "stream": True,
                "messages": [{"role": "user", "content": "Hi"}],
            },
        ) as response:
            assert response.status_code == 200
            names = [
                line.split(": ", 1)[1]
                for line in response.iter_lines()
                if line.startswith("event: ")
            ]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) <= {"content_block_delta"}


def test_the_async_client_reads_what_the_sync_client_wrote(server):
    system = _system()
    first = _ask(_client(server), system, "First?")

    async def ask() -> anthropic.types.Message:
        async with anthropic.AsyncAnthropic(
            base_url=server.url, api_key=KEY_ALPHA, max_retries=0, timeout=120
        ) as client:
            return await client.messages.create(
                model=MODEL_NAME,
                max_tokens=3,
                system=[{"type": "text", "text": system, "cache_control": EPHEMERAL}],
                messages=[{"role": "user", "content": "Second?"}],
            )

    second = asyncio.run(ask())
    assert second.usage.cache_read_input_tokens >= first.usage.cache_creation_input_tokens


def test_an_agent_loop_reads_the_previous_turns_at_every_later_turn(server):
    client = _client(server)
    system = _system(100)
    history: list[dict] = []
    previous_prompt = 0
    for turn in range(4):
        # The breakpoint rides the newest user turn, as agents place it.
        for message in history:
            if message["role"] == "user":
                message["content"] = [{"type": "text", "text": message["content"][0]["text"]}]
        question = f"Turn {turn}: what next?"
        history.append(
            {
                "role": "user",
                "content": [{"type": "text", "text": question, "cache_control": EPHEMERAL}],
            }
        )
        reply = client.messages.create(
            model=MODEL_NAME,
            max_tokens=4,
            system=[{"type": "text", "text": system, "cache_control": EPHEMERAL}],
            messages=history,
        )
        usage = reply.usage
        if turn:
            assert usage.cache_read_input_tokens >= 0.9 * previous_prompt, (turn, usage)
        previous_prompt = _prompt_tokens(usage)
        history.append({"role": "assistant", "content": reply.content[0].text or "ok"})


def test_another_tenant_never_reads_a_tenants_breakpoint(server):
    system = _system()
    _ask(_client(server, KEY_ALPHA), system, "Q1")
    other = _ask(_client(server, KEY_BETA), system, "Q1")
    assert other.usage.cache_read_input_tokens < 16
    assert other.usage.cache_creation_input_tokens >= 200


def test_the_metrics_count_writes_and_held_breakpoint_blocks(server):
    system = _system()
    _ask(_client(server), system, "Q")
    with httpx.Client(base_url=server.url, timeout=60, verify=ssl_context()) as http:
        text = http.get("/metrics", headers={"Authorization": f"Bearer {KEY_ADMIN}"}).text
        summary = http.get(
            "/v1/cache/summary", headers={"Authorization": f"Bearer {KEY_ADMIN}"}
        ).json()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }
    assert values["prefixserve_prefix_cache_write_tokens_total"] >= 200
    assert values["prefixserve_kv_cache_breakpoint_blocks"] >= 12
    assert values["prefixserve_request_cache_write_prompt_tokens_total"] >= 200
    assert summary["breakpoints"]["tenants"]["alpha"]["blocks"] >= 12


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (
            [
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": ""},
                }
            ],
            "'image' content block",
        ),
        (
            [{"type": "text", "text": f"b{i}", "cache_control": EPHEMERAL} for i in range(5)],
            "at most 4",
        ),
    ],
)
def test_content_the_server_cannot_take_is_a_400_in_anthropics_shape(server, content, needle):
    with pytest.raises(anthropic.BadRequestError) as caught:
        _client(server).messages.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": content}]
        )
    assert caught.value.status_code == 400
    assert caught.value.body["type"] == "error"
    assert needle in caught.value.body["error"]["message"]
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_a_1h_breakpoint_after_a_5m_one_is_refused_as_anthropic_refuses_it(server):
    with pytest.raises(anthropic.BadRequestError, match="ttl '1h' cannot come after"):
        _client(server).messages.create(
            model=MODEL_NAME,
            max_tokens=2,
            system=[{"type": "text", "text": _system(), "cache_control": EPHEMERAL}],
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "q", "cache_control": ONE_HOUR}],
                }
            ],
        )


def test_a_1h_breakpoint_and_the_automatic_5m_one_on_one_token_are_one_1h_breakpoint(server):
    message = _client(server).messages.create(
        model=MODEL_NAME,
        max_tokens=2,
        system=_system(),
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "What is rule 5?", "cache_control": ONE_HOUR}],
            }
        ],
        cache_control=EPHEMERAL,  # Anthropic's automatic caching: the same last block
        extra_body={"cache_report": True},
    )
    [entry] = message.model_extra["cache_report"]["breakpoints"]
    assert (entry["ttl_s"], entry["status"]) == (3600, "held")
    usage = message.usage
    assert usage.cache_creation_input_tokens >= 200
    assert usage.cache_creation.ephemeral_1h_input_tokens == usage.cache_creation_input_tokens
    assert usage.cache_creation.ephemeral_5m_input_tokens == 0


_TTL_ALLOWED = "'5m' or '1h'"
_SHAPE_ALLOWED = '"type": "ephemeral"'


@pytest.mark.parametrize(
    ("cache_control", "field", "allowed"),
    [
        ({"type": "ephemeral", "ttl": "2h"}, "cache_control.ttl", _TTL_ALLOWED),
        ({"type": "ephemeral", "ttl": 300}, "cache_control.ttl", _TTL_ALLOWED),
        ({"type": "persistent"}, "cache_control.type", "'ephemeral'"),
        ("ephemeral", "cache_control", _SHAPE_ALLOWED),
        (["ephemeral"], "cache_control", _SHAPE_ALLOWED),
    ],
)
@pytest.mark.parametrize(
    ("where", "prefix"),
    [
        ("messages", "messages[0].content[0]."),
        ("system", "system[0]."),
        ("tools", "tools[0]."),
        ("top level", ""),
    ],
)
def test_a_malformed_cache_control_is_a_400_naming_the_field_and_what_is_allowed(
    server, cache_control, field, allowed, where, prefix
):
    block = {"type": "text", "text": "q"}
    body = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "q"}]}
    if where == "messages":
        body["messages"] = [
            {"role": "user", "content": [{**block, "cache_control": cache_control}]}
        ]
    elif where == "system":
        body["system"] = [{**block, "cache_control": cache_control}]
    elif where == "tools":
        body["tools"] = [
            {"name": "t", "input_schema": {"type": "object"}, "cache_control": cache_control}
        ]
    else:
        body["cache_control"] = cache_control
    with httpx.Client(base_url=server.url, timeout=60, verify=ssl_context()) as http:
        response = http.post("/v1/messages", headers={"x-api-key": KEY_ALPHA}, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(prefix + field + ":"), error["message"]
    assert allowed in error["message"], error["message"]


def test_the_sdk_gets_a_bad_request_naming_the_ttl_of_a_malformed_cache_control(server):
    with pytest.raises(anthropic.BadRequestError) as caught:
        _ask(_client(server), _system(), "q", ttl={"type": "ephemeral", "ttl": "2h"})
    message = caught.value.body["error"]["message"]
    assert message.startswith("system[0].cache_control.ttl:") and _TTL_ALLOWED in message


def test_content_that_is_neither_a_string_nor_blocks_is_a_400_saying_what_is_allowed(server):
    with pytest.raises(anthropic.BadRequestError) as caught:
        _client(server).messages.create(
            model=MODEL_NAME, max_tokens=2, messages=[{"role": "user", "content": 5}]
        )
    message = caught.value.body["error"]["message"]
    assert message.startswith("messages[0].content:") and "a string or a list" in message


def test_sdk_error_classes_for_a_bad_key_an_unknown_model_and_an_operator_key(server):
    with pytest.raises(anthropic.AuthenticationError) as caught:
        _ask(_client(server, "sk-wrong"), "s", "q")
    assert caught.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        _client(server).messages.create(
            model="no-such-model", max_tokens=2, messages=[{"role": "user", "content": "q"}]
        )
    with pytest.raises(anthropic.PermissionDeniedError):
        _ask(_client(server, KEY_ADMIN), "s", "q")


def test_a_bearer_token_works_as_well_as_x_api_key(server):
    with httpx.Client(base_url=server.url, timeout=120, verify=ssl_context()) as http:
        response = http.post(
            "/v1/messages",
            headers={"Authorization": f"Bearer {KEY_ALPHA}"},
            json={
                "model": MODEL_NAME,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": "q"}],
            },
        )
    assert response.status_code == 200 and response.json()["type"] == "message"


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 0},
        {"temperature": 1.5},
        {"stream": "yes"},
        {"unknown_field": 1},
        {"messages": []},
        {"messages": [{"role": "assistant", "content": "prefill"}]},
    ],
)
def test_malformed_bodies_are_400s_in_anthropics_shape(server, body):
    full = {"model": MODEL_NAME, "max_tokens": 2, "messages": [{"role": "user", "content": "q"}]}
    full.update(body)
    with httpx.Client(base_url=server.url, timeout=60, verify=ssl_context()) as http:
        response = http.post("/v1/messages", headers={"x-api-key": KEY_ALPHA}, json=full)
    assert response.status_code == 400, response.text
    assert response.json()["type"] == "error"


def test_openais_24h_retention_holds_the_prompt_for_the_openai_sdk(server):
    client = server.client()
    prompt = _system()
    kwargs = {"model": MODEL_NAME, "max_tokens": 2, "temperature": 0.0}
    client.chat.completions.create(
        messages=[{"role": "user", "content": prompt}],
        extra_body={"prompt_cache_retention": "24h"},
        **kwargs,
    )
    held = server.run_in_engine(lambda e: e.kv_cache_manager.held.breakpoints.describe())
    assert held["alpha"]["breakpoints"] >= 1
    again = client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs)
    assert again.usage.prompt_tokens_details.cached_tokens >= 200


def test_the_async_openai_sdk_streams_and_reads_a_24h_retention(server):
    prompt = _system()

    async def stream_once() -> int:
        client = server.async_client()
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"prompt_cache_retention": "24h"},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        await client.close()
        return usage.prompt_tokens_details.cached_tokens

    first = asyncio.run(stream_once())  # at most the chat template's shared head
    assert asyncio.run(stream_once()) >= first + 200


def test_no_block_leaks_after_the_messages_tests(server):
    server.check_no_leaks()


def test_the_inspector_shows_writes_reads_and_each_tenants_held_breakpoints(server):
    from selenium.webdriver.support.ui import WebDriverWait

    from tests.helpers.browser import chromium, send_key

    _ask(_client(server, KEY_BETA), _system(), "Q")
    with chromium() as driver:
        send_key(driver, KEY_ADMIN)
        driver.get(server.url + "/inspector")
        shown = WebDriverWait(driver, 60, poll_frequency=0.2).until(
            lambda d: d.execute_script(
                "const row = document.querySelector('#breakpoints tr[data-tenant=\"beta\"]');"
                "const writes = document.getElementById('cache-writes').dataset.value;"
                "return row && Number(writes) > 0 ? {"
                " blocks: Number(row.children[2].textContent.replace(/,/g, '')),"
                " writes: Number(writes),"
                " reads: document.getElementById('cache-reads').dataset.value} : null;"
            ),
            message="the inspector never showed beta's held breakpoint",
        )
    assert shown["blocks"] >= 12 and shown["writes"] >= 200
    assert shown["reads"] != ""


def test_count_tokens_is_a_tenant_route_bounded_like_the_messages_route(server):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "q"}]}
    with httpx.Client(base_url=server.url, timeout=60, verify=ssl_context()) as http:
        for key, status in ((KEY_ALPHA, 200), (KEY_ADMIN, 403), ("sk-wrong", 401)):
            r = http.post("/v1/messages/count_tokens", headers={"x-api-key": key}, json=body)
            assert r.status_code == status, (key, r.text)
        too_long = {**body, "messages": [{"role": "user", "content": "x" * 10_000_000}]}
        # Refused before its body was read (the guard's 413, test_server_guard.py); the server
        # drains the upload before closing (lingering_close.py), so the client reads the 413.
        r = http.post("/v1/messages/count_tokens", headers={"x-api-key": KEY_ALPHA}, json=too_long)
        assert r.status_code == 413 and r.json()["type"] == "error"
        r = http.post("/v1/messages/count_tokens", headers={"x-api-key": KEY_ALPHA}, json=body)
        assert r.status_code == 200  # and the server goes on
