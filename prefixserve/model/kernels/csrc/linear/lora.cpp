// One adapter's LoRA update of one linear for a few rows of a bf16 step, in one call
// (lora/layers.py):
//
//   lora_add(out, x, a, blocks, meta, rows):
//     h[i, :] = x[rows[i], :] @ a.T                                        (fp32 sums)
//     out[rows[i], c0 + c] = bf16(out[rows[i], c0 + c] + sum_r h[i, h0 + r] * B_s[c, r])
//                                                       for each slice s = (c0, h0, width, at)
//
// Why native: oneDNN's bf16 matmul costs 15-23 us a call at these shapes whatever the rows,
// every PyTorch op of a multi-row step may wake OpenMP's sleeping threads, and the streaming
// linear (gemv.cpp) reduces each output horizontally, which is slow when the rank is the row
// length; one call per (adapter, linear) also keeps Python's share small (a step of 16 rows over
// 4 adapters makes 480 of them).
//
// x, a, out, blocks are bfloat16. a: [R, K], the slices' A stacked. blocks: every slice's B
// (so a fused linear's slices skip each other's zero blocks) laid out in blocks of 64 output
// columns, [ceil(width / 64), r, 64] with block[b, r, j] = B_s[64 b + j, r] (zero past width),
// slices one after the other: the kernel reads a and blocks front to back with a software
// prefetch, as memory streams (read [r, width] row by row, each 64 columns touched r rows far
// apart, and 4 adapters x 4 rows took 4x the time of 1 adapter x 16 rows). meta: int64 [S, 4]
// = (first output column, first column of h, width, element offset in blocks) per slice.
// rows: int64 [n], row indices into x and out. Rows are taken 4 at a time, so each weight
// vector loaded serves 4 rows; out is rounded once, to nearest even, as c10::BFloat16 does.
// One thread: an (adapter, linear) pair is a few microseconds of work, and helper threads
// would compete with OpenMP's for the cores.

#include "torch_lite.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_bits.h"
#include "kernels.h"

namespace {

// Elements (bf16) read ahead of use: the weights stream from memory once per step, and without
// it a single thread reads them latency-bound (gemv.cpp does the same).
constexpr int64_t kPrefetchAhead = 1024;

using prefixserve::bf16_bits_to_float;

#if defined(__AVX512BF16__)
inline __m512 widen(__m256i bf16) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16), 16));
}
#endif

// h[i * R + r] = x[rows[i]] . a[r] for the n rows.
void shrink(float* hp, const uint16_t* xp, const uint16_t* ap, const int64_t* rp, int64_t n,
            int64_t R, int64_t K) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  for (; i < n; i += 4) {
    const int64_t nr = std::min<int64_t>(4, n - i);
    const uint16_t* xr[4];
    for (int j = 0; j < 4; ++j) xr[j] = xp + rp[i + std::min<int64_t>(j, nr - 1)] * K;
    for (int64_t r = 0; r < R; ++r) {
      const uint16_t* w = ap + r * K;
      __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                       _mm512_setzero_ps()};
      for (int64_t k = 0; k < K; k += 32) {
        const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
        _mm_prefetch(reinterpret_cast<const char*>(w + k + kPrefetchAhead), _MM_HINT_T0);
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
        for (int j = 0; j < 4; ++j)
          acc[j] = _mm512_dpbf16_ps(acc[j], wv,
                                    (__m512bh)_mm512_maskz_loadu_epi16(mask, xr[j] + k));
      }
      for (int64_t j = 0; j < nr; ++j) hp[(i + j) * R + r] = _mm512_reduce_add_ps(acc[j]);
    }
  }
#else
  for (; i < n; ++i) {
    const uint16_t* xr = xp + rp[i] * K;
    for (int64_t r = 0; r < R; ++r) {
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k)
        sum += bf16_bits_to_float(xr[k]) * bf16_bits_to_float(ap[r * K + k]);
      hp[i * R + r] = sum;
    }
  }
#endif
}

// out[rows[i], c0 + c] += sum_r h[i, h0 + r] * B[c, r] for one slice (blocked B, see above).
void expand_add(uint16_t* op, int64_t W, const float* hp, int64_t H, const uint16_t* bp,
                const int64_t* rp, int64_t n, int64_t R, int64_t N, int64_t c_first,
                int64_t h_first) {
  hp += h_first;
  for (int64_t i0 = 0; i0 < n; i0 += 4) {
    const int64_t nr = std::min<int64_t>(4, n - i0);
#if defined(__AVX512BF16__)
    // 4 rows x 4 column vectors of accumulators: 16 independent FMA chains per r.
    for (int64_t c0 = 0; c0 < N; c0 += 64) {
      __mmask16 masks[4];
      for (int v = 0; v < 4; ++v) {
        const int64_t left = N - (c0 + 16 * v);
        masks[v] = left >= 16 ? __mmask16(0xFFFF)
                   : left <= 0 ? __mmask16(0)
                               : static_cast<__mmask16>((1u << left) - 1);
      }
      __m512 acc[4][4];
      for (int j = 0; j < 4; ++j)
        for (int v = 0; v < 4; ++v) acc[j][v] = _mm512_setzero_ps();
      for (int64_t r = 0; r < R; ++r) {
        const uint16_t* brow = bp + ((c0 / 64) * R + r) * 64;
        _mm_prefetch(reinterpret_cast<const char*>(brow + kPrefetchAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(brow + kPrefetchAhead + 32), _MM_HINT_T0);
        __m512 b[4];
        for (int v = 0; v < 4; ++v)
          b[v] = widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(brow + 16 * v)));
        for (int64_t j = 0; j < nr; ++j) {
          const __m512 hv = _mm512_set1_ps(hp[(i0 + j) * H + r]);
          for (int v = 0; v < 4; ++v) acc[j][v] = _mm512_fmadd_ps(hv, b[v], acc[j][v]);
        }
      }
      for (int64_t j = 0; j < nr; ++j) {
        uint16_t* orow = op + rp[i0 + j] * W + c_first + c0;
        for (int v = 0; v < 4 && masks[v]; ++v) {
          const __m512 o = widen(_mm256_maskz_loadu_epi16(masks[v], orow + 16 * v));
          const __m256i sum = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(o, acc[j][v]));
          _mm256_mask_storeu_epi16(orow + 16 * v, masks[v], sum);
        }
      }
    }
#else
    for (int64_t j = 0; j < nr; ++j) {
      uint16_t* orow = op + rp[i0 + j] * W + c_first;
      const float* hrow = hp + (i0 + j) * H;
      for (int64_t c = 0; c < N; ++c) {
        float acc = 0.0f;
        for (int64_t r = 0; r < R; ++r)
          acc += hrow[r] * bf16_bits_to_float(bp[((c / 64) * R + r) * 64 + c % 64]);
        const c10::BFloat16 sum(bf16_bits_to_float(orow[c]) + acc);
        std::memcpy(orow + c, &sum, sizeof(uint16_t));
      }
    }
#endif
  }
}

}  // namespace

void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor blocks,
              torch::Tensor meta, torch::Tensor rows) {
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && x.scalar_type() == torch::kBFloat16 &&
                  a.scalar_type() == torch::kBFloat16 && blocks.scalar_type() == torch::kBFloat16,
              "lora_add: bfloat16 out, x, a and blocks");
  TORCH_CHECK(out.dim() == 2 && x.dim() == 2 && a.dim() == 2 && blocks.dim() == 1 &&
                  out.is_contiguous() && x.is_contiguous() && a.is_contiguous() &&
                  blocks.is_contiguous(),
              "lora_add: contiguous out [T, W], x [T, K], a [R, K], blocks [*]");
  TORCH_CHECK(meta.scalar_type() == torch::kLong && meta.dim() == 2 && meta.size(1) == 4 &&
                  meta.is_contiguous(),
              "lora_add: meta int64 [S, 4]");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "lora_add: rows int64 [n]");
  const int64_t n = rows.size(0), R = a.size(0), K = a.size(1), W = out.size(1), T = x.size(0);
  TORCH_CHECK(x.size(1) == K && out.size(0) == T, "lora_add: x [T, K], out [T, W], a [R, K]");
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < T, "lora_add: row out of range");
  const int64_t S = meta.size(0), total = blocks.size(0);
  const int64_t* mp = meta.data_ptr<int64_t>();
  // A slice's rank: up to the next slice's first column of h (slices in h's column order).
  auto rank_of = [&](int64_t s) { return (s + 1 < S ? mp[4 * s + 5] : R) - mp[4 * s + 1]; };
  for (int64_t s = 0; s < S; ++s) {
    const int64_t c_first = mp[4 * s], h_first = mp[4 * s + 1], width = mp[4 * s + 2],
                  offset = mp[4 * s + 3];
    TORCH_CHECK(c_first >= 0 && width > 0 && c_first + width <= W && h_first >= 0 &&
                    h_first < R && offset >= 0,
                "lora_add: slice ", s, " out of bounds");
    const int64_t rank = rank_of(s);
    TORCH_CHECK(rank > 0 && offset + (width + 63) / 64 * 64 * rank <= total,
                "lora_add: slice ", s, " past the end of blocks");
  }
  thread_local std::vector<float> h;
  h.resize(static_cast<size_t>(n * R));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* ap = reinterpret_cast<const uint16_t*>(a.data_ptr<c10::BFloat16>());
  const auto* bp = reinterpret_cast<const uint16_t*>(blocks.data_ptr<c10::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  shrink(h.data(), xp, ap, rp, n, R, K);
  for (int64_t s = 0; s < S; ++s) {
    expand_add(op, W, h.data(), R, bp + mp[4 * s + 3], rp, n, rank_of(s), mp[4 * s + 2],
               mp[4 * s], mp[4 * s + 1]);
  }
}
