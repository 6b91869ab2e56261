// One bf16 linear for every row count, with one summation order: out[m, n] =
// bf16(sum_k x[m, k] * w[n, k] + bias[n]), each output accumulated in one fp32 lane by fused
// multiply-adds in the order k = 0, 1, ..., K - 1, whatever the number of rows, the register
// tile or the thread that computes it. So a row's result is the same alone, in a decode batch, in
// a speculative verification or in a prefill chunk: the engine's batch-invariant mode takes this
// kernel at every row count (tests/model/test_batch_invariance.py).
//
// Why fp32 multiply-adds on bf16 weights: on Intel Xeons without AMX (the CPU table's
// avx512_bf16_intel row) a VDPBF16PS retires at about a quarter of the rate of an fp32 FMA while
// doing twice its products, so the fp32 path has twice the arithmetic (measured on this kind:
// 60-66 against 118-136 GFLOP/s a core). The weight stays bf16 in memory (half the bytes of an
// fp32 copy, which decode streams) and is widened in registers by a shift or a mask: a bf16 is
// the upper half of a float.
//
// Layout (`pack_bf16_gemm`): the weight [N, K] is cut into panels of 32 output columns; a panel
// holds, for each pair of k, the 32 columns' two bf16 side by side: [N/32][K/2][32][2], zero
// padded to whole panels and an even K. One 64-byte load is 16 columns at k and k + 1: the
// shift gives the 16 floats of k, the mask those of k + 1.
//
// Gated MLPs (`linear_bf16_packed_gated`): gate_up's weight [2I, K] packed as is; a tile takes
// the gate panel j and the up panel j + I/32 together (two panels I/32 panels apart instead of
// side by side), so each output's sums are the plain GEMM's, and its epilogue writes
// bf16(act(bf16(gate)) * bf16(up)) -- the roundings of the unfused bf16 ops -- for 32 columns of
// [rows, I]: the [rows, 2I] intermediate and two elementwise passes over it are never made.
//
// Register tiles: MR rows x NP panels, MR * NP * 2 accumulators (at most 24). A decode-sized
// batch takes several panels at once (enough independent chains to stream the weight at memory
// speed); a prefill-sized one takes 12 rows on one panel (the panel stays in L1/L2 while row
// blocks pass it). Neither changes any output's order of summation.
#include <torch/extension.h>

// The vector tiles need AVX512F and, for the masked 16-bit stores of the epilogue, BW and VL.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PREFIXSERVE_GEMM_AVX512 1
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bf16_bits.h"
#include "kernels.h"
#include "exp_avx512.h"
#include "stream_pool.h"

namespace {

constexpr int64_t kPanel = 32;     // output columns per panel
constexpr int64_t kMaxTileRows = 12;  // rows of the largest register tile
// Bytes of weight a job of the stream pool covers at least (whole panels): large enough that
// the pool's per-job cost is small, small enough that two threads share a linear evenly.
constexpr int64_t kJobBytes = 48 * 1024;
// Batches of more rows than this are arithmetic-bound (decode-sized ones stream the weight): the
// stream pool keeps its helpers for them however often they stall (stream_pool.h).
constexpr int64_t kComputeBoundRows = 24;
// Arithmetic a job of a large batch covers at most (~50-100 us on one core).
constexpr int64_t kJobFlops = 6 * 1000 * 1000;

using prefixserve::bf16_bits_to_float;

// The activations of the gated epilogue (the values the Python side passes).
enum Act : int64_t { kNone = 0, kSilu = 1, kGeluTanh = 2 };

// Where a tile's results go: rows of `out` (ldo apart) from column n0, `cols` of them valid
// (the rest of the last panel is padding), `bias` from n0 or null. A gated tile (act != kNone):
// two panels, gate then up, `bias_up` the up half's bias, `cols` 32 outputs. `res`: rows of a
// residual (ldo apart, from n0) added to the rounded output, or null.
struct TileOut {
  uint16_t* out;
  int64_t ldo;
  int64_t cols;
  const float* bias;
  int64_t act = kNone;
  const float* bias_up = nullptr;
  const uint16_t* res = nullptr;
};

inline uint16_t float_to_bf16_bits(float f) {
  // Round to nearest even, as c10::BFloat16 and torch's .to(torch.bfloat16) do.
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// A tile's fp32 sums (`rows` rows, `lds` apart) to its outputs: + bias, rounded to bf16, + the
// residual and rounded again where there is one (the AVX-512 epilogue's roundings, in scalar
// code: the portable and the AVX2 tiles).
inline void store_sums(const float* sums, int64_t lds, int rows, const TileOut& out) {
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < out.cols; ++c) {
      uint16_t y = float_to_bf16_bits(sums[r * lds + c] + (out.bias ? out.bias[c] : 0.0f));
      if (out.res) {
        y = float_to_bf16_bits(bf16_bits_to_float(y) +
                               bf16_bits_to_float(out.res[r * out.ldo + c]));
      }
      out.out[r * out.ldo + c] = y;
    }
}

#if defined(PREFIXSERVE_GEMM_AVX512)
// 16 sums (+ bias) rounded to bf16 as c10::BFloat16 rounds (to nearest even, NaN kept quiet)
// and stored, the first `valid` of them.
inline void store_bf16(uint16_t* dst, __m512 sum, const float* bias, int64_t valid) {
  const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
  if (bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias));
  const __m512i bits = _mm512_castps_si512(sum);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  rounded = _mm512_srli_epi32(rounded, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(sum, sum, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_mask_storeu_epi16(dst, mask, _mm512_cvtepi32_epi16(rounded));
}

// v rounded to bf16 (as store_bf16 rounds), as floats.
inline __m512 round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_ps(_mm512_castsi512_ps(r), nan, v);
}

// silu(g) = g / (1 + exp(-g)), with exp of -|g| only (no overflow): g * s / (1 + e), s = 1 for
// g >= 0 and e otherwise, e = exp(-|g|).
inline __m512 silu16(__m512 g) {
  const __m512 e = prefixserve::exp_nonpositive16(
      _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 num = _mm512_mask_mul_ps(g, neg, g, e);
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// gelu with the tanh approximation, 0.5 g (1 + tanh(y)) with y = sqrt(2/pi) (g + 0.044715 g^3),
// is g * sigmoid(2y): the same form as silu16 with e = exp(-2|y|), which avoids the cancellation
// of 1 + tanh(y) for negative y.
inline __m512 gelu_tanh16(__m512 g) {
  const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 y = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f),
                                 _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
  const __m512 e = prefixserve::exp_nonpositive16(
      _mm512_mul_ps(_mm512_set1_ps(-2.0f), _mm512_abs_ps(y)));
  const __mmask16 neg = _mm512_cmp_ps_mask(y, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 num = _mm512_mask_mul_ps(g, neg, g, e);
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

// bf16(bf16(sum + bias) + residual) for the first `valid` of 16 columns: a linear's output and
// the residual add after it (x + o_proj(...), x + down_proj(...)), rounded as the two bf16 ops.
inline void store_residual(uint16_t* dst, __m512 sum, const float* bias, const uint16_t* res,
                           int64_t valid) {
  const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
  if (bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias));
  const __m512 r = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, res)), 16));
  store_bf16(dst, _mm512_add_ps(round_bf16(sum), r), nullptr, valid);
}

// bf16(act(bf16(gate + bias)) * bf16(up + bias_up)) for 16 columns, each step rounded as the
// unfused bf16 ops round it.
inline void store_gated(uint16_t* dst, __m512 gate, __m512 up, const float* bias,
                        const float* bias_up, int64_t act) {
  if (bias) gate = _mm512_add_ps(gate, _mm512_loadu_ps(bias));
  if (bias_up) up = _mm512_add_ps(up, _mm512_loadu_ps(bias_up));
  gate = round_bf16(gate);
  const __m512 a = round_bf16(act == kSilu ? silu16(gate) : gelu_tanh16(gate));
  store_bf16(dst, _mm512_mul_ps(a, round_bf16(up)), nullptr, 16);
}

template <int MR, int NP>
inline void tile_kernel(const float* x, int64_t ldx, const uint16_t* panel, int64_t panel_stride,
                        int64_t pairs, const TileOut& out) {
  __m512 acc[MR][NP * 2];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP * 2; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    for (int j = 0; j < NP; ++j) {
      const uint16_t* w = panel + j * panel_stride + p * (2 * kPanel);
      if (MR <= 4) _mm_prefetch(reinterpret_cast<const char*>(w + 16 * 2 * kPanel), _MM_HINT_T0);
      // The four weight vectors of this panel and pair first, then each row's two broadcasts
      // against them (30 registers at 12 rows: no spills).
      const __m512i pair0 = _mm512_loadu_si512(w), pair1 = _mm512_loadu_si512(w + kPanel);
      const __m512 even0 = _mm512_castsi512_ps(_mm512_slli_epi32(pair0, 16));
      const __m512 even1 = _mm512_castsi512_ps(_mm512_slli_epi32(pair1, 16));
      const __m512 odd0 = _mm512_castsi512_ps(_mm512_and_si512(pair0, high));
      const __m512 odd1 = _mm512_castsi512_ps(_mm512_and_si512(pair1, high));
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * ldx + 2 * p;
        const __m512 xe = _mm512_set1_ps(xr[0]);
        acc[r][2 * j] = _mm512_fmadd_ps(xe, even0, acc[r][2 * j]);
        acc[r][2 * j + 1] = _mm512_fmadd_ps(xe, even1, acc[r][2 * j + 1]);
        const __m512 xo = _mm512_set1_ps(xr[1]);
        acc[r][2 * j] = _mm512_fmadd_ps(xo, odd0, acc[r][2 * j]);
        acc[r][2 * j + 1] = _mm512_fmadd_ps(xo, odd1, acc[r][2 * j + 1]);
      }
    }
  }
  if (NP == 2 && out.act != kNone) {
    for (int r = 0; r < MR; ++r)
      for (int h = 0; h < 2; ++h)
        store_gated(out.out + r * out.ldo + h * 16, acc[r][h], acc[r][NP + h],
                    out.bias ? out.bias + h * 16 : nullptr,
                    out.bias_up ? out.bias_up + h * 16 : nullptr, out.act);
    return;
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP * 2; ++j) {
      if (j * 16 >= out.cols) break;
      const float* bias = out.bias ? out.bias + j * 16 : nullptr;
      uint16_t* dst = out.out + r * out.ldo + j * 16;
      if (out.res) {
        store_residual(dst, acc[r][j], bias, out.res + r * out.ldo + j * 16, out.cols - j * 16);
      } else {
        store_bf16(dst, acc[r][j], bias, out.cols - j * 16);
      }
    }
}
#else
// Portable: the same order (one fused multiply-add per k, k ascending) in scalar code.
template <int MR, int NP>
inline void tile_kernel(const float* x, int64_t ldx, const uint16_t* panel, int64_t panel_stride,
                        int64_t pairs, const TileOut& out) {
  float sums[MR][NP * kPanel] = {};
  for (int64_t p = 0; p < pairs; ++p)
    for (int j = 0; j < NP; ++j) {
      const uint16_t* w = panel + j * panel_stride + p * (2 * kPanel);
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * ldx + 2 * p;
        float* o = sums[r] + j * kPanel;
        for (int c = 0; c < kPanel; ++c) {
          o[c] = std::fma(xr[0], bf16_bits_to_float(w[2 * c]), o[c]);
          o[c] = std::fma(xr[1], bf16_bits_to_float(w[2 * c + 1]), o[c]);
        }
      }
    }
  store_sums(&sums[0][0], NP * kPanel, MR, out);
}
#endif

#if defined(__x86_64__) && defined(__GNUC__)
// AVX2 tiles, for CPUs without AVX-512 (the CPU table's AVX2-only row): 8 columns a vector,
// fp32 FMAs over k ascending, so each output's sum is the AVX-512 tile's, bit for bit; the
// epilogue is store_sums. Compiled into every x86-64 build (a target attribute), so AVX-512 hosts
// can check the two agree (`linear_bf16_packed_avx2`); chosen at run time where the CPU has AVX2
// and FMA and the build has no AVX-512 tiles. No gated epilogue: a gated MLP's activation then
// runs in PyTorch after the plain linear (Linear.gated).
#define PREFIXSERVE_GEMM_AVX2 1
#define PREFIXSERVE_TARGET_AVX2 __attribute__((target("avx2,fma")))

namespace avx2 {

template <int MR, int NP>
PREFIXSERVE_TARGET_AVX2 void tile_kernel(const float* x, int64_t ldx, const uint16_t* panel,
                                         int64_t panel_stride, int64_t pairs,
                                         const TileOut& out) {
  constexpr int V = kPanel / 8;  // vectors of 8 columns a panel
  __m256 acc[MR][NP * V];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP * V; ++j) acc[r][j] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t p = 0; p < pairs; ++p) {
    for (int j = 0; j < NP; ++j) {
      const uint16_t* w = panel + j * panel_stride + p * (2 * kPanel);
      for (int v = 0; v < V; ++v) {
        // Eight columns' (k, k + 1) pairs: the shift gives k's floats, the mask k + 1's.
        const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * v));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + r * ldx + 2 * p;
          __m256& a = acc[r][j * V + v];
          a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), even, a);
          a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), odd, a);
        }
      }
    }
  }
  float sums[MR][NP * kPanel];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP * V; ++j) _mm256_storeu_ps(sums[r] + 8 * j, acc[r][j]);
  store_sums(&sums[0][0], NP * kPanel, MR, out);
}

// The AVX2 tile family (run_block's T).
struct Tiles {
  static constexpr int64_t kMaxRows = 2;
  // One row takes two panels, two rows one: 8 chains, and with the rows' broadcasts and a
  // weight vector's two halves 15 of the 16 vector registers.
  static constexpr int panels_for(int rows) { return rows == 1 ? 2 : 1; }
  template <int MR, int NP>
  PREFIXSERVE_TARGET_AVX2 static void tile(const float* x, int64_t ldx, const uint16_t* panel,
                                           int64_t panel_stride, int64_t pairs,
                                           const TileOut& out) {
    avx2::tile_kernel<MR, NP>(x, ldx, panel, panel_stride, pairs, out);
  }
};

}  // namespace avx2
#endif

// The build's tile family (AVX-512, else portable): its largest tile height, the panels a tile
// of `rows` rows takes at once (enough chains for small batches, at most 24 accumulators), and
// the tile.
struct BuildTiles {
  static constexpr int64_t kMaxRows = kMaxTileRows;
  static constexpr int panels_for(int rows) { return rows <= 3 ? 4 : (rows <= 6 ? 2 : 1); }
  template <int MR, int NP>
  static void tile(const float* x, int64_t ldx, const uint16_t* panel, int64_t panel_stride,
                   int64_t pairs, const TileOut& out) {
    tile_kernel<MR, NP>(x, ldx, panel, panel_stride, pairs, out);
  }
};

struct Problem {
  const float* x;        // [rows, ldx] fp32, zero past K
  int64_t ldx;
  const uint16_t* w;     // packed
  int64_t pairs;         // K / 2, rounded up
  int64_t rows, N;       // N: out's columns (a gated call's I)
  const float* bias;     // [N] or null (gated: [2I])
  uint16_t* out;         // [rows, N] bf16 bits
  int64_t act = kNone;   // gated: the activation
  const uint16_t* res = nullptr;  // [rows, N] bf16 bits added to the output, or null
};

template <class T, int MR, int NP>
void run_tile(const Problem& pb, int64_t m0, int64_t panel0) {
  const int64_t stride = pb.pairs * 2 * kPanel, n0 = panel0 * kPanel;
  const TileOut out{pb.out + m0 * pb.N + n0,
                    pb.N,
                    std::min(pb.N - n0, NP * kPanel),
                    pb.bias ? pb.bias + n0 : nullptr,
                    kNone,
                    nullptr,
                    pb.res ? pb.res + m0 * pb.N + n0 : nullptr};
  T::template tile<MR, NP>(pb.x + m0 * pb.ldx, pb.ldx, pb.w + panel0 * stride, stride,
                           pb.pairs, out);
}

template <class T, int MR>
void run_rows(const Problem& pb, int64_t m0, int64_t panel0, int64_t panel1) {
  constexpr int NP = T::panels_for(MR);
  int64_t j = panel0;
  for (; j + NP <= panel1; j += NP) run_tile<T, MR, NP>(pb, m0, j);
  for (; j < panel1; ++j) run_tile<T, MR, 1>(pb, m0, j);
}

// Rows [m0, m0 + mr) (mr <= T::kMaxRows) over panels [panel0, panel1), on T's tile of mr rows.
template <class T, int MR = 1>
void run_block(const Problem& pb, int64_t m0, int64_t mr, int64_t panel0, int64_t panel1) {
  if constexpr (MR < T::kMaxRows) {
    if (mr > MR) {
      run_block<T, MR + 1>(pb, m0, mr, panel0, panel1);
      return;
    }
  }
  run_rows<T, MR>(pb, m0, panel0, panel1);
}

// Rows of the largest gated tile (two panels: 24 accumulators at 6 rows).
constexpr int64_t kMaxGatedRows = 6;

template <int MR>
void run_gated(const Problem& pb, int64_t m0, int64_t panel0, int64_t panel1) {
  const int64_t size = pb.pairs * 2 * kPanel, half = pb.N / kPanel;
  for (int64_t j = panel0; j < panel1; ++j) {
    const int64_t n0 = j * kPanel;
    const TileOut out{pb.out + m0 * pb.N + n0, pb.N, 2 * kPanel,
                      pb.bias ? pb.bias + n0 : nullptr, pb.act,
                      pb.bias ? pb.bias + pb.N + n0 : nullptr};
    tile_kernel<MR, 2>(pb.x + m0 * pb.ldx, pb.ldx, pb.w + j * size, half * size, pb.pairs, out);
  }
}

void run_gated_block(const Problem& pb, int64_t m0, int64_t mr, int64_t panel0, int64_t panel1) {
  switch (mr) {
    case 1: run_gated<1>(pb, m0, panel0, panel1); break;
    case 2: run_gated<2>(pb, m0, panel0, panel1); break;
    case 3: run_gated<3>(pb, m0, panel0, panel1); break;
    case 4: run_gated<4>(pb, m0, panel0, panel1); break;
    case 5: run_gated<5>(pb, m0, panel0, panel1); break;
    default: run_gated<6>(pb, m0, panel0, panel1); break;
  }
}

// Runs block(m0, rows, panel0, panel1) over every tile of `rows` x `panels` on the stream pool.
// Small batches: jobs of ~kJobBytes of weight (`np` panels a tile, `weight_panels` panels of
// weight read per panel index); large ones: one panel index a job, and a range of rows so that a
// job stays well under the pool's stall limit (a helper still on a long job reads as a helper
// without a core). Row ranges outermost: both threads keep the same x rows in cache while they
// sweep the panels.
template <typename Block>
void schedule(int64_t rows, int64_t panels, int64_t pairs, int64_t tile_rows, int64_t np,
              int64_t weight_panels, int64_t threads, const Block& block) {
  const int64_t panel_bytes = weight_panels * pairs * 2 * kPanel * 2;
  int64_t per_job = 1;
  if (rows <= tile_rows) {  // whole tiles of np panels
    per_job = std::max<int64_t>(np, kJobBytes / std::max<int64_t>(1, panel_bytes));
    per_job = (per_job + np - 1) / np * np;
  }
  per_job = std::min(per_job, std::max<int64_t>(1, (panels + threads - 1) / threads));
  const int64_t panel_jobs = (panels + per_job - 1) / per_job;
  const int64_t tile_flops = 2 * tile_rows * per_job * weight_panels * kPanel * 2 * pairs;
  const int64_t row_span = tile_rows * std::max<int64_t>(1, kJobFlops / tile_flops);
  const int64_t row_jobs = (rows + row_span - 1) / row_span;
  prefixserve::stream_pool().run(
      row_jobs * panel_jobs, threads,
      [&](int64_t job) {
        const int64_t p0 = (job % panel_jobs) * per_job, p1 = std::min(panels, p0 + per_job);
        const int64_t r0 = (job / panel_jobs) * row_span, r1 = std::min(rows, r0 + row_span);
        for (int64_t m0 = r0; m0 < r1; m0 += tile_rows)
          block(m0, std::min(tile_rows, r1 - m0), p0, p1);
      },
      /*compute_bound=*/rows > kComputeBoundRows);
}

// The x rows widened to fp32 with K padded to an even length (the pad is 0).
const float* widen_rows(const uint16_t* x, int64_t rows, int64_t K, int64_t ldx) {
  thread_local std::vector<float> scratch;
  if (static_cast<int64_t>(scratch.size()) < rows * ldx) scratch.resize(rows * ldx);
  for (int64_t m = 0; m < rows; ++m) {
    float* dst = scratch.data() + m * ldx;
    for (int64_t k = 0; k < K; ++k) dst[k] = bf16_bits_to_float(x[m * K + k]);
    for (int64_t k = K; k < ldx; ++k) dst[k] = 0.0f;
  }
  return scratch.data();
}

void check_packed(const torch::Tensor& packed, int64_t N, int64_t K) {
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.is_contiguous() &&
                  packed.dim() == 1 && packed.numel() == panels * pairs * 2 * kPanel,
              "linear_bf16_packed: the weight must come from pack_bf16_gemm for [", N, ", ", K,
              "]");
}

}  // namespace

// Whether this build has the AVX-512 tiles (elsewhere the AVX2 tiles or the portable loop
// compute the same sums, more slowly).
bool gemm_bf16_vectorized() {
#if defined(PREFIXSERVE_GEMM_AVX512)
  return true;
#else
  return false;
#endif
}

// The weight [N, K] (bf16) in the panel layout above, as a flat bf16 tensor.
torch::Tensor pack_bf16_gemm(torch::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kBFloat16 && w.dim() == 2,
              "pack_bf16_gemm needs a 2-D bfloat16 CPU weight");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel, pairs = (K + 1) / 2;
  // Zero-pad to whole panels and an even K, then [panel][col][pair][2] -> [panel][pair][col][2]
  // (torch's strided copy: a few hundred ms for Gemma 3's 262,144 x 640 head).
  const auto padded = at::constant_pad_nd(w, {0, 2 * pairs - K, 0, panels * kPanel - N});
  return padded.view({panels, kPanel, pairs, 2}).permute({0, 2, 1, 3}).contiguous().view({-1});
}

namespace {

// The checks and set-up both entry points share: x [rows, K] and bias [N] (N the weight's
// rows) against the packed weight; out [rows, out_cols]. Returns the Problem (x widened, bias
// in fp32 in `bias_fp32`).
Problem prepare(const char* name, torch::Tensor& out, torch::Tensor& x,
                const torch::Tensor& packed, int64_t N, int64_t out_cols,
                const c10::optional<torch::Tensor>& bias, std::vector<float>& bias_fp32) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), name, " runs on CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16, name,
              " needs bfloat16 x and out");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.is_contiguous() && out.is_contiguous(), name,
              " needs contiguous 2-D x and out");
  const int64_t rows = x.size(0), K = x.size(1);
  TORCH_CHECK(out.size(0) == rows && out.size(1) == out_cols, name, ": out must be [rows, ",
              out_cols, "]");
  check_packed(packed, N, K);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->size(0) == N,
                name, ": bias must be a contiguous bfloat16 [", N, "]");
    const auto* b = reinterpret_cast<const uint16_t*>(bias->data_ptr<c10::BFloat16>());
    bias_fp32.resize(N);
    for (int64_t n = 0; n < N; ++n) bias_fp32[n] = bf16_bits_to_float(b[n]);
  }
  const int64_t pairs = (K + 1) / 2, ldx = 2 * pairs;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  return Problem{rows > 0 ? widen_rows(xp, rows, K, ldx) : nullptr,
                 ldx,
                 reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>()),
                 pairs,
                 rows,
                 out_cols,
                 bias_fp32.empty() ? nullptr : bias_fp32.data(),
                 reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>())};
}

// A decode-sized call's epilogue: the stream pool's helpers prefetch the next linear's packed
// weight (`prefetch`) while the caller is back in Python between the two calls, when the memory
// bus would idle (decode at batch 1: 1.04-1.14x in five same-process A/B runs; batch 8 level).
// Larger batches reuse each weight enough that it makes no difference.
void prefetch_next(int64_t rows, const c10::optional<torch::Tensor>& prefetch) {
  if (rows <= kMaxTileRows && prefetch.has_value() && prefetch->defined()) {
    prefixserve::stream_pool().prefetch(prefetch->data_ptr(),
                                        prefetch->numel() * prefetch->element_size());
  }
}

// The tiles a call runs on: the build's (AVX-512, else portable), or AVX2's.
enum class TileChoice { kBuild, kAvx2 };

bool avx2_tiles_run_here() {
#if defined(PREFIXSERVE_GEMM_AVX2)
  static const bool here = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return here;
#else
  return false;
#endif
}

// The build's AVX-512 tiles where it has them, else AVX2's where the CPU runs them, else the
// portable loop: one summation order in all three.
TileChoice build_tiles() {
#if defined(PREFIXSERVE_GEMM_AVX512)
  return TileChoice::kBuild;
#else
  return avx2_tiles_run_here() ? TileChoice::kAvx2 : TileChoice::kBuild;
#endif
}

// prepare() for a plain linear, with its optional residual [rows, N] checked.
Problem prepare_linear(const char* name, torch::Tensor& out, torch::Tensor& x,
                       const torch::Tensor& packed, int64_t N,
                       const c10::optional<torch::Tensor>& bias,
                       const c10::optional<torch::Tensor>& residual,
                       std::vector<float>& bias_fp32) {
  Problem pb = prepare(name, out, x, packed, N, N, bias, bias_fp32);
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(residual->device().is_cpu() && residual->scalar_type() == torch::kBFloat16 &&
                    residual->is_contiguous() && residual->dim() == 2 &&
                    residual->size(0) == pb.rows && residual->size(1) == N,
                name, ": residual must be a contiguous bfloat16 [", pb.rows, ", ", N, "]");
    pb.res = reinterpret_cast<const uint16_t*>(residual->data_ptr<c10::BFloat16>());
  }
  return pb;
}

template <class T>
void run_linear_on(const Problem& pb, int64_t threads) {
  const int64_t panels = (pb.N + kPanel - 1) / kPanel;
  const int np = T::panels_for(static_cast<int>(std::min(pb.rows, T::kMaxRows)));
  schedule(pb.rows, panels, pb.pairs, T::kMaxRows, np, 1, threads,
           [&](int64_t m0, int64_t mr, int64_t p0, int64_t p1) {
             run_block<T>(pb, m0, mr, p0, p1);
           });
}

void run_linear(const Problem& pb, int64_t threads, TileChoice tiles) {
  if (pb.rows == 0 || pb.N == 0) return;
#if defined(PREFIXSERVE_GEMM_AVX2)
  if (tiles == TileChoice::kAvx2) return run_linear_on<avx2::Tiles>(pb, threads);
#endif
  run_linear_on<BuildTiles>(pb, threads);
}

}  // namespace

// out [rows, N] = x [rows, K] @ w.T (+ bias) (+ residual, after the output's rounding), w
// packed by pack_bf16_gemm; on the caller and up to `threads - 1` helpers of the stream pool;
// then, for a decode-sized call, `prefetch` (the next linear's packed weight) toward the
// helpers' caches. `residual` may be `out` itself (each element is read before it is written).
void linear_bf16_packed(torch::Tensor out, torch::Tensor x, torch::Tensor packed, int64_t N,
                        c10::optional<torch::Tensor> bias, int64_t threads,
                        c10::optional<torch::Tensor> prefetch,
                        c10::optional<torch::Tensor> residual) {
  std::vector<float> bias_fp32;
  const Problem pb = prepare_linear("linear_bf16_packed", out, x, packed, N, bias, residual,
                                    bias_fp32);
  run_linear(pb, threads, build_tiles());
  prefetch_next(pb.rows, prefetch);
}

// linear_bf16_packed on the AVX2 tiles whatever the build (x86-64 CPUs with AVX2 and FMA): the
// same sums, so the same bits, as the build's own tiles (tests/model/test_native_gemm.py).
void linear_bf16_packed_avx2(torch::Tensor out, torch::Tensor x, torch::Tensor packed, int64_t N,
                             c10::optional<torch::Tensor> bias, int64_t threads,
                             c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(avx2_tiles_run_here(),
              "linear_bf16_packed_avx2 needs an x86-64 CPU with AVX2 and FMA");
  std::vector<float> bias_fp32;
  const Problem pb = prepare_linear("linear_bf16_packed_avx2", out, x, packed, N, bias, residual,
                                    bias_fp32);
  run_linear(pb, threads, TileChoice::kAvx2);
}

// A gated MLP's first half: out [rows, I] = act(x @ gate.T) * (x @ up.T), the weight [2I, K]
// (gate rows then up rows, as GatedMLP fuses them) packed by pack_bf16_gemm, I a multiple of 32;
// `act` 1 for SiLU, 2 for GELU's tanh approximation. Each gate and up sum is the plain call's.
void linear_bf16_packed_gated(torch::Tensor out, torch::Tensor x, torch::Tensor packed,
                              int64_t N, c10::optional<torch::Tensor> bias, int64_t act,
                              int64_t threads, c10::optional<torch::Tensor> prefetch) {
  TORCH_CHECK(gemm_bf16_vectorized(), "linear_bf16_packed_gated needs the AVX-512 build");
  TORCH_CHECK(act == kSilu || act == kGeluTanh, "linear_bf16_packed_gated: act 1 or 2");
  TORCH_CHECK(N % (2 * kPanel) == 0, "linear_bf16_packed_gated: 2I must be a multiple of ",
              2 * kPanel);
  std::vector<float> bias_fp32;
  Problem pb = prepare("linear_bf16_packed_gated", out, x, packed, N, N / 2, bias, bias_fp32);
  pb.act = act;
  if (pb.rows == 0 || N == 0) return;
  schedule(pb.rows, N / 2 / kPanel, pb.pairs, kMaxGatedRows, 1, 2, threads,
           [&](int64_t m0, int64_t mr, int64_t p0, int64_t p1) {
             run_gated_block(pb, m0, mr, p0, p1);
           });
  prefetch_next(pb.rows, prefetch);
}

// The tiles linear_bf16_packed runs on here: "avx512", "avx2" or "portable".
std::string gemm_bf16_tiles() {
#if defined(PREFIXSERVE_GEMM_AVX512)
  return "avx512";
#else
  return avx2_tiles_run_here() ? "avx2" : "portable";
#endif
}
