"""Gemma 3 (text): interleaved sliding-window and global layers.

Differences from Llama: RMSNorm scales by (1 + weight); embeddings are multiplied by
sqrt(hidden_size) (rounded to the weight dtype, as transformers does); four norms per layer
(around attention and around the MLP); per-head q/k norms; attention scale
query_pre_attn_scalar ** -0.5; GELU-tanh MLP; sliding layers use their own rope base
(`rope_local_base_freq`, never scaled) and the sliding-window KV-cache group; optional soft-capping
of attention and final logits.
"""

from __future__ import annotations

import torch
from torch import nn

from prefixserve.model.config import ModelConfig
from prefixserve.model.layers.common import Attention, ForwardContext, GatedMLP, RMSNorm
from prefixserve.model.layers.native_layer import bind_decoder_layer
from prefixserve.model.layers.rotary import RotaryEmbedding
from prefixserve.model.models.llama import LlamaForCausalLM, Rope


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.is_sliding = config.layer_types[layer_idx] == "sliding"
        self.self_attn = Attention(config, layer_idx)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = RMSNorm(dim, eps, offset=True)
        self.post_attention_layernorm = RMSNorm(dim, eps, offset=True)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, offset=True)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, offset=True)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # Submodules through .forward: no hooks here (see layers.py).
        a = self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, ctx)
        h = self.post_attention_layernorm.forward(a).add_(h)
        m = self.mlp.forward(self.pre_feedforward_layernorm.forward(h))
        return self.post_feedforward_layernorm.forward(m).add_(h)

    def bind_native(self) -> object | None:
        """This layer as one native call (`native_layer.bind_decoder_layer`), or None."""
        return bind_decoder_layer(
            self.self_attn,
            self.mlp,
            self.input_layernorm,
            self.pre_feedforward_layernorm,
            (self.post_attention_layernorm, self.post_feedforward_layernorm),
        )


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text decoder; also serves the text part of Gemma3ForConditionalGeneration."""

    hf_rename = {
        "model.language_model.": "model.",
        "language_model.model.": "model.",
        "language_model.lm_head.": "lm_head.",
    }
    hf_skip_prefixes = (
        "vision_tower.",
        "multi_modal_projector.",
        "model.vision_tower.",
        "model.multi_modal_projector.",
    )

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        local_base = config.rope_local_base_freq or config.rope_theta
        self.rotary_local = RotaryEmbedding(config.head_dim, local_base, None)
        self.embed_scale = float(config.embed_scale or 1.0)

    def _make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return Gemma3DecoderLayer(config, layer_idx)

    def _make_norm(self, config: ModelConfig) -> RMSNorm:
        return RMSNorm(config.hidden_size, config.rms_norm_eps, offset=True)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        return h * torch.tensor(self.embed_scale, dtype=h.dtype)

    def layer_ropes(self, ctx: ForwardContext, dtype: torch.dtype) -> list[Rope]:
        """Sliding layers rotate by the local base, global ones by the global base."""
        rope_global = self.rotary.cos_sin(ctx.positions, dtype)
        rope_local = self.rotary_local.cos_sin(ctx.positions, dtype)
        return [rope_local if layer.is_sliding else rope_global for layer in self.model.layers]
