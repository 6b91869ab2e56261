// One tile of bf16 (or fp8) attention with keys in lanes on 256-bit vectors (AVX2 and FMA):
// attn_lanes_bf16_avx512.h's arithmetic where the CPU has no AVX512-BF16, giving the same bits, so
// a
// query's output does not depend on the kind of CPU either (one batch-invariant namespace).
//
// VDPBF16PS, which the AVX-512 scores take, adds its two products to the accumulator one after
// the other, the odd element's first, each in one rounding (a bf16 product is exact in fp32),
// with denormal inputs read as zero and denormal results flushed to zero: here two FMAs in that
// order under MXCSR's DAZ and FTZ (`Vdpbf16Rounding`, set only around the score loop). The same
// 2 FMAs against VDPBF16PS on 320,000 lanes of random chains on AMD Zen 4: identical. The rest
// (scale, softmax, the value FMAs, the output's rounding) is attn_lanes_avx2.h's and this file's
// copy of the AVX-512 code's operations.
//
// Tile layouts as attn_lanes_bf16_avx512.h's: K packed in pairs of dims with keys in lanes,
// kp[p * kTileKeys + j] = (k[j][2p], k[j][2p + 1]); V as fp32 rows v[j * D + d].
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

namespace prefixserve::lanes_bf16_avx2 {

using lanes_avx2::held;
using lanes_avx2::kTileKeys;
using lanes_avx2::lanes_in;

constexpr int kScoreGroup = 2;  // queries sharing each K load (16 ymm registers)

// VDPBF16PS's rounding for the FMAs between construction and destruction: MXCSR's FTZ and DAZ
// on and rounding to nearest even (the instruction's, whatever the caller's rounding control),
// the caller's MXCSR back after. `pin` keeps a value's computation between the two (an
// empty volatile asm: the compiler keeps volatile operations in their order). It takes and
// returns the value: an asm on the accumulator array's elements in place kept the array in
// memory, every FMA's sum stored and loaded again (the score loop ran 1.2-1.3x slower on Zen 3).
class Vdpbf16Rounding {
 public:
  Vdpbf16Rounding() : saved_(_mm_getcsr()) {
    _mm_setcsr((saved_ & ~kRoundingControl) | kFtzDaz);
  }
  ~Vdpbf16Rounding() { _mm_setcsr(saved_); }
  Vdpbf16Rounding(const Vdpbf16Rounding&) = delete;
  Vdpbf16Rounding& operator=(const Vdpbf16Rounding&) = delete;
  static __m256 pin(__m256 v) {
    asm volatile("" : "+x"(v));
    return v;
  }

 private:
  static constexpr unsigned kFtzDaz = 0x8040;
  static constexpr unsigned kRoundingControl = 0x6000;  // 00: to nearest even
  unsigned saved_;
};

// The raw scores times `scale` of N queries (bf16 bits q[i]) against the tile's 64 keys:
// s[i][c] holds keys 8c .. 8c + 7. In N passes of 8 / N key vectors: 8 accumulators, as many
// chains of dependent FMAs as hide an FMA's latency, for one query as for two.
template <int D, int N>
inline void tile_scores(const uint16_t* const* q, const uint32_t* kp, float scale,
                        __m256 (*s)[8], LineDrip* drip) {
  constexpr int V = 8 / N;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xffff0000u));
  alignas(32) float qf[N][D];  // the queries in fp32 (bf16 values are exact there)
  for (int i = 0; i < N; ++i) {
    for (int d = 0; d < D; d += 8) {
      const __m256i w =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q[i] + d)));
      _mm256_store_ps(qf[i] + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
  for (int pass = 0; pass < N; ++pass) {
    __m256 acc[N][V];
    {
      const Vdpbf16Rounding rounding;
      for (int i = 0; i < N; ++i) {
        for (int c = 0; c < V; ++c) {
          acc[i][c] = Vdpbf16Rounding::pin(_mm256_setzero_ps());
        }
      }
      for (int p = 0; p < D / 2; ++p) {
        if (drip != nullptr) drip->step(4);
        __m256 q_odd[N], q_even[N];
        for (int i = 0; i < N; ++i) {
          q_odd[i] = _mm256_broadcast_ss(qf[i] + 2 * p + 1);
          q_even[i] = _mm256_broadcast_ss(qf[i] + 2 * p);
        }
        const uint32_t* kt = kp + p * kTileKeys + 8 * V * pass;
        for (int c = 0; c < V; ++c) {
          const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kt + 8 * c));
          const __m256 k_odd = _mm256_castsi256_ps(_mm256_and_si256(k, high));
          const __m256 k_even = _mm256_castsi256_ps(_mm256_slli_epi32(k, 16));
          for (int i = 0; i < N; ++i) {
            acc[i][c] = _mm256_fmadd_ps(q_odd[i], k_odd, acc[i][c]);
            acc[i][c] = _mm256_fmadd_ps(q_even[i], k_even, acc[i][c]);
          }
        }
      }
      for (int i = 0; i < N; ++i)
        for (int c = 0; c < V; ++c) acc[i][c] = Vdpbf16Rounding::pin(acc[i][c]);
    }
    const __m256 sc = _mm256_set1_ps(scale);
    for (int i = 0; i < N; ++i)
      for (int c = 0; c < V; ++c) s[i][V * pass + c] = held(_mm256_mul_ps(acc[i][c], sc));
  }
}

// acc = acc * corr, then acc = fma(p[j], v[j], acc) for j in [j0, j1) ascending: one query, in
// chunks of 64 dims (the accumulators fit the registers).
template <int D>
inline void values_pass(float* acc, const float* p, float corr, int64_t j0, int64_t j1,
                        const float* v, LineDrip* drip) {
  constexpr int C = D < 64 ? D / 8 : 8;
  const __m256 cr = _mm256_set1_ps(corr);
  for (int d0 = 0; d0 < D; d0 += 8 * C) {
    __m256 a[C];
    for (int c = 0; c < C; ++c) a[c] = held(_mm256_mul_ps(_mm256_loadu_ps(acc + d0 + 8 * c), cr));
    for (int64_t j = j0; j < j1; ++j) {
      if (drip != nullptr) drip->step(2);
      const __m256 pj = _mm256_set1_ps(p[j]);
      const float* row = v + j * D + d0;
      for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(row + 8 * c), a[c]);
    }
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + d0 + 8 * c, a[c]);
  }
}

// acc_i += p_i[j] * v[j] for j in [j0, j1) ascending, two queries at once (each V vector loaded
// once for both), in chunks of 32 dims: per query the FMAs of values_pass, in its order.
template <int D>
inline void values_pair(float* const* acc, const float* const* p, int64_t j0, int64_t j1,
                        const float* v, LineDrip* drip) {
  constexpr int C = D < 32 ? D / 8 : 4;
  for (int d0 = 0; d0 < D; d0 += 8 * C) {
    __m256 a[2][C];
    for (int i = 0; i < 2; ++i)
      for (int c = 0; c < C; ++c) a[i][c] = _mm256_loadu_ps(acc[i] + d0 + 8 * c);
    for (int64_t j = j0; j < j1; ++j) {
      if (drip != nullptr) drip->step(2);
      const __m256 p0 = _mm256_set1_ps(p[0][j]), p1 = _mm256_set1_ps(p[1][j]);
      const float* row = v + j * D + d0;
      for (int c = 0; c < C; ++c) {
        const __m256 vv = _mm256_loadu_ps(row + 8 * c);
        a[0][c] = _mm256_fmadd_ps(p0, vv, a[0][c]);
        a[1][c] = _mm256_fmadd_ps(p1, vv, a[1][c]);
      }
    }
    for (int i = 0; i < 2; ++i)
      for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc[i] + d0 + 8 * c, a[i][c]);
  }
}

// The value update of n (1 or 2) queries, as attn_lanes_bf16_avx512.h's tile_values: each query's
// head
// up to the common range (its correction applied first), the common range for both together,
// each one's tail (a correction of 1: exact); the same FMAs in the same order as one alone.
template <int D>
inline void tile_values(int n, float* const* acc, const float* const* p, const float* corr,
                        const int64_t* lo, const int64_t* hi, const float* v, LineDrip* drip) {
  const int64_t common_lo = n == 2 ? std::max(lo[0], lo[1]) : lo[0];
  const int64_t common_hi = n == 2 ? std::min(hi[0], hi[1]) : hi[0];
  if (n == 1 || common_lo >= common_hi) {
    for (int i = 0; i < n; ++i) values_pass<D>(acc[i], p[i], corr[i], lo[i], hi[i], v, drip);
    return;
  }
  for (int i = 0; i < 2; ++i) values_pass<D>(acc[i], p[i], corr[i], lo[i], common_lo, v, nullptr);
  values_pair<D>(acc, p, common_lo, common_hi, v, drip);
  for (int i = 0; i < 2; ++i) {
    if (hi[i] > common_hi) values_pass<D>(acc[i], p[i], 1.0f, common_hi, hi[i], v, nullptr);
  }
}

// attn_lanes_bf16_avx512.h's RowScales: an 8-bit tile's row scales (fp8 codes held as exact
// values).
struct RowScales {
  const float* kscale;  // [kTileKeys]
  const float* vscale;  // [kTileKeys]
};

// attn_lanes_bf16_avx512.h's attend_tile: query i is q[i] (bf16 [D]) with visible keys [lo[i],
// hi[i])
// of the tile, running state m[i], l[i], acc[i] ([D]). `pbuf` holds n rows of 64 floats.
// `rows`: the tile's row scales, or nullptr (bf16 values).
template <int D>
inline void attend_tile(int64_t n, const uint16_t* const* q, const int64_t* lo, const int64_t* hi,
                        const uint32_t* kp, const float* v, float scale, float* const* m,
                        float* const* l, float* const* acc, float* pbuf,
                        const RowScales* rows = nullptr, LineDrip* drip = nullptr) {
  for (int64_t i0 = 0; i0 < n; i0 += kScoreGroup) {
    const int g = static_cast<int>(std::min<int64_t>(kScoreGroup, n - i0));
    __m256 s[kScoreGroup][8];
    if (g == 1) tile_scores<D, 1>(q + i0, kp, scale, s, drip);
    else tile_scores<D, 2>(q + i0, kp, scale, s, drip);
    float corr[kScoreGroup];
    const float* prow[kScoreGroup];
    for (int i = 0; i < g; ++i) {
      const int64_t qi = i0 + i;
      if (rows != nullptr) {
        for (int c = 0; c < 8; ++c)
          s[i][c] = held(_mm256_mul_ps(s[i][c], _mm256_loadu_ps(rows->kscale + 8 * c)));
      }
      float* pr = pbuf + qi * kTileKeys;
      corr[i] = lanes_avx2::tile_softmax(s[i], lo[qi], hi[qi], *m[qi], *l[qi], pr);
      for (int c = 0; rows != nullptr && c < 8; ++c) {
        const __m256 w = held(
            _mm256_mul_ps(_mm256_loadu_ps(pr + 8 * c), _mm256_loadu_ps(rows->vscale + 8 * c)));
        _mm256_storeu_ps(pr + 8 * c, _mm256_and_ps(lanes_in(8 * c, lo[qi], hi[qi]), w));
      }
      prow[i] = pr;
    }
    tile_values<D>(g, acc + i0, prow, corr, lo + i0, hi + i0, v, drip);
  }
}

// One query's output: bf16(acc * (1 / l)) into out[0, D).
template <int D>
inline void finish(const float* acc, float l, uint16_t* out) {
  const float inv = 1.0f / l;
  for (int d = 0; d < D; ++d) {
    c10::BFloat16 b(acc[d] * inv);
    out[d] = b.x;
  }
}

// Rows [lo, hi) of K (bf16 bits at element offsets rows[j] of k) packed into kp, 8 keys at a
// time by an 8 x 8 transpose of dim pairs.
template <int D>
void pack_keys(const uint16_t* k, const int64_t* rows, int64_t lo, int64_t hi, uint32_t* kp) {
  for (int64_t j0 = lo / 8 * 8; j0 < hi; j0 += 8) {
    if (j0 >= lo && j0 + 8 <= hi) {
      for (int p0 = 0; p0 < D / 2; p0 += 8) {
        __m256i r[8], t[8];
        for (int i = 0; i < 8; ++i)
          r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k + rows[j0 + i] + 2 * p0));
        lanes_avx2::transpose8(r, t);
        for (int p = 0; p < 8; ++p)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(kp + (p0 + p) * kTileKeys + j0), t[p]);
      }
      continue;
    }
    for (int64_t j = std::max(lo, j0); j < std::min(hi, j0 + 8); ++j) {
      const uint16_t* kr = k + rows[j];
      for (int p = 0; p < D / 2; ++p)
        kp[p * kTileKeys + j] = kr[2 * p] | static_cast<uint32_t>(kr[2 * p + 1]) << 16;
    }
  }
}

// A bf16 tile's rows [lo, hi) (element offsets rows[j]): K packed into kp, V widened to fp32
// rows vt[j * D + d].
template <int D>
void load_bf16(const uint16_t* k, const uint16_t* v, const int64_t* rows, int64_t lo, int64_t hi,
               uint32_t* kp, float* vt, LineDrip* drip) {
  pack_keys<D>(k, rows, lo, hi, kp);
  for (int64_t j = lo; j < hi; ++j) {
    if (drip != nullptr) drip->step(1);
    const uint16_t* vr = v + rows[j];
    for (int d = 0; d < D; d += 8) {
      const __m256i w =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vr + d)));
      _mm256_storeu_ps(vt + j * D + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
}

// 8 fp8 e4m3 codes as their exact fp32 values: a normal code's exponent rebiased (7 to 127)
// with its mantissa, a subnormal's m * 2^-9; the two NaN codes are never written.
inline __m256i fp8_to_fp32_bits(const char* src) {
  int64_t eight;
  std::memcpy(&eight, src, sizeof eight);
  const __m256i b = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(eight));
  const __m256i normal = _mm256_add_epi32(
      _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f)), 20),
      _mm256_set1_epi32(120 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(7))),
                                   _mm256_set1_ps(1.0f / 512.0f));
  const __m256i tiny =
      _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x78)), _mm256_setzero_si256());
  const __m256i magnitude = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub), tiny);
  return _mm256_or_si256(magnitude,
                         _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24));
}

// An fp8 tile's rows [lo, hi) (byte offsets rows[j]: D codes, then the row's scale) as their
// codes' exact values, the scales apart (RowScales): K as bf16 into kb[j * D], then packed into
// kp; V in fp32 into vt; the rows' scales into ks and vs.
template <int D>
void load_fp8(const char* k, const char* v, const int64_t* rows, int64_t lo, int64_t hi,
              uint32_t* kp, float* vt, uint16_t* kb, float* ks, float* vs, LineDrip* drip) {
  int64_t kb_rows[kTileKeys];
  for (int64_t j = lo; j < hi; ++j) {
    if (drip != nullptr) drip->step(1);
    const char* kr = k + rows[j];
    const char* vr = v + rows[j];
    ks[j] = kv8::row_scale(kr + D);
    vs[j] = kv8::row_scale(vr + D);
    for (int d = 0; d < D; d += 16) {
      const __m256i a = _mm256_srli_epi32(fp8_to_fp32_bits(kr + d), 16);
      const __m256i b = _mm256_srli_epi32(fp8_to_fp32_bits(kr + d + 8), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(kb + j * D + d),
                          _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xd8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vt + j * D + d), fp8_to_fp32_bits(vr + d));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vt + j * D + d + 8),
                          fp8_to_fp32_bits(vr + d + 8));
    }
    kb_rows[j] = j * D;
  }
  pack_keys<D>(kb, kb_rows, lo, hi, kp);
}

}  // namespace prefixserve::lanes_bf16_avx2

#endif  // __AVX2__ && __FMA__
