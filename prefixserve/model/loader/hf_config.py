"""A Hugging Face config.json -> ModelConfig.

The dict is first run through transformers' own config class for the architecture, so fields
the file leaves out take the same defaults transformers would use (a `save_pretrained`
config.json omits values equal to the defaults).
"""

from __future__ import annotations

from typing import Any

from prefixserve.model.config import ModelConfig
from prefixserve.model.models.registry import (
    SUPPORTED_ARCHITECTURES,
    architecture_of_model_type,
    hf_model_type,
)

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3")


def model_config_from_hf(hf: dict[str, Any], dtype: str) -> ModelConfig:
    """Build from a config.json dict; unsupported architectures raise ValueError."""
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else architecture_of_model_type(hf.get("model_type", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported model architecture {arch!r} (model_type "
            f"{hf.get('model_type')!r}); supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    full = _with_transformers_defaults(hf, arch)
    if arch == "Gemma3ForConditionalGeneration" and "text_config" in full:
        text = full["text_config"]
        text_eos = text.get("eos_token_id")
        if full.get("eos_token_id") is not None:
            text_eos = full["eos_token_id"]
        full = {**text, "eos_token_id": text_eos}
    is_gemma = arch.startswith("Gemma3")

    rope_scaling = full.get("rope_scaling")
    if rope_scaling is not None:
        rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling type {rope_type!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        rope_scaling = {**rope_scaling, "rope_type": rope_type}
        if rope_type == "default":
            rope_scaling = None

    num_layers = int(full["num_hidden_layers"])
    sliding_window = full.get("sliding_window")
    layer_types = _layer_types(full, arch, num_layers)
    if "sliding" not in layer_types:
        sliding_window = None

    num_heads = int(full["num_attention_heads"])
    head_dim = full.get("head_dim") or full["hidden_size"] // num_heads
    eos = full.get("eos_token_id")
    eos_ids = [] if eos is None else [int(eos)] if isinstance(eos, int) else list(eos)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(full["vocab_size"]),
        hidden_size=int(full["hidden_size"]),
        intermediate_size=int(full["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(full.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        max_model_len=int(full["max_position_embeddings"]),
        dtype=dtype,
        tie_word_embeddings=bool(full.get("tie_word_embeddings", is_gemma)),
        eos_token_ids=eos_ids,
        bos_token_id=full.get("bos_token_id"),
        rms_norm_eps=float(full["rms_norm_eps"]),
        rope_theta=float(full.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling,
        rope_local_base_freq=full.get("rope_local_base_freq") if is_gemma else None,
        layer_types=layer_types,
        sliding_window=int(sliding_window) if sliding_window else None,
        hidden_act=full.get("hidden_activation") or full.get("hidden_act") or "silu",
        # Qwen2 always has q/k/v biases and never an o_proj bias.
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(full.get("attention_bias", False)),
        o_bias=arch != "Qwen2ForCausalLM" and bool(full.get("attention_bias", False)),
        mlp_bias=bool(full.get("mlp_bias", False)),
        qk_norm=arch in ("Qwen3ForCausalLM",) or is_gemma,
        query_pre_attn_scalar=full.get("query_pre_attn_scalar") if is_gemma else None,
        attn_logit_softcapping=full.get("attn_logit_softcapping"),
        final_logit_softcapping=full.get("final_logit_softcapping"),
    )


# The keys of a Llama config.json for which transformers' LlamaConfig defaults differ from the
# fallbacks `model_config_from_hf` uses (for every other key it reads, the two agree: no kv-head
# count means one per head, silu, untied, rope_theta 10000, no biases, head_dim = hidden / heads,
# no layer_types or sliding window). save_pretrained writes all of them.
_LLAMA_KEYS_WITH_OTHER_DEFAULTS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "rms_norm_eps",
    "bos_token_id",
    "eos_token_id",
)


def _complete_llama_config(hf: dict[str, Any], arch: str) -> bool:
    """A plain Llama config.json that states every value whose default matters: transformers'
    LlamaConfig would add nothing `model_config_from_hf` reads, so importing it (~1 s) can be
    skipped."""
    return (
        arch == "LlamaForCausalLM"
        and hf.get("model_type") == "llama"
        and hf.get("rope_scaling") is None  # scaled rope: let transformers validate it
        and all(key in hf for key in _LLAMA_KEYS_WITH_OTHER_DEFAULTS)
    )


def _with_transformers_defaults(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """Fill in what config.json omits with transformers' defaults for the architecture."""
    if _complete_llama_config(hf, arch):
        return dict(hf)
    from transformers import CONFIG_MAPPING

    model_type = hf.get("model_type") or hf_model_type(arch)
    if arch == "Gemma3ForCausalLM" and model_type == "gemma3":
        model_type = "gemma3_text"
    config_cls = CONFIG_MAPPING[model_type]
    kwargs = {k: v for k, v in hf.items() if k not in ("model_type", "transformers_version")}
    return config_cls(**kwargs).to_dict()


def _layer_types(full: dict[str, Any], arch: str, num_layers: int) -> list[str]:
    explicit = full.get("layer_types")
    if arch == "MistralForCausalLM":
        return ["sliding" if full.get("sliding_window") else "full"] * num_layers
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not full.get("use_sliding_window"):
        return ["full"] * num_layers
    if explicit:
        return ["sliding" if kind == "sliding_attention" else "full" for kind in explicit]
    return ["full"] * num_layers
