// The 8- and 4-bit linears' epilogues (linear_int8.cpp; the K-quant files' sums go through them
// too): a range of output columns' fp32 sums to bf16 outputs, with the bias, the residual add
// or the gated MLP's act(gate) * up, rounded as the unfused bf16 ops round them. Each step is
// gemm_bf16_tiles.h's, whose scalar, eight-lane (AVX2) and sixteen-lane (AVX-512) forms give the
// same bits.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "bf16_bits.h"
#include "gemm_bf16_tiles.h"

namespace prefixserve::int8 {

using prefixserve::gemm::act_scalar;
using prefixserve::gemm::float_to_bf16_bits;
using prefixserve::gemm::round_bf16_scalar;
using prefixserve::gemm::store_sums_f32;

// What follows the sums: out [rows, ldo] from column 0 of this range; `act` != kNone makes
// out[:, c] = bf16(act(bf16(gate + b)) * bf16(up + b_up)) of the sums of row c and row c + half.
struct Epilogue {
  uint16_t* out;
  int64_t ldo;
  const float* bias;  // [N] or null
  int64_t act;
  const uint16_t* res;  // [rows, ldo] or null
  bool f32 = false;  // out holds fp32 (a plain call: the LM head's logits): sums + bias unrounded
};

// Sums [rows, width] (ld apart) of weight rows n0.. to outputs: + bias, rounded to bf16, + the
// residual and rounded again where there is one.
// On AVX-512 builds both epilogues take gemm_bf16's vector forms (the same bits as its scalar
// ones), 16 columns at a time; on AVX2 builds its eight-lane forms; the portable build and the
// last few columns its scalar ones.
inline void store_plain(const float* sums, int64_t ld, int64_t rows, int64_t n0, int64_t width,
                        const Epilogue& e) {
  if (e.f32) return store_sums_f32(e.out, e.ldo, sums, ld, rows, n0, width, e.bias);
#if defined(PREFIXSERVE_GEMM_AVX512)
  using prefixserve::gemm::store_bf16;
  using prefixserve::gemm::store_residual;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; c += 16) {
      const int64_t valid = std::min<int64_t>(16, width - c);
      const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
      const __m512 sum = _mm512_maskz_loadu_ps(mask, sums + r * ld + c);
      uint16_t* dst = e.out + r * e.ldo + n0 + c;
      const float* bias = e.bias ? e.bias + n0 + c : nullptr;
      if (e.res)
        store_residual(dst, sum, bias, e.res + r * e.ldo + n0 + c, valid);
      else
        store_bf16(dst, sum, bias, valid);
    }
  return;
#endif
  int64_t vector_cols = 0;
#if defined(PREFIXSERVE_GEMM_AVX2) && defined(__AVX2__) && defined(__FMA__)
  vector_cols = width / 8 * 8;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < vector_cols; c += 8)
      prefixserve::gemm::avx2::store_plain8(
          e.out + r * e.ldo + n0 + c, _mm256_loadu_ps(sums + r * ld + c),
          e.bias ? e.bias + n0 + c : nullptr, e.res ? e.res + r * e.ldo + n0 + c : nullptr);
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = vector_cols; c < width; ++c) {
      float sum = sums[r * ld + c];
      if (e.bias) sum += e.bias[n0 + c];
      uint16_t y = float_to_bf16_bits(sum);
      if (e.res)
        y = float_to_bf16_bits(prefixserve::bf16_bits_to_float(y) +
                               prefixserve::bf16_bits_to_float(e.res[r * e.ldo + n0 + c]));
      e.out[r * e.ldo + n0 + c] = y;
    }
}

// Gate sums [rows, width] then up sums [rows, width] (both ld apart) of output columns c0..
inline void store_gated_sums(const float* gate, const float* up, int64_t ld, int64_t rows,
                             int64_t c0, int64_t width, int64_t half, const Epilogue& e) {
  int64_t vector_cols = 0;
#if defined(PREFIXSERVE_GEMM_AVX512)
  vector_cols = width / 16 * 16;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < vector_cols; c += 16)
      prefixserve::gemm::store_gated(e.out + r * e.ldo + c0 + c,
                                     _mm512_loadu_ps(gate + r * ld + c),
                                     _mm512_loadu_ps(up + r * ld + c),
                                     e.bias ? e.bias + c0 + c : nullptr,
                                     e.bias ? e.bias + half + c0 + c : nullptr, e.act);
#elif defined(PREFIXSERVE_GEMM_AVX2) && defined(__AVX2__) && defined(__FMA__)
  vector_cols = width / 8 * 8;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < vector_cols; c += 8)
      prefixserve::gemm::avx2::store_gated8(e.out + r * e.ldo + c0 + c,
                                            _mm256_loadu_ps(gate + r * ld + c),
                                            _mm256_loadu_ps(up + r * ld + c),
                                            e.bias ? e.bias + c0 + c : nullptr,
                                            e.bias ? e.bias + half + c0 + c : nullptr, e.act);
#endif
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = vector_cols; c < width; ++c) {
      float g = gate[r * ld + c], u = up[r * ld + c];
      if (e.bias) {
        g += e.bias[c0 + c];
        u += e.bias[half + c0 + c];
      }
      const float a = round_bf16_scalar(act_scalar(round_bf16_scalar(g), e.act));
      e.out[r * e.ldo + c0 + c] = float_to_bf16_bits(a * round_bf16_scalar(u));
    }
}

}  // namespace prefixserve::int8
