"""Loading HF directories and GGUF files: dtypes, sharding, errors, the conversion cache."""

import json
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_hf_models import build_hf_model

from prefixserve.model import loader
from prefixserve.model.loader import (
    LoadedModel,
    ModelLoadError,
    ensure_converted,
    iter_safetensors_weights,
    load_model,
    resolve_dtype,
    safetensors_files,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def tiny_model_dir(tmp_path: Path, default_model_dir: Path, family: str = "llama_tied", **save):
    """A random-weight tiny model directory with the default model's tokenizer."""
    model, _ = build_hf_model(family, tmp_path)
    if save:
        for f in tmp_path.glob("model*.safetensors*"):
            f.unlink()
        model.save_pretrained(tmp_path, safe_serialization=True, **save)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir / name, tmp_path / name)
    return model, tmp_path


# --- dtype ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("BF16", torch.bfloat16),
        (torch.float32, torch.float32),
    ],
)
def test_dtype_aliases_resolve(name, expected):
    assert resolve_dtype(name) == expected


@pytest.mark.parametrize("name", ["float16", "fp16", "half", torch.float16])
def test_fp16_is_refused_with_the_reason(name):
    with pytest.raises(ValueError, match="float16 matmul"):
        resolve_dtype(name)


def test_unknown_dtype_names_the_allowed_ones():
    with pytest.raises(ValueError, match=r"dtype must be one of .*bfloat16.*got .int8."):
        resolve_dtype("int8")


def test_load_model_refuses_fp16_before_touching_the_path(tmp_path):
    with pytest.raises(ValueError, match="float16"):
        load_model(tmp_path / "nothing-here", dtype="fp16")


# --- errors ---------------------------------------------------------------------------------------


def _assert_clear_error(exc_info, path):
    message = str(exc_info.value)
    assert str(path) in message
    assert "LlamaForCausalLM" in message and "Gemma3ForCausalLM" in message


def test_missing_path_error_names_path_and_supported_architectures(tmp_path):
    path = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError) as exc_info:
        load_model(path)
    _assert_clear_error(exc_info, path)
    assert "no such file" in str(exc_info.value)


def test_directory_without_config_is_one_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json is missing") as exc_info:
        load_model(tmp_path)
    _assert_clear_error(exc_info, tmp_path)


def test_unreadable_config_is_one_clear_error(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json is unreadable") as exc_info:
        load_model(tmp_path)
    _assert_clear_error(exc_info, tmp_path)


def test_unsupported_architecture_is_one_clear_error(tmp_path):
    config = {"architectures": ["BertForMaskedLM"], "model_type": "bert"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="BertForMaskedLM") as exc_info:
        load_model(tmp_path)
    _assert_clear_error(exc_info, tmp_path)


def test_missing_weights_is_one_clear_error(tmp_path, default_model_dir):
    shutil.copy(default_model_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelLoadError, match="no \\*.safetensors") as exc_info:
        load_model(tmp_path)
    _assert_clear_error(exc_info, tmp_path)


def test_missing_shard_is_one_clear_error(tmp_path, default_model_dir):
    _, path = tiny_model_dir(tmp_path, default_model_dir, max_shard_size="20KB")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match=shards[-1].name):
        load_model(path, dtype="float32")


def test_corrupt_safetensors_is_one_clear_error(tmp_path, default_model_dir):
    _, path = tiny_model_dir(tmp_path, default_model_dir)
    (path / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(ModelLoadError, match="model.safetensors is unreadable"):
        load_model(path, dtype="float32")


def test_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"abc")
    with pytest.raises(ModelLoadError, match="not .gguf"):
        load_model(path)


def test_unreadable_gguf_is_one_clear_error(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 16)
    with pytest.raises(ModelLoadError) as exc_info:
        load_model(path)
    _assert_clear_error(exc_info, path)


def test_max_model_len_out_of_range_names_the_limit(tmp_path, default_model_dir):
    _, path = tiny_model_dir(tmp_path, default_model_dir)
    with pytest.raises(ValueError, match=r"max_model_len must be an integer in \[1, 256\]"):
        load_model(path, dtype="float32", max_model_len=100_000)


# --- HF directories -------------------------------------------------------------------------------


def test_hf_dir_loads_weights_tokenizer_and_config(tmp_path, default_model_dir):
    hf_model, path = tiny_model_dir(tmp_path, default_model_dir)
    loaded = load_model(path, dtype="float32", max_model_len=64)
    assert isinstance(loaded, LoadedModel)
    assert loaded.path == path and loaded.config.max_model_len == 64
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.tokenizer.encode("Paris", add_special_tokens=False)
    ours = dict(loaded.model.named_parameters())
    for name, tensor in hf_model.state_dict().items():
        if name in ours:
            assert torch.equal(ours[name], tensor), name


def test_weights_are_cast_to_the_requested_dtype(tmp_path, default_model_dir):
    _, path = tiny_model_dir(tmp_path, default_model_dir)
    loaded = load_model(path, dtype="bf16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert all(t.dtype == torch.bfloat16 for _, t in iter_safetensors_weights(path, torch.bfloat16))


def test_sharded_checkpoint_loads_the_same_weights_as_a_single_file(tmp_path, default_model_dir):
    _, single = tiny_model_dir(tmp_path / "single", default_model_dir)
    _, sharded = tiny_model_dir(tmp_path / "sharded", default_model_dir, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) > 1
    a = dict(load_model(single, dtype="float32").model.state_dict())
    b = dict(load_model(sharded, dtype="float32").model.state_dict())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


# --- the conversion cache -------------------------------------------------------------------------


def _fake_convert(calls: list[str], delay: float):
    def convert(gguf_path, out_dir, chat_template=None):
        calls.append(str(out_dir))
        time.sleep(delay)  # widen the race window
        (out_dir / "model.safetensors").write_bytes(b"weights")
        (out_dir / "config.json").write_text("{}")

    return convert


def test_racing_conversions_convert_once_and_leave_no_temp_dirs(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert(calls, 0.3))
    target = tmp_path / "models" / "m"
    results: list[Path] = []
    threads = [
        threading.Thread(target=lambda: results.append(ensure_converted(Path("x.gguf"), target)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [target] * 3
    assert len(calls) == 1
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json",
        "model.safetensors",
        loader.CONVERSION_MARKER,
    ]
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir, chat_template=None):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(loader, "convert_gguf", broken)
    target = tmp_path / "models" / "m"
    with pytest.raises(OSError, match="disk full"):
        ensure_converted(Path("x.gguf"), target)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []


def test_conversion_marker_names_the_current_version(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert([], 0))
    target = ensure_converted(Path("x.gguf"), tmp_path / "models" / "m")
    marker = json.loads((target / loader.CONVERSION_MARKER).read_text())
    assert marker == {"version": loader.CONVERSION_VERSION, "source": "x.gguf"}
    assert loader.is_converted(target)


@pytest.mark.parametrize("marker", [None, {"version": 1}, "not json"])
def test_directory_from_an_older_conversion_is_converted_again_in_place(
    tmp_path, monkeypatch, marker
):
    """A directory without the current conversion version (converted before the tokenizer
    honoured tokenizer.ggml.add_bos_token) is replaced by a fresh conversion at the same path,
    with nothing left beside it."""
    target = tmp_path / "models" / "m"
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"old": true}')
    (target / "stale.txt").write_text("from the old conversion")
    if marker is not None:
        text = marker if isinstance(marker, str) else json.dumps(marker)
        (target / loader.CONVERSION_MARKER).write_text(text)
    assert not loader.is_converted(target)
    calls: list[str] = []
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert(calls, 0))
    assert ensure_converted(Path("x.gguf"), target) == target
    assert len(calls) == 1
    assert json.loads((target / "config.json").read_text()) == {}
    assert not (target / "stale.txt").exists()
    assert loader.is_converted(target)
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]
    ensure_converted(Path("x.gguf"), target)  # current now: not converted again
    assert len(calls) == 1


def test_reconversion_without_an_atomic_exchange_falls_back_to_two_renames(tmp_path, monkeypatch):
    target = tmp_path / "models" / "m"
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"old": true}')
    monkeypatch.setattr(loader, "_exchange_dirs", lambda a, b: False)
    monkeypatch.setattr(loader, "convert_gguf", _fake_convert([], 0))
    ensure_converted(Path("x.gguf"), target)
    assert json.loads((target / "config.json").read_text()) == {}
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]


def _tiny_tokenizer(post_processor=None):
    """A word-level fast tokenizer with bos (1) and eos (2), optionally adding some."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    if post_processor is not None:
        raw.post_processor = post_processor
    return PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.mark.parametrize(
    ("adds", "flags", "expected_ids", "expected_adds"),
    [
        # SmolLM2: transformers adds BOS, the file says add_bos_token = False
        ("bos", {"bos": False}, [3, 4], {"bos": False, "eos": False}),
        # Gemma 3: BOS added and the file says so: kept as it is
        ("bos", {"bos": True, "eos": False}, [1, 3, 4], {"bos": True, "eos": False}),
        ("none", {"bos": True}, [1, 3, 4], {"bos": True, "eos": False}),
        ("none", {"bos": True, "eos": True}, [1, 3, 4, 2], {"bos": True, "eos": True}),
        ("bos", {"eos": True}, [1, 3, 4, 2], {"bos": True, "eos": True}),  # bos kept
        ("bos", {}, [1, 3, 4], {"bos": True, "eos": False}),  # no flags: nothing changes
        ("none", {}, [3, 4], {"bos": False, "eos": False}),
    ],
)
def test_text_special_tokens_follow_the_gguf_add_bos_and_add_eos_flags(
    adds, flags, expected_ids, expected_adds
):
    from tokenizers import processors

    post = None
    if adds == "bos":
        post = processors.TemplateProcessing(
            single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
        )
    tokenizer = _tiny_tokenizer(post)
    special = {"bos": 1, "eos": 2, "unk": 0}
    assert loader.set_text_special_tokens(tokenizer, special, flags) == expected_adds
    assert tokenizer.encode("a b") == expected_ids
    assert tokenizer.encode("a b", add_special_tokens=False) == [3, 4]


def test_gguf_cache_dir_depends_on_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"1")
    b.write_bytes(b"22")
    assert loader.gguf_cache_dir(a) != loader.gguf_cache_dir(b)
    assert loader.gguf_cache_dir(a).parent == tmp_path / "cache" / "gguf"


@pytest.mark.slow
def test_gguf_file_loads_like_the_converted_default_model(tmp_path, monkeypatch, default_model_dir):
    """A .gguf path is converted into the cache and loaded; same weights as the default."""
    from prefixserve.model.default_model import default_model_gguf

    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    loaded = load_model(default_model_gguf(), dtype="bfloat16")
    assert loaded.path.parent == tmp_path / "gguf"
    assert loaded.tokenizer.eos_token_ids == {2}
    reference = load_model(default_model_dir, dtype="bfloat16").model.state_dict()
    ours = loaded.model.state_dict()
    assert all(torch.equal(ours[k], reference[k]) for k in reference)
