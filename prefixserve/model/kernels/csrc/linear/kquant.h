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
// A fused weight of Q4_K rows then Q6_K rows (llama.cpp's Q4_K_M gives v more bits than q and
// k): kMixed, both parts' groups one after the other in a flat codes tensor.
enum Format : int { kNone = 0, kQ4K = 4, kQ6K = 6, kMixed = 10 };
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
// weight row at a time, their low nibbles then their high ones; the four bytes of 32-bit lane L
// of load p hold columns 128 p + 8 L .. + 3 in their low nibbles and the next four in their high
// ones. So each lane's eight codes lie in one sub-block of Q4_K (32 columns) and of Q6_K (16):
// Q4_K sums a lane's low and high nibbles' products in one 32-bit lane (linear_q4k.cpp).
// Both formats are packed to it (model/quant/weights.py `pack_q4_k`, `pack_q6_k`).
constexpr int64_t x_column(int64_t q) {
  const int64_t pair = q / 128, high = (q / 64) % 2, r = q % 64;
  return 128 * pair + 8 * (r / 4) + 4 * high + r % 4;
}

// The K-quant format of a linear_int8 call's codes and scales (codes uint8 [ceil(N / 4),
// K / 256, group bytes]; scales fp16 [N, 2 K / 256] (d, dmin) for Q4_K, [N, K / 256] (d) for
// Q6_K; kMixed: codes uint8 [bytes], the Q4_K rows' groups then the Q6_K rows', scales fp16
// [N, 2 K / 256], a Q6_K row's d in its first K / 256), or kNone; whether their shapes fit N
// rows of K columns; and the first row of a weight's Q6_K part (N for one format).
Format format_of(const torch::Tensor& codes, const torch::Tensor& scales);
bool shapes_fit(Format format, const torch::Tensor& codes, const torch::Tensor& scales,
                int64_t N, int64_t K);
int64_t mixed_split(Format format, const torch::Tensor& codes, int64_t N, int64_t K);

// x [rows, K] bf16 quantized per super-block on the caller and up to `threads - 1` helpers.
XSuper quantize_x(const uint16_t* x, int64_t rows, int64_t K, int64_t threads,
                  bool compute_bound);

// A K-quant weight as a call sees it: Q6_K rows from `split` on (kMixed; N for Q4_K alone, 0
// for Q6_K alone).
struct Weight {
  Format format;
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t K;
  int64_t split;
};

// The sums of weight rows [n0, n0 + width) with every row of xq into sums [rows, width].
void sum_range(const Weight& w, const XSuper& xq, int64_t n0, int64_t width, float* sums);
// Q4_K's and Q6_K's: `scales_per_row` fp16 scales a row, sums rows `ld` apart.
void sum_range_q4k(const uint8_t* codes, const uint16_t* d_dmin, int64_t scales_per_row,
                   const XSuper& xq, int64_t n0, int64_t width, float* sums, int64_t ld);
void sum_range_q6k(const uint8_t* codes, const uint16_t* d, int64_t scales_per_row,
                   const XSuper& xq, int64_t n0, int64_t width, float* sums, int64_t ld);

// Bytes of a weight row of K columns (codes, sub-scales and mins, the super-blocks' scales; a
// mixed weight's by its Q6_K rows, the larger).
inline int64_t row_bytes(Format format, int64_t K) {
  return format == kQ4K ? K / kSuper * (kQ4KGroupBytes / kGroupRows + 4)
                        : K / kSuper * (kQ6KGroupBytes / kGroupRows + 2);
}

}  // namespace prefixserve::kquant
