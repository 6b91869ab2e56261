"""Soak: two tenants' concurrent clients with random disconnects, bad requests and operator
resets mixed in. Afterwards no leaked block, no stuck request, bounded memory, and no tenant ever
saw a cache hit on a prefix only the other tenant had sent.

Short in `make test` (10 s); `make soak SOAK_SECONDS=1800` runs it longer.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid

import httpx
import pytest

from tests.helpers.server import KEY_ADMIN, KEY_ALPHA, KEY_BETA, MODEL_NAME

SOAK_SECONDS = float(os.environ.get("PREFIXSERVE_SOAK_SECONDS", "10"))
WORKERS_PER_TENANT = 3
RSS_GROWTH_LIMIT_MB = 512

pytestmark = pytest.mark.timeout(int(SOAK_SECONDS) + 600)


def _rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


class _Ledger:
    """Per tenant, the prefixes it has sent (started), to judge each cache hit it reports."""

    def __init__(self) -> None:
        # Requests started per (tenant, prefix): a hit is the tenant's own only when another of
        # its requests with that prefix started before this one finished.
        self.sent: dict[tuple[str, int], int] = {}
        self.foreign_hits: list[tuple[str, int, int]] = []
        self.counts: dict[str, int] = {}

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


async def _worker(
    url: str, tenant: str, key: str, prefixes: list[str], ledger: _Ledger, seed: int
) -> None:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + SOAK_SECONDS
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        while time.monotonic() < deadline:
            index = rng.randrange(len(prefixes))
            body = {
                "model": MODEL_NAME,
                "prompt": prefixes[index] + f" question {rng.randrange(10**6)}:",
                "max_tokens": rng.randint(1, 6),
                "temperature": rng.choice([0.0, 0.8]),
                "ignore_eos": True,
            }
            action = rng.random()
            if action < 0.8:
                ledger.sent[tenant, index] = ledger.sent.get((tenant, index), 0) + 1
            if action < 0.5:  # a whole request: its cached_tokens is judged
                response = await http.post("/v1/completions", json=body)
                assert response.status_code == 200, response.text
                cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
                if cached and ledger.sent[tenant, index] < 2:
                    ledger.foreign_hits.append((tenant, index, cached))
                ledger.count("complete")
            elif action < 0.8:  # a stream the client drops after a chunk or two
                body["max_tokens"] = 40
                async with http.stream(
                    "POST", "/v1/completions", json={**body, "stream": True}
                ) as r:
                    assert r.status_code == 200
                    chunks = 0
                    async for _ in r.aiter_lines():
                        chunks += 1
                        if chunks >= rng.randint(1, 4):
                            break
                ledger.count("disconnect")
            else:  # a bad request: refused, harmlessly
                bad = rng.choice(
                    [
                        {**body, "max_tokens": -1},
                        {**body, "temperature": "hot"},
                        {**body, "seed": 2**64},
                        {**body, "prompt": []},
                    ]
                )
                response = await http.post("/v1/completions", json=bad)
                assert response.status_code == 400, response.text
                ledger.count("bad")


async def _operator(url: str, ledger: _Ledger, seed: int) -> None:
    rng = random.Random(seed)
    headers = {"Authorization": f"Bearer {KEY_ADMIN}"}
    deadline = time.monotonic() + SOAK_SECONDS
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=120) as http:
        while time.monotonic() < deadline:
            await asyncio.sleep(rng.uniform(1.0, 4.0))
            running = rng.random() < 0.5
            response = await http.post(
                "/reset_prefix_cache", params={"reset_running_requests": str(running).lower()}
            )
            assert response.status_code in (200, 409), response.text
            ledger.count("reset")


def test_two_tenants_soak_without_leaks_stuck_requests_or_cross_tenant_hits(server):
    server.check_no_leaks()
    run = uuid.uuid4().hex[:8]
    # The same texts for both tenants: only the salt keeps their blocks apart.
    prefixes = [f"Soak {run} document {i}: " + "lorem ipsum dolor " * 12 for i in range(4)]
    ledger = _Ledger()
    rss_before = _rss_mb()

    async def main():
        tasks = [
            _worker(server.url, tenant, key, prefixes, ledger, seed=100 * n + w)
            for n, (tenant, key) in enumerate([("alpha", KEY_ALPHA), ("beta", KEY_BETA)])
            for w in range(WORKERS_PER_TENANT)
        ]
        await asyncio.gather(*tasks, _operator(server.url, ledger, seed=7))

    asyncio.run(main())
    assert ledger.counts.get("complete", 0) > 0 and ledger.counts.get("disconnect", 0) > 0
    assert not ledger.foreign_hits, f"hits on prefixes the tenant never sent: {ledger.foreign_hits}"
    server.check_no_leaks()  # no stuck request, every block back in the pool
    growth = _rss_mb() - rss_before
    assert growth < RSS_GROWTH_LIMIT_MB, f"RSS grew by {growth:.0f} MB"
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY_ALPHA}"}) as h:
        assert h.get("/health").status_code == 200
