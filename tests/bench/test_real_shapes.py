"""benchmarks/real_shapes.py (the model shapes CPU users run, random weights, llama.cpp's GGUF
files) and the decode bandwidth accounting of benchmarks/bench_bandwidth.py that bench_model
prints: the shapes' configs are ones our loader takes, what the script writes loads, and the
bytes a decode token reads add up to each kept tensor's bytes."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from benchmarks import bench_bandwidth, real_shapes
from prefixserve.model.loader.hf_config import model_config_from_hf
from prefixserve.model.loader.loading import load_hf_dir
from tests.helpers.gguf_files import finish_gguf

# The published parameter counts (billions, as the models' cards round them).
PUBLISHED = {
    "llama-3.2-1b": 1.24,
    "llama-3.2-3b": 3.21,
    "qwen2.5-1.5b": 1.54,
    "llama-3.1-8b": 8.03,
}


def test_the_shape_table_has_the_published_models_parameter_counts():
    assert set(real_shapes.SHAPES) == set(PUBLISHED)
    for name, billions in PUBLISHED.items():
        assert round(real_shapes.SHAPES[name].params() / 1e9, 2) == billions, name


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_every_shape_config_is_one_our_loader_takes_with_its_values(name):
    shape = real_shapes.SHAPES[name]
    config = model_config_from_hf(shape.hf_config(1, 2), "bfloat16")
    assert config.architecture == shape.architecture
    assert (config.hidden_size, config.intermediate_size) == (shape.hidden, shape.intermediate)
    assert (config.num_layers, config.num_heads) == (shape.layers, shape.heads)
    assert (config.num_kv_heads, config.head_dim) == (shape.kv_heads, shape.head_dim)
    assert config.vocab_size == shape.vocab
    assert config.tie_word_embeddings == shape.tie_word_embeddings
    assert config.qkv_bias == (name == "qwen2.5-1.5b")
    assert config.rope_theta == shape.rope_theta
    assert config.layer_types == ["full"] * shape.layers
    if shape.rope_scaling is not None:
        assert config.rope_scaling["rope_type"] == "llama3"


def test_only_the_8b_shape_asks_for_q4_k_m_alone():
    assert real_shapes.SHAPES["llama-3.1-8b"].files == ("q4_k_m",)
    others = [s for n, s in real_shapes.SHAPES.items() if n != "llama-3.1-8b"]
    assert all(s.files == real_shapes.FILES for s in others)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_tiny_version_written_by_the_script_loads_in_our_loader(
    name, tmp_path, default_model_dir
):
    """The same writer at test size: the safetensors file written tensor by tensor is one our
    loader streams into the model (norms 1, the rest normal with std 0.02, the same bytes on
    every run), the tokenizer is the packaged one's."""
    shape = real_shapes.tiny(real_shapes.SHAPES[name])
    out = tmp_path / "hf"
    real_shapes.write_hf_dir(shape, out, default_model_dir, quiet=True)
    loaded = load_hf_dir(out, torch.float32, quantization="none")
    assert loaded.config.vocab_size == shape.vocab
    assert loaded.config.qkv_bias == shape.qkv_bias
    params = dict(loaded.model.named_parameters())
    assert torch.equal(params["model.norm.weight"], torch.ones(shape.hidden))
    embed = params["model.embed_tokens.weight"]
    assert embed.shape == (shape.vocab, shape.hidden)
    assert abs(float(embed.std()) - real_shapes.STD) < 0.001
    assert loaded.tokenizer.encode("hello world") == _default_tokens(default_model_dir)
    again = tmp_path / "again"
    real_shapes.write_hf_dir(shape, again, default_model_dir, quiet=True)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert json.loads((out / "config.json").read_text())["vocab_size"] == shape.vocab


def _default_tokens(default_model_dir) -> list[int]:
    from prefixserve.model.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_model_dir).encode("hello world")


def test_the_disk_check_refuses_a_plan_naming_what_it_needs(tmp_path, monkeypatch):
    """The 8B's plan (HF directory and bf16 file side by side: ~32 GB) against 10 GB free."""

    class Usage:
        free = 10e9

    monkeypatch.setattr(real_shapes.shutil, "disk_usage", lambda _: Usage)
    shape = real_shapes.SHAPES["llama-3.1-8b"]
    with pytest.raises(SystemExit, match=r"need ~32\.1 GB of disk .* has 10\.0 GB free"):
        real_shapes.check_disk(shape, ["hf", "bf16", "q4_k_m"], False, tmp_path)
    Usage.free = 40e9
    real_shapes.check_disk(shape, ["hf", "bf16", "q4_k_m"], False, tmp_path)
    Usage.free = 38e9
    with pytest.raises(SystemExit, match=r"need ~37\.7 GB"):  # kept: all three at once
        real_shapes.check_disk(shape, ["hf", "bf16", "q4_k_m"], True, tmp_path)


@pytest.mark.slow
def test_llama_cpp_pads_the_vocabulary_and_our_loader_takes_its_q4_k_m(tmp_path, default_model_dir):
    """Through llama.cpp's own converter and quantizer (the peer's; skipped without it): the
    vocabulary past the tokenizer's is padded, our conversion of the Q4_K_M file loads with its
    Q4_K and Q6_K weights kept, and the intermediates are gone."""
    try:
        real_shapes.converter_script()
    except SystemExit:
        pytest.skip("the llama.cpp peer is not set up (scripts/peers/setup_llama_cpp.sh)")
    from prefixserve.model.loader.gguf_convert import convert_gguf

    shape = real_shapes.tiny(real_shapes.SHAPES["llama-3.2-1b"])
    made = real_shapes.ensure_files(
        shape, ("q4_k_m",), root=tmp_path, tokenizer_dir=default_model_dir
    )
    path = made["q4_k_m"]
    assert sorted(p.name for p in path.parent.glob("*.gguf")) == [path.name]
    assert not (path.parent / "hf").exists()
    tokens = gguf.GGUFReader(path).fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == shape.vocab
    convert_gguf(path, tmp_path / "converted")
    loaded = load_hf_dir(tmp_path / "converted", torch.bfloat16)
    assert loaded.config.vocab_size == shape.vocab
    assert set(loaded.config.quantization.split("+")) == {"q4_k", "q6_k"}
    # Llama 3's rope scaling, written by llama.cpp as rope_freqs.weight, read back (gguf_rope.py)
    scaling = loaded.config.rope_scaling
    assert {k: scaling[k] for k in shape.rope_scaling} == shape.rope_scaling
    record = json.loads((path.parent / "steps.json").read_text())
    assert [s["name"] for s in record["steps"]] == ["hf", "bf16", "q4_k_m"]


# ---- bytes per decode token


def test_our_bytes_per_token_are_each_linear_once_an_embedding_row_and_the_norms(
    default_model_bf16,
):
    """The default model in bf16 (tied head): every linear's weight as its kernel reads it, the
    head once, one embedding row and every norm, counted here from the config alone."""
    config = default_model_bf16.config
    h, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 2 * h * i + i * h + 2 * h
    values = config.num_layers * per_layer + config.vocab_size * h + h + h
    got = bench_bandwidth.weight_bytes_per_token(default_model_bf16.model)
    assert got == 2 * values


def test_our_bytes_per_token_count_an_8_bit_linear_as_its_codes_and_scales(default_model_bf16):
    from prefixserve.model.layers.linear import Linear

    model = default_model_bf16.model
    linear = next(m for m in model.modules() if isinstance(m, Linear) and m.bias is None)
    codes, scales = torch.zeros(100, dtype=torch.uint8), torch.zeros(10, dtype=torch.float16)
    before = bench_bandwidth.weight_bytes_per_token(model)
    plain = bench_bandwidth.linear_bytes(linear)
    linear._int8 = (codes, scales, None)
    try:
        assert bench_bandwidth.linear_bytes(linear) == 100 + 20
        assert bench_bandwidth.weight_bytes_per_token(model) == before - plain + 120
    finally:
        del linear._int8


def _gguf_with(path, tied: bool):
    """A GGUF of an embedding (Q8_0, 64 rows of 32), a layer's F16 weight and F32 norm, and an
    output matrix unless `tied`; returns (path, each tensor's bytes)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    embed = gguf.quants.quantize(
        np.ones((64, 32), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("token_embd.weight", embed, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", np.ones((32, 32), dtype=np.float16))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))
    if not tied:
        writer.add_tensor("output.weight", np.ones((64, 32), dtype=np.float16))
    finish_gguf(writer)
    return path


@pytest.mark.parametrize("tied", [False, True], ids=["output", "tied"])
def test_llama_cpp_bytes_per_token_are_the_files_tensors_with_one_embedding_row(tmp_path, tied):
    path = _gguf_with(tmp_path / "m.gguf", tied)
    row = 34  # Q8_0: 32 codes and an fp16 scale
    expected = 32 * 32 * 2 + 32 * 4 + row + (64 * row if tied else 64 * 32 * 2)
    assert bench_bandwidth.gguf_weight_bytes_per_token(path) == expected


def test_kv_bytes_per_token_are_both_caches_of_every_layer_over_the_context(
    default_model_bf16,
):
    config = default_model_bf16.config
    got = bench_bandwidth.kv_bytes_per_token(config, 128)
    assert got == 2 * config.num_layers * 128 * config.num_kv_heads * config.head_dim * 2
