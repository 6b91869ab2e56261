"""A prefix-cache reset and the disk tier, composed (issue 26, finding 3): a reset forgets every
tier the engine serves from, so the same prompt is computed again, not loaded from disk; a
RAM-only reset keeps the disk; writes queued before a reset never land after it; other
namespaces of a shared store stay."""

from __future__ import annotations

import threading
from pathlib import Path

from prefixserve import LLM, SamplingParams
from prefixserve.kv_store import BackgroundWriter, DiskKVStore
from prefixserve.kv_store.block_write import BlockWrite
from prefixserve.kv_store.scan import namespace_records

PROMPT = "A reset must forget the disk tier as well as the pool. " * 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)


def _llm(model, store: Path) -> LLM:
    return LLM(
        dtype=model.config.dtype,
        loaded_model=model,
        enable_kv_store=True,
        kv_store_dir=str(store),
        kv_store_gb=1,
    )


def _cached(llm: LLM) -> tuple[int, int]:
    [out] = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    return out.num_cached_tokens, out.num_disk_cached_tokens


def _warm(llm: LLM) -> None:
    assert _cached(llm) == (0, 0)
    llm.llm_engine.kv_connector.writer.flush()
    assert llm.llm_engine.kv_connector.store.total_bytes > 0


def test_a_reset_forgets_the_disk_tier_too(default_model_exact, tmp_path):
    llm = _llm(default_model_exact, tmp_path)
    _warm(llm)
    assert llm.reset_prefix_cache()
    assert _cached(llm) == (0, 0)  # computed again: neither the pool nor the disk had it
    llm.llm_engine.check_no_leaks()


def test_a_ram_only_reset_keeps_the_disk_tier(default_model_exact, tmp_path):
    llm = _llm(default_model_exact, tmp_path)
    _warm(llm)
    assert llm.reset_prefix_cache(ram_only=True)
    cached, from_disk = _cached(llm)
    assert cached > 0 and from_disk == cached


def test_a_reset_also_forgets_what_another_process_stored_in_the_namespace(
    default_model_exact, tmp_path
):
    first = _llm(default_model_exact, tmp_path)
    _warm(first)
    second = _llm(default_model_exact, tmp_path)  # shares the store, as two servers of one user
    assert second.reset_prefix_cache()
    store = first.llm_engine.kv_connector.store
    assert namespace_records(str(store.root / store.namespace)) == []
    assert first.reset_prefix_cache(ram_only=True)  # its own RAM copy goes too
    assert _cached(first) == (0, 0)


class _SlowStore(DiskKVStore):
    """A store whose puts wait until released, to hold a write in progress."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.entered, self.release = threading.Event(), threading.Event()

    def put(self, *args, **kwargs):
        self.entered.set()
        assert self.release.wait(30)
        return super().put(*args, **kwargs)


def test_writes_queued_before_a_clear_never_land_after_it(tmp_path):
    namespace = "ab" * 16
    store = _SlowStore(tmp_path, namespace, 1 << 30)
    other = DiskKVStore(tmp_path, "cd" * 16, 1 << 30)
    assert other.put(BlockWrite.at((b"\x02" * 16, 0), [1] * 16, b"x" * 64))
    writer = BackgroundWriter(store, max_queue_bytes=1 << 20, max_queue_items=16)
    for i in range(4):
        assert writer.submit(BlockWrite.at((bytes([i + 1]) * 16, 0), [i] * 16, b"y" * 64))
    assert store.entered.wait(30)  # one write is in progress, three are queued
    discarding = threading.Thread(target=writer.discard)
    discarding.start()
    store.release.set()
    discarding.join(30)
    store.clear()
    writer.flush(30)
    assert namespace_records(str(tmp_path / namespace)) == []
    assert len(namespace_records(str(tmp_path / other.namespace))) == 1  # other models' stay
    assert store.stats().cleared == 1 and writer.stats().dropped == 3
    writer.close(5)
