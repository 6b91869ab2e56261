// One tile of bf16 attention with keys in lanes: the arithmetic that the long-chunk kernel
// (prefill_attention.cpp) and the paged kernel's keys-in-lanes path (paged_lanes.cpp)
// share, so a query gets the same bits from either, whichever rows it shared a call with and
// whether its keys were cached or computed this step (batch invariance with the fast prefill
// kernel on).
//
// A tile is the kTileKeys keys at absolute positions [t0, t0 + kTileKeys), t0 a multiple of
// kTileKeys. A query meets each tile it sees once, tiles in ascending order, and only its own
// visible keys [lo, hi) of the tile:
//   scores  s[j] = (sum over dim pairs p ascending of VDPBF16PS(q pair p, k[j] pair p)) * scale,
//           each key in its own fp32 lane (no cross-lane sums);
//   softmax m' = max(m, max s[lo, hi)); corr = exp(m - m') (0 for the first tile);
//           e[j] = exp(s[j] - m'); l = fma(l, corr, sum of e: 4 vectors added in order, then
//           the 16 lanes' fixed reduction);
//   values  acc = acc * corr, then acc = fma(e[j], v[j], acc) for j ascending over [lo, hi).
// The output is bf16(acc * (1 / l)). Every multiply-add is an explicit FMA or a rounded
// intrinsic (`_round` forms), so the compiler's contraction cannot differ between call sites.
//
// K of a tile is handed over packed in pairs of dims, keys in lanes: kp[p * kstride + j] holds
// (k[j][2p], k[j][2p + 1]); V as fp32 rows v[j * D + d].
#pragma once

#if defined(__AVX512BF16__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "exp_avx512.h"
#include "line_sweep.h"

namespace prefixserve::lanes {

constexpr int64_t kTileKeys = 64;
constexpr int kScoreGroup = 4;  // queries sharing each K load of the score loop
constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;

// Queries whose value accumulators stay in registers together (32 zmm registers in all).
template <int D>
constexpr int value_group() {
  return D <= 64 ? 4 : (D <= 128 ? 2 : 1);
}

// Lanes of keys [first, first + 16) inside [lo, hi).
inline __mmask16 lanes_in(int64_t first, int64_t lo, int64_t hi) {
  const int64_t a = lo - first, b = hi - first;
  if (b <= 0 || a >= 16) return 0;
  const uint32_t upper = b >= 16 ? 0xFFFFu : ((1u << b) - 1u);
  const uint32_t lower = a <= 0 ? 0xFFFFu : ((0xFFFFu << a) & 0xFFFFu);
  return static_cast<__mmask16>(upper & lower);
}

inline float exp1(float x) {
  return _mm512_cvtss_f32(exp_nonpositive16(_mm512_set1_ps(x)));
}

// The raw scores of N queries against the tile's 64 keys: s[i][c] holds keys 16c .. 16c + 15.
template <int D, int N>
inline void tile_scores(const uint16_t* const* q, const uint32_t* kp, int64_t kstride,
                        float scale, __m512 (*s)[4], LineDrip* drip) {
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < 4; ++c) s[i][c] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {
    if (drip != nullptr) drip->step(4);
    const uint32_t* kt = kp + p * kstride;
    __m512bh k4[4];
    for (int c = 0; c < 4; ++c) k4[c] = (__m512bh)_mm512_loadu_si512(kt + 16 * c);
    for (int i = 0; i < N; ++i) {
      int32_t pair;  // q's dims 2p and 2p + 1 (a memcpy: bf16 data, no aliasing)
      std::memcpy(&pair, q[i] + 2 * p, sizeof pair);
      const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < 4; ++c) s[i][c] = _mm512_dpbf16_ps(s[i][c], qb, k4[c]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < 4; ++c) s[i][c] = _mm512_mul_round_ps(s[i][c], sc, kRound);
}

// The online-softmax update of one query over its visible keys [lo, hi) of the tile: the
// exponentials into p[0, 64) (0 outside [lo, hi)), the new m and l; returns corr.
inline float tile_softmax(const __m512* s, int64_t lo, int64_t hi, float& m, float& l, float* p) {
  __mmask16 mk[4];
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int c = 0; c < 4; ++c) {
    mk[c] = lanes_in(16 * c, lo, hi);
    vmax = _mm512_mask_max_ps(vmax, mk[c], vmax, s[c]);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  const float corr = m == -std::numeric_limits<float>::infinity() ? 0.0f : exp1(m - m_new);
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    const __m512 e =
        _mm512_maskz_mov_ps(mk[c], exp_nonpositive16(_mm512_sub_round_ps(s[c], mv, kRound)));
    _mm512_storeu_ps(p + 16 * c, e);
    vsum = _mm512_add_round_ps(vsum, e, kRound);
  }
  l = std::fma(l, corr, _mm512_reduce_add_ps(vsum));
  m = m_new;
  return corr;
}

// acc_i (= acc_i * corr_i first, where corr is given) += p_i[j] * v[j] for j in [j0, j1)
// ascending, N queries at once (each V row loaded once for all of them).
template <int D, int N>
inline void values_pass(float* const* acc, const float* const* p, const float* corr, int64_t j0,
                        int64_t j1, const float* v, LineDrip* drip = nullptr) {
  constexpr int C = D / 16;
  __m512 a[N][C];
  for (int i = 0; i < N; ++i) {
    for (int c = 0; c < C; ++c) a[i][c] = _mm512_loadu_ps(acc[i] + 16 * c);
    if (corr != nullptr) {
      const __m512 ci = _mm512_set1_ps(corr[i]);
      for (int c = 0; c < C; ++c) a[i][c] = _mm512_mul_round_ps(a[i][c], ci, kRound);
    }
  }
  for (int64_t j = j0; j < j1; ++j) {
    if (drip != nullptr) drip->step(4);
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(v + j * D + 16 * c);
    for (int i = 0; i < N; ++i) {
      const __m512 pj = _mm512_set1_ps(p[i][j]);
      for (int c = 0; c < C; ++c) a[i][c] = _mm512_fmadd_ps(pj, vv[c], a[i][c]);
    }
  }
  for (int i = 0; i < N; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc[i] + 16 * c, a[i][c]);
}

template <int D>
inline void values_pass_n(int n, float* const* acc, const float* const* p, const float* corr,
                          int64_t j0, int64_t j1, const float* v, LineDrip* drip) {
  switch (n) {
    case 1: return values_pass<D, 1>(acc, p, corr, j0, j1, v, drip);
    case 2: if constexpr (value_group<D>() >= 2)
              return values_pass<D, 2>(acc, p, corr, j0, j1, v, drip);
            break;
    case 3: if constexpr (value_group<D>() >= 3)
              return values_pass<D, 3>(acc, p, corr, j0, j1, v, drip);
            break;
    case 4: if constexpr (value_group<D>() >= 4)
              return values_pass<D, 4>(acc, p, corr, j0, j1, v, drip);
            break;
  }
  for (int i = 0; i < n; ++i)
    values_pass<D, 1>(acc + i, p + i, corr == nullptr ? nullptr : corr + i, j0, j1, v, drip);
}

// The value update of n <= value_group queries: each query's own range [lo_i, hi_i), split as
// its head up to the common range, the common range (all queries together), its tail; the
// same FMAs in the same order as one query alone.
template <int D>
inline void tile_values(int n, float* const* acc, const float* const* p, const float* corr,
                        const int64_t* lo, const int64_t* hi, const float* v, LineDrip* drip) {
  int64_t common_lo = lo[0], common_hi = hi[0];
  for (int i = 1; i < n; ++i) {
    common_lo = std::max(common_lo, lo[i]);
    common_hi = std::min(common_hi, hi[i]);
  }
  if (n == 1 || common_lo >= common_hi) {
    for (int i = 0; i < n; ++i) values_pass<D, 1>(acc + i, p + i, corr + i, lo[i], hi[i], v, drip);
    return;
  }
  for (int i = 0; i < n; ++i) values_pass<D, 1>(acc + i, p + i, corr + i, lo[i], common_lo, v);
  values_pass_n<D>(n, acc, p, nullptr, common_lo, common_hi, v, drip);
  for (int i = 0; i < n; ++i) {
    if (hi[i] > common_hi) values_pass<D, 1>(acc + i, p + i, nullptr, common_hi, hi[i], v);
  }
}

// A tile of 8-bit codes held as their exact values (fp8 e4m3: every code is exact in bf16):
// key j's scores are multiplied by kscale[j] after `scale`, and a query's weight of value j by
// vscale[j] after the softmax (its sum l is of the unscaled weights), each rounded once.
struct RowScales {
  const float* kscale;  // [kTileKeys]
  const float* vscale;  // [kTileKeys]
};

// A batch of queries meeting one tile: query i is q[i] (bf16 [D]) with visible keys
// [lo[i], hi[i]) of the tile (0 <= lo < hi <= 64), running state m[i], l[i], acc[i] ([D]).
// `pbuf` holds n rows of 64 floats. `rows`: the tile's row scales, or nullptr (bf16 values).
// `drip`: the next tile's lines to ask for on the way (line_sweep.h), or nullptr.
template <int D>
inline void attend_tile(int64_t n, const uint16_t* const* q, const int64_t* lo, const int64_t* hi,
                        const uint32_t* kp, int64_t kstride, const float* v, float scale,
                        float* const* m, float* const* l, float* const* acc, float* pbuf,
                        const RowScales* rows = nullptr, LineDrip* drip = nullptr) {
  constexpr int VG = value_group<D>();
  for (int64_t i0 = 0; i0 < n; i0 += kScoreGroup) {
    const int g = static_cast<int>(std::min<int64_t>(kScoreGroup, n - i0));
    __m512 s[kScoreGroup][4];
    switch (g) {
      case 1: tile_scores<D, 1>(q + i0, kp, kstride, scale, s, drip); break;
      case 2: tile_scores<D, 2>(q + i0, kp, kstride, scale, s, drip); break;
      case 3: tile_scores<D, 3>(q + i0, kp, kstride, scale, s, drip); break;
      default: tile_scores<D, 4>(q + i0, kp, kstride, scale, s, drip); break;
    }
    if (rows != nullptr) {
      for (int i = 0; i < g; ++i)
        for (int c = 0; c < 4; ++c)
          s[i][c] = _mm512_mul_round_ps(s[i][c], _mm512_loadu_ps(rows->kscale + 16 * c), kRound);
    }
    float corr[kScoreGroup];
    const float* prow[kScoreGroup];
    for (int i = 0; i < g; ++i) {
      float* pr = pbuf + (i0 + i) * kTileKeys;
      corr[i] = tile_softmax(s[i], lo[i0 + i], hi[i0 + i], *m[i0 + i], *l[i0 + i], pr);
      for (int c = 0; rows != nullptr && c < 4; ++c) {
        const __mmask16 k = lanes_in(16 * c, lo[i0 + i], hi[i0 + i]);
        const __m512 w = _mm512_maskz_mul_round_ps(k, _mm512_loadu_ps(pr + 16 * c),
                                                   _mm512_loadu_ps(rows->vscale + 16 * c), kRound);
        _mm512_storeu_ps(pr + 16 * c, w);
      }
      prow[i] = pr;
    }
    for (int i = 0; i < g; i += VG) {
      const int nv = std::min(VG, g - i);
      tile_values<D>(nv, acc + i0 + i, prow + i, corr + i, lo + i0 + i, hi + i0 + i, v, drip);
    }
  }
}

// One query's output: bf16(acc * (1 / l)) into out[0, D).
template <int D>
inline void finish(const float* acc, float l, uint16_t* out) {
  const float inv = 1.0f / l;
  for (int d = 0; d < D; ++d) {
    const float x = acc[d] * inv;
    c10::BFloat16 b(x);
    out[d] = b.x;
  }
}

}  // namespace prefixserve::lanes

#endif  // __AVX512BF16__
