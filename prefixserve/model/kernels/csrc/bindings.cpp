// The extension's Python bindings: every kernel of csrc/ is declared once in kernels.h (the
// decoder layer's class in layer/decoder_layer.h) and bound here, so no kernel file depends on
// another for its module, and only this file parses pybind11. It includes torch's pybind11 glue
// (the Tensor casters, `py`) rather than torch/extension.h, which adds torch's whole C++ frontend
// (nn, optim, data): the same bindings, compiled in 29 s instead of 53 on the AVX2 host.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "decoder_layer.h"
#include "kernels.h"

namespace {

using prefixserve::layer::DecoderLayerBf16;
using prefixserve::layer::OptTensor;
using prefixserve::layer::PackedLinear;

// A decoder layer's linear from Python: (packed, out_features, bias, next_packed) for the bf16
// kernel, or (codes, scales, bias, next weight) for the 8-bit one.
PackedLinear packed_linear(const py::tuple& t) {
  TORCH_CHECK(t.size() == 4, "a linear is (packed, out_features, bias, next_packed) or (codes, "
                             "scales, bias, next weight)");
  if (!py::isinstance<py::int_>(t[1])) {
    // [N, K / G] (or [2, N, K / 32], scales and mins): N rows, the codes packed by four
    auto scales = t[1].cast<torch::Tensor>();
    return {true, t[0].cast<torch::Tensor>(), scales, scales.size(scales.dim() - 2),
            t[2].cast<OptTensor>(), t[3].cast<OptTensor>()};
  }
  return {false, t[0].cast<torch::Tensor>(), torch::Tensor(), t[1].cast<int64_t>(),
          t[2].cast<OptTensor>(), t[3].cast<OptTensor>()};
}

void register_decoder_layer(py::module& m) {
  py::class_<DecoderLayerBf16>(m, "DecoderLayerBf16",
                               "a Llama-family (or Qwen3, Gemma 3) decoder layer's weights, bound "
                               "for one native call per layer (csrc/layer/decoder_layer.cpp)")
      .def(py::init([](torch::Tensor input_norm, torch::Tensor mlp_norm, double eps,
                       const py::tuple& qkv, const py::tuple& o, const py::tuple& gate_up,
                       const py::tuple& down, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       double scale, int64_t act, const OptTensor& q_norm,
                       const OptTensor& k_norm, const OptTensor& attn_out_norm,
                       const OptTensor& mlp_out_norm, bool offset) {
             return DecoderLayerBf16(std::move(input_norm), std::move(mlp_norm), eps,
                                     packed_linear(qkv), packed_linear(o),
                                     packed_linear(gate_up), packed_linear(down), heads,
                                     kv_heads, head_dim, scale, act, q_norm, k_norm,
                                     attn_out_norm, mlp_out_norm, offset);
           }),
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decoder_layer(m);
  m.def("lora_add", &lora_add,
        "one adapter's LoRA update of one linear for a few bf16 rows: out[rows] += x[rows] @ A.T "
        "@ B.T, B in blocks of 64 columns per slice",
        py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention", &prefill_attention,
        "causal attention of one long bf16 chunk over contiguous K/V rows (scores with "
        "VDPBF16PS, online softmax and P @ V in fp32) on the caller and up to `threads - 1` "
        "stream-pool helpers (0: OpenMP's thread count)",
        py::arg("out"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"),
        py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("prefill_attention_ready", &prefill_attention_ready,
        "whether prefill_attention has its AVX512-BF16 loop in this build");
  m.def("rope_kv_vectorized", &rope_kv_vectorized,
        "whether rope_write_kv has its AVX512-BF16 vector loop in this build");
  m.def("rope_write_kv", &rope_write_kv,
        "rotary on a fused qkv's q and k heads in place, then k and v into their cache slots");
  m.def("stream_pool_backoffs", &stream_pool_backoffs,
        "times the stream pool ran jobs on the caller alone (its helpers got no core)");
  // Without the GIL: the server's event loop runs while a step streams its weights.
  m.def("linear_bf16_small", &linear_bf16_small,
        "bf16 linear for a few rows: a stream over the weight, fp32 accumulation",
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_int8", &linear_int8,
        "linear over int8 weight codes with fp32 or fp16 group scales (csrc/linear/linear_int8.cpp), bf16 x "
        "and out, optional bias, gated act and residual, one summation order per output",
        py::arg("out"), py::arg("x"), py::arg("codes"), py::arg("scales"), py::arg("bias"),
        py::arg("act"), py::arg("residual"), py::arg("threads"),
        py::arg("prefetch") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_int8_family", &linear_int8_family,
        "the vector family linear_int8 was built with: avx512, avx2 or portable");
  m.def("gemm_bf16_vectorized", &gemm_bf16_vectorized,
        "whether linear_bf16_packed has its AVX-512 tiles in this build");
  m.def("gemm_bf16_tiles", &gemm_bf16_tiles,
        "the build's FMA tiles linear_bf16_packed runs on without a selection: avx512, avx2 or "
        "portable");
  m.def("gemm_bf16_families", &gemm_bf16_families,
        "every tile family of linear_bf16_packed that runs here (the same sums in each)");
  m.def("gemm_bf16_select", &gemm_bf16_select,
        "the families decode-sized and larger calls take from now on ('' keeps one), whether "
        "decode-sized tiles prefetch in software and the panels of a lone row's tile (2 or 4; "
        "-1 keeps either)",
        py::arg("decode"), py::arg("prefill"), py::arg("prefetch") = -1,
        py::arg("one_row_panels") = -1);
  m.def("gemm_bf16_selected", &gemm_bf16_selected,
        "(decode family, prefill family, the largest decode-sized row count, prefetch, the "
        "panels of a lone row's tile)");
  m.def("linear_bf16_packed_on", &linear_bf16_packed_on,
        "linear_bf16_packed on the named tile family whatever the selection (the same sums)",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"),
        py::arg("threads"), py::arg("tiles"), py::arg("residual") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("pack_bf16_gemm", &pack_bf16_gemm,
        "a bf16 weight [N, K] in linear_bf16_packed's panels of 32 columns by pairs of k");
  m.def("linear_bf16_packed", &linear_bf16_packed,
        "bf16 linear for any row count with one summation order per output (gemm_bf16_tiles.h) "
        "on every tile family: batch-invariant; `prefetch`: the next linear's packed weight; "
        "`residual`: added to the rounded output (a decoder layer's residual add)",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"),
        py::arg("threads"), py::arg("prefetch") = py::none(), py::arg("residual") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("linear_bf16_packed_gated", &linear_bf16_packed_gated,
        "a gated MLP's gate_up linear with act(gate) * up in its epilogue (act 1: SiLU, 2: "
        "GELU tanh), the same sums as linear_bf16_packed",
        py::arg("out"), py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("bias"),
        py::arg("act"), py::arg("threads"), py::arg("prefetch") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  // The paged kernel's arguments; `threads` 0 takes OpenMP's thread count.
#define PREFIXSERVE_PAGED_ARGS                                                                   \
  py::arg("out"), py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), \
      py::arg("seq_info"), py::arg("scale"), py::arg("softcap"), py::arg("window"),              \
      py::arg("threads") = 0, py::call_guard<py::gil_scoped_release>()
  m.def("paged_attention", &paged_attention,
        "paged attention over a block-structured KV cache, its work items on the caller and up "
        "to `threads - 1` stream-pool helpers (0: OpenMP's thread count)",
        PREFIXSERVE_PAGED_ARGS);
  m.def("paged_attention_portable", &paged_attention_portable,
        "paged_attention on its portable path (fp32 tiles, tree-summed scores) on every CPU",
        PREFIXSERVE_PAGED_ARGS);
  m.def("paged_attention_lanes_width", &paged_attention_lanes_width,
        "the width of paged_attention's keys-in-lanes tiles in this build (prefill_attention's "
        "arithmetic, the same bits at each width): 512, 256, or 0 (the portable path)");
  m.def("paged_attention_portable_width", &paged_attention_portable_width,
        "the width of the portable path's vectors in this build: 512 (AVX-512 intrinsics) or 0 "
        "(compiler-vectorized loops), which may round otherwise");
  m.def("paged_attention_avx2", &paged_attention_avx2,
        "paged_attention on the 256-bit keys-in-lanes tiles whatever the build's widest; false "
        "(nothing written) where they do not serve the call",
        PREFIXSERVE_PAGED_ARGS);
#undef PREFIXSERVE_PAGED_ARGS
  m.def("rms_norm", &rms_norm, "RMSNorm of rows (contiguous last dim, any outer strides) with transformers' roundings");
}
