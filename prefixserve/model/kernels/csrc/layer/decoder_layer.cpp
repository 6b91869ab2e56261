// One decoder layer in one native call, for steps whose every row attends through the paged
// kernel (decode, verification, chunks over a cached prefix): RMSNorm, the fused qkv linear, the
// per-head q/k norms where the model has them (Qwen3, Gemma 3), rotary and the K/V writes, paged
// attention, o_proj with the residual add in its epilogue, RMSNorm, gate_up with act(gate) * up
// in its epilogue, down_proj with the residual add. Gemma 3's layers norm attention's and the
// MLP's outputs before their residual adds, and scale every norm by (1 + weight). The same
// kernels, called in the same order with the same arguments, as the Python layers
// (`LlamaDecoderLayer.forward`, `Gemma3DecoderLayer.forward`) make, so the output is that path's,
// bit for bit; what goes away is the Python between them (~8 calls, ~20 tensor views and
// allocations, the argument conversions of each binding): 2.4-5.9 ms of a batch-1 decode step
// over the default model's 30 layers, 1.19-1.37x in two same-run measurements (BENCHMARKS.md).
//
// The layer's weights are bound once (`DecoderLayerBf16`, built by
// prefixserve/model/layers/native_layer.py after the linears are packed; bound to Python in
// bindings.cpp, which converts the linears' tuples); a step passes only its own tensors. The GIL is
// released for the whole layer.
#include "torch_lite.h"

#include <cstdint>
#include <utility>

#include "decoder_layer.h"
// The kernels this layer calls (their own files check their arguments).
#include "kernels.h"

namespace prefixserve::layer {
namespace {

// out = x @ w^T (+ bias) (+ residual, after the rounding), on the linear's kernel.
void run_linear(const PackedLinear& w, torch::Tensor out, const torch::Tensor& x,
                int64_t threads, OptTensor residual) {
  if (w.int8)
    linear_int8(out, x, w.packed, w.scales, w.bias, 0, residual, threads, w.next);
  else
    linear_bf16_packed(out, x, w.packed, w.n, w.bias, threads, w.next, residual);
}

// out = act(gate) * up of a fused gate_up linear, on the linear's kernel.
void run_gated(const PackedLinear& w, torch::Tensor out, const torch::Tensor& x, int64_t act,
               int64_t threads) {
  if (w.int8)
    linear_int8(out, x, w.packed, w.scales, w.bias, act, c10::nullopt, threads, w.next);
  else
    linear_bf16_packed_gated(out, x, w.packed, w.n, w.bias, act, threads, w.next);
}

// A norm of the layer: its weight, or an undefined tensor where the layer has none.
torch::Tensor optional_norm(const OptTensor& w) { return w.has_value() ? *w : torch::Tensor(); }

}  // namespace

DecoderLayerBf16::DecoderLayerBf16(at::Tensor input_norm, at::Tensor mlp_norm, double eps,
                                   PackedLinear qkv, PackedLinear o, PackedLinear gate_up,
                                   PackedLinear down, int64_t heads, int64_t kv_heads,
                                   int64_t head_dim, double scale, int64_t act,
                                   const OptTensor& q_norm, const OptTensor& k_norm,
                                   const OptTensor& attn_out_norm, const OptTensor& mlp_out_norm,
                                   bool offset)
    : input_norm_(std::move(input_norm)),
      mlp_norm_(std::move(mlp_norm)),
      q_norm_(optional_norm(q_norm)),
      k_norm_(optional_norm(k_norm)),
      attn_out_norm_(optional_norm(attn_out_norm)),
      mlp_out_norm_(optional_norm(mlp_out_norm)),
      eps_(eps),
      offset_(offset),
      qkv_(std::move(qkv)),
      o_(std::move(o)),
      gate_up_(std::move(gate_up)),
      down_(std::move(down)),
      heads_(heads),
      kv_heads_(kv_heads),
      head_dim_(head_dim),
      scale_(scale),
      act_(act) {
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0 && head_dim > 0,
              "DecoderLayerBf16: bad head counts");
  TORCH_CHECK(qkv_.n == (heads + 2 * kv_heads) * head_dim && o_.n == input_norm_.size(0) &&
                  down_.n == o_.n && gate_up_.n % 2 == 0,
              "DecoderLayerBf16: the linears' shapes do not make a decoder layer");
  TORCH_CHECK(q_norm_.defined() == k_norm_.defined(),
              "DecoderLayerBf16: q and k norms come together");
}

at::Tensor DecoderLayerBf16::forward(const at::Tensor& h, const at::Tensor& cos,
                                     const at::Tensor& sin, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& slots,
                                     const at::Tensor& block_tables, const at::Tensor& seq_info,
                                     int64_t window, int64_t threads) const {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.scalar_type() == torch::kBFloat16,
              "DecoderLayerBf16: h must be a contiguous bfloat16 [T, hidden]");
  const int64_t t = h.size(0), q_size = heads_ * head_dim_;
  auto x = torch::empty_like(h);
  rms_norm(x, h, input_norm_, eps_, offset_);
  auto qkv = h.new_empty({t, qkv_.n});
  run_linear(qkv_, qkv, x, threads, c10::nullopt);
  if (q_norm_.defined()) {  // per head, in place in qkv (Attention.forward's order)
    auto q = qkv.narrow(1, 0, q_size).view({t, heads_, head_dim_});
    rms_norm(q, q, q_norm_, eps_, offset_);
    auto k = qkv.narrow(1, q_size, kv_heads_ * head_dim_).view({t, kv_heads_, head_dim_});
    rms_norm(k, k, k_norm_, eps_, offset_);
  }
  rope_write_kv(qkv, cos, sin, heads_, kv_heads_, k_cache, v_cache, slots);
  auto q = qkv.narrow(1, 0, q_size).view({t, heads_, head_dim_});
  auto attn = h.new_empty({t, q_size});
  paged_attention(attn, q, k_cache, v_cache, block_tables, seq_info, scale_, 0.0, window,
                  threads);
  auto mid = add_normed(o_, attn_out_norm_, attn, h, threads);
  auto x2 = torch::empty_like(h);
  rms_norm(x2, mid, mlp_norm_, eps_, offset_);
  auto hidden = h.new_empty({t, gate_up_.n / 2});
  run_gated(gate_up_, hidden, x2, act_, threads);
  return add_normed(down_, mlp_out_norm_, hidden, mid, threads);
}

// residual + w(x): the add in the linear's epilogue, or, with a norm on the linear's output
// (Gemma 3), norm(w(x)) + residual as the Python layer's `norm.forward(a).add_(residual)`.
at::Tensor DecoderLayerBf16::add_normed(const PackedLinear& w, const at::Tensor& norm,
                                        const at::Tensor& x, const at::Tensor& residual,
                                        int64_t threads) const {
  auto out = torch::empty_like(residual);
  if (!norm.defined()) {
    run_linear(w, out, x, threads, residual);
    return out;
  }
  auto a = torch::empty_like(residual);
  run_linear(w, a, x, threads, c10::nullopt);
  rms_norm(out, a, norm, eps_, offset_);
  return out.add_(residual);
}

}  // namespace prefixserve::layer
