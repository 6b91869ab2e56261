// GGUF Q4_K weights in super-blocks (linear_q4k.cpp): the sums of a linear_int8 call whose
// weight is Q4_K, which linear_int8.cpp's chunks and epilogues then take as any other sums.
#pragma once

#include <cstdint>
#include <vector>

#include "torch_lite.h"

namespace prefixserve::q4k {

// Columns of a super-block, and the bytes of one super-block of a packed group of four rows:
// four rows' 128 bytes of codes, then their eight 6-bit sub-scales, then their eight sub-mins.
constexpr int64_t kSuper = 256;
constexpr int64_t kGroupRows = 4;
constexpr int64_t kGroupBytes = kGroupRows * 128 + 2 * kGroupRows * 8;

// Rows of x quantized per super-block: codes [rows, K] (each super-block's 256 in the order the
// weight's nibbles come in, `x_column`), the scale of each super-block [blocks, rows] and the sum
// of each sub-block's 32 codes [rows, blocks, 8].
struct XSuper {
  int64_t rows = 0;
  int64_t blocks = 0;
  std::vector<int8_t> codes;
  std::vector<float> scale;
  std::vector<int16_t> sums;
};

// Whether codes and scales are the super-block layout (`linear_int8`'s doc), for x of K columns.
bool is_layout(const torch::Tensor& codes, const torch::Tensor& scales);
// Whether that layout's shapes fit N rows of K columns; false for anything else.
bool shapes_fit(const torch::Tensor& codes, const torch::Tensor& scales, int64_t N, int64_t K);

// x [rows, K] bf16 quantized per super-block on the caller and up to `threads - 1` helpers.
XSuper quantize_x(const uint16_t* x, int64_t rows, int64_t K, int64_t threads,
                  bool compute_bound);

// The sums of weight rows [n0, n0 + width) with every row of xq into sums [rows, width]: codes
// the packed groups ([ceil(N / 4), K / 256, kGroupBytes]), d_dmin each row's super-blocks' fp16
// d and dmin ([N, 2 K / 256]).
void sum_range(const uint8_t* codes, const uint16_t* d_dmin, int64_t K, const XSuper& xq,
               int64_t n0, int64_t width, float* sums);

// Bytes of a weight row (codes, sub-scales and mins, d and dmin) of K columns.
inline int64_t row_bytes(int64_t K) { return K / kSuper * (kGroupBytes / kGroupRows + 4); }

}  // namespace prefixserve::q4k
