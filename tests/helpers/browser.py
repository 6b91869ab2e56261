"""A headless Chromium for the browser tests: Debian's `chromium` driven through its
`chromium-driver` by Selenium (`make browser` installs both where it runs as root with apt).

Where a part is missing the tests skip with `SKIP_PREFIX` + the missing packages, and
tests/conftest.py's terminal summary counts those skips in one line, so they are never silent.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
SKIP_PREFIX = "browser test needs "
WINDOW = (1400, 1000)


def missing_parts() -> list[str]:
    """The packages the browser tests need and this machine lacks."""
    missing = []
    if not os.access(CHROMIUM, os.X_OK):
        missing.append(f"chromium (Debian package, {CHROMIUM})")
    if not os.access(CHROMEDRIVER, os.X_OK):
        missing.append(f"chromium-driver (Debian package, {CHROMEDRIVER})")
    if importlib.util.find_spec("selenium") is None:
        missing.append("selenium (pip, the test extra)")
    return missing


def skip_if_missing() -> None:
    missing = missing_parts()
    if missing:
        pytest.skip(
            SKIP_PREFIX + ", ".join(missing) + " (`make browser` installs the Debian packages "
            "as root with apt-get; the test extra, `make install`, installs selenium)"
        )


@contextmanager
def chromium(network_log: bool = False) -> Iterator[Any]:
    """A headless Chromium WebDriver, WINDOW sized; quit on exit. Skips when a part is missing.
    With `network_log`, `sent_headers` reads the headers of the requests the browser sent."""
    skip_if_missing()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={WINDOW[0]},{WINDOW[1]}")
    if network_log:
        options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    # The system chromedriver, given by path: Selenium Manager then downloads nothing.
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def basic_auth(key: str, user: str = "operator") -> str:
    return "Basic " + base64.b64encode(f"{user}:{key}".encode()).decode()


def send_key(driver: Any, key: str) -> None:
    """Make every later request of the page carry `key` as HTTP Basic credentials, the way a
    browser sends them once the operator has logged in. Through the DevTools protocol, so a test
    can swap keys on an open page; the page's EventSource and fetch calls carry it too."""
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd(
        "Network.setExtraHTTPHeaders", {"headers": {"Authorization": basic_auth(key)}}
    )


def sent_headers(driver: Any, path: str) -> list[dict[str, str]]:
    """The headers (names in lower case) of each request the browser sent to `path` since the
    last call, as it put them on the wire (DevTools' requestWillBeSentExtraInfo, which carries
    cookies). Needs a driver made by `chromium(network_log=True)`."""
    urls: dict[str, str] = {}
    headers: dict[str, dict[str, str]] = {}
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        params = message.get("params", {})
        if message.get("method") == "Network.requestWillBeSent":
            urls[params["requestId"]] = params["request"]["url"]
        elif message.get("method") == "Network.requestWillBeSentExtraInfo":
            sent = {k.lower(): v for k, v in params.get("headers", {}).items()}
            headers.setdefault(params["requestId"], {}).update(sent)
    return [
        headers.get(request_id, {})
        for request_id, url in urls.items()
        if urlsplit(url).path == path
    ]
