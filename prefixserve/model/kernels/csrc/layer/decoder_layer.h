// One decoder layer in one native call (decoder_layer.cpp), declared for bindings.cpp, which
// turns the Python tuples of its linears into `PackedLinear`s and binds the class. Only ATen's
// types here: decoder_layer.cpp compiles on the precompiled torch_lite.h, without pybind11.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace prefixserve::layer {

using OptTensor = c10::optional<at::Tensor>;

// A linear of the layer: packed for linear_bf16_packed (the packed weight, its out features, its
// bias, and the packed weight of the linear the forward pass runs next, prefetched after a
// decode-sized call, as `Linear._next_packed`), or 8-bit for linear_int8 (codes, scales, bias,
// the next weight).
struct PackedLinear {
  bool int8;
  at::Tensor packed;  // or the int8 codes
  at::Tensor scales;
  int64_t n;
  OptTensor bias;
  OptTensor next;
};

class DecoderLayerBf16 {
 public:
  // The norms: `input_norm` before attention, `mlp_norm` before the MLP; optional `q_norm` /
  // `k_norm` per head after the qkv linear (Qwen3, Gemma 3), and `attn_out_norm` /
  // `mlp_out_norm` on attention's and the MLP's outputs before their residual adds (Gemma 3's
  // post norms). `offset`: every norm scales by (1 + weight) (Gemma).
  DecoderLayerBf16(at::Tensor input_norm, at::Tensor mlp_norm, double eps, PackedLinear qkv,
                   PackedLinear o, PackedLinear gate_up, PackedLinear down, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, double scale, int64_t act,
                   const OptTensor& q_norm, const OptTensor& k_norm,
                   const OptTensor& attn_out_norm, const OptTensor& mlp_out_norm, bool offset);

  // h [T, hidden] bf16 contiguous -> the layer's output [T, hidden]. cos/sin [T, head_dim]
  // (RotaryEmbedding.cos_sin's rows); the caches, slot mapping, block tables, seq info and
  // window are the paged kernel's (AttentionMetadata.kernel), covering every row of h.
  at::Tensor forward(const at::Tensor& h, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& slots, const at::Tensor& block_tables,
                     const at::Tensor& seq_info, int64_t window, int64_t threads) const;

 private:
  at::Tensor add_normed(const PackedLinear& w, const at::Tensor& norm, const at::Tensor& x,
                        const at::Tensor& residual, int64_t threads) const;

  at::Tensor input_norm_, mlp_norm_, q_norm_, k_norm_, attn_out_norm_, mlp_out_norm_;
  double eps_;
  bool offset_;
  PackedLinear qkv_, o_, gate_up_, down_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_;
  int64_t act_;
};

}  // namespace prefixserve::layer
