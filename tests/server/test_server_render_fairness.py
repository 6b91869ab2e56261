"""The tokenizer thread is shared fairly and bounded per tenant: its queue takes tenants in turn
(tokenizer_queue.py), and a tenant past `--max-render-jobs-per-tenant` gets a 429 (admission.py),
on every route that renders or tokenizes, /v1/messages/count_tokens included."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from prefixserve.entrypoints.api_server import build_app
from prefixserve.entrypoints.server.admission import Admission
from prefixserve.entrypoints.server.auth import ApiKeys
from prefixserve.entrypoints.server.errors import OpenAIError
from prefixserve.entrypoints.server.tokenizer_queue import TokenizerQueue
from tests.helpers.server import KEY_ALPHA, KEY_BETA, MODEL_NAME, serve_in_thread, ssl_context

RENDER_BOUND = 8
FLOOD = 24
# The bodies: 10,000 empty messages, ~355 KB, a fifth of a second to render each.
HEAVY = {
    "model": MODEL_NAME,
    "messages": [{"role": ("user", "assistant")[i % 2], "content": ""} for i in range(9_999)]
    + [{"role": "user", "content": "q"}],
}
LIGHT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "one line"}]}


# ------------------------------------------------------------------------- the admission bound
def test_a_tenant_past_its_render_bound_gets_429_and_the_others_do_not():
    admission = Admission(max_render_jobs_per_tenant=2)
    admission.admit_render("a")
    admission.admit_render("a")
    with pytest.raises(OpenAIError, match="--max-render-jobs-per-tenant") as info:
        admission.admit_render("a")
    assert info.value.status_code == 429 and info.value.headers == {"Retry-After": "1"}
    admission.admit_render("b")
    admission.release_render("a")
    admission.admit_render("a")
    for tenant in ("a", "a", "b"):
        admission.release_render(tenant)
    assert admission.render_jobs_of == {}


# ---------------------------------------------------------------------------- the fair queue
class _Thread:
    """Jobs for the queue that record the order they ran in; `hold` keeps the thread busy
    until `release`."""

    def __init__(self) -> None:
        self.ran: list[str] = []
        self.gate = threading.Event()

    def job(self, name: str):
        return lambda: self.ran.append(name) or name

    def hold(self):
        def held() -> str:
            self.gate.wait(60)
            self.ran.append("held")
            return "held"

        return held


async def _started(queue: TokenizerQueue, tenant: str, waiting: int) -> None:
    """Yield to the loop until `tenant` has `waiting` jobs queued (no timing involved)."""
    while queue.num_waiting(tenant) < waiting:
        await asyncio.sleep(0)


def test_a_tenants_job_waits_for_the_running_job_only_never_for_another_tenants_backlog():
    async def scenario() -> list[str]:
        queue, thread = TokenizerQueue(), _Thread()
        held = asyncio.ensure_future(queue.run("alpha", thread.hold()))
        backlog = [asyncio.ensure_future(queue.run("alpha", thread.job(f"a{i}"))) for i in range(5)]
        await _started(queue, "alpha", 5)
        beta = asyncio.ensure_future(queue.run("beta", thread.job("b")))
        await _started(queue, "beta", 1)
        thread.gate.set()
        await asyncio.gather(held, beta, *backlog)
        return thread.ran

    assert asyncio.run(scenario()) == ["held", "b", "a0", "a1", "a2", "a3", "a4"]


def test_tenants_with_backlogs_take_the_thread_in_turn():
    async def scenario() -> list[str]:
        queue, thread = TokenizerQueue(), _Thread()
        held = asyncio.ensure_future(queue.run("alpha", thread.hold()))
        jobs = [asyncio.ensure_future(queue.run("alpha", thread.job(f"a{i}"))) for i in range(3)]
        await _started(queue, "alpha", 3)
        jobs += [asyncio.ensure_future(queue.run("beta", thread.job(f"b{i}"))) for i in range(3)]
        await _started(queue, "beta", 3)
        thread.gate.set()
        await asyncio.gather(held, *jobs)
        return thread.ran

    assert asyncio.run(scenario()) == ["held", "b0", "a0", "b1", "a1", "b2", "a2"]


def test_a_cancelled_waiting_job_never_runs_and_the_others_go_on():
    async def scenario() -> tuple[list[str], int]:
        queue, thread = TokenizerQueue(), _Thread()
        held = asyncio.ensure_future(queue.run("alpha", thread.hold()))
        dropped = asyncio.ensure_future(queue.run("alpha", thread.job("dropped")))
        kept = asyncio.ensure_future(queue.run("beta", thread.job("kept")))
        await _started(queue, "beta", 1)
        dropped.cancel()
        thread.gate.set()
        await asyncio.gather(held, kept)
        with pytest.raises(asyncio.CancelledError):
            await dropped
        return thread.ran, queue.num_waiting("alpha")

    assert asyncio.run(scenario()) == (["held", "kept"], 0)


def test_a_job_cancelled_while_it_runs_keeps_the_thread_until_it_ends():
    async def scenario() -> list[str]:
        queue, thread = TokenizerQueue(), _Thread()
        held = asyncio.ensure_future(queue.run("alpha", thread.hold()))
        after = asyncio.ensure_future(queue.run("beta", thread.job("after")))
        await _started(queue, "beta", 1)
        held.cancel()
        await asyncio.sleep(0)
        assert queue.num_waiting("beta") == 1  # not handed to the thread while "held" runs
        thread.gate.set()
        await after
        return thread.ran

    assert asyncio.run(scenario()) == ["held", "after"]


def test_a_failing_job_raises_in_its_caller_and_frees_the_thread():
    def broken() -> None:
        raise ValueError("the template refused")

    async def scenario() -> str:
        queue = TokenizerQueue()
        with pytest.raises(ValueError, match="the template refused"):
            await queue.run("alpha", broken)
        return await queue.run("beta", lambda: "next")

    assert asyncio.run(scenario()) == "next"


def test_a_job_the_executor_refuses_gives_the_turn_back():
    """`run_in_executor` itself failing (a shut-down executor) must not leave the thread's turn
    taken: every later prompt would wait for ever."""

    async def scenario() -> int:
        queue = TokenizerQueue()
        queue.executor.shutdown()
        with pytest.raises(RuntimeError):
            await queue.run("alpha", lambda: 0)
        queue.executor = ThreadPoolExecutor(max_workers=1)
        return await asyncio.wait_for(queue.run("beta", lambda: 1), timeout=10)

    assert asyncio.run(scenario()) == 1


# ------------------------------------------------------------------------- over a live server
@pytest.fixture(scope="module")
def bounded(async_engine) -> Iterator[tuple[str, Admission]]:
    keys = ApiKeys()
    keys.add(KEY_ALPHA, "alpha")
    keys.add(KEY_BETA, "beta")
    admission = Admission(max_render_jobs_per_tenant=RENDER_BOUND)
    app = build_app(async_engine, [MODEL_NAME], api_keys=keys, admission=admission)
    server, thread, url = serve_in_thread(app)
    yield url, admission
    server.should_exit = True
    thread.join(timeout=30)


def _headers(key: str) -> dict[str, str]:
    return {"x-api-key": key}


async def _flood_then_one_line(url: str) -> list[tuple[str, int]]:
    """Alpha sends FLOOD heavy count_tokens at once; beta sends one line as soon as alpha is
    refused (its bound is full then), or once alpha's flood is all answered. Returns each
    response's (tenant, status) in the order they came back."""
    answered: list[tuple[str, int]] = []
    alpha_refused = asyncio.Event()
    limits = httpx.Limits(max_connections=FLOOD + 1)
    async with httpx.AsyncClient(
        base_url=url, timeout=300, verify=ssl_context(), limits=limits
    ) as http:

        async def alpha() -> None:
            r = await http.post(
                "/v1/messages/count_tokens", headers=_headers(KEY_ALPHA), json=HEAVY
            )
            answered.append(("alpha", r.status_code))
            if r.status_code == 429:
                assert r.json()["error"]["type"] == "rate_limit_error"
                assert r.headers["Retry-After"] == "1"
                alpha_refused.set()

        async def beta() -> None:
            flood = asyncio.gather(*(alpha() for _ in range(FLOOD)))
            refused = asyncio.ensure_future(alpha_refused.wait())
            await asyncio.wait([refused, flood], return_when=asyncio.FIRST_COMPLETED)
            refused.cancel()
            r = await http.post("/v1/messages/count_tokens", headers=_headers(KEY_BETA), json=LIGHT)
            answered.append(("beta", r.status_code))
            await flood

        await beta()
    return answered


def test_a_count_tokens_flood_is_refused_past_its_bound_and_never_queues_another_tenant_behind_it(
    bounded,
):
    url, admission = bounded
    answered = asyncio.run(_flood_then_one_line(url))
    alpha = [status for tenant, status in answered if tenant == "alpha"]
    assert answered.count(("beta", 200)) == 1
    assert alpha.count(429) >= 1 and set(alpha) == {200, 429}
    # Beta came while alpha held its bound of jobs on the thread; it waited for the one running
    # (and the one given the turn before it came), never for all of them.
    beta_at = answered.index(("beta", 200))
    assert ("alpha", 200) in answered[beta_at + 1 :], answered
    assert admission.render_jobs_of == {}


def test_chat_and_messages_rendering_count_against_the_same_render_bound(bounded):
    url, admission = bounded
    chat = {**HEAVY, "max_tokens": 1}

    async def flood() -> list[int]:
        async with httpx.AsyncClient(
            base_url=url,
            timeout=300,
            verify=ssl_context(),
            limits=httpx.Limits(max_connections=FLOOD),
        ) as http:

            async def one(i: int) -> int:
                if i % 2:
                    path, headers, body = "/v1/messages", _headers(KEY_ALPHA), chat
                else:
                    path, headers = "/v1/chat/completions", {"Authorization": f"Bearer {KEY_ALPHA}"}
                    body = chat
                return (await http.post(path, headers=headers, json=body)).status_code

            return list(await asyncio.gather(*(one(i) for i in range(FLOOD))))

    statuses = asyncio.run(flood())
    # 10,000 messages are longer than the context: the renders that were admitted end in a 400.
    assert statuses.count(429) >= 1 and set(statuses) <= {400, 429}, statuses
    assert admission.render_jobs_of == {}


def test_the_sdks_see_the_render_bound_as_a_rate_limit_and_the_other_tenant_is_served(bounded):
    """What clients see of the bound, through the official SDKs (no retries): while alpha's
    render bound is full (held here, as a flood holds it; the floods above fill it over HTTP),
    alpha's requests over both dialects get RateLimitErrors (429), never another error class;
    beta's one-line question is answered meanwhile, and alpha's once its jobs are done."""
    url, admission = bounded
    import anthropic
    import openai

    def clients(key: str) -> tuple:  # noqa: ANN202
        http = {"verify": ssl_context()}
        return (
            anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60,
                                http_client=anthropic.DefaultHttpxClient(**http)),
            openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60,
                          http_client=openai.DefaultHttpxClient(**http)),
        )  # fmt: skip

    def ask(ant, oai) -> list:  # noqa: ANN001
        counted = ant.messages.count_tokens(model=MODEL_NAME, messages=LIGHT["messages"])
        answer = oai.chat.completions.create(
            model=MODEL_NAME, messages=LIGHT["messages"], max_tokens=1
        )
        return [counted.input_tokens, answer.usage.prompt_tokens]

    alpha, beta = clients(KEY_ALPHA), clients(KEY_BETA)
    for _ in range(RENDER_BOUND):
        admission.admit_render("alpha")
    try:
        with pytest.raises(anthropic.RateLimitError) as refused:
            alpha[0].messages.count_tokens(model=MODEL_NAME, messages=HEAVY["messages"])
        assert refused.value.response.headers["retry-after"] == "1"
        with pytest.raises(openai.RateLimitError) as refused:
            alpha[1].chat.completions.create(
                model=MODEL_NAME, messages=LIGHT["messages"], max_tokens=1
            )
        assert refused.value.response.headers["retry-after"] == "1"
        assert min(ask(*beta)) > 0
    finally:
        for _ in range(RENDER_BOUND):
            admission.release_render("alpha")
    assert min(ask(*alpha)) > 0
    assert admission.render_jobs_of == {}
