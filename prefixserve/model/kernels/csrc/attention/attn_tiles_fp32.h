// The portable paged path's tile arithmetic (paged_attention.cpp): one query, or a few, against
// a tile of keys converted to fp32 rows (kt, vt: [slot][head_dim]), with an online softmax in
// fp32. A query's result depends on nothing but its own query and keys: the same blocks of keys
// from the tile's slot 0, the same softmax update and the same value sums in slot order, however
// many queries meet the tile together. With AVX-512 and a head dim of 64/128/256 the inner loops
// are intrinsics; otherwise portable loops the compiler vectorizes (-O3 -march=native). `drip`:
// the next tile's lines to ask for on the way (line_sweep.h), or nullptr.
#pragma once

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "exp_avx512.h"
#include "line_sweep.h"

namespace prefixserve::tiles_fp32 {

// Lines of the next tile asked for at each coarse step of the arithmetic (a query group).
constexpr int kDripLines = 8;

// exp(x) for x <= 0 to ~2 ulp: range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial,
// written so the compiler vectorizes loops over it (std::exp does not vectorize here). Every
// multiply-add is an explicit std::fma: left to -ffp-contract, the compiler fused them or not
// depending on where the function was inlined, and two call sites of one softmax update gave
// results an ulp apart (a batch-invariance test caught it).
inline float exp_nonpositive(float x) {
  if (x != x) return x;  // NaN (a corrupted cache slot) propagates to the output
  x = std::max(x, -87.0f);
  const float n = std::floor(std::fma(x, 1.44269504088896341f, 0.5f));
  const float r = std::fma(-n, 1.42860682030941723e-6f, std::fma(-n, 0.693145751953125f, x));
  float p = std::fma(r, 0.00138889f, 0.00833336823f);
  p = std::fma(r, p, 0.0416666418f);
  p = std::fma(r, p, 0.166666672f);
  p = std::fma(r, p, 0.5f);
  p = std::fma(r, p, 1.0f);
  p = std::fma(r, p, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Dot product with 16 independent partial sums (vectorizes without reassociating math flags).
template <int HD>
inline float dot(const float* a, const float* b, int64_t n) {
  if constexpr (HD > 0) n = HD;
  float part[16] = {0.0f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int t = 0; t < 16; ++t) part[t] += a[i + t] * b[i + t];
  }
  for (int t = 0; t < 8; ++t) part[t] += part[t + 8];
  for (int t = 0; t < 4; ++t) part[t] += part[t + 4];
  float sum = (part[0] + part[2]) + (part[1] + part[3]);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline float sum16(const float* x, int64_t lo, int64_t hi, bool take_max) {
  float part[16];
  const float init = take_max ? -std::numeric_limits<float>::infinity() : 0.0f;
  for (int t = 0; t < 16; ++t) part[t] = init;
  int64_t j = lo;
  for (; j + 16 <= hi; j += 16) {
    for (int t = 0; t < 16; ++t) {
      part[t] = take_max ? std::max(part[t], x[j + t]) : part[t] + x[j + t];
    }
  }
  for (; j < hi; ++j) part[0] = take_max ? std::max(part[0], x[j]) : part[0] + x[j];
  float r = part[0];
  for (int t = 1; t < 16; ++t) r = take_max ? std::max(r, part[t]) : r + part[t];
  return r;
}

#if defined(__AVX512F__)
// r[i] = sum of the 16 lanes of v[i], for 16 vectors at once (transpose-and-add tree).
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp(x) for x <= 0, 16 lanes: the same reduction and polynomial as exp_nonpositive.
using prefixserve::exp_nonpositive16;

inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// attend_tile for head_dim HD (a multiple of 16) with AVX-512: 16 scores per reduce16, the
// exponentials 16 at a time, the accumulator in registers. `s` has 16 floats of slack.
// The raw (soft-capped) scores of keys [j0, j0 + n), n <= 16, of the query q (C = HD / 16
// vectors) into s + j0: each key's 16 lane products chained over the dims, then reduce16's tree.
// A key's score depends on nothing but the query and the key (reduce16 never mixes keys).
template <int HD>
inline void score_block_avx512(const __m512* q, const float* kt, int64_t j0, int64_t n,
                               float softcap, float* s) {
  constexpr int C = HD / 16;
  __m512 part[16];
  // Unrolled, so that the 16 keys' chains stay in registers and overlap (a loop kept part[] on
  // the stack and ran one key's four dependent FMAs after another: 2.5x slower).
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    __m512 a = _mm512_setzero_ps();
    if (t < n) {
      const float* kr = kt + (j0 + t) * HD;
      for (int c = 0; c < C; ++c) a = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(kr + 16 * c), a);
    }
    part[t] = a;
  }
  __m512 sc = reduce16(part);
  if (softcap > 0.0f) {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, sc);
    for (int t = 0; t < 16; ++t) tmp[t] = softcap * std::tanh(tmp[t] / softcap);
    sc = _mm512_load_ps(tmp);
  }
  _mm512_mask_storeu_ps(s + j0, lanes_below(n), sc);
}

// The online-softmax update of one query over its raw scores s[lo, hi) of a tile: the new
// running max, the exponentials (into s) summed 16 lanes at a time from lo, the new sum; returns
// the factor by which the old accumulator is to be scaled.
inline float softmax_tile_avx512(float* s, int64_t lo, int64_t hi, float& m, float& l) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = lo; j0 < hi; j0 += 16) {
    const __mmask16 k = lanes_below(hi - j0);
    vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_maskz_loadu_ps(k, s + j0));
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  const float correction = exp_nonpositive(m - m_new);
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j0 = lo; j0 < hi; j0 += 16) {
    const __mmask16 k = lanes_below(hi - j0);
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j0), mv));
    _mm512_mask_storeu_ps(s + j0, k, e);
    vsum = _mm512_mask_add_ps(vsum, k, vsum, e);
  }
  l = std::fma(l, correction, _mm512_reduce_add_ps(vsum));
  m = m_new;
  return correction;
}

// The first half of attend_tile_avx512: the scores of slots [lo, hi) in blocks of 16 from lo,
// then the softmax update; returns the correction factor of the old accumulator.
template <int HD>
inline float scores_tile_avx512(const float* qv, const float* kt, int64_t lo, int64_t hi,
                                float softcap, float* s, float& m, float& l) {
  constexpr int C = HD / 16;
  __m512 q[C];
  for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(qv + 16 * c);
  for (int64_t j0 = lo; j0 < hi; j0 += 16)
    score_block_avx512<HD>(q, kt, j0, std::min<int64_t>(16, hi - j0), softcap, s);
  return softmax_tile_avx512(s, lo, hi, m, l);
}

// The second half: acc = acc * correction + sum over j in [lo, hi) of s[j] * v[j], j ascending,
// for NQ queries at once (their s rows `s_stride` apart, accumulators HD apart): each query's
// sums are the one-query loop's, while the NQ * HD / 16 chains hide the FMA latency that one
// query's HD / 16 chains cannot, and each V row is loaded once for all of them.
template <int HD, int NQ>
inline void values_tile_avx512(const float* vt, int64_t lo, int64_t hi, const float* s,
                               int64_t s_stride, const float* correction, float* acc) {
  constexpr int C = HD / 16;
  __m512 a[NQ][C];
  for (int i = 0; i < NQ; ++i) {
    const __m512 corr = _mm512_set1_ps(correction[i]);
    for (int c = 0; c < C; ++c)
      a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * HD + 16 * c), corr);
  }
  for (int64_t j = lo; j < hi; ++j) {
    const float* vr = vt + j * HD;
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vr + 16 * c);
    for (int i = 0; i < NQ; ++i) {
      const __m512 pj = _mm512_set1_ps(s[i * s_stride + j]);
      for (int c = 0; c < C; ++c) a[i][c] = _mm512_fmadd_ps(pj, v[c], a[i][c]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + i * HD + 16 * c, a[i][c]);
}

template <int HD>
inline void attend_tile_avx512(const float* qv, const float* kt, const float* vt, int64_t lo,
                               int64_t hi, float softcap, float* s, float& m, float& l,
                               float* acc) {
  const float correction = scores_tile_avx512<HD>(qv, kt, lo, hi, softcap, s, m, l);
  values_tile_avx512<HD, 1>(vt, lo, hi, s, 0, &correction, acc);
}
#endif

// Dims of the accumulator kept in registers over a whole tile (8 AVX2 vectors).
constexpr int kValueChunk = 64;

// acc[d] += s[j] * vt[j][d] for j ascending in [lo, hi), every d: the same operations in the same
// order as the plain loop, kValueChunk dims at a time over all of j, so the chunk's accumulator
// stays in registers instead of going through memory at every key.
template <int HD>
inline void values_in_chunks(const float* vt, const float* s, int64_t lo, int64_t hi, float* acc,
                             LineDrip* drip) {
  for (int d0 = 0; d0 < HD; d0 += kValueChunk) {
    float a[kValueChunk];
    std::memcpy(a, acc + d0, sizeof a);
    for (int64_t j = lo; j < hi; ++j) {
      if (drip != nullptr && d0 == 0) drip->step(1);
      const float pj = s[j];
      const float* vr = vt + j * HD + d0;
      for (int d = 0; d < kValueChunk; ++d) a[d] += pj * vr[d];
    }
    std::memcpy(acc + d0, a, sizeof a);
  }
}

// One query vector against key slots [lo, hi) of a converted tile (rows of `head_dim` floats):
// the online-softmax update of its running max `m`, sum `l` and unnormalized output `acc`.
// HD > 0 fixes head_dim at compile time.
template <int HD>
inline void attend_tile(const float* qv, const float* kt, const float* vt, int64_t head_dim,
                        int64_t lo, int64_t hi, float softcap, float* s, float& m, float& l,
                        float* acc, LineDrip* drip) {
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0) {
    if (drip != nullptr) drip->step(kDripLines);
    attend_tile_avx512<HD>(qv, kt, vt, lo, hi, softcap, s, m, l, acc);
    return;
  }
#endif
  if constexpr (HD > 0) head_dim = HD;
  for (int64_t j = lo; j < hi; ++j) {
    if (drip != nullptr) drip->step(1);
    s[j] = dot<HD>(qv, kt + j * head_dim, head_dim);
  }
  if (softcap > 0.0f) {
    for (int64_t j = lo; j < hi; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
  }
  const float m_new = std::max(m, sum16(s, lo, hi, true));
  const float correction = exp_nonpositive(m - m_new);
  for (int64_t j = lo; j < hi; ++j) s[j] = exp_nonpositive(s[j] - m_new);
  l = std::fma(l, correction, sum16(s, lo, hi, false));
  m = m_new;
  for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
  if constexpr (HD > 0 && HD % kValueChunk == 0) {
    values_in_chunks<HD>(vt, s, lo, hi, acc, drip);
    return;
  }
  for (int64_t j = lo; j < hi; ++j) {
    if (drip != nullptr) drip->step(1);
    const float pj = s[j];
    const float* vr = vt + j * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += pj * vr[d];
  }
}

// Queries attended together over one range of a tile (attend_tiles).
constexpr int64_t kQueryGroup = 4;

// attend_tile for nq consecutive query vectors (head_dim apart; their m, l and acc too) that see
// the same slots [lo, hi): GQA's query heads of one KV head, a cascade's shared blocks. Each
// query's arithmetic is attend_tile's; with AVX-512 the value pass runs up to kQueryGroup
// queries at once. `s` holds kQueryGroup rows of s_stride floats.
template <int HD>
inline void attend_tiles(const float* qv, int64_t nq, const float* kt, const float* vt,
                         int64_t head_dim, int64_t lo, int64_t hi, float softcap, float* s,
                         int64_t s_stride, float* m, float* l, float* acc, LineDrip* drip) {
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0) {
    for (int64_t q0 = 0; q0 < nq; q0 += kQueryGroup) {
      const int64_t n = std::min(kQueryGroup, nq - q0);
      if (drip != nullptr) drip->step(kDripLines);
      float correction[kQueryGroup];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t qi = q0 + i;
        correction[i] = scores_tile_avx512<HD>(qv + qi * HD, kt, lo, hi, softcap, s + i * s_stride,
                                               m[qi], l[qi]);
      }
      float* a = acc + q0 * HD;
      switch (n) {
        case 1: values_tile_avx512<HD, 1>(vt, lo, hi, s, s_stride, correction, a); break;
        case 2: values_tile_avx512<HD, 2>(vt, lo, hi, s, s_stride, correction, a); break;
        case 3: values_tile_avx512<HD, 3>(vt, lo, hi, s, s_stride, correction, a); break;
        default: values_tile_avx512<HD, 4>(vt, lo, hi, s, s_stride, correction, a); break;
      }
    }
    return;
  }
#endif
  (void)s_stride;
  for (int64_t qi = 0; qi < nq; ++qi)
    attend_tile<HD>(qv + qi * head_dim, kt, vt, head_dim, lo, hi, softcap, s, m[qi], l[qi],
                    acc + qi * head_dim, drip);
}

#if defined(__AVX512F__)
// attend_tiles for every query of `rows` rows of one chunk against a tile they see from its slot
// 0 (full attention), row r up to its own slot his[r] (exclusive; <= 0: nothing). The same
// arithmetic per query as attend_tile (the same blocks of 16 keys from slot 0, the same softmax
// update, the same value sums in slot order), in another loop order: block by block of 16 keys
// for all the queries, so that the block's K and V rows are read from L1 by every query instead
// of the whole tile (64 KB of fp32 K and V at 128 slots, more than L1) once per query. The
// query heads of a row (`group`, consecutive) share each V load. `s` holds rows * group rows of
// s_stride floats.
template <int HD>
inline void attend_rows_avx512(const float* qv, int64_t rows, int64_t group, const int64_t* his,
                               const float* kt, const float* vt, float softcap, float* s,
                               int64_t s_stride, float* m, float* l, float* acc) {
  constexpr int C = HD / 16;
  int64_t hi_max = 0;
  for (int64_t r = 0; r < rows; ++r) hi_max = std::max(hi_max, his[r]);
  for (int64_t j0 = 0; j0 < hi_max; j0 += 16) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::min<int64_t>(16, his[r] - j0);
      for (int64_t g = 0; n > 0 && g < group; ++g) {
        const int64_t qi = r * group + g;
        __m512 q[C];
        for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(qv + qi * HD + 16 * c);
        score_block_avx512<HD>(q, kt, j0, n, softcap, s + qi * s_stride);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; his[r] > 0 && g < group; ++g) {
      const int64_t qi = r * group + g;
      const float correction = softmax_tile_avx512(s + qi * s_stride, 0, his[r], m[qi], l[qi]);
      const __m512 corr = _mm512_set1_ps(correction);
      for (int c = 0; c < C; ++c) {
        float* a = acc + qi * HD + 16 * c;
        _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), corr));
      }
    }
  }
  const float ones[kQueryGroup] = {1.0f, 1.0f, 1.0f, 1.0f};  // acc * 1.0f is acc, exactly
  for (int64_t j0 = 0; j0 < hi_max; j0 += 16) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t hi = std::min(j0 + 16, his[r]);
      for (int64_t g0 = 0; hi > j0 && g0 < group; g0 += kQueryGroup) {
        const int64_t qi = r * group + g0;
        const float* sr = s + qi * s_stride;
        float* a = acc + qi * HD;
        switch (std::min(kQueryGroup, group - g0)) {
          case 1: values_tile_avx512<HD, 1>(vt, j0, hi, sr, s_stride, ones, a); break;
          case 2: values_tile_avx512<HD, 2>(vt, j0, hi, sr, s_stride, ones, a); break;
          case 3: values_tile_avx512<HD, 3>(vt, j0, hi, sr, s_stride, ones, a); break;
          default: values_tile_avx512<HD, 4>(vt, j0, hi, sr, s_stride, ones, a); break;
        }
      }
    }
  }
}
#endif

}  // namespace prefixserve::tiles_fp32
