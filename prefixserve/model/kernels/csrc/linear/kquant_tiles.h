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
#include <utility>

#include "held.h"
#include "kquant.h"

namespace prefixserve::kquant {

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define PREFIXSERVE_KQUANT_VNNI 1
// Weight rows x x rows of a tile, and its pairs at most (the float work's 16 lanes: 4i + j).
constexpr int kTileW = 4, kTileX = 4, kMaxPairs = 16;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PREFIXSERVE_KQUANT_AVX2 1
// Pairs of a tile at most 8 (one 256-bit vector of float sums, lane i NX + j): 4 x 1 at batch
// 1, else 2 x 4 (or 2 x 2): eight accumulators, two rows' codes and sub-scales and one x vector
// fit in sixteen registers.
constexpr int kTileW = 4, kTileX = 4, kMaxPairs = 8;
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
// The decode tiles' (one x row, at most 4 pairs in one 128-bit vector, lane i NX + j): lane p
// of the result is the sum of v[p]'s eight lanes (p < 4).
inline __m128i sum_four(const __m256i (&v)[4]) {
  const __m256i h =
      _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// And their float work's lanes i NX + j: x row j's scale of super-block b.
template <int NW, int NX>
inline __m128 x_scales4(const XSuper& xq, int64_t x0, int64_t b) {
  float lanes[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int p = 0; p < NW * NX; ++p) lanes[p] = xq.scale[b * xq.rows + x0 + p % NX];
  return _mm_loadu_ps(lanes);
}

// Lane p of the result: the sum of v[p]'s eight lanes (p < N <= 8; exact: integers).
template <int N>
inline __m256i sum_eight(const __m256i (&v)[N]) {
  const __m256i zero = _mm256_setzero_si256();
  const auto at = [&](int p) { return p < N ? v[p < N ? p : 0] : zero; };
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(at(0), at(1)),
                                      _mm256_hadd_epi32(at(2), at(3)));
  const __m256i b = N > 4 ? _mm256_hadd_epi32(_mm256_hadd_epi32(at(4), at(5)),
                                              _mm256_hadd_epi32(at(6), at(7)))
                          : zero;
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20),
                          _mm256_permute2x128_si256(a, b, 0x31));
}

// The float work's lanes i NX + j (NX > 1: a decode's tile is `tile4`): x row j's scale of
// super-block b (0 past NW NX).
template <int NW, int NX>
inline __m256 x_scales(const XSuper& xq, int64_t x0, int64_t b) {
  const float* at = xq.scale.data() + b * xq.rows + x0;
  if constexpr (NX == 4) {
    return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(at));
  } else {
    alignas(32) float lanes[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    for (int p = 0; p < NW * NX; ++p) lanes[p] = at[p % NX];
    return _mm256_load_ps(lanes);
  }
}

// Lane i NX + j of the result: `per_row` halves v[per_row i + k] as floats (k < per_row; 0
// past NW NX): a tile's d (per_row 1) or d and dmin (2, k = 1 for dmin) per lane.
template <int NW, int NX>
inline __m256 row_lanes(__m128i halves, int per_row, int k) {
  alignas(32) int32_t idx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int p = 0; p < NW * NX; ++p) idx[p] = per_row * (p / NX) + k;
  return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(halves),
                                  _mm256_load_si256(reinterpret_cast<const __m256i*>(idx)));
}


// Step T = 4 p + 2 s + h of a super-block's eight (a compile-time step, so each decode's shifts,
// masks and lane maps are constants): row i's codes and sub-scale words (F::decode<p, s, h>) times
// x row j's 32 codes at 128 p + 64 h + 32 s of the super-block, into pair i NX + j.
template <class F, int NW, int NX, int T>
inline void avx2_step(const uint8_t* blk, int64_t slot,
                      const int8_t* const (&xc)[NX], int64_t at, __m256i (&acc)[NW * NX]) {
  constexpr int p = T / 4, s = (T / 2) % 2, h = T % 2;
  __m256i w[NW], sc[NW];
#pragma GCC unroll 4
  for (int i = 0; i < NW; ++i) F::template decode<p, s, h>(blk, slot + i, w[i], sc[i]);
#pragma GCC unroll 4
  for (int j = 0; j < NX; ++j) {
    const __m256i xv = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(xc[j] + at + 128 * p + 64 * h + 32 * s));
    // Each step's sums held (held.h): integer adds may be reassociated, and GCC kept each
    // step's products on the stack to add them up after the eighth (48 stores and loads a
    // super-block in the 2 x 4 tile). Not in the decode tiles, `tile4`: there it stopped GCC
    // unrolling their step loops, whose masks and shifts are then computed at run time.
#pragma GCC unroll 4
    for (int i = 0; i < NW; ++i)
      acc[i * NX + j] = held(_mm256_add_epi32(
          acc[i * NX + j], _mm256_madd_epi16(_mm256_maddubs_epi16(w[i], xv), sc[i])));
  }
}

template <class F, int NW, int NX, int... T>
inline void avx2_steps(std::integer_sequence<int, T...>, const uint8_t* blk, int64_t slot,
                       const int8_t* const (&xc)[NX], int64_t at, __m256i (&acc)[NW * NX]) {
  (avx2_step<F, NW, NX, T>(blk, slot, xc, at, acc), ...);
}

// A tile of K-quant format F: NW weight rows (slots slot.. of one packed group, `F::kGroupBytes`
// a super-block) by NX x rows (from x0), pair i NX + j in lane i NX + j of `out`. Per
// super-block, each pair's integer sum: F::start (its offset's part, or 0), then the eight steps
// of 32 columns (p, s, h) (x's codes at 128 p + 64 h + 32 s, `x_column`), each adding row i's
// codes times x row j's (VPMADDUBSW: unsigned codes of at most 6 bits times signed x never
// saturates) times row i's sub-scale words (VPMADDWD); the pairs' sums folded into lanes
// (`sum_eight`) and F::finish's float work on them. F::decode<p, s, h>(blk, slot, w, sc) gives a
// step's codes and sub-scale words, read from the group each step (nothing is held per row, which
// leaves the registers to the eight sums).
template <class F, int NW, int NX>
void avx2_tile(const uint8_t* group, int64_t slot, const uint16_t* scales, int64_t per_row,
               const XSuper& xq, int64_t x0, float* out) {
  static_assert(NW * NX <= kMaxPairs, "a tile of at most 8 pairs");
  const int64_t blocks = xq.blocks;
  const int8_t* xc[NX];
  for (int j = 0; j < NX; ++j) xc[j] = xq.codes.data() + (x0 + j) * blocks * kSuper;
  __m256 acc_f = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * F::kGroupBytes;
    __m256i acc[NW * NX];
    for (int i = 0; i < NW; ++i)
      for (int j = 0; j < NX; ++j) acc[i * NX + j] = F::start(blk, slot + i, xq, x0 + j, b);
    avx2_steps<F, NW, NX>(std::make_integer_sequence<int, 8>(), blk, slot, xc, b * kSuper, acc);
    acc_f = F::template finish<NW, NX>(sum_eight<NW * NX>(acc), blk, slot, scales, per_row, xq,
                                       x0, b, acc_f);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc_f);
  for (int p = 0; p < NW * NX; ++p) out[p] = lanes[p];
}

// The AVX2 family's tile of format F: a decode's (one x row) is F's own 4 x 1 `tile4`, measured
// faster at batch 1 than the shared tile; more x rows take `avx2_tile`.
template <class F, int NW, int NX>
void avx2_tile_or_decode(const uint8_t* group, int64_t slot, const uint16_t* scales,
                         int64_t per_row, const XSuper& xq, int64_t x0, float* out) {
  if constexpr (NX == 1)
    F::template tile4<NW, 1>(group, slot, scales, per_row, xq, x0, out);
  else
    avx2_tile<F, NW, NX>(group, slot, scales, per_row, xq, x0, out);
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
    const int64_t tile_w = tx == 1 ? kTileW : std::min<int64_t>(kTileW, kMaxPairs / kTileX);
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
    if constexpr (kTileX >= 4 && NW * kTileX <= kMaxPairs) {
      if (nx >= 4) return Tiles::template tile<NW, 4>(group, slot, s, per_row, xq, x0, out);
    }
    if constexpr (kTileX >= 2 && NW * kTileX <= kMaxPairs) {
      if (nx >= 2) return Tiles::template tile<NW, 2>(group, slot, s, per_row, xq, x0, out);
    }
    Tiles::template tile<NW, 1>(group, slot, s, per_row, xq, x0, out);
  }
};

}  // namespace prefixserve::kquant
