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
// prefixserve/model/layers/native_layer.py after the linears are packed); a step passes only its
// own tensors. The GIL is released for the whole layer.
#include <torch/extension.h>

#include <cstdint>

// The kernels this layer calls (their own files check their arguments).
#include "kernels.h"

namespace {

using OptTensor = c10::optional<torch::Tensor>;

// A linear of the layer: packed for linear_bf16_packed (the packed weight, its out features, its
// bias, and the packed weight of the linear the forward pass runs next, prefetched after a
// decode-sized call, as `Linear._next_packed`), or 8-bit for linear_int8 (codes, scales, bias,
// the next weight).
struct PackedLinear {
  bool int8;
  torch::Tensor packed;  // or the int8 codes
  torch::Tensor scales;
  int64_t n;
  OptTensor bias;
  OptTensor next;
};

PackedLinear packed_linear(const py::tuple& t) {
  TORCH_CHECK(t.size() == 4, "a linear is (packed, out_features, bias, next_packed) or (codes, "
                             "scales, bias, next weight)");
  if (!py::isinstance<py::int_>(t[1])) {
    // [N, K / G] (or [2, N, K / 32], scales and mins): N rows, the codes packed by four
    auto scales = t[1].cast<torch::Tensor>();
    return {true, t[0].cast<torch::Tensor>(), scales, scales.size(scales.dim() - 2),
            t[2].cast<OptTensor>(),
            t[3].cast<OptTensor>()};
  }
  return {false, t[0].cast<torch::Tensor>(), torch::Tensor(), t[1].cast<int64_t>(),
          t[2].cast<OptTensor>(), t[3].cast<OptTensor>()};
}

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

class DecoderLayerBf16 {
 public:
  // The norms: `input_norm` before attention, `mlp_norm` before the MLP; optional `q_norm` /
  // `k_norm` per head after the qkv linear (Qwen3, Gemma 3), and `attn_out_norm` /
  // `mlp_out_norm` on attention's and the MLP's outputs before their residual adds (Gemma 3's
  // post norms). `offset`: every norm scales by (1 + weight) (Gemma).
  DecoderLayerBf16(torch::Tensor input_norm, torch::Tensor mlp_norm, double eps,
                   const py::tuple& qkv, const py::tuple& o, const py::tuple& gate_up,
                   const py::tuple& down, int64_t heads, int64_t kv_heads, int64_t head_dim,
                   double scale, int64_t act, const OptTensor& q_norm, const OptTensor& k_norm,
                   const OptTensor& attn_out_norm, const OptTensor& mlp_out_norm, bool offset)
      : input_norm_(std::move(input_norm)),
        mlp_norm_(std::move(mlp_norm)),
        q_norm_(optional_norm(q_norm)),
        k_norm_(optional_norm(k_norm)),
        attn_out_norm_(optional_norm(attn_out_norm)),
        mlp_out_norm_(optional_norm(mlp_out_norm)),
        eps_(eps),
        offset_(offset),
        qkv_(packed_linear(qkv)),
        o_(packed_linear(o)),
        gate_up_(packed_linear(gate_up)),
        down_(packed_linear(down)),
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

  // h [T, hidden] bf16 contiguous -> the layer's output [T, hidden]. cos/sin [T, head_dim]
  // (RotaryEmbedding.cos_sin's rows); the caches, slot mapping, block tables, seq info and
  // window are the paged kernel's (AttentionMetadata.kernel), covering every row of h.
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& cos,
                        const torch::Tensor& sin, const torch::Tensor& k_cache,
                        const torch::Tensor& v_cache, const torch::Tensor& slots,
                        const torch::Tensor& block_tables, const torch::Tensor& seq_info,
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
    paged_attention(attn, q, k_cache, v_cache, block_tables, seq_info, scale_, 0.0, window);
    auto mid = add_normed(o_, attn_out_norm_, attn, h, threads);
    auto x2 = torch::empty_like(h);
    rms_norm(x2, mid, mlp_norm_, eps_, offset_);
    auto hidden = h.new_empty({t, gate_up_.n / 2});
    run_gated(gate_up_, hidden, x2, act_, threads);
    return add_normed(down_, mlp_out_norm_, hidden, mid, threads);
  }

 private:
  // residual + w(x): the add in the linear's epilogue, or, with a norm on the linear's output
  // (Gemma 3), norm(w(x)) + residual as the Python layer's `norm.forward(a).add_(residual)`.
  torch::Tensor add_normed(const PackedLinear& w, const torch::Tensor& norm, const torch::Tensor& x,
                           const torch::Tensor& residual, int64_t threads) const {
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

  torch::Tensor input_norm_, mlp_norm_, q_norm_, k_norm_, attn_out_norm_, mlp_out_norm_;
  double eps_;
  bool offset_;
  PackedLinear qkv_, o_, gate_up_, down_;
  int64_t heads_, kv_heads_, head_dim_;
  double scale_;
  int64_t act_;
};

void register_decoder_layer(py::module& m) {
  py::class_<DecoderLayerBf16>(m, "DecoderLayerBf16",
                               "a Llama-family (or Qwen3, Gemma 3) decoder layer's weights, bound "
                               "for one native call per layer (csrc/layer/decoder_layer.cpp)")
      .def(py::init<torch::Tensor, torch::Tensor, double, const py::tuple&, const py::tuple&,
                    const py::tuple&, const py::tuple&, int64_t, int64_t, int64_t, double,
                    int64_t, const OptTensor&, const OptTensor&, const OptTensor&,
                    const OptTensor&, bool>(),
           py::arg("input_norm"), py::arg("mlp_norm"), py::arg("eps"), py::arg("qkv"),
           py::arg("o"), py::arg("gate_up"), py::arg("down"), py::arg("heads"),
           py::arg("kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("act"),
           py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("attn_out_norm") = py::none(), py::arg("mlp_out_norm") = py::none(),
           py::arg("offset") = false)
      .def("forward", &DecoderLayerBf16::forward, py::arg("h"), py::arg("cos"), py::arg("sin"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("block_tables"),
           py::arg("seq_info"), py::arg("window"), py::arg("threads"),
           py::call_guard<py::gil_scoped_release>());
}
