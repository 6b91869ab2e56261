// One tile of attention over an int8 KV cache in integer dot products on 256-bit vectors (AVX2
// and FMA): attn_lanes_int8_avx512.h's arithmetic where the CPU has no AVX512-VNNI (AVX2 hosts,
// AVX-512
// hosts without BF16), giving the same bits. Every rounded step is the same operation on the
// same operands: the int16 query and weights (rounded alike), exact int32 sums (their order
// cannot matter), the scalings, the softmax (attn_lanes_avx2.h), the value update and the
// output's rounding. So an int8 engine's batch-invariant namespace is one for both kinds of host
// (model_runner.kv_numerics), and a shared tier serves blocks between them.
//
// The sums take VPMADDWD (int16 pairs times int16 pairs into int32): products of at most
// 32767 * 128, at most 2^30 over a head dim of 256, exact. Tile layouts: K as pairs of dims in
// int16 with keys in lanes, kp[p * kTileKeys + j] = (k[j][2p], k[j][2p + 1]); V as pairs of keys
// in int16, vp[jp * D + slot] = (v[2jp][d], v[2jp + 1][d]) with d = value_dim(slot) (VPUNPCK's
// interleaving, undone by `finish`).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attn_lanes_avx2.h"
#include "kv8_rows.h"
#include "line_sweep.h"

namespace prefixserve::lanes_int8_avx2 {

using lanes_avx2::held;
using lanes_avx2::kTileKeys;
using lanes_avx2::lanes_in;
using lanes_avx2::reduce_max16;
using lanes_avx2::tile_softmax;

constexpr int kScoreGroup = 2;  // queries sharing each K load (16 ymm registers)
constexpr float kMaxCode16 = 32767.0f;

// The value dim held in slot `slot` of a V pair row: within each 16 dims, VPUNPCKLWD then HWD
// of two rows' 16 int16 codes hold dims 8L + 4v .. 8L + 4v + 3 in 128-bit lane L of vector v.
constexpr int value_dim(int slot) {
  const int s = slot % 16;
  return slot - s + 8 * ((s % 8) / 4) + 4 * (s / 8) + s % 4;
}

// A quantized query's bytes: its int16 codes.
template <int D>
constexpr int64_t query_bytes() {
  return 2 * D;
}

// 16 int32 lanes (each within int16) stored as 16 int16.
inline void store_int16(int16_t* out, __m256i a, __m256i b) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out),
                      _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xd8));
}

// q (bf16 bits, D dims) as int16 codes into `out` (query_bytes<D>()); returns max|q| / 32767
// (0 for a zero query). attn_lanes_int8_avx512.h's quantize_query, its codes unsplit.
template <int D>
inline float quantize_query(const uint16_t* q, uint8_t* out) {
  __m256 x[D / 8];
  __m256 amax[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  for (int c = 0; c < D / 8; ++c) {
    const __m256i w =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 8 * c)));
    x[c] = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    amax[c % 2] = _mm256_max_ps(amax[c % 2], _mm256_and_ps(x[c], magnitude));
  }
  const float m = reduce_max16(amax[0], amax[1]);
  const __m256 inv = _mm256_set1_ps(m > 0.0f ? kMaxCode16 / m : 0.0f);
  auto* codes = reinterpret_cast<int16_t*>(out);
  for (int c = 0; c < D / 8; c += 2) {
    store_int16(codes + 8 * c, _mm256_cvtps_epi32(held(_mm256_mul_ps(x[c], inv))),
                _mm256_cvtps_epi32(held(_mm256_mul_ps(x[c + 1], inv))));
  }
  return m / kMaxCode16;
}

inline __m256i pair_of(const int16_t* p) {  // two int16 broadcast to every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return _mm256_set1_epi32(v);
}

// The scores of N queries (int16 codes q[i], factors qfac[i]) against the tile's 64 keys:
// s[i][c] holds keys 8c .. 8c + 7. Two halves of 32 keys (the accumulators fit the registers).
template <int D, int N>
inline void tile_scores(const int16_t* const* q, const float* qfac, const uint32_t* kp,
                        const float* kscale, __m256 (*s)[8], LineDrip* drip) {
  for (int half = 0; half < 2; ++half) {
    __m256i acc[N][4];
    for (int i = 0; i < N; ++i)
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm256_setzero_si256();
    for (int p = 0; p < D / 2; ++p) {
      if (drip != nullptr) drip->step(4);
      const uint32_t* kt = kp + p * kTileKeys + 32 * half;
      __m256i k[4];
      for (int c = 0; c < 4; ++c)
        k[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kt + 8 * c));
      for (int i = 0; i < N; ++i) {
        const __m256i qp = pair_of(q[i] + 2 * p);
        for (int c = 0; c < 4; ++c)
          acc[i][c] = _mm256_add_epi32(acc[i][c], _mm256_madd_epi16(k[c], qp));
      }
    }
    for (int i = 0; i < N; ++i) {
      const __m256 f = _mm256_set1_ps(qfac[i]);
      for (int c = 0; c < 4; ++c) {
        const __m256 raw = _mm256_cvtepi32_ps(acc[i][c]);
        const __m256 ks = _mm256_loadu_ps(kscale + 32 * half + 8 * c);
        s[i][4 * half + c] = held(_mm256_mul_ps(held(_mm256_mul_ps(raw, ks)), f));
      }
    }
  }
}

// A query's weights of the tile's values: w16[j] = round(p[j] * vscale[j] * 32767 / wmax) for
// j in [lo, hi), 0 elsewhere, into w[0, 64); returns wmax / 32767 (0 when every weight is 0).
inline float quantize_weights(const float* p, const float* vscale, int64_t lo, int64_t hi,
                              int16_t* w) {
  __m256 x[8];
  __m256 wmax[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int c = 0; c < 8; ++c) {
    const __m256 prod = held(_mm256_mul_ps(_mm256_loadu_ps(p + 8 * c),
                                           _mm256_loadu_ps(vscale + 8 * c)));
    x[c] = _mm256_and_ps(lanes_in(8 * c, lo, hi), prod);
    wmax[c % 2] = _mm256_max_ps(wmax[c % 2], x[c]);
  }
  const float m = reduce_max16(wmax[0], wmax[1]);
  const __m256 inv = _mm256_set1_ps(m > 0.0f ? kMaxCode16 / m : 0.0f);
  for (int c = 0; c < 8; c += 2) {
    store_int16(w + 8 * c, _mm256_cvtps_epi32(held(_mm256_mul_ps(x[c], inv))),
                _mm256_cvtps_epi32(held(_mm256_mul_ps(x[c + 1], inv))));
  }
  return m / kMaxCode16;
}

// acc_i = fma(float(sum over key pairs [jp0, jp1) of w16_i . v), wscale_i, acc_i * corr_i) for
// N queries at once, in chunks of 64 / N dims (the accumulators fit the registers; each V pair
// row's chunk loaded once for all N).
template <int D, int N>
inline void values_pass(float* const* acc, const int16_t* const* w, const float* wscale,
                        const float* corr, int64_t jp0, int64_t jp1, const uint32_t* vp,
                        LineDrip* drip) {
  constexpr int C = 8 / N;  // vectors of 8 dims a chunk
  for (int d0 = 0; d0 < D; d0 += 8 * C) {
    __m256i a[N][C];
    for (int i = 0; i < N; ++i)
      for (int c = 0; c < C; ++c) a[i][c] = _mm256_setzero_si256();
    for (int64_t jp = jp0; jp < jp1; ++jp) {
      if (drip != nullptr) drip->step(2);
      const uint32_t* row = vp + jp * D + d0;
      __m256i wp[N];
      for (int i = 0; i < N; ++i) wp[i] = pair_of(w[i] + 2 * jp);
      for (int c = 0; c < C; ++c) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 8 * c));
        for (int i = 0; i < N; ++i)
          a[i][c] = _mm256_add_epi32(a[i][c], _mm256_madd_epi16(v, wp[i]));
      }
    }
    for (int i = 0; i < N; ++i) {
      const __m256 ws = _mm256_set1_ps(wscale[i]), cr = _mm256_set1_ps(corr[i]);
      for (int c = 0; c < C; ++c) {
        float* out = acc[i] + d0 + 8 * c;
        const __m256 old = held(_mm256_mul_ps(_mm256_loadu_ps(out), cr));
        _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(a[i][c]), ws, old));
      }
    }
  }
}

// A tile of int8 K/V as load_tile leaves it.
struct Tile {
  const uint32_t* kp;    // [D / 2][kTileKeys] pairs of dims' codes in int16, keys in lanes
  const float* kscale;   // [kTileKeys]
  const uint32_t* vp;    // [kTileKeys / 2][D] pairs of keys' codes in int16
  const float* vscale;   // [kTileKeys]
};

// attn_lanes_int8_avx512.h's attend_tile: query i is qb[i] (quantize_query's bytes) with factor
// qfac[i]
// and visible keys [lo[i], hi[i]) of the tile, running state m[i], l[i], acc[i] ([D],
// value_dim's order). `pbuf` holds n rows of kTileKeys floats, `wbuf` n rows of kTileKeys int16.
template <int D>
inline void attend_tile(int64_t n, const uint8_t* const* qb, const float* qfac,
                        const int64_t* lo, const int64_t* hi, const Tile& t, float* const* m,
                        float* const* l, float* const* acc, float* pbuf, uint8_t* wbuf,
                        LineDrip* drip = nullptr) {
  for (int64_t i0 = 0; i0 < n; i0 += kScoreGroup) {
    const int g = static_cast<int>(std::min<int64_t>(kScoreGroup, n - i0));
    const int16_t* q[kScoreGroup];
    for (int i = 0; i < g; ++i) q[i] = reinterpret_cast<const int16_t*>(qb[i0 + i]);
    __m256 s[kScoreGroup][8];
    if (g == 1) tile_scores<D, 1>(q, qfac + i0, t.kp, t.kscale, s, drip);
    else tile_scores<D, 2>(q, qfac + i0, t.kp, t.kscale, s, drip);
    float corr[kScoreGroup], wscale[kScoreGroup];
    const int16_t* wrow[kScoreGroup];
    int64_t jlo = kTileKeys, jhi = 0;
    for (int i = 0; i < g; ++i) {
      const int64_t qi = i0 + i;
      float* pr = pbuf + qi * kTileKeys;
      corr[i] = tile_softmax(s[i], lo[qi], hi[qi], *m[qi], *l[qi], pr);
      int16_t* wr = reinterpret_cast<int16_t*>(wbuf) + qi * kTileKeys;
      wscale[i] = quantize_weights(pr, t.vscale, lo[qi], hi[qi], wr);
      wrow[i] = wr;
      jlo = std::min(jlo, lo[qi]);
      jhi = std::max(jhi, hi[qi]);
    }
    if (g == 1) values_pass<D, 1>(acc + i0, wrow, wscale, corr, jlo / 2, (jhi + 1) / 2, t.vp, drip);
    else values_pass<D, 2>(acc + i0, wrow, wscale, corr, jlo / 2, (jhi + 1) / 2, t.vp, drip);
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

inline __m256i codes16(const char* src) {  // 16 int8 codes widened to int16
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)));
}

// An int8 tile's rows [lo, hi) (byte offsets rows[j] into kbase / vbase: D codes, then the
// row's scale) in this file's layouts: K into kp, V into vp (a key outside [lo, hi) reads as
// zeros there), the rows' scales into ks and vs.
template <int D>
void load_tile(const char* kbase, const char* vbase, const int64_t* rows, int64_t lo, int64_t hi,
               uint32_t* kp, float* ks, uint32_t* vp, float* vs, LineDrip* drip) {
  for (int64_t j0 = lo / 8 * 8; j0 < hi; j0 += 8) {
    if (j0 >= lo && j0 + 8 <= hi) {  // 8 keys: 8 pairs of each at a time, transposed
      for (int i = 0; i < 8; ++i) ks[j0 + i] = kv8::row_scale(kbase + rows[j0 + i] + D);
      for (int h = 0; h < D / 16; ++h) {
        __m256i r[8], t[8];
        for (int i = 0; i < 8; ++i) r[i] = codes16(kbase + rows[j0 + i] + 16 * h);
        lanes_avx2::transpose8(r, t);
        for (int p = 0; p < 8; ++p) {
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(kp + (8 * h + p) * kTileKeys + j0),
                              t[p]);
        }
      }
      continue;
    }
    for (int64_t j = std::max(lo, j0); j < std::min(hi, j0 + 8); ++j) {
      const int8_t* kr = reinterpret_cast<const int8_t*>(kbase + rows[j]);
      ks[j] = kv8::row_scale(kr + D);
      for (int p = 0; p < D / 2; ++p) {
        kp[p * kTileKeys + j] = static_cast<uint16_t>(kr[2 * p]) |
                                static_cast<uint32_t>(static_cast<uint16_t>(kr[2 * p + 1])) << 16;
      }
    }
  }
  for (int64_t jp = lo / 2; jp < (hi + 1) / 2; ++jp) {
    if (drip != nullptr) drip->step(2);
    const char* r[2];
    for (int k = 0; k < 2; ++k) {
      const int64_t j = 2 * jp + k;
      r[k] = j >= lo && j < hi ? vbase + rows[j] : nullptr;
      if (r[k] != nullptr) vs[j] = kv8::row_scale(r[k] + D);
    }
    for (int h = 0; h < D / 16; ++h) {
      const __m256i a = r[0] != nullptr ? codes16(r[0] + 16 * h) : _mm256_setzero_si256();
      const __m256i b = r[1] != nullptr ? codes16(r[1] + 16 * h) : _mm256_setzero_si256();
      auto* out = reinterpret_cast<__m256i*>(vp + jp * D + 16 * h);
      _mm256_storeu_si256(out, _mm256_unpacklo_epi16(a, b));
      _mm256_storeu_si256(out + 1, _mm256_unpackhi_epi16(a, b));
    }
  }
}

}  // namespace prefixserve::lanes_int8_avx2

#endif  // __AVX2__ && __FMA__
