"""model_config_from_hf: defaults, KV-cache groups and the errors users can cause."""

from __future__ import annotations

import pytest
import transformers

from prefixserve.core.kv_cache.spec import FullAttentionSpec, SlidingWindowSpec
from prefixserve.model.loader.hf_config import model_config_from_hf
from prefixserve.model.models.registry import SUPPORTED_ARCHITECTURES, create_model


def diff_dict(config: transformers.PretrainedConfig, arch: str) -> dict:
    """What save_pretrained writes to config.json: only values that differ from defaults."""
    config.architectures = [arch]
    return config.to_diff_dict()


def test_unsupported_architecture_names_it_and_the_supported_ones():
    with pytest.raises(ValueError) as info:
        model_config_from_hf({"architectures": ["GPT2LMHeadModel"]}, "float32")
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in message


def test_float16_is_refused():
    hf = diff_dict(transformers.LlamaConfig(num_hidden_layers=2), "LlamaForCausalLM")
    with pytest.raises(ValueError, match="float16"):
        model_config_from_hf(hf, "float16")


def test_unsupported_rope_scaling_is_refused():
    hf = diff_dict(
        transformers.LlamaConfig(
            num_hidden_layers=2, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
        ),
        "LlamaForCausalLM",
    )
    with pytest.raises(ValueError, match="dynamic"):
        model_config_from_hf(hf, "float32")


def test_llama_is_one_full_attention_group():
    hf = diff_dict(
        transformers.LlamaConfig(num_hidden_layers=3, num_key_value_heads=2), "LlamaForCausalLM"
    )
    config = model_config_from_hf(hf, "bfloat16")
    assert config.kv_cache_groups() == [FullAttentionSpec()]
    assert config.layer_to_group == [0, 0, 0]
    assert config.sliding_window is None
    assert config.tie_word_embeddings is False  # LlamaConfig's default, absent from the file
    assert config.num_kv_heads == 2 and config.head_dim == 4096 // 32


def test_gemma3_defaults_fill_what_config_json_leaves_out():
    hf = diff_dict(
        transformers.Gemma3TextConfig(num_hidden_layers=7, sliding_window=512),
        "Gemma3ForCausalLM",
    )
    assert "tie_word_embeddings" not in hf  # equal to the default, so save_pretrained drops it
    config = model_config_from_hf(hf, "bfloat16")
    assert config.tie_word_embeddings is True
    # Default pattern: five sliding layers, then a global one.
    assert config.layer_types == ["sliding"] * 5 + ["full"] + ["sliding"]
    assert config.kv_cache_groups() == [FullAttentionSpec(), SlidingWindowSpec(sliding_window=512)]
    assert config.layer_to_group == [1, 1, 1, 1, 1, 0, 1]
    assert config.rope_local_base_freq == 10_000.0
    assert config.attn_scale == 256**-0.5  # query_pre_attn_scalar, not head_dim


def test_gemma3_conditional_generation_uses_its_text_config():
    hf = transformers.Gemma3Config(
        text_config={"num_hidden_layers": 2, "hidden_size": 64, "sliding_window": 16}
    ).to_dict()
    hf["architectures"] = ["Gemma3ForConditionalGeneration"]
    config = model_config_from_hf(hf, "float32")
    assert config.architecture == "Gemma3ForConditionalGeneration"
    assert config.num_layers == 2 and config.hidden_size == 64
    assert config.sliding_window == 16


def test_mistral_without_sliding_window_is_full_attention():
    hf = diff_dict(
        transformers.MistralConfig(num_hidden_layers=2, sliding_window=None), "MistralForCausalLM"
    )
    assert model_config_from_hf(hf, "float32").kv_cache_groups() == [FullAttentionSpec()]


def test_eos_token_ids_are_a_list():
    hf = diff_dict(transformers.Qwen3Config(num_hidden_layers=2), "Qwen3ForCausalLM")
    hf["eos_token_id"] = [5, 7]
    assert model_config_from_hf(hf, "float32").eos_token_ids == [5, 7]


def test_create_model_is_in_the_config_dtype_and_tied():
    hf = diff_dict(
        transformers.Qwen3Config(
            num_hidden_layers=2,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=50,
            tie_word_embeddings=True,
        ),
        "Qwen3ForCausalLM",
    )
    model = create_model(model_config_from_hf(hf, "bfloat16"))
    assert {p.dtype for p in model.parameters()} == {__import__("torch").bfloat16}
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.kv_cache_groups() == [FullAttentionSpec()]
    assert model.layer_group(1) == 0


def test_complete_llama_config_skips_transformers_and_agrees_with_it(
    default_model_dir, monkeypatch
):
    import json

    from prefixserve.model.loader import hf_config as config_module

    hf = json.loads((default_model_dir / "config.json").read_text())
    assert config_module._complete_llama_config(hf, "LlamaForCausalLM")
    shortcut = model_config_from_hf(hf, "float32")
    monkeypatch.setattr(config_module, "_complete_llama_config", lambda hf, arch: False)
    assert model_config_from_hf(hf, "float32") == shortcut
