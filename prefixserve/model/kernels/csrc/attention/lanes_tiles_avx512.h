// The AVX-512 tile loaders of the paged kernel's keys-in-lanes path (paged_lanes.cpp): a tile's
// rows from their blocks into the layouts of attn_lanes_bf16_avx512.h (bf16, and fp8 codes as their
// exact values) and attn_lanes_int8_avx512.h (int8 codes). `rows[j]`: key j's row offset in the
// cache,
// in elements (bf16) or bytes (8-bit rows: D codes, then the row's fp32 scale); keys [lo, hi) of
// the tile are loaded. `drip`: the next tile's lines to ask for on the way (line_sweep.h).
#pragma once

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "attn_lanes_bf16_avx512.h"
#include "kv8_rows.h"
#include "line_sweep.h"

namespace prefixserve::lanes {

// out[p] = lane i of r[i]'s element p, for 16 vectors of 16 32-bit elements (a 16 x 16
// transpose: unpacks within 128-bit lanes, then two rounds of lane shuffles).
__attribute__((always_inline)) inline void transpose16(const __m512i* r, __m512i* out) {
  __m512i t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c]: rows 4i .. 4i + 3, column c of each 128-bit lane
    u[4 * i + 0] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int h = 0; h < 2; ++h) {
    for (int c = 0; c < 4; ++c) {
      v[8 * h + c] = _mm512_shuffle_i32x4(u[8 * h + c], u[8 * h + 4 + c], 0x88);
      v[8 * h + 4 + c] = _mm512_shuffle_i32x4(u[8 * h + c], u[8 * h + 4 + c], 0xdd);
    }
  }
  for (int c = 0; c < 8; ++c) {
    out[c] = _mm512_shuffle_i32x4(v[c], v[8 + c], 0x88);
    out[8 + c] = _mm512_shuffle_i32x4(v[c], v[8 + c], 0xdd);
  }
}

// 32 fp8 e4m3 codes as bf16 bits, exactly (every e4m3 value is a bf16 one): normal codes keep
// their sign and mantissa with the exponent rebiased (7 to 127), subnormal ones (m * 2^-9) come
// from a table; the two NaN codes are never written.
inline __m512i fp8_to_bf16(const char* src) {
  const __m512i b =
      _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  const __m512i magnitude_bits = _mm512_and_si512(b, _mm512_set1_epi16(0x7f));  // e << 3 | m
  const __m512i normal =
      _mm512_add_epi16(_mm512_slli_epi16(magnitude_bits, 4), _mm512_set1_epi16(0x3C00));
  const __m512i subnormals = _mm512_set_epi16(  // bf16(m * 2^-9) at index m < 8
      0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x3C60, 0x3C40,
      0x3C20, 0x3C00, 0x3BC0, 0x3B80, 0x3B00, 0);
  const __m512i sub =
      _mm512_permutexvar_epi16(_mm512_and_si512(b, _mm512_set1_epi16(7)), subnormals);
  const __mmask32 tiny = _mm512_cmpeq_epi16_mask(_mm512_and_si512(b, _mm512_set1_epi16(0x78)),
                                                 _mm512_setzero_si512());
  const __m512i magnitude = _mm512_mask_blend_epi16(tiny, normal, sub);
  return _mm512_or_si512(magnitude,
                         _mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8));
}

// Rows [lo, hi) of K (bf16 bits at element offsets rows[j] of k) packed into kp in pairs of
// dims with keys in lanes, 16 keys at a time by a 16 x 16 transpose.
template <int D>
void pack_keys(const uint16_t* k, const int64_t* rows, int64_t lo, int64_t hi, uint32_t* kp) {
  for (int64_t j0 = lo / 16 * 16; j0 < hi; j0 += 16) {
    if (j0 >= lo && j0 + 16 <= hi) {
      for (int p0 = 0; p0 < D / 2; p0 += 16) {
        __m512i r[16], t[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(k + rows[j0 + i] + 2 * p0);
        transpose16(r, t);
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(kp + (p0 + p) * kTileKeys + j0, t[p]);
      }
      continue;
    }
    for (int64_t j = std::max(lo, j0); j < std::min(hi, j0 + 16); ++j) {
      const uint32_t* kr = reinterpret_cast<const uint32_t*>(k + rows[j]);
      for (int p = 0; p < D / 2; ++p) kp[p * kTileKeys + j] = kr[p];
    }
  }
}

// A bf16 tile's rows [lo, hi): K packed into kp, V widened to fp32 rows vt[j * D + d].
template <int D>
void load_bf16(const uint16_t* k, const uint16_t* v, const int64_t* rows, int64_t lo, int64_t hi,
               uint32_t* kp, float* vt, LineDrip* drip) {
  pack_keys<D>(k, rows, lo, hi, kp);
  for (int64_t j = lo; j < hi; ++j) {
    if (drip != nullptr) drip->step(1);
    const uint16_t* vr = v + rows[j];
    for (int d = 0; d < D; d += 16) {
      const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(vr + d)));
      _mm512_storeu_ps(vt + j * D + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
  }
}

// An fp8 tile's rows [lo, hi) as their codes' exact values, the scales apart (RowScales): K as
// bf16 into kb[j * D], then packed into kp; V in fp32 into vt; the rows' scales into ks and vs.
template <int D>
void load_fp8(const char* k, const char* v, const int64_t* rows, int64_t lo, int64_t hi,
              uint32_t* kp, float* vt, uint16_t* kb, float* ks, float* vs, LineDrip* drip) {
  (void)drip;
  int64_t kb_rows[kTileKeys];
  for (int64_t j = lo; j < hi; ++j) {
    const char* kr = k + rows[j];
    const char* vr = v + rows[j];
    ks[j] = kv8::row_scale(kr + D);
    vs[j] = kv8::row_scale(vr + D);
    for (int d = 0; d < D; d += 32) {
      _mm512_storeu_si512(kb + j * D + d, fp8_to_bf16(kr + d));
      const __m512i w = fp8_to_bf16(vr + d);
      const __m512i lo16 = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(w));
      const __m512i hi16 = _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(w, 1));
      _mm512_storeu_si512(vt + j * D + d, _mm512_slli_epi32(lo16, 16));
      _mm512_storeu_si512(vt + j * D + d + 16, _mm512_slli_epi32(hi16, 16));
    }
    kb_rows[j] = j * D;
  }
  pack_keys<D>(kb, kb_rows, lo, hi, kp);
}

#if defined(__AVX512VNNI__)
// An int8 tile's rows [lo, hi) (byte offsets rows[j] into kbase / vbase) in
// attn_lanes_int8_avx512.h's
// layouts, the codes as the cache holds them: K in quads of dims, keys in lanes, into kq; V
// interleaved in quads of keys into vq (a key outside [lo, hi) reads as zeros there); the rows'
// scales into ks and vs.
template <int D>
void load_int8(const char* kbase, const char* vbase, const int64_t* rows, int64_t lo, int64_t hi,
               uint32_t* kq, float* ks, uint32_t* vq, float* vs, LineDrip* drip) {
  auto codes64 = [](const char* src) { return _mm512_loadu_si512(src); };
  for (int64_t j0 = lo / 16 * 16; j0 < hi; j0 += 16) {
    if (j0 >= lo && j0 + 16 <= hi) {  // 16 keys: 16 quads of each at a time, transposed
      for (int i = 0; i < 16; ++i) ks[j0 + i] = kv8::row_scale(kbase + rows[j0 + i] + D);
      for (int h = 0; h < D / 64; ++h) {
        __m512i r[16], t[16];
        for (int i = 0; i < 16; ++i) r[i] = codes64(kbase + rows[j0 + i] + 64 * h);
        transpose16(r, t);
        for (int p = 0; p < 16; ++p) {
          _mm512_storeu_si512(kq + (16 * h + p) * kTileKeys + j0, t[p]);
        }
      }
      continue;
    }
    for (int64_t j = std::max(lo, j0); j < std::min(hi, j0 + 16); ++j) {
      const char* kr = kbase + rows[j];
      ks[j] = kv8::row_scale(kr + D);
      for (int p = 0; p < D / 4; ++p) std::memcpy(kq + p * kTileKeys + j, kr + 4 * p, 4);
    }
  }
  for (int64_t jq = lo / 4; jq < (hi + 3) / 4; ++jq) {
    if (drip != nullptr) drip->step(2);
    const char* r[4];
    for (int k = 0; k < 4; ++k) {
      const int64_t j = 4 * jq + k;
      r[k] = j >= lo && j < hi ? vbase + rows[j] : nullptr;
      if (r[k] != nullptr) vs[j] = kv8::row_scale(r[k] + D);
    }
    for (int h = 0; h < D / 64; ++h) {
      __m512i v[4];
      for (int k = 0; k < 4; ++k)
        v[k] = r[k] != nullptr ? codes64(r[k] + 64 * h) : _mm512_setzero_si512();
      const __m512i ab_lo = _mm512_unpacklo_epi8(v[0], v[1]);
      const __m512i ab_hi = _mm512_unpackhi_epi8(v[0], v[1]);
      const __m512i cd_lo = _mm512_unpacklo_epi8(v[2], v[3]);
      const __m512i cd_hi = _mm512_unpackhi_epi8(v[2], v[3]);
      uint32_t* out = vq + jq * D + 64 * h;
      _mm512_storeu_si512(out, _mm512_unpacklo_epi16(ab_lo, cd_lo));
      _mm512_storeu_si512(out + 16, _mm512_unpackhi_epi16(ab_lo, cd_lo));
      _mm512_storeu_si512(out + 32, _mm512_unpacklo_epi16(ab_hi, cd_hi));
      _mm512_storeu_si512(out + 48, _mm512_unpackhi_epi16(ab_hi, cd_hi));
    }
  }
}
#endif  // __AVX512VNNI__

}  // namespace prefixserve::lanes

#endif  // __AVX512BF16__
