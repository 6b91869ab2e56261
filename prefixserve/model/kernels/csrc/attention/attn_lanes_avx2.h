// The keys-in-lanes tile arithmetic on 256-bit vectors (AVX2 and FMA) that both AVX2 tile kinds
// share (attn_lanes_bf16_avx2.h, attn_lanes_int8_avx2.h): the softmax of
// attn_lanes_bf16_avx512.h in 8-lane halves, with the same bits. Every rounded step is the same
// operation on the same operands as the AVX-512 code's: exp_nonpositive8 (common/exp_avx2.h) is
// exp_avx512.h's exp_nonpositive16 lane for lane; the 16-lane maxima and sums reduce in
// _mm512_reduce_*_ps's order (upper half onto lower, then 128-bit halves, then pairs); a product
// that the AVX-512 code rounds with a `_round` form is `held` here, so the compiler's
// -ffp-contract cannot fuse it into a later add.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "exp_avx2.h"

namespace prefixserve::lanes_avx2 {

using prefixserve::exp_nonpositive8;  // common/exp_avx2.h
using prefixserve::held;              // common/held.h

constexpr int64_t kTileKeys = 64;
constexpr int kRoundNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;


// The 16 lanes (lo: 0-7, hi: 8-15) reduced as _mm512_reduce_max_ps / _mm512_reduce_add_ps do.
inline float reduce_max16(__m256 lo, __m256 hi) {
  const __m256 t3 = _mm256_max_ps(hi, lo);
  const __m128 t6 = _mm_max_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_max_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ps(t8, _mm_shuffle_ps(t8, t8, _MM_SHUFFLE(0, 1, 0, 1))));
}

inline float reduce_add16(__m256 lo, __m256 hi) {
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

// All-ones lanes for keys [first, first + 8) inside [lo, hi).
inline __m256 lanes_in(int64_t first, int64_t lo, int64_t hi) {
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i from = _mm256_set1_epi32(static_cast<int32_t>(lo - first - 1));
  const __m256i to = _mm256_set1_epi32(static_cast<int32_t>(hi - first));
  return _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_cmpgt_epi32(iota, from), _mm256_cmpgt_epi32(to, iota)));
}

// attn_lanes_bf16_avx512.h's tile_softmax in 8-lane halves: the exponentials into p[0, 64) (0
// outside
// [lo, hi)), the new m and l; returns corr.
inline float tile_softmax(const __m256* s, int64_t lo, int64_t hi, float& m, float& l, float* p) {
  __m256 mk[8];
  __m256 vmax[2];
  vmax[0] = vmax[1] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int c = 0; c < 8; ++c) {
    mk[c] = lanes_in(8 * c, lo, hi);
    vmax[c % 2] = _mm256_blendv_ps(vmax[c % 2], _mm256_max_ps(vmax[c % 2], s[c]), mk[c]);
  }
  const float m_new = std::max(m, reduce_max16(vmax[0], vmax[1]));
  const float corr = m == -std::numeric_limits<float>::infinity()
                         ? 0.0f
                         : _mm256_cvtss_f32(exp_nonpositive8(_mm256_set1_ps(m - m_new)));
  const __m256 mv = _mm256_set1_ps(m_new);
  __m256 vsum[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int c = 0; c < 8; ++c) {
    const __m256 e = _mm256_and_ps(mk[c], exp_nonpositive8(_mm256_sub_ps(s[c], mv)));
    _mm256_storeu_ps(p + 8 * c, e);
    vsum[c % 2] = _mm256_add_ps(vsum[c % 2], e);
  }
  l = std::fma(l, corr, reduce_add16(vsum[0], vsum[1]));
  m = m_new;
  return corr;
}

// out[p] = lane i of r[i]'s element p, for 8 vectors of 8 32-bit elements (inlined: as a call,
// its vectors passed through memory, it took 7% of a decode step's attention on Zen 3).
__attribute__((always_inline)) inline void transpose8(const __m256i* r, __m256i* out) {
  __m256i t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // u[4h + c]: rows 4h .. 4h + 3, element c of each 128-bit lane
    u[4 * h + 0] = _mm256_unpacklo_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 1] = _mm256_unpackhi_epi64(t[4 * h], t[4 * h + 2]);
    u[4 * h + 2] = _mm256_unpacklo_epi64(t[4 * h + 1], t[4 * h + 3]);
    u[4 * h + 3] = _mm256_unpackhi_epi64(t[4 * h + 1], t[4 * h + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    out[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
    out[4 + c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
  }
}

}  // namespace prefixserve::lanes_avx2

#endif  // __AVX2__ && __FMA__
