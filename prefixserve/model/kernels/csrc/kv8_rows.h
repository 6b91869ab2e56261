// The 8-bit KV cache's rows (model/quant/kv_cache.py): head_dim codes, int8 or fp8 e4m3, then
// the row's fp32 scale; a value is code * scale in fp32. The portable paged path's decoders,
// row by row (paged_attention.cpp), giving every finite code its exact value; the lanes path
// reads the codes in registers (paged_lanes_bf16.cpp: int8 as integers, fp8 as exact bf16).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

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

}  // namespace prefixserve::kv8
