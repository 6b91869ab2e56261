// What the K-quant kernels (linear_q4k.cpp, linear_q6k.cpp) share: the vector family, the exact
// integer reductions of a tile's per-pair accumulators, and the walk of a range of weight rows
// in tiles that never cross a packed group of four rows.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kquant.h"

namespace prefixserve::kquant {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define PREFIXSERVE_KQUANT_VNNI 1
// Weight rows x x rows of a tile, and its pairs at most (the float work's 16 lanes: 4i + j).
constexpr int kTileW = 4, kTileX = 4, kMaxPairs = 16;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PREFIXSERVE_KQUANT_AVX2 1
// Pairs of a tile at most 4 (one 128-bit vector of accumulators, lane i NX + j): 4 x 1 at
// batch 1, else 2 x 2.
constexpr int kTileW = 4, kTileX = 2, kMaxPairs = 4;
#else
constexpr int kTileW = 1, kTileX = 1, kMaxPairs = 1;
#endif

#if defined(PREFIXSERVE_KQUANT_VNNI)
// Sums of 16-lane int32 vectors, four halving steps (exact: integers).
inline __m512i fold_a(__m512i a, __m512i b) {  // [a's 8 | b's 8]
  return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE));
}
inline __m512i fold_b(__m512i a, __m512i b) {  // 128-bit lanes: a's two, then b's two
  return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x88), _mm512_shuffle_i64x2(a, b, 0xDD));
}
inline __m512i fold_c(__m512i a, __m512i b) {  // within 128 bits: [a 2, b 2]
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
inline __m512i fold_d(__m512i a, __m512i b) {  // within 128 bits: [a, a, b, b]
  const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
  return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0x88)),
                          _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0xDD)));
}

// From u[j] (128-bit lane i: four partial sums of pair (i, j); absent for j >= NX) to lane
// 4i + j: the pair's sum.
template <int NX>
inline __m512i fold_pairs(const __m512i (&u)[4]) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i w0 = fold_c(u[0], NX > 1 ? u[1] : zero);
  if constexpr (NX <= 2) return fold_d(w0, zero);
  const __m512i w1 = fold_c(u[2], NX > 3 ? u[3] : zero);
  return fold_d(w0, w1);
}

// Lane 4i + j: the sum of acc[i][j]'s sixteen lanes.
template <int NW, int NX>
inline __m512i sum_pairs(const __m512i (&acc)[NW][NX]) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i u[4];
  for (int j = 0; j < 4; ++j) {
    if (j >= NX) {
      u[j] = zero;
      continue;
    }
    // Rows 0-1 and 2-3 folded to 8 lanes each, then to four 128-bit lanes (row i in lane i).
    const __m512i t0 = fold_a(acc[0][j], NW > 1 ? acc[NW > 1 ? 1 : 0][j] : zero);
    const __m512i t1 = NW > 2 ? fold_a(acc[NW > 2 ? 2 : 0][j], acc[NW > 3 ? 3 : 0][j]) : zero;
    u[j] = fold_b(t0, t1);
  }
  return fold_pairs<NX>(u);
}

// The float work's lanes 4i + j: x row j's scale of super-block b.
template <int NX>
inline __m512 x_scales(const XSuper& xq, int64_t x0, int64_t b) {
  const float* at = xq.scale.data() + b * xq.rows + x0;
  if constexpr (NX == 1) return _mm512_set1_ps(*at);
  const __m512i lane_x = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  const __m128 xs = _mm_maskz_loadu_ps(static_cast<__mmask8>((1u << NX) - 1), at);
  return _mm512_permutexvar_ps(lane_x, _mm512_castps128_ps512(xs));
}

// Lanes 4i + j of a tile's float sums, out[i NX + j].
template <int NW, int NX>
inline void store_pairs(__m512 acc, float* out) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  for (int i = 0; i < NW; ++i)
    for (int j = 0; j < NX; ++j) out[i * NX + j] = lanes[4 * i + j];
}
#elif defined(PREFIXSERVE_KQUANT_AVX2)
// Lane p of the result: the sum of v[p]'s eight lanes (p < 4).
inline __m128i sum_four(const __m256i (&v)[4]) {
  const __m256i h =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// The float work's lanes i NX + j: x row j's scale of super-block b.
template <int NW, int NX>
inline __m128 x_scales(const XSuper& xq, int64_t x0, int64_t b) {
  float lanes[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int p = 0; p < NW * NX; ++p) lanes[p] = xq.scale[b * xq.rows + x0 + p % NX];
  return _mm_loadu_ps(lanes);
}
#endif

// Half-precision bits as a float (exact).
inline float half_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// Sums of weight rows [n0, n0 + width) with every row of xq into sums [rows, ld], in tiles
// of Tiles::tile<NW, NX>(group, slot, scales of the tile's first row, scales per row, xq, x0,
// out[NW x NX]), NW weight rows of one packed group (`group_bytes` a super-block) from slot
// `slot`, NX x rows from x0; `scales_per_row` fp16 scales a row.
template <class Tiles>
void walk(const uint8_t* codes, int64_t group_bytes, const uint16_t* scales,
          int64_t scales_per_row, const XSuper& xq, int64_t n0, int64_t width, float* sums,
          int64_t ld) {
  float out[kMaxPairs];
  const int64_t rows = xq.rows, blocks = xq.blocks;
  for (int64_t m0 = 0; m0 < rows;) {
    const int64_t more = rows - m0;
    const int64_t tx = kTileX >= 4 && more >= 4 ? 4 : kTileX >= 2 && more >= 2 ? 2 : 1;
    const int64_t tile_w = std::max<int64_t>(1, std::min<int64_t>(kTileW, kMaxPairs / tx));
    for (int64_t n = 0; n < width;) {
      const int64_t r = n0 + n, slot = r % kGroupRows, left = width - n;
      const int64_t nw = slot == 0 && left >= 4 && tile_w >= 4       ? 4
                         : slot % 2 == 0 && left >= 2 && tile_w >= 2 ? 2
                                                                     : 1;
      const uint8_t* group = codes + (r / kGroupRows) * blocks * group_bytes;
      const uint16_t* s = scales + r * scales_per_row;
      if (nw == 4) {
        if constexpr (kTileW >= 4)
          Tiles::template rows<4>(group, slot, s, scales_per_row, xq, m0, tx, out);
      } else if (nw == 2) {
        if constexpr (kTileW >= 2)
          Tiles::template rows<2>(group, slot, s, scales_per_row, xq, m0, tx, out);
      } else {
        Tiles::template rows<1>(group, slot, s, scales_per_row, xq, m0, tx, out);
      }
      for (int64_t i = 0; i < nw; ++i)
        for (int64_t j = 0; j < tx; ++j) sums[(m0 + j) * ld + n + i] = out[i * tx + j];
      n += nw;
    }
    m0 += tx;
  }
}

// Tiles::rows<NW>: the x-row count's instantiation of Tiles::tile<NW, NX> (4, 2 or 1, bounded
// by kMaxPairs).
template <class Tiles>
struct Rows {
  template <int NW>
  static void rows(const uint8_t* group, int64_t slot, const uint16_t* s, int64_t per_row,
                   const XSuper& xq, int64_t x0, int64_t nx, float* out) {
    if constexpr (kTileX >= 4 && NW * 4 <= kMaxPairs) {
      if (nx >= 4) return Tiles::template tile<NW, 4>(group, slot, s, per_row, xq, x0, out);
    }
    if constexpr (kTileX >= 2 && NW * 2 <= kMaxPairs) {
      if (nx >= 2) return Tiles::template tile<NW, 2>(group, slot, s, per_row, xq, x0, out);
    }
    Tiles::template tile<NW, 1>(group, slot, s, per_row, xq, x0, out);
  }
};

}  // namespace prefixserve::kquant
