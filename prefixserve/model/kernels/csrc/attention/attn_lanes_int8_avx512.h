// One tile of attention over an int8 KV cache in integer dot products (builds with AVX512-BF16
// and VNNI; attn_lanes_int8_avx2.h elsewhere on AVX2, the same bits): the paged
// kernel's int8 path (paged_lanes.cpp). A cache row is D int8 codes and its fp32 scale
// (model/quant/kv_cache.py); its values are code * scale.
//
// Per query (bf16, D dims), once per work item:
//   q16[d] = round(q[d] * (32767 / max|q|)) in int16, qfac = (max|q| / 32767) * scale.
// Per tile of kTileKeys keys (the same tiles, in the same order, as the bf16 path):
//   scores  s[j] = (float(sum over d of q16[d] * code_k[j][d]) * kscale[j]) * qfac, the sum in
//           int32 (exact, so its order cannot matter);
//   softmax lanes::tile_softmax, as for bf16 (m, l, corr, p[j] = exp(s[j] - m'), 0 outside the
//           query's visible keys [lo, hi));
//   values  w[j] = p[j] * vscale[j]; wmax = max w; w16[j] = round(w[j] * (32767 / wmax));
//           acc = fma(float(sum over j of w16[j] * code_v[j][d]), wmax / 32767, acc * corr),
//           the sum in int32 again.
// Integer sums are exact: a query's output does not depend on which keys beside its own the
// tile holds (their w16 is 0), on the other queries of the call, nor on whether its keys were
// cached (batch invariance). The int16 query keeps ~15 bits against bf16's 8; the weights keep
// 15 bits of the tile's largest.
//
// The sums run on the codes as the cache holds them, 4 per 32-bit lane (VPDPBUSD: unsigned
// bytes times signed bytes), each 16-bit factor split in bytes, x = 256 * hi + lo:
//   scores  sum q16 * k = 256 * (sum hi * (k + 128) - 128 * sum hi) + sum lo * k, with hi signed
//           and lo in [0, 256) (k + 128 is k's byte with its top bit flipped);
//   values  sum w16 * v = 256 * sum hi * v + sum lo * v (w16 >= 0: both bytes unsigned);
// each in two passes over the tile sharing one accumulator (the first pass shifted by 8 bits).
// Every partial sum fits int32 (|sum| < 2^31 for D <= 256), so the total is the exact sum.
//
// Tile layouts: K as quads of dims with keys in lanes, kq[p * kTileKeys + j] = bytes
// (k[j][4p] .. k[j][4p + 3]); V as quads of keys, vq[jq * D + slot] = bytes (v[4jq][d] ..
// v[4jq + 3][d]) with d = value_dim(slot) (VPUNPCK's interleaving, undone by `finish`).
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attn_lanes_bf16_avx512.h"
#include "line_sweep.h"

namespace prefixserve::lanes_int8 {

using lanes::kRound;
using lanes::kTileKeys;

constexpr float kMaxCode16 = 32767.0f;

// The value dim held in slot `slot` of a V quad row: within each 64 dims, vector v (16 slots) of
// the four that VPUNPCKLBW/HBW then LWD/HWD make holds dims 16L + 4v .. 16L + 4v + 3 of each
// 128-bit lane L.
constexpr int value_dim(int slot) {
  const int h = slot / 64, r = slot % 64, v = r / 16, s = r % 16;
  return 64 * h + 16 * (s / 4) + 4 * v + s % 4;
}

// Queries whose integer accumulators stay in registers together.
template <int D>
constexpr int value_group() {
  return D <= 64 ? 4 : (D <= 128 ? 2 : 1);
}
constexpr int kScoreGroup = lanes::kScoreGroup;

// A quantized query's bytes: q16's high bytes [D] (signed), low bytes [D], then the int32
// -128 * (sum of the high bytes).
template <int D>
constexpr int64_t query_bytes() {
  return 2 * D + 4;
}

// q (bf16 bits, D dims) as int16 codes, split into `out` (query_bytes<D>()); returns
// max|q| / 32767 (0 for a zero query).
template <int D>
inline float quantize_query(const uint16_t* q, uint8_t* out) {
  __m512 x[D / 16];
  __m512 amax = _mm512_setzero_ps();
  for (int c = 0; c < D / 16; ++c) {
    const __m512i w = _mm512_cvtepu16_epi32(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16 * c)));
    x[c] = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    amax = _mm512_max_ps(amax, _mm512_abs_ps(x[c]));
  }
  const float m = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(m > 0.0f ? kMaxCode16 / m : 0.0f);
  __m512i hsum = _mm512_setzero_si512();
  for (int c = 0; c < D / 16; ++c) {
    const __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(x[c], inv, kRound), kRound);
    const __m512i hi = _mm512_srai_epi32(v, 8);
    hsum = _mm512_add_epi32(hsum, hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * c), _mm512_cvtepi32_epi8(hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + D + 16 * c),
                     _mm512_cvtepi32_epi8(_mm512_and_si512(v, _mm512_set1_epi32(0xff))));
  }
  const int32_t bias = -128 * _mm512_reduce_add_epi32(hsum);
  std::memcpy(out + 2 * D, &bias, sizeof bias);
  return m / kMaxCode16;
}

inline __m512i quad(const uint8_t* p) {  // 4 bytes broadcast to every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm512_set1_epi32(v);
}

// The scores of N queries (bytes qb[i]) against the tile's 64 keys: s[i][c] holds keys
// 16c .. 16c + 15.
template <int D, int N>
inline void tile_scores(const uint8_t* const* qb, const float* qfac, const uint32_t* kq,
                        const float* kscale, __m512 (*s)[4], LineDrip* drip) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[N][4];
  for (int i = 0; i < N; ++i) {
    int32_t bias;
    std::memcpy(&bias, qb[i] + 2 * D, sizeof bias);
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_set1_epi32(bias);
  }
  for (int p = 0; p < D / 4; ++p) {  // high bytes against k + 128
    if (drip != nullptr) drip->step(4);
    __m512i ku[4];
    for (int c = 0; c < 4; ++c)
      ku[c] = _mm512_xor_si512(_mm512_loadu_si512(kq + p * kTileKeys + 16 * c), flip);
    for (int i = 0; i < N; ++i) {
      const __m512i qh = quad(qb[i] + 4 * p);
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbusd_epi32(acc[i][c], ku[c], qh);
    }
  }
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_slli_epi32(acc[i][c], 8);
  for (int p = 0; p < D / 4; ++p) {  // low bytes against k
    if (drip != nullptr) drip->step(4);
    __m512i k4[4];
    for (int c = 0; c < 4; ++c) k4[c] = _mm512_loadu_si512(kq + p * kTileKeys + 16 * c);
    for (int i = 0; i < N; ++i) {
      const __m512i ql = quad(qb[i] + D + 4 * p);
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbusd_epi32(acc[i][c], ql, k4[c]);
    }
  }
  for (int i = 0; i < N; ++i) {
    const __m512 f = _mm512_set1_ps(qfac[i]);
    for (int c = 0; c < 4; ++c) {
      const __m512 raw = _mm512_cvt_roundepi32_ps(acc[i][c], kRound);
      const __m512 ks = _mm512_loadu_ps(kscale + 16 * c);
      s[i][c] = _mm512_mul_round_ps(_mm512_mul_round_ps(raw, ks, kRound), f, kRound);
    }
  }
}

// A query's weights of the tile's values: w16[j] = round(p[j] * vscale[j] * 32767 / wmax) for
// j in [lo, hi), 0 elsewhere, as bytes into wb (high bytes [64], then low bytes [64]); returns
// wmax / 32767 (0 when every weight is 0).
inline float quantize_weights(const float* p, const float* vscale, int64_t lo, int64_t hi,
                              uint8_t* wb) {
  __m512 w[4];
  __m512 wmax = _mm512_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    const __mmask16 k = lanes::lanes_in(16 * c, lo, hi);
    w[c] = _mm512_maskz_mul_round_ps(k, _mm512_loadu_ps(p + 16 * c),
                                     _mm512_loadu_ps(vscale + 16 * c), kRound);
    wmax = _mm512_max_ps(wmax, w[c]);
  }
  const float m = _mm512_reduce_max_ps(wmax);
  const __m512 inv = _mm512_set1_ps(m > 0.0f ? kMaxCode16 / m : 0.0f);
  for (int c = 0; c < 4; ++c) {
    const __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(w[c], inv, kRound), kRound);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wb + 16 * c),
                     _mm512_cvtepi32_epi8(_mm512_srli_epi32(v, 8)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(wb + kTileKeys + 16 * c),
                     _mm512_cvtepi32_epi8(_mm512_and_si512(v, _mm512_set1_epi32(0xff))));
  }
  return m / kMaxCode16;
}

// acc_i = fma(float(sum over key quads [jq0, jq1) of w16_i . v), wscale_i, acc_i * corr_i) for
// N queries at once (each V quad row loaded once a pass for all of them).
template <int D, int N>
inline void values_pass(float* const* acc, const uint8_t* const* wb, const float* wscale,
                        const float* corr, int64_t jq0, int64_t jq1, const uint32_t* vq,
                        LineDrip* drip) {
  constexpr int C = D / 16;
  __m512i a[N][C];
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) a[i][c] = _mm512_setzero_si512();
  for (int half = 0; half < 2; ++half) {  // the high bytes, then (shifted) the low ones
    if (half == 1) {
      for (int i = 0; i < N; ++i)
        for (int c = 0; c < C; ++c) a[i][c] = _mm512_slli_epi32(a[i][c], 8);
    }
    for (int64_t jq = jq0; jq < jq1; ++jq) {
      if (drip != nullptr) drip->step(4);
      const uint32_t* row = vq + jq * D;
      for (int c = 0; c < C; ++c) {
        const __m512i v = _mm512_loadu_si512(row + 16 * c);
        for (int i = 0; i < N; ++i)
          a[i][c] = _mm512_dpbusd_epi32(a[i][c], quad(wb[i] + half * kTileKeys + 4 * jq), v);
      }
    }
  }
  for (int i = 0; i < N; ++i) {
    const __m512 ws = _mm512_set1_ps(wscale[i]), cr = _mm512_set1_ps(corr[i]);
    for (int c = 0; c < C; ++c) {
      const __m512 old = _mm512_mul_round_ps(_mm512_loadu_ps(acc[i] + 16 * c), cr, kRound);
      const __m512 sum = _mm512_cvt_roundepi32_ps(a[i][c], kRound);
      _mm512_storeu_ps(acc[i] + 16 * c, _mm512_fmadd_round_ps(sum, ws, old, kRound));
    }
  }
}

template <int D>
inline void values_pass_n(int n, float* const* acc, const uint8_t* const* wb,
                          const float* wscale, const float* corr, int64_t jq0, int64_t jq1,
                          const uint32_t* vq, LineDrip* drip) {
  switch (n) {
    case 1: return values_pass<D, 1>(acc, wb, wscale, corr, jq0, jq1, vq, drip);
    case 2: if constexpr (value_group<D>() >= 2)
              return values_pass<D, 2>(acc, wb, wscale, corr, jq0, jq1, vq, drip);
            break;
    case 3: if constexpr (value_group<D>() >= 3)
              return values_pass<D, 3>(acc, wb, wscale, corr, jq0, jq1, vq, drip);
            break;
    case 4: if constexpr (value_group<D>() >= 4)
              return values_pass<D, 4>(acc, wb, wscale, corr, jq0, jq1, vq, drip);
            break;
  }
  for (int i = 0; i < n; ++i)
    values_pass<D, 1>(acc + i, wb + i, wscale + i, corr + i, jq0, jq1, vq, drip);
}

// A tile of int8 K/V as the loaders (paged_lanes.cpp) leave it.
struct Tile {
  const uint32_t* kq;      // [D / 4][kTileKeys] quads of dims' codes, keys in lanes
  const float* kscale;     // [kTileKeys]
  const uint32_t* vq;      // [kTileKeys / 4][D] quads of keys' codes
  const float* vscale;     // [kTileKeys]
};

// A batch of queries meeting one tile: query i is qb[i] (quantize_query's bytes) with factor
// qfac[i] and visible keys [lo[i], hi[i]) of the tile, running state m[i], l[i], acc[i] ([D],
// value_dim's order). `pbuf` holds n rows of kTileKeys floats, `wbuf` n rows of 2 * kTileKeys
// bytes. `drip`: the next tile's lines to ask for on the way (line_sweep.h), or nullptr.
template <int D>
inline void attend_tile(int64_t n, const uint8_t* const* qb, const float* qfac,
                        const int64_t* lo, const int64_t* hi, const Tile& t, float* const* m,
                        float* const* l, float* const* acc, float* pbuf, uint8_t* wbuf,
                        LineDrip* drip = nullptr) {
  constexpr int VG = value_group<D>();
  for (int64_t i0 = 0; i0 < n; i0 += kScoreGroup) {
    const int g = static_cast<int>(std::min<int64_t>(kScoreGroup, n - i0));
    __m512 s[kScoreGroup][4];
    switch (g) {
      case 1: tile_scores<D, 1>(qb + i0, qfac + i0, t.kq, t.kscale, s, drip); break;
      case 2: tile_scores<D, 2>(qb + i0, qfac + i0, t.kq, t.kscale, s, drip); break;
      case 3: tile_scores<D, 3>(qb + i0, qfac + i0, t.kq, t.kscale, s, drip); break;
      default: tile_scores<D, 4>(qb + i0, qfac + i0, t.kq, t.kscale, s, drip); break;
    }
    float corr[kScoreGroup], wscale[kScoreGroup];
    const uint8_t* wrow[kScoreGroup];
    for (int i = 0; i < g; ++i) {
      const int64_t qi = i0 + i;
      float* pr = pbuf + qi * kTileKeys;
      corr[i] = lanes::tile_softmax(s[i], lo[qi], hi[qi], *m[qi], *l[qi], pr);
      uint8_t* wr = wbuf + qi * 2 * kTileKeys;
      wscale[i] = quantize_weights(pr, t.vscale, lo[qi], hi[qi], wr);
      wrow[i] = wr;
    }
    for (int i = 0; i < g; i += VG) {
      const int nv = std::min(VG, g - i);
      int64_t jlo = lo[i0 + i], jhi = hi[i0 + i];
      for (int k = 1; k < nv; ++k) {
        jlo = std::min(jlo, lo[i0 + i + k]);
        jhi = std::max(jhi, hi[i0 + i + k]);
      }
      values_pass_n<D>(nv, acc + i0 + i, wrow + i, wscale + i, corr + i, jlo / 4, (jhi + 3) / 4,
                       t.vq, drip);
    }
  }
}

// One query's output: bf16(acc * (1 / l)) into out[0, D), acc in value_dim's order.
template <int D>
inline void finish(const float* acc, float l, uint16_t* out) {
  const float inv = 1.0f / l;
  for (int slot = 0; slot < D; ++slot) {
    c10::BFloat16 b(acc[slot] * inv);
    out[value_dim(slot)] = b.x;
  }
}

}  // namespace prefixserve::lanes_int8

#endif  // __AVX512BF16__ && __AVX512VNNI__
