// A bfloat16's bits as a float: the 16 bits are the float's upper half (exact).
#pragma once

#include <cstdint>
#include <cstring>

namespace prefixserve {

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &wide, sizeof f);
  return f;
}

}  // namespace prefixserve
