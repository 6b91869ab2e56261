// One tile of attention over an int8 KV cache in integer dot products (AVX512-VNNI): the paged
// kernel's int8 path (paged_lanes_bf16.cpp). A cache row is D int8 codes and its fp32 scale
// (model/quant/kv_cache.py); its values are code * scale.
//
// Per query (bf16, D dims), once per work item:
//   q16[d] = round(q[d] * (32767 / max|q|)) in int16, qfac = (max|q| / 32767) * scale.
// Per tile of kTileKeys keys (the same tiles, in the same order, as the bf16 path):
//   scores  s[j] = (float(sum over d of q16[d] * code_k[j][d]) * kscale[j]) * qfac, the sum in
//           int32 (VPDPWSSD over pairs of dims: exact, so its order cannot matter);
//   softmax lanes::tile_softmax, as for bf16 (m, l, corr, p[j] = exp(s[j] - m'), 0 outside the
//           query's visible keys [lo, hi));
//   values  w[j] = p[j] * vscale[j]; wmax = max w; w16[j] = round(w[j] * (32767 / wmax));
//           acc = fma(float(sum over j of w16[j] * code_v[j][d]), wmax / 32767, acc * corr),
//           the sum in int32 again (VPDPWSSD over pairs of keys).
// Integer sums are exact: a query's output does not depend on which keys beside its own the
// tile holds (their w16 is 0), on the other queries of the call, nor on whether its keys were
// cached (batch invariance). The int16 query keeps ~15 bits against bf16's 8; the weights keep
// 15 bits of the tile's largest.
//
// Tile layouts: K as int16 pairs of dims with keys in lanes, kp[p * kTileKeys + j] = (k[j][2p],
// k[j][2p + 1]) (as the bf16 tiles); V as int16 pairs of keys, vp[jp * D + slot] = (v[2jp][d],
// v[2jp + 1][d]) with d = value_dim(slot) (VPUNPCK's interleaving, undone by `finish`).
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "attn_lanes_bf16.h"
#include "line_sweep.h"

namespace prefixserve::lanes_int8 {

using lanes::kRound;
using lanes::kTileKeys;

constexpr float kMaxCode16 = 32767.0f;

// The value dim held in slot `slot` of a V pair row: within each 32 dims, unpacklo's (dims
// 8L .. 8L + 3 of each 128-bit lane L) then unpackhi's (8L + 4 .. 8L + 7).
constexpr int value_dim(int slot) {
  const int h = slot / 32, s = slot % 32, hi = s / 16, lane = s % 16;
  return 32 * h + 8 * (lane / 4) + 4 * hi + lane % 4;
}

// Queries whose integer accumulators stay in registers together.
template <int D>
constexpr int value_group() {
  return D <= 64 ? 4 : (D <= 128 ? 2 : 1);
}
constexpr int kScoreGroup = lanes::kScoreGroup;

// q (bf16 bits, D dims) as int16 codes into q16; returns max|q| / 32767 (0 for a zero query).
template <int D>
inline float quantize_query(const uint16_t* q, int16_t* q16) {
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
  for (int c = 0; c < D / 16; ++c) {
    const __m512i v = _mm512_cvt_roundps_epi32(_mm512_mul_round_ps(x[c], inv, kRound), kRound);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + 16 * c), _mm512_cvtsepi32_epi16(v));
  }
  return m / kMaxCode16;
}

// The scores of N queries against the tile's 64 keys: s[i][c] holds keys 16c .. 16c + 15.
template <int D, int N>
inline void tile_scores(const int16_t* const* q16, const float* qfac, const uint32_t* kp,
                        const float* kscale, __m512 (*s)[4], LineDrip* drip) {
  __m512i acc[N][4];
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_si512();
  for (int p = 0; p < D / 2; ++p) {
    if (drip != nullptr) drip->step(4);
    __m512i k4[4];
    for (int c = 0; c < 4; ++c) k4[c] = _mm512_loadu_si512(kp + p * kTileKeys + 16 * c);
    for (int i = 0; i < N; ++i) {
      int32_t pair;
      std::memcpy(&pair, q16[i] + 2 * p, sizeof pair);
      const __m512i qp = _mm512_set1_epi32(pair);
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpwssd_epi32(acc[i][c], qp, k4[c]);
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
// j in [lo, hi), 0 elsewhere; returns wmax / 32767 (0 when every weight is 0).
inline float quantize_weights(const float* p, const float* vscale, int64_t lo, int64_t hi,
                              int16_t* w16) {
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
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(w16 + 16 * c), _mm512_cvtsepi32_epi16(v));
  }
  return m / kMaxCode16;
}

// acc_i = fma(float(sum over key pairs [jp0, jp1) of w16_i . v), wscale_i, acc_i * corr_i) for
// N queries at once (each V pair row loaded once for all of them).
template <int D, int N>
inline void values_pass(float* const* acc, const int16_t* const* w16, const float* wscale,
                        const float* corr, int64_t jp0, int64_t jp1, const uint32_t* vp,
                        LineDrip* drip) {
  constexpr int C = D / 16;
  __m512i a[N][C];
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) a[i][c] = _mm512_setzero_si512();
  for (int64_t jp = jp0; jp < jp1; ++jp) {
    if (drip != nullptr) drip->step(4);
    const uint32_t* row = vp + jp * D;
    for (int c = 0; c < C; ++c) {
      const __m512i v = _mm512_loadu_si512(row + 16 * c);
      for (int i = 0; i < N; ++i) {
        int32_t pair;
        std::memcpy(&pair, w16[i] + 2 * jp, sizeof pair);
        a[i][c] = _mm512_dpwssd_epi32(a[i][c], _mm512_set1_epi32(pair), v);
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
inline void values_pass_n(int n, float* const* acc, const int16_t* const* w16,
                          const float* wscale, const float* corr, int64_t jp0, int64_t jp1,
                          const uint32_t* vp, LineDrip* drip) {
  switch (n) {
    case 1: return values_pass<D, 1>(acc, w16, wscale, corr, jp0, jp1, vp, drip);
    case 2: if constexpr (value_group<D>() >= 2)
              return values_pass<D, 2>(acc, w16, wscale, corr, jp0, jp1, vp, drip);
            break;
    case 3: if constexpr (value_group<D>() >= 3)
              return values_pass<D, 3>(acc, w16, wscale, corr, jp0, jp1, vp, drip);
            break;
    case 4: if constexpr (value_group<D>() >= 4)
              return values_pass<D, 4>(acc, w16, wscale, corr, jp0, jp1, vp, drip);
            break;
  }
  for (int i = 0; i < n; ++i)
    values_pass<D, 1>(acc + i, w16 + i, wscale + i, corr + i, jp0, jp1, vp, drip);
}

// A tile of int8 K/V as the loaders (paged_lanes_bf16.cpp) leave it.
struct Tile {
  const uint32_t* kp;      // [D / 2][kTileKeys] int16 pairs of dims, keys in lanes
  const float* kscale;     // [kTileKeys]
  const uint32_t* vp;      // [kTileKeys / 2][D] int16 pairs of keys
  const float* vscale;     // [kTileKeys]
};

// A batch of queries meeting one tile: query i is q16[i] with factor qfac[i] and visible keys
// [lo[i], hi[i]) of the tile, running state m[i], l[i], acc[i] ([D], value_dim's order).
// `pbuf` holds n rows of kTileKeys floats, `wbuf` n rows of kTileKeys int16.
template <int D>
inline void attend_tile(int64_t n, const int16_t* const* q16, const float* qfac,
                        const int64_t* lo, const int64_t* hi, const Tile& t, float* const* m,
                        float* const* l, float* const* acc, float* pbuf, int16_t* wbuf,
                        LineDrip* drip = nullptr) {
  constexpr int VG = value_group<D>();
  for (int64_t i0 = 0; i0 < n; i0 += kScoreGroup) {
    const int g = static_cast<int>(std::min<int64_t>(kScoreGroup, n - i0));
    __m512 s[kScoreGroup][4];
    switch (g) {
      case 1: tile_scores<D, 1>(q16 + i0, qfac + i0, t.kp, t.kscale, s, drip); break;
      case 2: tile_scores<D, 2>(q16 + i0, qfac + i0, t.kp, t.kscale, s, drip); break;
      case 3: tile_scores<D, 3>(q16 + i0, qfac + i0, t.kp, t.kscale, s, drip); break;
      default: tile_scores<D, 4>(q16 + i0, qfac + i0, t.kp, t.kscale, s, drip); break;
    }
    float corr[kScoreGroup], wscale[kScoreGroup];
    const int16_t* wrow[kScoreGroup];
    for (int i = 0; i < g; ++i) {
      const int64_t qi = i0 + i;
      float* pr = pbuf + qi * kTileKeys;
      corr[i] = lanes::tile_softmax(s[i], lo[qi], hi[qi], *m[qi], *l[qi], pr);
      int16_t* wr = wbuf + qi * kTileKeys;
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
      values_pass_n<D>(nv, acc + i0 + i, wrow + i, wscale + i, corr + i, jlo / 2, (jhi + 1) / 2,
                       t.vp, drip);
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
