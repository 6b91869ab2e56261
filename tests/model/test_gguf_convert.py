"""GGUF conversion: once per file and version, atomic under races, tokenizer flags honoured, a
tensor type it cannot read refused before any weight is."""

import json
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from prefixserve import cli
from prefixserve.model.errors import ModelLoadError
from prefixserve.model.loader import gguf_convert
from prefixserve.model.loader.gguf_convert import ensure_converted
from prefixserve.model.loader.gguf_tokenizer import set_text_special_tokens
from prefixserve.model.loader.loading import load_model
from prefixserve.model.quant.weights import Int8Weight, recover_gguf_blocks

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
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert(calls, 0.3))
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
        gguf_convert.CONVERSION_MARKER,
    ]
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir, chat_template=None):
        (out_dir / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_convert, "convert_gguf", broken)
    target = tmp_path / "models" / "m"
    with pytest.raises(OSError, match="disk full"):
        ensure_converted(Path("x.gguf"), target)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []


def test_conversion_marker_names_the_current_version(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert([], 0))
    target = ensure_converted(Path("x.gguf"), tmp_path / "models" / "m")
    marker = json.loads((target / gguf_convert.CONVERSION_MARKER).read_text())
    assert marker == {"version": gguf_convert.CONVERSION_VERSION, "source": "x.gguf"}
    assert gguf_convert.is_converted(target)


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
        (target / gguf_convert.CONVERSION_MARKER).write_text(text)
    assert not gguf_convert.is_converted(target)
    calls: list[str] = []
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert(calls, 0))
    assert ensure_converted(Path("x.gguf"), target) == target
    assert len(calls) == 1
    assert json.loads((target / "config.json").read_text()) == {}
    assert not (target / "stale.txt").exists()
    assert gguf_convert.is_converted(target)
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]
    ensure_converted(Path("x.gguf"), target)  # current now: not converted again
    assert len(calls) == 1


def test_reconversion_without_an_atomic_exchange_falls_back_to_two_renames(tmp_path, monkeypatch):
    target = tmp_path / "models" / "m"
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"old": true}')
    monkeypatch.setattr(gguf_convert, "_exchange_dirs", lambda a, b: False)
    monkeypatch.setattr(gguf_convert, "convert_gguf", _fake_convert([], 0))
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
    assert set_text_special_tokens(tokenizer, special, flags) == expected_adds
    assert tokenizer.encode("a b") == expected_ids
    assert tokenizer.encode("a b", add_special_tokens=False) == [3, 4]


def test_gguf_cache_dir_depends_on_the_file(tmp_path, monkeypatch):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"1")
    b.write_bytes(b"22")
    assert gguf_convert.gguf_cache_dir(a) != gguf_convert.gguf_cache_dir(b)
    assert gguf_convert.gguf_cache_dir(a).parent == tmp_path / "cache" / "gguf"


def test_gemma3_fallback_chat_template_is_the_packaged_one_and_others_have_none():
    template = gguf_convert.fallback_chat_template("gemma3")
    assert template.startswith("{{ bos_token }}")
    assert "<start_of_turn>" in template and "<end_of_turn>" in template
    assert gguf_convert.fallback_chat_template("llama") is None


def test_a_listed_template_missing_from_the_install_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf_convert, "_TEMPLATES_DIR", tmp_path)
    with pytest.raises(FileNotFoundError):
        gguf_convert.fallback_chat_template("gemma3")


# --- tensor types ---------------------------------------------------------------------------------


def _tiny_llama_gguf(path: Path, qtype: gguf.GGMLQuantizationType, complete: bool = False) -> Path:
    """A one-layer llama GGUF whose config and vocabulary transformers converts, with one weight
    of type `qtype` (zero blocks) beside an F32 embedding; `complete`: and every other weight of
    the layer (F32, random), so that it converts."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_block_count(1)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(16)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(61)])
    writer.add_token_scores([0.0] * 64)
    writer.add_token_types([2, 3, 3] + [1] * 61)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", np.zeros((64, 32), dtype=np.float32))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = np.zeros((32, 32 // block_size * type_size), dtype=np.uint8)
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=qtype)
    rest = {"attn_k": (32, 32), "attn_v": (32, 32), "attn_output": (32, 32), "ffn_gate": (64, 32)}
    rest.update({"ffn_up": (64, 32), "ffn_down": (32, 64), "attn_norm": (32,), "ffn_norm": (32,)})
    rng = np.random.default_rng(0)
    for name, shape in rest.items() if complete else ():
        writer.add_tensor(f"blk.0.{name}.weight", rng.standard_normal(shape, dtype=np.float32))
    if complete:
        writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


_UNREADABLE = [gguf.GGMLQuantizationType.Q8_1, gguf.GGMLQuantizationType.Q8_K]


@pytest.mark.parametrize("qtype", _UNREADABLE, ids=lambda t: t.name)
def test_a_tensor_type_the_conversion_cannot_read_is_one_load_error_naming_file_and_type(
    tmp_path, monkeypatch, qtype
):
    """Refused before transformers reads a weight (it raised NotImplementedError from its
    dequantization): the error names the file, the type, a tensor of it and the readable types;
    nothing is left in the cache."""
    from transformers import modeling_gguf_pytorch_utils

    read, real = [], modeling_gguf_pytorch_utils.load_gguf_checkpoint

    def load_gguf_checkpoint(*args, **kwargs):
        read.append(kwargs.get("return_tensors"))
        return real(*args, **kwargs)

    monkeypatch.setattr(modeling_gguf_pytorch_utils, "load_gguf_checkpoint", load_gguf_checkpoint)
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf", qtype)
    with pytest.raises(ModelLoadError) as exc_info:
        load_model(path)
    assert True not in read, "the weights were read"
    message = str(exc_info.value)
    assert str(path) in message
    assert f"unsupported GGUF tensor type {qtype.name} (tensor 'blk.0.attn_q.weight')" in message
    readable = message.split("the GGUF tensor types prefixserve converts: ")[1].split(".")[0]
    assert {"F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K"} <= set(readable.split(", "))
    assert qtype.name not in readable.split(", ")
    target = gguf_convert.gguf_cache_dir(path)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir() if ".tmp-" in p.name] == []


def test_a_file_of_readable_tensor_types_passes_the_type_check(tmp_path):
    for qtype in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0):
        gguf_convert.check_gguf_tensor_types(
            _tiny_llama_gguf(tmp_path / f"{qtype.name}.gguf", qtype)
        )


def test_serve_on_a_gguf_of_an_unreadable_tensor_type_prints_one_error_line_and_exits_2(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_1)
    assert cli.main(["serve", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1
    assert errors[0].startswith(f"prefixserve serve: error: cannot load model {str(path)!r}: ")
    assert "unsupported GGUF tensor type Q8_1" in errors[0]


# --- the conversion tensor by tensor: shards, and block recovery by rows ----------------------


def _block_values(fmt: str, rows: int = 64, cols: int = 256) -> torch.Tensor:
    """fp32 values exactly as a file of `fmt` dequantizes to: random codes, each block's largest
    code at its extreme, scales a block can be recovered from (Q4_K is matched to the file's
    own super-blocks instead: `KQuantRows`, tests/model/test_linear_kquant.py)."""
    g = torch.Generator().manual_seed(0)
    top, group = {"q8_0": (127, 32), "q6_k": (32, 16)}[fmt]
    codes = torch.randint(-top, top, (rows, cols), generator=g, dtype=torch.int8)
    codes.view(rows, -1, group)[:, :, 0] = -top
    scales = (torch.rand(rows, cols // group, generator=g) * 0.01).half().float()
    return Int8Weight(codes, scales, fmt).dequantize()


@pytest.mark.parametrize("fmt", ["q8_0", "q6_k"])
def test_blocks_recovered_by_chunks_of_rows_are_the_whole_tensors(monkeypatch, fmt):
    values = _block_values(fmt)
    whole = recover_gguf_blocks(values)
    assert whole is not None and whole.fmt == fmt
    monkeypatch.setattr(gguf_convert, "RECOVER_CHUNK", 256 * 5)  # chunks of 5 rows, one of 4
    by_rows = gguf_convert.recover_by_rows(values)
    assert by_rows.fmt == whole.fmt
    assert torch.equal(whole.codes, by_rows.codes) and torch.equal(whole.scales, by_rows.scales)


def test_rows_of_another_type_past_the_first_chunk_give_what_the_whole_tensor_gives(monkeypatch):
    """Chunks that disagree (Q8_0 rows, then rows of no block type) are answered by the whole
    tensor: none."""
    values = _block_values("q8_0")
    values[40:] = torch.randn(24, 256)
    monkeypatch.setattr(gguf_convert, "RECOVER_CHUNK", 256 * 8)
    assert recover_gguf_blocks(values) is None
    assert gguf_convert.recover_by_rows(values) is None


def test_a_conversion_past_a_shard_writes_shards_and_their_index(tmp_path, monkeypatch):
    """The same tensors and block weights whether they fit one model.safetensors or each goes
    to a shard of its own, named by model.safetensors.index.json, which the loader reads."""
    from safetensors.torch import load_file

    from prefixserve.model.loader.hf_dir import iter_safetensors_weights

    path = _tiny_llama_gguf(tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0, True)
    gguf_convert.convert_gguf(path, tmp_path / "one")
    monkeypatch.setattr(gguf_convert, "SHARD_BYTES", 1)
    gguf_convert.convert_gguf(path, tmp_path / "many")
    assert not (tmp_path / "one" / "model.safetensors.index.json").exists()
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == len(index["weight_map"]) > 1
    assert shards == sorted(p.name for p in (tmp_path / "many").glob("model-*.safetensors"))
    one = dict(iter_safetensors_weights(tmp_path / "one", torch.float32))
    many = dict(iter_safetensors_weights(tmp_path / "many", torch.float32))
    assert one.keys() == many.keys() == index["weight_map"].keys()
    assert all(torch.equal(one[k], many[k]) for k in one)
    blocks = [load_file(str(tmp_path / d / "weights.gguf_blocks")) for d in ("one", "many")]
    assert blocks[0].keys() == blocks[1].keys()
    assert "model.layers.0.self_attn.q_proj.weight.codes" in blocks[0]
    assert all(torch.equal(blocks[0][k], blocks[1][k]) for k in blocks[0])


def test_the_block_file_written_a_weight_at_a_time_reads_back_as_safetensors(tmp_path):
    """`BlockFileWriter` (codes, scales, mins, super-scales, each weight's type) gives an
    ordinary safetensors file: the same tensors and metadata as safetensors' own save_file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from prefixserve.model.loader.block_file import BlockFileWriter
    from prefixserve.model.quant.weights import BLOCK_FORMATS_KEY, q4_k_from_raw

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (8, 2 * 144), dtype=np.uint8)
    raw.reshape(8, 2, 144)[..., :4] = (
        (rng.random((8, 2, 2)) * 1e-3).astype(np.float16).view(np.uint8)
    )
    weights = {
        "model.layers.0.mlp.down_proj.weight": q4_k_from_raw(torch.from_numpy(raw)),
        "model.layers.0.self_attn.o_proj.weight": _block_weight("q8_0"),
    }
    names = [*weights, "model.layers.1.mlp.up_proj.weight"]  # one name that never comes
    with BlockFileWriter(tmp_path / "streamed.safetensors", names) as writer:
        for name, weight in weights.items():
            writer.add(name, weight)
    expected = {}
    for name, weight in weights.items():
        for field in ("codes", "scales", "mins", "super_scales"):
            if getattr(weight, field) is not None:
                expected[f"{name}.{field}"] = getattr(weight, field)
    formats = json.dumps({name: weight.fmt for name, weight in weights.items()})
    save_file(expected, str(tmp_path / "whole.safetensors"), {BLOCK_FORMATS_KEY: formats})
    with safe_open(str(tmp_path / "streamed.safetensors"), "pt") as streamed:
        assert streamed.metadata()[BLOCK_FORMATS_KEY] == formats
        assert set(streamed.keys()) == set(expected)
        for key, tensor in expected.items():
            got = streamed.get_tensor(key)
            assert got.dtype == tensor.dtype and torch.equal(got, tensor), key
    assert not list(tmp_path.glob(".*partial"))


def test_a_block_file_with_no_weight_is_not_written_and_one_that_fails_leaves_nothing(tmp_path):
    from prefixserve.model.loader.block_file import BlockFileWriter

    with BlockFileWriter(tmp_path / "none.safetensors", ["a.weight"]):
        pass
    with pytest.raises(RuntimeError), BlockFileWriter(tmp_path / "failed.safetensors", ["a"]) as w:
        w.add("a", _block_weight("q8_0"))
        raise RuntimeError("the conversion failed")
    assert list(tmp_path.iterdir()) == []


def _block_weight(fmt: str) -> Int8Weight:
    weight = recover_gguf_blocks(_block_values(fmt, rows=4, cols=64))
    assert weight is not None and weight.fmt == fmt
    return weight
