// Reading a tile's cache lines from memory in one burst of independent loads, every line once in
// address order, before its rows are gathered (then from L1/L2): the paged kernels' loaders
// (paged_attention.cpp, paged_lanes.cpp). Gathered straight from memory, row after strided
// row between the conversions, the rows of a decode batch at long context arrived at a third of
// the read bandwidth, and software prefetches alone did not change that (AMD Zen 4; BENCHMARKS.md).
// While a tile is computed, LineDrip asks for the next one's lines a few at a time, so that
// those reads find them in L2.
#pragma once

#if defined(__SSE__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <vector>

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

// The next tile's cache lines, asked for a few at a time while this tile is computed: a burst of
// hundreds of prefetches at once (or of demand loads) leaves the arithmetic waiting; spread
// through it, they arrive before the tile's own burst read (BENCHMARKS.md).
class LineDrip {
 public:
  explicit LineDrip(size_t max_lines = 4096) { line_.reserve(max_lines); }
  void clear() {
    line_.clear();
    next_ = 0;
  }
  // Every line of [k, k + bytes) and [v, v + bytes) (rows of one layout, alike modulo 64), in
  // address order, K's and V's in turn; past max_lines, nothing more.
  void add_runs(const char* k, const char* v, int64_t bytes) {
    const uintptr_t mask = ~static_cast<uintptr_t>(63);
    const uintptr_t k0 = reinterpret_cast<uintptr_t>(k) & mask;
    const uintptr_t v0 = reinterpret_cast<uintptr_t>(v) & mask;
    const uintptr_t k1 = reinterpret_cast<uintptr_t>(k + bytes - 1) & mask;
    for (uintptr_t o = 0; k0 + o <= k1 && line_.size() + 2 <= line_.capacity(); o += 64) {
      line_.push_back(reinterpret_cast<const char*>(k0 + o));
      line_.push_back(reinterpret_cast<const char*>(v0 + o));
    }
  }
  // Ask for the next n lines toward L2 (none left: nothing). T1, not T0: measured faster.
  inline void step(int n) {
#if defined(__SSE__)
    for (int i = 0; i < n && next_ < line_.size(); ++i) {
      _mm_prefetch(line_[next_++], _MM_HINT_T1);
    }
#else
    (void)n;
#endif
  }

 private:
  std::vector<const char*> line_;
  size_t next_ = 0;
};

}  // namespace prefixserve
