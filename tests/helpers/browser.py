"""A headless Chromium for the browser tests: Debian's `chromium` driven through its
`chromium-driver` by Selenium (`make browser` installs both where it runs as root with apt).

Where a part is missing the tests skip with `SKIP_PREFIX` + the missing packages, and
tests/conftest.py's terminal summary counts those skips in one line, so they are never silent.
"""

from __future__ import annotations

import base64
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

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
def chromium() -> Iterator[Any]:
    """A headless Chromium WebDriver, WINDOW sized; quit on exit. Skips when a part is missing."""
    skip_if_missing()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument(f"--window-size={WINDOW[0]},{WINDOW[1]}")
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
