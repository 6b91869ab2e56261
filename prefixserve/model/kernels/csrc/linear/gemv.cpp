// A bf16 linear for decode-sized batches: out[m, n] = bf16(sum_k x[m, k] * w[n, k] + bias[n]),
// with x [rows, K], w [N, K] (nn.Linear's layout, not packed) and fp32 accumulation.
//
// At a few rows a linear is a stream over its weight: the time is the weight's bytes over memory
// bandwidth, plus whatever a library call costs around it. For up to four x rows this loop reads
// the weight as one sequential stream; larger batches take register tiles of four weight rows by
// four x rows (the weight rows of a chunk stay in L2 between groups of x rows). It needs no
// packed layout and no parallel region when it runs on one thread. With AVX512-BF16 the products are VDPBF16PS (bf16 pairs into fp32 lanes, as oneDNN's
// bf16 GEMM computes them); elsewhere a portable loop converts bf16 to fp32 by a shift and the
// compiler vectorizes it (-O3 -march=native).
#include "torch_lite.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <cstdint>
#include <cstring>

#include "bf16_bits.h"
#include "kernels.h"
#include "stream_pool.h"

namespace {

// Batch rows sharing one pass over a weight row.
constexpr int64_t kRowGroup = 4;
// How far ahead of the row being read the weight is prefetched (elements: 4 KB). One core
// streams from memory only as fast as the loads it has in flight: one sequential stream with
// this prefetch read the default model's linears at 37 GB/s, against 25 without it and 27 for
// four interleaved rows.
constexpr int64_t kPrefetchAhead = 2048;

using prefixserve::bf16_bits_to_float;

#if defined(__AVX512BF16__)
// The lane sums of four vectors, [sum(a), sum(b), sum(c), sum(d)]: one transpose-and-add tree
// instead of four separate reductions (which would dominate a stream of short dot products).
inline __m128 sum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3], and the same of c, d
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // per 128-bit lane: [a, b, c, d] partial sums
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(
                                        _mm512_castps_pd(abcd), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}
#endif

// Every output out[m, n] is summed in one order, whatever the batch: one 16-lane fp32
// accumulator over K, 32 elements (16 bf16 pairs) at a time, the last 32 masked, then the 16
// lanes reduced by sum4's tree. So a row's result does not depend on how many rows share the
// call, on which group of rows it falls in, nor on the register tile that computed it: the
// kernel is batch-invariant by itself (tests/model/test_batch_invariance.py). (The engine's
// batch-invariant mode still takes oneDNN's GEMM at every row count: this kernel is not yet as
// fast for large batches.)
#if defined(__AVX512BF16__)
inline __m512bh load_bh(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load_bh(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}
#endif

// Dot products of NW weight rows (K elements apart) with NX x rows (K apart), into
// sums[i * kRowGroup + j] for weight row i and x row j: a register tile of NW x NX
// accumulators (16 at most), each weight vector loaded once for the NX rows.
template <int NW, int NX>
inline void dot_block(const uint16_t* w, const uint16_t* x, int64_t K, float* sums) {
#if defined(__AVX512BF16__)
  __m512 acc[NW][NX];
  for (int i = 0; i < NW; ++i)
    for (int j = 0; j < NX; ++j) acc[i][j] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[NW];
    for (int i = 0; i < NW; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(w + i * K + k + kPrefetchAhead), _MM_HINT_T0);
      wv[i] = load_bh(w + i * K + k);
    }
    for (int j = 0; j < NX; ++j) {
      const __m512bh xv = load_bh(x + j * K + k);
      for (int i = 0; i < NW; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], wv[i], xv);
    }
  }
  if (k < K) {
    const __mmask32 mask = (__mmask32(1) << (K - k)) - 1;
    for (int j = 0; j < NX; ++j) {
      const __m512bh xv = load_bh(x + j * K + k, mask);
      for (int i = 0; i < NW; ++i)
        acc[i][j] = _mm512_dpbf16_ps(acc[i][j], load_bh(w + i * K + k, mask), xv);
    }
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int i = 0; i < NW; ++i) {
    float four[4];
    _mm_storeu_ps(four, sum4(acc[i][0], NX > 1 ? acc[i][NX > 1 ? 1 : 0] : zero,
                             NX > 2 ? acc[i][NX > 2 ? 2 : 0] : zero,
                             NX > 3 ? acc[i][NX > 3 ? 3 : 0] : zero));
    for (int j = 0; j < NX; ++j) sums[i * kRowGroup + j] = four[j];
  }
#else
  // Portable: each output's own 16 partial sums, then their sum in index order.
  for (int i = 0; i < NW; ++i) {
    const uint16_t* wr = w + i * K;
    for (int j = 0; j < NX; ++j) {
      const uint16_t* xr = x + j * K;
      float part[16] = {0.0f};
      int64_t k = 0;
      for (; k + 16 <= K; k += 16) {
        for (int t = 0; t < 16; ++t)
          part[t] += bf16_bits_to_float(wr[k + t]) * bf16_bits_to_float(xr[k + t]);
      }
      float sum = 0.0f;
      for (int t = 0; t < 16; ++t) sum += part[t];
      for (; k < K; ++k) sum += bf16_bits_to_float(wr[k]) * bf16_bits_to_float(xr[k]);
      sums[i * kRowGroup + j] = sum;
    }
  }
#endif
}

template <int NW>
inline void dot(const uint16_t* w, const uint16_t* x, int64_t K, int64_t nx, float* sums) {
  switch (nx) {
    case 1: dot_block<NW, 1>(w, x, K, sums); break;
    case 2: dot_block<NW, 2>(w, x, K, sums); break;
    case 3: dot_block<NW, 3>(w, x, K, sums); break;
    default: dot_block<NW, 4>(w, x, K, sums); break;
  }
}

// Weight rows per register tile.
constexpr int64_t kWeightGroup = 4;

inline void dot_rows(const uint16_t* w, const uint16_t* x, int64_t K, int64_t nw, int64_t nx,
                     float* sums) {
  switch (nw) {
    case 1: dot<1>(w, x, K, nx, sums); break;
    case 2: dot<2>(w, x, K, nx, sums); break;
    case 3: dot<3>(w, x, K, nx, sums); break;
    default: dot<4>(w, x, K, nx, sums); break;
  }
}

}  // namespace

// out [rows, N] = x [rows, K] @ w[N, K]^T (+ bias [N]), all bf16 and contiguous, accumulated in
// fp32 and rounded once (into an fp32 out, not rounded: the LM head's logits). Work is split over chunks of ~64 KB of weight rows, run by the caller
// and up to `threads - 1` helpers of the stream pool (stream_pool.h); within a chunk, groups of
// four x rows against four weight rows at a time.
void linear_bf16_small(torch::Tensor out, torch::Tensor x, torch::Tensor w,
                       c10::optional<torch::Tensor> bias, int64_t threads) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && out.device().is_cpu(),
              "linear_bf16_small runs on CPU tensors only");
  const bool out_f32 = out.scalar_type() == torch::kFloat;
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16 &&
                  (out.scalar_type() == torch::kBFloat16 || out_f32),
              "linear_bf16_small needs bfloat16 x and weight, and a bfloat16 (or float32) out");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2 && x.is_contiguous() &&
                  w.is_contiguous() && out.is_contiguous(),
              "linear_bf16_small needs contiguous 2-D x, weight and out");
  const int64_t rows = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && out.size(0) == rows && out.size(1) == N,
              "linear_bf16_small: shapes x [rows, K], weight [N, K], out [rows, N]");
  const uint16_t* bias_ptr = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->size(0) == N,
                "linear_bf16_small: bias must be a contiguous bfloat16 [N]");
    bias_ptr = reinterpret_cast<const uint16_t*>(bias->data_ptr<c10::BFloat16>());
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>());
  auto* op = out_f32 ? nullptr : out.data_ptr<c10::BFloat16>();
  float* opf = out_f32 ? out.data_ptr<float>() : nullptr;
  const int64_t chunk_rows = std::max<int64_t>(16, (32 * 1024) / std::max<int64_t>(1, K));
  const int64_t chunks = (N + chunk_rows - 1) / chunk_rows;
  prefixserve::stream_pool().run(chunks, threads, [&](int64_t chunk) {
    const int64_t begin = chunk * chunk_rows, end = std::min(N, begin + chunk_rows);
    float sums[kWeightGroup * kRowGroup];
    // Four x rows stay in L1 while the chunk's weight rows (~64 KB, in L2 after the first
    // group) pass them four at a time.
    // A decode-sized batch reads one weight row at a time (one sequential stream: the fastest
    // read, above); larger ones take tiles of four, which reuse each loaded x vector.
    const int64_t group = rows <= kRowGroup ? 1 : kWeightGroup;
    for (int64_t m0 = 0; m0 < rows; m0 += kRowGroup) {
      const int64_t nx = std::min(kRowGroup, rows - m0);
      for (int64_t n = begin; n < end; n += group) {
        const int64_t nw = std::min(group, end - n);
        dot_rows(wp + n * K, xp + m0 * K, K, nw, nx, sums);
        for (int64_t i = 0; i < nw; ++i) {
          const float add = bias_ptr ? bf16_bits_to_float(bias_ptr[n + i]) : 0.0f;
          for (int64_t j = 0; j < nx; ++j) {
            const float y = sums[i * kRowGroup + j] + add;
            if (opf) {
              opf[(m0 + j) * N + n + i] = y;
            } else {
              op[(m0 + j) * N + n + i] = c10::BFloat16(y);
            }
          }
        }
      }
    }
  });
}

// Times the stream pool has run jobs on the caller alone because its helpers got no core.
int64_t stream_pool_backoffs() { return prefixserve::stream_pool().backoffs(); }
