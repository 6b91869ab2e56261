// Reading a tile's cache lines from memory in one burst of independent loads, every line once in
// address order, before its rows are gathered (then from L1/L2): the paged kernels' loaders
// (paged_attention.cpp, paged_lanes_bf16.cpp). Gathered straight from memory, row after strided
// row between the conversions, the rows of a decode batch at long context arrived at a third of
// the read bandwidth, and software prefetches alone did not change that (AMD Zen 4; BENCHMARKS.md).
#pragma once

#include <cstdint>
#include <cstring>

namespace prefixserve {

// Read 4 bytes of every 64 in [k, k + bytes) and [v, v + bytes), and their last 4 (a row that
// ends on a line of its own); a row under 4 bytes, its first. The loads are kept by an empty asm
// that takes their OR.
inline void touch_lines(const char* k, const char* v, int64_t bytes) {
  auto word = [](const char* p) {
    uint32_t w;
    std::memcpy(&w, p, sizeof w);
    return w;
  };
  uint32_t sink = 0;
  if (bytes < 4) {
    sink = static_cast<uint8_t>(*k) | static_cast<uint8_t>(*v);
    asm volatile("" : : "r"(sink));
    return;
  }
  for (int64_t b = 0; b < bytes - 4; b += 64) sink |= word(k + b) | word(v + b);
  sink |= word(k + bytes - 4) | word(v + bytes - 4);
  asm volatile("" : : "r"(sink));
}

}  // namespace prefixserve
