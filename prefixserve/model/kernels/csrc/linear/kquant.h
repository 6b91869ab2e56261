// GGUF's K-quants in super-blocks of 256 (Q4_K: linear_q4k.cpp, Q6_K: linear_q6k.cpp): the sums
// of a linear_int8 call whose weight is one of them, which linear_int8.cpp's chunks and epilogues
// then take as any other sums. Both read x quantized once per super-block, in one column order
// (`quantize_x`), and walk the weight in packed groups of four rows (kquant_tiles.h).
#pragma once

#include <cstdint>
#include <vector>

#include "torch_lite.h"

namespace prefixserve::kquant {

constexpr int64_t kSuper = 256;  // columns of a super-block
constexpr int64_t kGroupRows = 4;

// The formats, by their packed group's bytes per super-block: Q4_K four rows' 128 bytes of
// nibbles, then their 8 sub-scales each, then their 8 sub-mins each; Q6_K four rows' 128 bytes
// of low nibbles, then their 64 bytes of high bit pairs, then their 16 int8 sub-scales each.
enum Format : int { kNone = 0, kQ4K = 4, kQ6K = 6 };
constexpr int64_t kQ4KGroupBytes = kGroupRows * (128 + 8 + 8);
constexpr int64_t kQ6KGroupBytes = kGroupRows * (128 + 64 + 16);

// Rows of x quantized per super-block (scale amax / 127, codes rounded to nearest even in
// [-127, 127]): codes [rows, K], each super-block's 256 in the kernels' column order
// (`x_column`), each super-block's scale [blocks, rows], the sums of each 32 columns' codes
// [rows, blocks, 8] and of each 16's [rows, blocks, 16] (natural column order).
struct XSuper {
  int64_t rows = 0;
  int64_t blocks = 0;
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<int16_t> sums32;
  std::vector<int16_t> sums16;
};

// The column (within its super-block) of x's code at position q: 64 bytes (128 columns) of a
// weight row at a time, their low nibbles (columns 0-31 and 64-95) then their high ones (32-63,
// 96-127). Q4_K's file order; Q6_K is packed to it.
constexpr int64_t x_column(int64_t q) {
  const int64_t pair = q / 128, high = (q / 64) % 2, r = q % 64;
  return 64 * (2 * pair + r / 32) + 32 * high + r % 32;
}

// The K-quant format of a linear_int8 call's codes and scales (codes uint8 [ceil(N / 4),
// K / 256, group bytes]; scales fp16 [N, 2 K / 256] (d, dmin) for Q4_K, [N, K / 256] (d) for
// Q6_K), or kNone; and whether their shapes fit N rows of K columns.
Format format_of(const torch::Tensor& codes, const torch::Tensor& scales);
bool shapes_fit(Format format, const torch::Tensor& codes, const torch::Tensor& scales,
                int64_t N, int64_t K);

// x [rows, K] bf16 quantized per super-block on the caller and up to `threads - 1` helpers.
XSuper quantize_x(const uint16_t* x, int64_t rows, int64_t K, int64_t threads,
                  bool compute_bound);

// The sums of weight rows [n0, n0 + width) with every row of xq into sums [rows, width].
void sum_range(Format format, const uint8_t* codes, const uint16_t* scales, int64_t K,
               const XSuper& xq, int64_t n0, int64_t width, float* sums);
void sum_range_q4k(const uint8_t* codes, const uint16_t* d_dmin, int64_t K, const XSuper& xq,
                   int64_t n0, int64_t width, float* sums);
void sum_range_q6k(const uint8_t* codes, const uint16_t* d, int64_t K, const XSuper& xq,
                   int64_t n0, int64_t width, float* sums);

// Bytes of a weight row of K columns (codes, sub-scales and mins, the super-blocks' scales).
inline int64_t row_bytes(Format format, int64_t K) {
  return format == kQ4K ? K / kSuper * (kQ4KGroupBytes / kGroupRows + 4)
                        : K / kSuper * (kQ6KGroupBytes / kGroupRows + 2);
}

}  // namespace prefixserve::kquant
