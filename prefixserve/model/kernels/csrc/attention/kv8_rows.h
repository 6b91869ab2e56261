// The 8-bit KV cache's rows (model/quant/kv_cache.py): head_dim codes, int8 or fp8 e4m3, then
// the row's fp32 scale; a value is code * scale in fp32. The portable paged path's decoders,
// row by row (paged_attention.cpp), giving every finite code its exact value; the lanes path
// reads the codes in registers (paged_lanes.cpp: int8 as integers, fp8 as exact bf16).
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>

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

// fp8 e4m3 (float8_e4m3fn: sign, 4 exponent bits of bias 7, 3 mantissa bits; 0x7f/0xff NaN).
// One e4m3 byte's value, exactly (PyTorch's float8_e4m3fn; NaN codes NaN), in arithmetic without
// branches or selects so that the compiler vectorizes it (a table lookup per byte does not: it
// bound the portable path's fp8 tiles on AVX2): (8 + m) * 2^(e - 10) for a normal code,
// m * 2^-9 for a subnormal one (e = 0), both products exact; the NaN codes get a NaN's bits.
inline float fp8_value(uint8_t b) {
  const uint32_t e = (b >> 3) & 15u, m = b & 7u;
  const uint32_t normal = e != 0;
  const float mantissa = static_cast<float>(static_cast<int32_t>(m + 8 * normal));
  const float power = std::bit_cast<float>((e + (1 - normal) + 117) << 23);
  const uint32_t nan = static_cast<uint32_t>((b & 0x7fu) == 0x7fu) * 0x7fc00000u;
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  return std::bit_cast<float>(std::bit_cast<uint32_t>(mantissa * power) | nan | sign);
}

inline void row_to_float(const uint8_t* src, float* dst, int64_t n) {
  const float scale = row_scale(src + n);
  for (int64_t i = 0; i < n; ++i) dst[i] = fp8_value(src[i]) * scale;
}

}  // namespace prefixserve::kv8
