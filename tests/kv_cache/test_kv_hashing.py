"""Rules of block hashing (prefixserve/kv_cache/hashing.py)."""

from __future__ import annotations

import ast
import hashlib
import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash

from prefixserve.core.kv_cache import hashing
from prefixserve.core.kv_cache.hashing import (
    encode_extra_keys,
    generate_block_extra_keys,
    get_hash_fn,
    get_request_block_hasher,
    hash_block_tokens,
    init_none_hash,
)
from prefixserve.core.request import Request
from prefixserve.sampling_params import SamplingParams
from tests.helpers.kv_cache import make_request


@pytest.fixture
def restore_none_hash():
    saved = hashing.NONE_HASH
    yield
    hashing.NONE_HASH = saved


def test_none_hash_derived_from_pythonhashseed(monkeypatch, restore_none_hash):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    first = init_none_hash()
    assert first == hashlib.sha256(b"prefixserve-none-hash:123").digest()
    assert init_none_hash() == first
    assert hashing.NONE_HASH == first
    monkeypatch.setenv("PYTHONHASHSEED", "124")
    assert init_none_hash() != first


def test_none_hash_random_without_pythonhashseed(monkeypatch, restore_none_hash):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert init_none_hash() != init_none_hash()
    assert len(hashing.NONE_HASH) == 32
    assert len(init_none_hash("xxhash")) == 16


def test_block_hashes_reproducible_across_processes_with_pythonhashseed():
    code = (
        "from prefixserve.core.kv_cache.hashing import hash_block_tokens;"
        "print(hash_block_tokens('sha256', None, [1, 2, 3, 4]).hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="7")
    outs = {
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        for _ in range(2)
    }
    assert len(outs) == 1


def test_hash_functions_selected_by_name():
    assert get_hash_fn("sha256")(b"abc") == hashlib.sha256(b"abc").digest()
    assert get_hash_fn("xxhash")(b"abc") == xxhash.xxh3_128_digest(b"abc")
    assert len(get_hash_fn("xxhash")(b"abc")) == 16


def test_unknown_hash_name_is_a_value_error_listing_valid_names():
    with pytest.raises(ValueError, match=r"'md5'.*valid: sha256, xxhash"):
        get_hash_fn("md5")
    with pytest.raises(ValueError, match="valid"):
        get_request_block_hasher(4, "pickle")


def test_serialization_is_canonical_bytes_not_pickle():
    parent = b"\x11" * 32
    expected_input = parent + struct.pack("<4i", 1, 2, 3, 70000)
    assert hash_block_tokens("sha256", parent, [1, 2, 3, 70000]) == (
        hashlib.sha256(expected_input).digest()
    )
    # Extra keys: tagged, length-prefixed values.
    assert encode_extra_keys(None) == b""
    assert hash_block_tokens("sha256", parent, [1, 2, 3, 70000], ("a",)) == (
        hashlib.sha256(expected_input + b"\x01L\x01\x00\x00\x00S\x01\x00\x00\x00a").digest()
    )
    assert encode_extra_keys(("ab", ("img", -1), 5)) == (
        b"\x01L\x03\x00\x00\x00"
        b"S\x02\x00\x00\x00ab"
        b"L\x02\x00\x00\x00S\x03\x00\x00\x00imgI\x01\x00\x00\x00\xff"
        b"I\x01\x00\x00\x00\x05"
    )
    with pytest.raises(TypeError):
        encode_extra_keys((object(),))


def test_first_block_parent_is_none_hash():
    request = make_request("r", [1, 2, 3, 4])
    assert request.block_hashes == [hash_block_tokens("sha256", hashing.NONE_HASH, [1, 2, 3, 4])]


def test_a_stores_secret_seeds_the_first_block_instead_of_the_process_none_hash():
    secret_a, secret_b = b"a" * 32, b"b" * 32
    seed_a = hashing.none_hash_from_secret(secret_a)
    assert seed_a == hashing.none_hash_from_secret(secret_a) != hashing.NONE_HASH
    assert seed_a != hashing.none_hash_from_secret(secret_b)
    hasher = get_request_block_hasher(4, "sha256", none_hash=seed_a)
    request = Request("r", [1, 2, 3, 4, 5, 6, 7, 8], SamplingParams(), block_hasher=hasher)
    first = hash_block_tokens("sha256", seed_a, [1, 2, 3, 4])
    assert request.block_hashes == [first, hash_block_tokens("sha256", first, [5, 6, 7, 8])]


def test_hash_chains_parent_hash():
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8])
    b = make_request("b", [9, 9, 9, 9, 5, 6, 7, 8])
    assert a.block_hashes[1] == hash_block_tokens("sha256", a.block_hashes[0], [5, 6, 7, 8])
    assert a.block_hashes[1] != b.block_hashes[1]


def test_only_full_blocks_are_hashed():
    assert len(make_request("r", list(range(7))).block_hashes) == 1
    assert len(make_request("r", list(range(8))).block_hashes) == 2
    assert make_request("r", [1, 2, 3]).block_hashes == []


def test_hashes_extend_incrementally_as_tokens_are_appended():
    request = make_request("r", [1, 2, 3])
    full = make_request("f", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    request.append_output_token_ids(4)
    assert request.block_hashes == full.block_hashes[:1]
    request.append_output_token_ids([5, 6, 7])
    assert request.block_hashes == full.block_hashes[:1]
    request.append_output_token_ids([8, 9])
    assert request.block_hashes == full.block_hashes


def test_xxhash_chain_differs_from_sha256_and_is_16_bytes():
    a = make_request("a", list(range(8)), hash_fn="xxhash")
    b = make_request("b", list(range(8)))
    assert [len(h) for h in a.block_hashes] == [16, 16]
    assert a.block_hashes != b.block_hashes


def test_extra_keys_none_when_request_has_none():
    request = make_request("r", list(range(8)))
    assert generate_block_extra_keys(request, 0, 4) is None
    assert request.block_hashes[0] == hash_block_tokens("sha256", None, [0, 1, 2, 3], None)


def test_lora_name_is_an_extra_key_of_every_block():
    request = make_request("r", list(range(8)), lora_name="adapter-a")
    assert generate_block_extra_keys(request, 0, 4) == ("adapter-a",)
    assert generate_block_extra_keys(request, 4, 8) == ("adapter-a",)
    plain = make_request("p", list(range(8)))
    assert request.block_hashes[0] != plain.block_hashes[0]


def test_lora_digest_follows_the_name_so_a_reloaded_name_never_shares_blocks():
    one = make_request("r", list(range(8)), lora_name="a", lora_digest=b"\x01" * 32)
    other = make_request("s", list(range(8)), lora_name="a", lora_digest=b"\x02" * 32)
    assert generate_block_extra_keys(one, 0, 4) == ("a", b"\x01" * 32)
    assert one.block_hashes[0] != other.block_hashes[0]
    assert one.block_hashes[0] != make_request("t", list(range(8)), lora_name="a").block_hashes[0]


def test_cache_salt_only_on_first_block():
    salted = make_request("s", list(range(8)), cache_salt="tenant-1")
    assert generate_block_extra_keys(salted, 0, 4) == ("tenant-1",)
    assert generate_block_extra_keys(salted, 4, 8) is None
    # The chain carries the salt: the second block differs only through its parent.
    assert salted.block_hashes[1] == hash_block_tokens(
        "sha256", salted.block_hashes[0], [4, 5, 6, 7], None
    )
    plain = make_request("p", list(range(8)))
    assert salted.block_hashes[1] != plain.block_hashes[1]


def test_prompt_embeds_digest_is_an_extra_key():
    embeds = np.arange(6 * 3, dtype=np.float32).reshape(6, 3)
    request = make_request("r", [0] * 8, prompt_embeds=embeds)
    digest0 = hashlib.sha256(embeds[0:4].tobytes()).digest()
    digest1 = hashlib.sha256(embeds[4:6].tobytes()).digest()
    assert generate_block_extra_keys(request, 0, 4) == (digest0,)
    assert generate_block_extra_keys(request, 4, 8) == (digest1,)
    assert generate_block_extra_keys(request, 8, 12) is None
    other = make_request("o", [0] * 8, prompt_embeds=embeds + 1)
    assert request.block_hashes[0] != other.block_hashes[0]


def test_extra_keys_order_lora_salt_embeds():
    embeds = np.zeros((4, 2), dtype=np.float32)
    request = make_request(
        "r",
        [0] * 4,
        lora_name="lora",
        cache_salt="salt",
        prompt_embeds=embeds,
    )
    keys = generate_block_extra_keys(request, 0, 4)
    assert keys == ("lora", "salt", hashlib.sha256(embeds.tobytes()).digest())
    assert request.block_hashes == [hash_block_tokens("sha256", None, [0] * 4, keys)]


def test_token_ids_outside_int32_are_a_value_error():
    with pytest.raises(ValueError, match="32-bit"):
        hash_block_tokens("sha256", None, [2**31, 0, 0, 0])


def test_cache_core_imports_no_torch_and_nothing_above_it():
    package = pathlib.Path(hashing.__file__).parent
    allowed = (
        "prefixserve.core.kv_cache",
        "prefixserve.core.request",
        "prefixserve.sampling_params",
        "prefixserve.settings",  # a leaf: environment switches, no imports of the package
    )
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name.split(".")[0] != "torch", f"{path.name} imports {name}"
                if name.startswith("prefixserve"):
                    assert name.startswith(allowed), f"{path.name} imports {name}"


def test_a_lone_surrogate_extra_key_hashes_instead_of_raising_and_stays_distinct():
    a = hash_block_tokens("sha256", None, [1, 2, 3, 4], ("\ud800",))
    b = hash_block_tokens("sha256", None, [1, 2, 3, 4], ("\ud801",))
    assert a != b
    assert hash_block_tokens("sha256", None, [1, 2, 3, 4], ("é",)) == hash_block_tokens(
        "sha256", None, [1, 2, 3, 4], ("é",)
    )
