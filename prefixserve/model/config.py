"""What the model code needs to know about a checkpoint: the decoder's shape and options.

`hf_config.model_config_from_hf` builds one from a Hugging Face config.json.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from prefixserve.core.kv_cache.spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from prefixserve.dtypes import BYTES_PER_ELEMENT, SUPPORTED_DTYPES

if TYPE_CHECKING:
    from prefixserve.model.quant.kv_cache import KVFormat


@dataclass(slots=True)
class ModelConfig:
    """The decoder's shape and the options each family switches on.

    `layer_types[i]` is "full" or "sliding"; layers of one kind form one KV-cache group, in the
    order of `kv_cache_groups()` ("full" first when both exist), and `layer_to_group[i]` indexes it.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    dtype: str
    tie_word_embeddings: bool
    eos_token_ids: list[int]
    rms_norm_eps: float
    rope_theta: float
    layer_types: list[str]
    sliding_window: int | None = None
    bos_token_id: int | None = None
    rope_scaling: dict[str, Any] | None = None
    # Gemma 3: the sliding layers' own rope base (their rope is never scaled).
    rope_local_base_freq: float | None = None
    hidden_act: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Attention scale is query_pre_attn_scalar ** -0.5 when set, else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    layer_to_group: list[int] = field(default_factory=list)
    # The 8-bit weight formats the loaded linears hold ("q8_0", "int8", "q8_0+int8"; None: none),
    # set by the loader (model/loader/quantize.py).
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"dtype must be one of {SUPPORTED_DTYPES}, got {self.dtype!r} "
                "(float16 matmuls are unusably slow on CPU)"
            )
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers"
            )
        for kind in self.layer_types:
            if kind not in ("full", "sliding"):
                raise ValueError(f"layer type must be 'full' or 'sliding', got {kind!r}")
        if "sliding" in self.layer_types and not self.sliding_window:
            raise ValueError("sliding layers need a positive sliding_window, got None")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        kinds = self._group_kinds()
        self.layer_to_group = [kinds.index(kind) for kind in self.layer_types]

    def _group_kinds(self) -> list[str]:
        return [kind for kind in ("full", "sliding") if kind in self.layer_types]

    def kv_cache_groups(self) -> list[KVCacheSpec]:
        """One KV-cache spec per group of layers sharing an attention kind."""
        return [
            FullAttentionSpec()
            if kind == "full"
            else SlidingWindowSpec(sliding_window=int(self.sliding_window))
            for kind in self._group_kinds()
        ]

    def kv_cache_bytes_per_block(self, block_size: int, kv_format: KVFormat | None = None) -> int:
        """Bytes one KV block of `block_size` tokens takes over all layers (K and V), in the
        model's dtype or in `kv_format`'s rows (model/quant/kv_cache.py)."""
        if kv_format is None:
            row = self.head_dim * BYTES_PER_ELEMENT[self.dtype]
        else:
            row = kv_format.row_bytes(self.head_dim)
        return 2 * self.num_layers * block_size * self.num_kv_heads * row

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def attn_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5

    @property
    def embed_scale(self) -> float | None:
        """Gemma multiplies the embeddings by sqrt(hidden_size); the others do not scale them."""
        return math.sqrt(self.hidden_size) if self.architecture.startswith("Gemma3") else None
