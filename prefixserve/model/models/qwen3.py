"""Qwen3: the Llama decoder with per-head RMSNorm on queries and keys before the rotary
embedding (`ModelConfig.qk_norm`, weights `self_attn.q_norm` / `self_attn.k_norm`)."""

from __future__ import annotations

from prefixserve.model.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models; q/k norms are switched on by the config."""
