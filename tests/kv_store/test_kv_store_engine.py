"""The disk tier with the packaged default model (float32, or the exact dtype of
`default_model_exact` where the test is not the float32 invariant): outputs are identical whether a
block's K/V came from the RAM pool, from the store or from a recompute (greedy and seeded
sampling), also in a new process; damaged and foreign files are misses; `in_memory` requests write
nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prefixserve import LLM, SamplingParams

PROMPT = "The history of the printing press begins in the fifteenth century. " * 12
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=10),
    SamplingParams(temperature=0.9, top_k=40, seed=1234, max_tokens=10),
]


def _llm(model, store: Path | None, **kwargs) -> LLM:
    if store is None:
        return LLM(dtype=model.config.dtype, loaded_model=model, enable_kv_store=False, **kwargs)
    return LLM(
        dtype=model.config.dtype,
        loaded_model=model,
        enable_kv_store=True,
        kv_store_dir=str(store),
        kv_store_gb=1,
        **kwargs,
    )


def _tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _generate(llm: LLM, **kwargs):
    return llm.generate([PROMPT, PROMPT], PARAMS, use_tqdm=False, **kwargs)


def test_outputs_are_identical_from_the_pool_the_store_and_a_recompute(
    default_model_fp32, tmp_path
):
    recomputed = _tokens(_generate(_llm(default_model_fp32, None)))
    writer = _llm(default_model_fp32, tmp_path)
    first = _generate(writer)
    from_pool = _generate(writer)
    assert all(o.num_cached_tokens > 0 for o in from_pool)
    writer.llm_engine.close()  # what is queued reaches the disk

    restarted = _llm(default_model_fp32, tmp_path)  # an empty pool over the same store
    from_disk = _generate(restarted)
    metrics = restarted.llm_engine.get_metrics()
    num_prompt = len(from_disk[0].prompt_token_ids)
    # The first sample loads the prompt's blocks from disk; the second hits them in RAM.
    assert from_disk[0].num_cached_tokens == (num_prompt - 1) // 16 * 16
    assert from_disk[0].num_disk_cached_tokens == from_disk[0].num_cached_tokens
    assert from_disk[1].num_disk_cached_tokens == 0 < from_disk[1].num_cached_tokens
    assert all(o.num_disk_cached_tokens == 0 for o in from_pool)
    assert metrics["kv_store_hit_tokens"] == from_disk[0].num_cached_tokens
    assert recomputed == _tokens(first) == _tokens(from_pool) == _tokens(from_disk)
    restarted.llm_engine.check_no_leaks()


_CHILD = textwrap.dedent(
    """
    import json, sys
    from prefixserve import LLM, SamplingParams
    llm = LLM(dtype=sys.argv[3], enable_kv_store=True, kv_store_dir=sys.argv[1], kv_store_gb=1)
    params = [SamplingParams(temperature=0.0, max_tokens=10),
              SamplingParams(temperature=0.9, top_k=40, seed=1234, max_tokens=10)]
    outs = llm.generate([sys.argv[2]] * 2, params, use_tqdm=False)
    llm.llm_engine.close()
    print(json.dumps([[list(o.outputs[0].token_ids), o.num_cached_tokens] for o in outs]))
    """
)


def test_a_new_process_on_the_same_store_hits_what_its_predecessor_stored(
    default_model_exact, tmp_path
):
    model = default_model_exact

    def run() -> list:
        done = subprocess.run(
            [sys.executable, "-c", _CHILD, str(tmp_path), PROMPT, model.config.dtype],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
        return json.loads(done.stdout.strip().splitlines()[-1])

    # The predecessor: this process, its writes flushed when it closes.
    predecessor = _llm(model, tmp_path)
    cold = _generate(predecessor)
    predecessor.llm_engine.close()
    assert cold[0].num_cached_tokens == 0  # (the second sample may hit the first's blocks)
    warm = run()
    assert all(cached > 0 for _, cached in warm)
    recomputed = _tokens(_generate(_llm(model, None)))
    assert _tokens(cold) == [t for t, _ in warm] == recomputed


def test_a_damaged_file_is_a_miss_that_is_recomputed_and_written_again(
    default_model_exact, tmp_path
):
    writer = _llm(default_model_exact, tmp_path)
    expected = _tokens(_generate(writer))
    writer.llm_engine.close()
    files = sorted(tmp_path.glob("*/*/*.kv"))
    assert files
    for path in files:  # flip one byte in the middle of every record, times kept (bit rot)
        times = path.stat()
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
    reader = _llm(default_model_exact, tmp_path)
    outputs = _generate(reader)
    metrics = reader.llm_engine.get_metrics()
    assert _tokens(outputs) == expected
    assert metrics["kv_store_hit_tokens"] == 0 and metrics["kv_store_bad_files_dropped"] >= 1
    assert metrics["kv_store_load_failures"] >= 1
    reader.llm_engine.close()
    # The bad record was removed, the block recomputed and written again: the next process hits.
    third = _llm(default_model_exact, tmp_path)
    assert _tokens(_generate(third)) == expected
    assert third.llm_engine.get_metrics()["kv_store_hit_tokens"] > 0


def test_a_store_written_in_another_dtype_never_hits(
    default_model_bf16, default_model_fp32, tmp_path
):
    bf16 = LLM(
        dtype="bfloat16",
        loaded_model=default_model_bf16,
        enable_kv_store=True,
        kv_store_dir=str(tmp_path),
        kv_store_gb=1,
    )
    bf16.generate([PROMPT], PARAMS[0], use_tqdm=False)
    bf16.llm_engine.close()
    fp32 = _llm(default_model_fp32, tmp_path)
    [out] = fp32.generate([PROMPT], PARAMS[0], use_tqdm=False)
    assert out.num_cached_tokens == 0
    assert fp32.llm_engine.get_metrics()["kv_store_hit_tokens"] == 0


def test_in_memory_retention_leaves_no_file(default_model_exact, tmp_path):
    llm = _llm(default_model_exact, tmp_path)
    _generate(llm, prompt_cache_retention="in_memory")
    llm.llm_engine.close()
    assert not list(tmp_path.glob("*/*/*.kv"))
    llm2 = _llm(default_model_exact, tmp_path)
    _generate(llm2, prompt_cache_retention="24h")
    llm2.llm_engine.close()
    assert list(tmp_path.glob("*/*/*.kv"))


def test_an_unknown_retention_is_refused(default_model_exact, tmp_path):
    llm = _llm(default_model_exact, tmp_path)
    with pytest.raises(ValueError, match="prompt_cache_retention"):
        _generate(llm, prompt_cache_retention="forever")
    llm.llm_engine.check_no_leaks()


def test_a_disk_tier_with_a_key_loads_only_what_carries_its_mac(default_model_exact, tmp_path):
    """`--kv-store-key-file` (a directory others can write): the hash seed is the key's (no seed
    file), a process with the key hits what another stored, and a record forged where it sits
    (another record's K/V, its xxh3 checksum recomputed: anyone can) is a miss, dropped and
    counted, and the answer is the cold start's."""
    key = tmp_path / "disk.key"
    key.write_text("a key for the disk tier, 32 bytes or more\n")
    key.chmod(0o600)
    store = tmp_path / "store"
    cold = _tokens(_generate(_llm(default_model_exact, None)))
    writer = _llm(default_model_exact, store, kv_store_key_file=str(key))
    assert _tokens(_generate(writer)) == cold
    writer.llm_engine.close()
    assert not (store / "seed").exists()
    reader = _llm(default_model_exact, store, kv_store_key_file=str(key))
    assert _tokens(_generate(reader)) == cold
    assert reader.llm_engine.get_metrics()["kv_store_hit_tokens"] > 0
    reader.llm_engine.close()
    files = sorted(store.glob("*/*/*.kv"))
    donor = files[-1].read_bytes()
    for path in files:  # every record's payload replaced by the donor's, checksum recomputed
        _forge_file(path, donor)
    forged = _llm(default_model_exact, store, kv_store_key_file=str(key))
    assert _tokens(_generate(forged)) == cold
    metrics = forged.llm_engine.get_metrics()
    assert metrics["kv_store_hit_tokens"] == 0 and metrics["kv_store_bad_files_dropped"] >= 1
    assert forged.llm_engine.kv_connector.store.stats().unauthenticated_dropped >= 1
    forged.llm_engine.close()


def _forge_file(path: Path, donor: bytes) -> None:
    """The record at `path` with `donor`'s payload (same size) and a fresh xxh3 checksum, its
    file times kept (so that a stat sees nothing)."""
    import xxhash

    from prefixserve.kv_store import record

    times = path.stat()
    data = path.read_bytes()
    payload_len = record.FIXED.unpack_from(data)[7]
    head = data[: len(data) - payload_len - record.CHECKSUM_BYTES]
    payload = donor[len(donor) - payload_len - record.CHECKSUM_BYTES : -record.CHECKSUM_BYTES]
    path.write_bytes(head + payload + xxhash.xxh3_128(head + payload).digest())
    os.utime(path, ns=(times.st_atime_ns, times.st_mtime_ns))
