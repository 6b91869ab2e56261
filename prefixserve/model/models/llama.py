"""The Llama decoder (also Mistral, SmolLM2 and Qwen2, whose q/k/v biases come from the config).

Parameter names mirror transformers' (`model.layers.N.self_attn...`) except that q/k/v and
gate/up are fused into `qkv_proj` and `gate_up_proj`; `load_weights` fills them shard by shard.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from prefixserve.core.kv_cache.spec import KVCacheSpec
from prefixserve.model.config import ModelConfig
from prefixserve.model.layers.common import (
    Attention,
    ForwardContext,
    GatedMLP,
    RMSNorm,
    one_thread,
)
from prefixserve.model.layers.linear import (
    STREAM_THREADS,
    Linear,
    lm_head_fp32_copy,
    pack_linears,
)
from prefixserve.model.layers.native_layer import bind_decoder_layer
from prefixserve.model.layers.rotary import RotaryEmbedding
from prefixserve.model.loader.weights import check_all_loaded, load_hf_weights

# A layer's rotary rows for a step: (cos, sin), RotaryEmbedding.cos_sin's.
Rope = tuple[torch.Tensor, torch.Tensor]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = GatedMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, config.mlp_bias
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        # Submodules through .forward: no hooks here (see layers.py). The residual adds happen
        # in o_proj's and down_proj's epilogues where they can (`Linear.add_to`).
        h = self.self_attn.forward(self.input_layernorm.forward(h), cos, sin, ctx, residual=h)
        return self.mlp.forward(self.post_attention_layernorm.forward(h), residual=h)

    def bind_native(self) -> object | None:
        """This layer as one native call (`native_layer.bind_decoder_layer`), or None."""
        return bind_decoder_layer(
            self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        )


class DecoderBody(nn.Module):
    """Embedding, layers and final norm (transformers' `model.` prefix)."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], norm: RMSNorm) -> None:
        super().__init__()
        # Given a weight, nn.Embedding skips its random init: on the meta device that init
        # (normal_) would import torch._dynamo, ~2 s; load_weights fills the weight anyway.
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(layers)
        self.norm = norm


class LlamaForCausalLM(nn.Module):
    """A decoder-only LM over the paged KV cache.

    `forward(input_ids [T], ctx) -> hidden [T, hidden_size]`; `compute_logits(hidden [n, H]) ->
    [n, vocab] float32` is applied by the runner only to the rows it samples from.
    """

    # Leading name prefixes of checkpoint tensors we rename / ignore (multimodal wrappers).
    hf_rename: dict[str, str] = {}
    hf_skip_prefixes: tuple[str, ...] = ()

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(
            config,
            [self._make_layer(config, i) for i in range(config.num_layers)],
            self._make_norm(config),
        )
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)
        self.tie_weights()

    def _make_layer(self, config: ModelConfig, layer_idx: int) -> nn.Module:
        return LlamaDecoderLayer(config, layer_idx)

    def _make_norm(self, config: ModelConfig) -> RMSNorm:
        return RMSNorm(config.hidden_size, config.rms_norm_eps)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # The contract names the engine uses (docs/contracts.md).
    def kv_cache_groups(self) -> list[KVCacheSpec]:
        return self.config.kv_cache_groups()

    def layer_group(self, layer_idx: int) -> int:
        return self.config.layer_to_group[layer_idx]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def input_embeddings(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """The embeddings of `input_ids`, with the rows of `ctx.embeds` replaced by the given
        prompt embeddings."""
        h = self.embed(input_ids)
        if ctx.embeds is not None:
            rows, values = ctx.embeds
            h.index_copy_(0, rows, values.to(h.dtype))
        return h

    def layer_ropes(self, ctx: ForwardContext, dtype: torch.dtype) -> list[Rope]:
        """Each layer's (cos, sin) rows for this step's positions: one pair for every layer."""
        return [self.rotary.cos_sin(ctx.positions, dtype)] * len(self.model.layers)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.input_embeddings(input_ids, ctx)
        ropes = self.layer_ropes(ctx, h.dtype)
        native = self.native_layers() if ctx.native_layers else None
        if native is not None:
            h = self._native_forward(native, h, ropes, ctx)
        else:
            for layer, (cos, sin) in zip(self.model.layers, ropes, strict=True):
                h = layer.forward(h, cos, sin, ctx)
        return self.model.norm.forward(h)

    # The decoder layers bound as native calls (`native_layers`): unbound until the first step
    # that may use them, then a list, or None where some layer cannot take the native form.
    _native: list[object] | None | bool = False

    def native_layers(self) -> list[object] | None:
        """Every decoder layer as one native call (its `bind_native`), bound on first use after
        loading; None unless every layer has that form."""
        if self._native is False:
            bound = [
                layer.bind_native() if hasattr(layer, "bind_native") else None
                for layer in self.model.layers
            ]
            self._native = None if any(b is None for b in bound) else bound
        return self._native

    def _native_forward(
        self, native: list[object], h: torch.Tensor, ropes: list[Rope], ctx: ForwardContext
    ) -> torch.Tensor:
        """The decoder layers as native calls over a step whose every row attends through the
        paged kernel (the runner's `ForwardContext.native_layers`)."""
        t = h.shape[0]
        threads = STREAM_THREADS[0]
        steps = [
            (meta.slot_mapping, meta.kernel.block_tables, meta.kernel.info, meta.kernel.window)
            for meta in ctx.groups
        ]
        # Each distinct (cos, sin) as the kernel's [T, head_dim] rows, viewed once a step.
        distinct = {id(rope): rope for rope in ropes}
        rows = {key: (cos.view(t, -1), sin.view(t, -1)) for key, (cos, sin) in distinct.items()}
        layer_to_group = self.config.layer_to_group
        for i, layer in enumerate(native):
            slots, tables, info, window = steps[layer_to_group[i]]
            k_cache, v_cache = ctx.kv_caches[i]
            cos, sin = rows[id(ropes[i])]
            h = layer.forward(h, cos, sin, k_cache, v_cache, slots, tables, info, window, threads)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, vocab] float32 logits: the LM head's fp32 sums, never rounded to bf16 (a bf16
        rounding made near-ties exact ties, issue 56), then the soft-cap in fp32."""
        logits = self.lm_head.forward_fp32(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(
        self,
        weights: Iterable[tuple[str, torch.Tensor]],
        *,
        assign: bool = False,
        given: frozenset[str] | set[str] = frozenset(),
    ) -> None:
        """Load Hugging Face-named tensors. Without `lm_head.weight` the head is tied to the
        embedding; rotary `inv_freq` buffers are skipped. `assign=True` lets unfused parameters
        take the given tensors without a copy (only for tensors nobody else will modify, e.g.
        freshly memory-mapped safetensors; see `load_hf_weights`). `given`: parameters whose
        linears already have 8-bit codes (`quantize.give_block_weights`), not loaded."""
        tied = self.config.tie_word_embeddings

        def wanted() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                if tied and name.endswith("lm_head.weight"):
                    continue
                yield name, tensor

        with one_thread():
            loaded = load_hf_weights(
                self, wanted(), self.hf_rename, self.hf_skip_prefixes, assign=assign, given=given
            )
            if not tied and "lm_head.weight" not in loaded:
                self.lm_head.weight = self.model.embed_tokens.weight
                loaded.add("lm_head.weight")
            check_all_loaded(self, loaded)
            pack_linears(
                self, no_fp32_copy=() if lm_head_fp32_copy(self.lm_head) else (self.lm_head,)
            )
            self._native = False  # the packed weights changed: bind again on first use


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with q/k/v biases (`ModelConfig.qkv_bias`)."""


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama, with every layer sliding when the config sets `sliding_window`."""
