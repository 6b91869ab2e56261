// RMSNorm of rows with transformers' roundings: Llama-style
// `w * cast(x_f32 * rsqrt(mean(x^2) + eps))` (the normalized row rounded to the dtype, then
// scaled by the weight and rounded again), Gemma-style (offset) `cast(x_f32 * rsqrt(...) * (1 +
// w))`. Each row's result depends on that row alone.
//
// bf16 rows take AVX-512 loops where the build has them: 16 lanes of squares summed by FMAs,
// then one tree reduction (another order than the scalar loop's, so a row's bits may differ by an
// ulp between builds with and without the loop; within a build each row's result is its own),
// and the scaling in vectors with the scalar loop's roundings (c10's: to nearest even, NaN
// 0x7fc0, subnormals kept). Decode-sized calls stay on the calling thread (at::parallel_for's
// wake-up costs more than the rows).
#include "torch_lite.h"
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PREFIXSERVE_RMS_AVX512 1
#include <immintrin.h>
#endif

#include "bf16_bits.h"
#include "kernels.h"

namespace {

// Rows per at::parallel_for chunk: a chunk is at least this many elements of work.
constexpr int64_t kGrainElements = 64 * 1024;

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return prefixserve::bf16_bits_to_float(x.x); }
inline void store(float* dst, float x) { *dst = x; }
inline void store(c10::BFloat16* dst, float x) { *dst = c10::BFloat16(x); }

template <typename scalar_t>
void rms_norm_row(scalar_t* dst, const scalar_t* x, const float* w, int64_t dim, float eps,
                  bool offset) {
  float part[16] = {0.0f};
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    for (int t = 0; t < 16; ++t) part[t] += to_float(x[i + t]) * to_float(x[i + t]);
  }
  float sum = 0.0f;
  for (int t = 0; t < 16; ++t) sum += part[t];
  for (; i < dim; ++i) sum += to_float(x[i]) * to_float(x[i]);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
  if (offset) {  // Gemma: (x * inv) * (1 + w), cast once at the end
    for (int64_t d = 0; d < dim; ++d) store(dst + d, to_float(x[d]) * inv * (1.0f + w[d]));
    return;
  }
  for (int64_t d = 0; d < dim; ++d) {  // Llama: cast x * inv first, then scale by w
    scalar_t normed;
    store(&normed, to_float(x[d]) * inv);
    store(dst + d, w[d] * to_float(normed));
  }
}

#if defined(PREFIXSERVE_RMS_AVX512)
inline __m512 load_bf16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// v's bf16 bits in the low half of each lane, rounded as c10::BFloat16 rounds (to nearest even,
// NaN 0x7fc0, subnormals kept: VCVTNEPS2BF16 would flush them and keep NaN payloads).
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
}

inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
}

inline __mmask16 lanes(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF)
                    : static_cast<__mmask16>((1u << left) - 1u);
}

void rms_norm_row_bf16(c10::BFloat16* dst, const c10::BFloat16* x, const float* w, int64_t dim,
                       float eps, bool offset) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 v = load_bf16(x + i, lanes(dim - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const float sum = _mm512_reduce_add_ps(acc);
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(sum / static_cast<float>(dim) + eps));
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < dim; i += 16) {
    const __mmask16 m = lanes(dim - i);
    const __m512 v = _mm512_mul_ps(load_bf16(x + i, m), inv);
    const __m512 wv = _mm512_maskz_loadu_ps(m, w + i);
    const __m512 y = offset ? _mm512_mul_ps(v, _mm512_add_ps(one, wv))
                            : _mm512_mul_ps(wv, round_bf16(v));
    _mm256_mask_storeu_epi16(dst + i, m, _mm512_cvtepi32_epi16(bf16_bits(y)));
  }
}
#endif

// Rows of `dim` contiguous values: row (i, j) at x + i * xs[0] + j * xs[1] (and out's at its own
// strides), for i < outer, j < inner. Each row is read whole before it is written, so out may be x.
struct Rows {
  int64_t outer, inner, dim;
  int64_t xs[2], os[2];
};

template <typename scalar_t>
void rms_norm_rows(scalar_t* out, const scalar_t* x, const scalar_t* weight, const Rows& r,
                   float eps, bool offset) {
  const int64_t dim = r.dim;
  std::vector<float> w(dim);
  for (int64_t d = 0; d < dim; ++d) w[d] = to_float(weight[d]);
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(dim, 1));
  at::parallel_for(0, r.outer * r.inner, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t i = row / r.inner, j = row % r.inner;
      const scalar_t* src = x + i * r.xs[0] + j * r.xs[1];
      scalar_t* dst = out + i * r.os[0] + j * r.os[1];
#if defined(PREFIXSERVE_RMS_AVX512)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        rms_norm_row_bf16(dst, src, w.data(), dim, eps, offset);
        continue;
      }
#endif
      rms_norm_row(dst, src, w.data(), dim, eps, offset);
    }
  });
}

}  // namespace

namespace {

// The rows of a [rows, dim] or [outer, inner, dim] tensor whose last dim is contiguous (a view of
// per-head rows inside a fused qkv, for q/k norms, has outer strides of its own).
Rows rows_of(const torch::Tensor& x, const torch::Tensor& out) {
  const bool three = x.dim() == 3;
  Rows r{x.size(0), three ? x.size(1) : 1, x.size(x.dim() - 1), {x.stride(0), 0}, {out.stride(0), 0}};
  if (three) {
    r.xs[1] = x.stride(1);
    r.os[1] = out.stride(1);
  }
  return r;
}

// Whether no two rows of t (each its last dim's `dim` values) share an element, for non-negative
// strides: inner rows at least a row apart, outer ones past the inner rows' whole span.
bool rows_apart(const torch::Tensor& t) {
  const int64_t dim = t.size(-1);
  if (t.dim() == 2) return t.size(0) <= 1 || t.stride(0) >= dim;
  const int64_t inner_span = (t.size(1) - 1) * t.stride(1) + dim;
  return (t.size(1) <= 1 || t.stride(1) >= dim) && (t.size(0) <= 1 || t.stride(0) >= inner_span);
}

}  // namespace

// out = RMSNorm(x) over the last dim of x [rows, dim] or [outer, inner, dim], each with a
// contiguous last dim (other strides free; out may be x itself: a norm in place); x, weight and
// out share a dtype (float32 or bfloat16).
void rms_norm(torch::Tensor out, torch::Tensor x, torch::Tensor weight, double eps, bool offset) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu() && weight.device().is_cpu(),
              "rms_norm runs on CPU tensors only");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1 && out.stride(-1) == 1 &&
                  weight.is_contiguous() && out.sizes() == x.sizes() && weight.dim() == 1 &&
                  weight.size(0) == x.size(-1),
              "rms_norm needs x/out [rows, dim] or [outer, inner, dim] with a contiguous last dim "
              "and weight [dim]");
  TORCH_CHECK(x.scalar_type() == out.scalar_type() && x.scalar_type() == weight.scalar_type(),
              "x, weight and out must share a dtype");
  // Rows with strides of their own: out's rows must not overlap one another (threads write them
  // at once), and out is either x itself (in place: each row is read before it is written) or
  // apart from it.
  TORCH_CHECK(rows_apart(out), "rms_norm: out's rows overlap one another");
  if (!out.is_same(x)) at::assert_no_overlap(out, x);
  const Rows r = rows_of(x, out);
  if (x.scalar_type() == torch::kFloat) {
    rms_norm_rows<float>(out.data_ptr<float>(), x.data_ptr<float>(), weight.data_ptr<float>(), r,
                         static_cast<float>(eps), offset);
  } else if (x.scalar_type() == torch::kBFloat16) {
    rms_norm_rows<c10::BFloat16>(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                                 weight.data_ptr<c10::BFloat16>(), r, static_cast<float>(eps),
                                 offset);
  } else {
    TORCH_CHECK(false, "rms_norm supports float32 and bfloat16, got ", x.scalar_type());
  }
}
