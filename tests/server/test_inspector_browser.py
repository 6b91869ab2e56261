"""The live cache inspector (issue 29) in a real browser: a headless Chromium opens /inspector on
the session's server with the operator key, requests go through the API as tenant alpha, and the
page's numbers, tree and report table follow them; a tenant key is refused, on the wire and in the
page; the page loads nothing from another origin.

The browser parts skip (counted in pytest's summary, tests/conftest.py) where Debian's chromium,
chromium-driver or the selenium package is missing; `make browser` installs the Debian packages.

Login: the operator key goes as HTTP Basic credentials in an Authorization header that the
DevTools protocol adds to every request of the page (Network.setExtraHTTPHeaders,
tests.helpers.browser.send_key), the page's EventSource included. The login path a person uses,
credentials in the URL (http://operator:<key>@127.0.0.1:<port>/inspector), has its own test: a
browser may send those with the page load only, and the page load's session cookie
(inspector_sessions.py) is what lets the page's event stream in. The header is kept because a
test can swap the key on an open page.

`PREFIXSERVE_WRITE_SCREENSHOT=1` writes the first test's screenshot to docs/inspector.png (the one
the README shows); otherwise it goes to the test's tmp_path, so a run leaves the tree clean.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import httpx

from tests.helpers.browser import WINDOW, basic_auth, chromium, send_key, sent_headers
from tests.helpers.server import BLOCK_SIZE, KEY_ADMIN, KEY_ALPHA, KEY_BETA, MODEL_NAME, LiveServer

REASONS = {
    "not_full_block",
    "last_token_rule",
    "never_seen",
    "evicted",
    "disk_load_skipped",
    "expired",
    "in_flight_wait",
    "cache_disabled",
    "salt_or_tenant",
    "adapter",
}
STATIC_DIR = Path(__file__).resolve().parents[2] / "prefixserve/entrypoints/server/static/inspector"
DOCS_SCREENSHOT = Path(__file__).resolve().parents[2] / "docs/inspector.png"
WAIT_S = 90  # generous: the page updates about once a second, the CPU is shared


def _wait(driver: Any, what: str, condition: Any, timeout: float = WAIT_S) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.2).until(condition, message=what)


# The page is redrawn on every summary, so it is read in one script (no stale elements).
_READ_PAGE = """
const q = (s) => Array.from(document.querySelectorAll(s));
const val = (id) => { const e = document.getElementById(id); return e ? e.dataset.value : null; };
return {
  status: document.getElementById('status').textContent,
  state: document.getElementById('status').dataset.state,
  hitRateAll: val('hit-rate-all'),
  cached: val('pool-cached'),
  kvDtype: val('kv-dtype'),
  kvBytesPerToken: val('kv-bytes-per-token'),
  missCounts: Object.fromEntries(q('#miss-legend li').map(li => [li.dataset.reason,
                                                                 Number(li.dataset.count)])),
  rows: q('#reports tbody tr').map(tr => ({
    id: tr.dataset.requestId, reason: tr.dataset.reason, tenant: tr.dataset.tenant,
    hit: Number(tr.dataset.hitBlocks), full: Number(tr.dataset.fullBlocks)})),
  nodes: q('#tree li[data-hash]').map(li => ({
    hash: li.dataset.hash, blocks: Number(li.dataset.blocks), tokens: Number(li.dataset.tokens),
    tenant: li.dataset.tenant,
    children: li.querySelectorAll(':scope > details > ul > li').length})),
};
"""


def _page(driver: Any) -> dict[str, Any]:
    return driver.execute_script(_READ_PAGE)


def _open_live(driver: Any, server: LiveServer) -> dict[str, Any]:
    """Open the inspector as the operator; wait until it is live and has drawn a summary."""
    send_key(driver, KEY_ADMIN)
    driver.get(server.url + "/inspector")
    _wait(driver, "the inspector's status never read 'live'", lambda d: _page(d)["state"] == "live")
    _wait(driver, "no summary was drawn", lambda d: _page(d)["hitRateAll"] not in ("", None))
    return _page(driver)


def _complete(server: LiveServer, prompt: str) -> str:
    response = server.client().completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        max_tokens=2,
        temperature=0.0,
        extra_body={"cache_report": True},
    )
    return response.id


def test_inspector_follows_requests_live(server: LiveServer, tmp_path: Path) -> None:
    started = time.monotonic()
    with chromium() as driver:
        before = _open_live(driver, server)
        # A prompt no test sent before (the nonce leads its first block), sent twice: the second
        # hits its cached blocks. A third shares its trunk and then differs: a branch in the tree.
        nonce = uuid.uuid4().hex
        trunk = f"{nonce} " + " ".join(
            f"Item {i}: the inspector shows cached prefixes as a tree." for i in range(24)
        )
        # Each ending is longer than a block, so both branches hold full blocks of their own.
        ending = " One ending for the first prompt, long enough to fill a block or two of its own."
        other = " Quite another ending: the tree branches here, and this branch has blocks too."
        first = _complete(server, trunk + ending)
        second = _complete(server, trunk + ending)
        third = _complete(server, trunk + other)
        ids = {first, second, third}

        def reports_show_requests(d: Any) -> dict[str, dict[str, Any]] | None:
            rows = {row["id"]: row for row in _page(d)["rows"]}
            return rows if ids <= rows.keys() else None

        rows = _wait(driver, "the report table never showed the requests", reports_show_requests)
        assert rows[first]["reason"] == "never_seen", rows[first]
        assert rows[second]["reason"] in REASONS - {"never_seen"}, rows[second]
        assert rows[third]["reason"] in REASONS, rows[third]
        for rid in ids:
            assert rows[rid]["tenant"] == "alpha", rows[rid]
        full = rows[first]["full"]
        assert full >= 10, rows[first]  # a long prompt: many full blocks
        # All of it, but for the last-token rule; the third, the trunk only.
        assert rows[second]["hit"] >= full - 1, rows[second]
        assert 0 < rows[third]["hit"] < full, rows[third]

        def tree_shows_prompt(d: Any) -> dict[str, Any] | None:
            page = _page(d)
            nodes = [n for n in page["nodes"] if n["tenant"] == "alpha"]
            covers = any(n["tokens"] >= full * BLOCK_SIZE for n in nodes)
            branch = any(
                n["tokens"] == rows[third]["hit"] * BLOCK_SIZE and n["children"] >= 2 for n in nodes
            )
            moved = page["hitRateAll"] != before["hitRateAll"]
            return page if covers and branch and moved else None

        page = _wait(
            driver,
            "the tree never showed the prompt's blocks and its branch, or the hit rate never moved",
            tree_shows_prompt,
        )
        assert all(n["blocks"] >= 1 and n["hash"] for n in page["nodes"]), page["nodes"]
        assert page["missCounts"]["never_seen"] >= before["missCounts"].get("never_seen", 0) + 1
        assert page["state"] == "live"
        # The pool's KV dtype and bytes per token (the server's default: bf16, 30 layers x 3 KV
        # heads x K and V x 64 dims x 2 bytes).
        assert page["kvDtype"] == "bf16" and page["kvBytesPerToken"] == str(30 * 3 * 2 * 64 * 2)

        driver.set_window_size(*WINDOW)
        screenshot = (
            DOCS_SCREENSHOT
            if os.environ.get("PREFIXSERVE_WRITE_SCREENSHOT") == "1"
            else tmp_path / "inspector.png"
        )
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        assert driver.save_screenshot(str(screenshot))
        assert screenshot.stat().st_size > 10_000
    print(f"browser test took {time.monotonic() - started:.1f} s")


def test_tenant_keys_are_refused(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path in ("/inspector", "/inspector/events"):
            for key in (KEY_ALPHA, KEY_BETA):
                for auth in (f"Bearer {key}", basic_auth(key)):
                    with http.stream("GET", path, headers={"Authorization": auth}) as r:
                        assert r.status_code == 403, (path, auth, r.status_code)
            with http.stream("GET", path) as r:
                assert r.status_code == 401, (path, r.status_code)
                assert r.headers["www-authenticate"].lower().startswith("basic")
        # The operator's key, as a browser sends it: the page, then a summary on the stream.
        operator = {"Authorization": basic_auth(KEY_ADMIN)}
        page = http.get("/inspector", headers=operator)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        with http.stream("GET", "/inspector/events", headers=operator) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            event, data = None, None
            for line in r.iter_lines():
                if line.startswith("event:"):
                    event = line.partition(":")[2].strip()
                elif line.startswith("data:") and event == "summary":
                    data = json.loads(line.partition(":")[2])
                    break
        assert data is not None and {"pool", "hit_rate", "tree", "recent_reports"} <= data.keys()


def test_inspector_page_refuses_tenant_key(server: LiveServer) -> None:
    with chromium() as driver:
        # A tenant's key on the page itself: refused, no inspector drawn.
        send_key(driver, KEY_ALPHA)
        driver.get(server.url + "/inspector")
        assert driver.find_elements("id", "status") == []
        assert "cache inspector" not in driver.title
        # The page open as the operator, then the key swapped for a tenant's (a revoked or
        # mistyped key): the reconnect is refused and the page says so, with the HTTP status.
        _open_live(driver, server)
        send_key(driver, KEY_ALPHA)
        driver.find_element("id", "reconnect").click()

        def refused(d: Any) -> dict[str, Any] | None:
            page = _page(d)
            return page if page["state"] == "error" else None

        page = _wait(driver, "the page never showed the refusal", refused)
        assert "403" in page["status"], page["status"]


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in ("src", "href", "action", "poster", "srcset", "data") and value:
                self.urls.append(value)


def test_inspector_loads_nothing_from_elsewhere(server: LiveServer) -> None:
    operator = {"Authorization": basic_auth(KEY_ADMIN)}
    with httpx.Client(base_url=server.url, timeout=30, headers=operator) as http:
        page = http.get("/inspector")
        assert page.status_code == 200
        links = _Links()
        links.feed(page.text)
        assert links.urls, "the page links its script and style sheet"
        origin = urlsplit(server.url)
        for url in links.urls:
            absolute = urlsplit(urljoin(server.url + "/inspector", url))
            assert (absolute.scheme, absolute.netloc) == (origin.scheme, origin.netloc), url
            assert http.get(absolute.path).status_code == 200, url  # and it is served
    # Nor do the script and the style sheet fetch from elsewhere; and the script puts server data
    # in the page as text only (tenant names and prompt text are anyone's).
    js = (STATIC_DIR / "inspector.js").read_text()
    css = (STATIC_DIR / "inspector.css").read_text()
    assert set(re.findall(r"https?://[^\s\"')]+", js)) <= {"http://www.w3.org/2000/svg"}
    assert not re.search(r"https?://|@import|url\(", css)
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in js, sink


def test_the_inspector_goes_live_when_the_operator_logs_in_with_the_key_in_the_url(
    server: LiveServer,
) -> None:
    """The login path a person uses: `http://user:KEY@host/inspector`. Chromium sends those
    credentials with the page load only, never with the page's EventSource; the page load's
    session cookie (HttpOnly, SameSite=Strict, read-only) is what lets the stream in."""
    with chromium(network_log=True) as driver:
        host = urlsplit(server.url)
        driver.get(f"{host.scheme}://operator:{KEY_ADMIN}@{host.netloc}/inspector")
        _wait(
            driver,
            "the inspector logged in by URL never went live",
            lambda d: _page(d)["state"] == "live" and _page(d)["hitRateAll"] not in ("", None),
        )
        cookies = {c["name"]: c for c in driver.get_cookies()}
        stream_requests = sent_headers(driver, "/inspector/events")
    [session] = [c for name, c in cookies.items() if name.startswith("prefixserve_inspector")]
    assert session["httpOnly"] and session["sameSite"] == "Strict"
    assert session["path"] == "/inspector"
    # The page's own EventSource sent the session: what lets it in where the browser does not
    # send the URL's credentials with it (the session alone opens the stream: the next test).
    assert stream_requests, "the page opened no event stream"
    expected = f"{session['name']}={session['value']}"
    assert all(expected in h.get("cookie", "") for h in stream_requests), stream_requests


def test_the_inspector_session_cookie_opens_the_read_only_routes_and_nothing_else(
    server: LiveServer,
) -> None:
    """Issued to a page load with the operator key; HttpOnly, SameSite=Strict, Path=/inspector;
    with it alone the page and its event stream answer, every other route still wants a key."""
    from prefixserve.entrypoints.server.inspector_sessions import COOKIE_NAME

    with httpx.Client(base_url=server.url, timeout=30) as http:
        page = http.get("/inspector", headers={"Authorization": basic_auth(KEY_ADMIN)})
        assert page.status_code == 200
        set_cookie = page.headers["set-cookie"]
        for attribute in ("HttpOnly", "SameSite=Strict", "Path=/inspector", "Max-Age="):
            assert attribute in set_cookie, set_cookie
        token = http.cookies[COOKIE_NAME]
    cookie = {"Cookie": f"{COOKIE_NAME}={token}"}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/inspector", headers=cookie).status_code == 200
        assert "set-cookie" not in http.get("/inspector", headers=cookie).headers
        with http.stream("GET", "/inspector/events", headers=cookie) as events:
            assert events.status_code == 200
            assert next(events.iter_lines()).startswith("retry:")
        for method, path in (
            ("GET", "/v1/cache/summary"),
            ("GET", "/metrics"),
            ("POST", "/reset_prefix_cache"),
            ("POST", "/pins"),
            ("POST", "/v1/completions"),
            ("POST", "/inspector/events"),
        ):
            assert http.request(method, path, headers=cookie).status_code == 401, (method, path)
        forged = {"Cookie": f"{COOKIE_NAME}=not-a-token"}
        assert http.get("/inspector/events", headers=forged).status_code == 401
        # A tenant's page load gets no session.
        refused = http.get("/inspector", headers={"Authorization": basic_auth(KEY_ALPHA)})
        assert refused.status_code == 403 and "set-cookie" not in refused.headers
