"""Loading HF directories and GGUF files: dtypes, sharding, errors."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from prefixserve.model.loader.hf_dir import iter_safetensors_weights, safetensors_files
from prefixserve.model.loader.loading import LoadedModel, ModelLoadError, load_model, resolve_dtype
from tests.helpers.models import build_hf_model


def tiny_model_dir(tmp_path: Path, family: str = "llama_tied", **save):
    """A random-weight tiny model directory with the default model's tokenizer."""
    model, _ = build_hf_model(family, tmp_path, tokenizer=True, **save)
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


def test_missing_shard_is_one_clear_error(tmp_path):
    _, path = tiny_model_dir(tmp_path, max_shard_size="20KB")
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match=shards[-1].name):
        load_model(path, dtype="float32")


def test_corrupt_safetensors_is_one_clear_error(tmp_path):
    _, path = tiny_model_dir(tmp_path)
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


def test_max_model_len_out_of_range_names_the_limit(tmp_path):
    _, path = tiny_model_dir(tmp_path)
    with pytest.raises(ValueError, match=r"max_model_len must be an integer in \[1, 256\]"):
        load_model(path, dtype="float32", max_model_len=100_000)


# --- HF directories -------------------------------------------------------------------------------


def test_hf_dir_loads_weights_tokenizer_and_config(tmp_path):
    hf_model, path = tiny_model_dir(tmp_path)
    loaded = load_model(path, dtype="float32", max_model_len=64)
    assert isinstance(loaded, LoadedModel)
    assert loaded.path == path and loaded.config.max_model_len == 64
    assert loaded.config.architecture == "LlamaForCausalLM"
    assert loaded.tokenizer.encode("Paris", add_special_tokens=False)
    ours = dict(loaded.model.named_parameters())
    for name, tensor in hf_model.state_dict().items():
        if name in ours:
            assert torch.equal(ours[name], tensor), name


def test_weights_are_cast_to_the_requested_dtype(tmp_path):
    _, path = tiny_model_dir(tmp_path)
    loaded = load_model(path, dtype="bf16")
    assert {p.dtype for p in loaded.model.parameters()} == {torch.bfloat16}
    assert all(t.dtype == torch.bfloat16 for _, t in iter_safetensors_weights(path, torch.bfloat16))


def test_sharded_checkpoint_loads_the_same_weights_as_a_single_file(tmp_path):
    _, single = tiny_model_dir(tmp_path / "single")
    _, sharded = tiny_model_dir(tmp_path / "sharded", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(safetensors_files(sharded)) > 1
    a = dict(load_model(single, dtype="float32").model.state_dict())
    b = dict(load_model(sharded, dtype="float32").model.state_dict())
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_gguf_file_loads_like_the_converted_default_model(
    tmp_path, monkeypatch, default_model_bf16
):
    """A .gguf path is converted into the cache and loaded; same weights as the default."""
    from prefixserve.model.loader.default_model import default_model_gguf

    monkeypatch.setenv("PREFIXSERVE_CACHE_DIR", str(tmp_path))
    loaded = load_model(default_model_gguf(), dtype="bfloat16")
    assert loaded.path.parent == tmp_path / "gguf"
    assert loaded.tokenizer.eos_token_ids == {2}
    reference = default_model_bf16.model.state_dict()  # the converted default model
    ours = loaded.model.state_dict()
    assert all(torch.equal(ours[k], reference[k]) for k in reference)


# --- a converted GGUF file's block weights --------------------------------------------------------


def test_linears_kept_in_blocks_never_read_their_bf16_tensors(tmp_path):
    """A converted GGUF file's block linears get their codes before the bf16 load, which skips
    their tensors (an 8B Q4_K_M model would otherwise hold and pack 16 GB of bf16 first): with
    those tensors gone from the checkpoint, the model loads and answers with the very logprobs
    of the whole copy; quantization "none", which needs them, names them missing."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from prefixserve.llm import LLM
    from prefixserve.model.loader.default_model import ensure_gemma3_270m
    from prefixserve.model.loader.loading import resolve_model_dir
    from prefixserve.model.quant.weights import BLOCK_FORMATS_KEY, GGUF_BLOCKS_FILE
    from prefixserve.sampling_params import SamplingParams

    source = resolve_model_dir(ensure_gemma3_270m())
    with safe_open(str(source / GGUF_BLOCKS_FILE), "pt") as handle:
        kept = set(json.loads(handle.metadata()[BLOCK_FORMATS_KEY]))
    thinned = tmp_path / "thinned"
    thinned.mkdir()
    dropped = 0
    for path in source.iterdir():
        if path.suffix != ".safetensors" or path.name == GGUF_BLOCKS_FILE:
            (thinned / path.name).symlink_to(path)
            continue
        tensors = load_file(str(path))
        for name in tensors.keys() & kept:
            if "embed_tokens" not in name:  # the embedding's lookups read its bf16 rows
                del tensors[name]
                dropped += 1
        save_file(tensors, str(thinned / path.name), metadata={"format": "pt"})
    assert dropped > 100

    def answer(model_dir: Path) -> list[float]:
        loaded = load_model(str(model_dir))
        sp = SamplingParams(max_tokens=4, temperature=0, logprobs=1, ignore_eos=True)
        out = LLM(loaded_model=loaded, num_kv_blocks=32).generate(["The sea is"], sp)[0]
        return [next(iter(entry.values())).logprob for entry in out.outputs[0].logprobs]

    assert answer(thinned) == answer(source)
    with pytest.raises(ValueError, match="missing weights"):
        load_model(str(thinned), quantization="none")
