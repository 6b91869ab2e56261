"""Rules of the store's compatibility key (prefixserve/kv_store/fingerprint.py)."""

from __future__ import annotations

import os

import pytest

from prefixserve.kv_store import fingerprint
from prefixserve.kv_store.fingerprint import KV_LAYOUT_VERSION, model_fingerprint, store_namespace


def _model_dir(root, config=b'{"hidden_size": 64}', shards=(b"weights-0",)):
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_bytes(config)
    for i, data in enumerate(shards):
        (root / f"model-{i:05d}.safetensors").write_bytes(data)
    return root


def test_fingerprint_is_stable_and_depends_only_on_config_and_weights(tmp_path):
    a = _model_dir(tmp_path / "a")
    b = _model_dir(tmp_path / "b")
    (b / "tokenizer.json").write_text("{}")  # tokens are ids; the tokenizer cannot change K/V
    assert model_fingerprint(a) == model_fingerprint(b) == model_fingerprint(str(a))
    assert len(model_fingerprint(a)) == 32


def test_fingerprint_changes_with_the_config(tmp_path):
    a = _model_dir(tmp_path / "a")
    b = _model_dir(tmp_path / "b", config=b'{"hidden_size": 65}')
    assert model_fingerprint(a) != model_fingerprint(b)


def test_fingerprint_changes_with_any_weight_byte(tmp_path):
    a = _model_dir(tmp_path / "a", shards=(b"weights-0", b"weights-1"))
    b = _model_dir(tmp_path / "b", shards=(b"weights-0", b"weights-2"))
    c = _model_dir(tmp_path / "c", shards=(b"weights-0",))
    assert len({model_fingerprint(a), model_fingerprint(b), model_fingerprint(c)}) == 3


def test_fingerprint_sees_a_weight_file_rewritten_in_place(tmp_path):
    a = _model_dir(tmp_path / "a")
    before = model_fingerprint(a)
    shard = a / "model-00000.safetensors"
    stat = shard.stat()
    shard.write_bytes(b"weights-9")  # same size
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert model_fingerprint(a) != before


def test_fingerprint_second_call_does_not_read_the_weights_again(tmp_path, monkeypatch):
    a = _model_dir(tmp_path / "a", shards=(b"x" * 100_000,))
    first = model_fingerprint(a)

    def must_not_hash(path):
        raise AssertionError(f"{path} hashed twice")

    monkeypatch.setattr(fingerprint, "_hash_file", must_not_hash)
    assert model_fingerprint(a) == first


def test_fingerprint_of_a_directory_without_config_or_weights_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        model_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        model_fingerprint(tmp_path)


def test_fingerprint_streams_files_larger_than_one_chunk(tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "_CHUNK", 1000)
    a = _model_dir(tmp_path / "a", shards=(bytes(range(256)) * 20,))
    import xxhash

    assert fingerprint._hash_file(a / "model-00000.safetensors") == xxhash.xxh3_128_hexdigest(
        bytes(range(256)) * 20
    )


BASE = dict(
    model_fingerprint="f" * 32,
    dtype="bfloat16",
    block_size=16,
    hash_algo="sha256",
    kv_layout="L30/kvh3/hd64",
)


@pytest.mark.parametrize(
    "change",
    [
        {"model_fingerprint": "e" * 32},
        {"dtype": "float32"},
        {"block_size": 32},
        {"hash_algo": "xxhash"},
        {"kv_layout": "L30/kvh3/hd128"},
    ],
)
def test_namespace_differs_for_any_other_model_dtype_block_size_hash_or_layout(change):
    assert store_namespace(**BASE) != store_namespace(**{**BASE, **change})


def test_namespace_includes_the_kv_layout_version(monkeypatch):
    before = store_namespace(**BASE)
    monkeypatch.setattr(fingerprint, "KV_LAYOUT_VERSION", KV_LAYOUT_VERSION + 1)
    assert store_namespace(**BASE) != before


def test_namespace_is_32_hex_digits_and_stable():
    name = store_namespace(**BASE)
    assert len(name) == 32 and int(name, 16) >= 0
    assert store_namespace(**BASE) == name


@pytest.mark.parametrize(
    "bad",
    [
        {"dtype": ""},
        {"block_size": 0},
        {"block_size": True},
        {"block_size": 16.0},
        {"kv_layout": None},
        {"hash_algo": ""},
    ],
)
def test_namespace_refuses_bad_values(bad):
    with pytest.raises(ValueError, match="store_namespace"):
        store_namespace(**{**BASE, **bad})
