// The 8-bit KV cache's rows (model/quant/kv_cache.py): head_dim codes, int8 or fp8 e4m3, then
// the row's fp32 scale; a value is code * scale in fp32. The decoders the paged kernels share:
// row by row in portable code (paged_attention.cpp) and 16 codes at a time in AVX-512
// (paged_lanes_bf16.cpp); both give every finite code its exact value.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace prefixserve::kv8 {

// The scale stored after a row's codes.
inline float row_scale(const void* codes_end) {
  float scale;
  std::memcpy(&scale, codes_end, sizeof scale);
  return scale;
}

inline void row_to_float(const int8_t* src, float* dst, int64_t n) {
  const float scale = row_scale(src + n);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

// fp8 e4m3 (float8_e4m3fn: sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7f/0xff NaN)
// to float, exactly, for every byte.
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float v = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                       : std::ldexp(static_cast<float>(8 + m), e - 10);
      if ((b & 0x7f) == 0x7f) v = std::numeric_limits<float>::quiet_NaN();
      value[b] = (b & 0x80) ? -v : v;
    }
  }
};
inline const Fp8Table& fp8_table() {
  static const Fp8Table table;
  return table;
}
inline void row_to_float(const uint8_t* src, float* dst, int64_t n) {
  const float scale = row_scale(src + n);
  const float* lut = fp8_table().value;
  for (int64_t i = 0; i < n; ++i) dst[i] = lut[src[i]] * scale;
}

#if defined(__AVX512F__)
// 16 8-bit codes at src as fp32 values (code * scale): int8 exactly; fp8 e4m3 exactly too, its
// bits moved into a float's (normal codes) or its mantissa scaled by 2^-9 (subnormal codes), the
// values fp8_table() holds (its NaN codes are never written).
inline __m512 codes16(const char* src, bool fp8, __m512 scale) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  if (!fp8) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale);
  }
  const __m512i b = _mm512_cvtepu8_epi32(bytes);
  const __m512i magnitude = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  const __m512i normal =
      _mm512_add_epi32(_mm512_slli_epi32(magnitude, 20), _mm512_set1_epi32(120 << 23));
  const __m512 subnormal = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(7))), _mm512_set1_ps(0x1p-9f));
  const __mmask16 tiny = _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, _mm512_set1_epi32(0x78)),
                                                 _mm512_setzero_si512());
  __m512 v = _mm512_mask_blend_ps(tiny, _mm512_castsi512_ps(normal), subnormal);
  v = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(v), _mm512_slli_epi32(_mm512_and_si512(
                                                                   b, _mm512_set1_epi32(0x80)),
                                                               24)));
  return _mm512_mul_ps(v, scale);
}
#endif  // __AVX512F__

}  // namespace prefixserve::kv8
