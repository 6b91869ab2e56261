// The register tiles of the bf16 GEMM (gemm_bf16.cpp), one family per instruction set, all with
// one summation order: each output is summed in one fp32 lane over the pairs (k, k + 1) of its
// weight row in ascending order, k + 1 before k within a pair, each product added with one
// rounding, denormal inputs and results flushed to zero. That is VDPBF16PS's definition
// (AVX512-BF16: both products of a pair into the lane, the odd one first), which the fp32 FMA
// families follow step for step (the products of two bf16 are exact in fp32, so an FMA and the
// dot product round the same sum), and the callers set the flush-to-zero modes (FlushDenormals).
// So every family gives the same bits, and the GEMM may pick whichever runs fastest here:
// - the AVX-512 FMA tiles (the build's where it has AVX-512F/BW/VL): weight pairs widened in
//   registers by a shift and a mask, x widened to fp32 once per call;
// - the bf16 dot-product tiles (`dot`, AVX512-BF16 CPUs, a target attribute): one VDPBF16PS per
//   pair of products on the packed pairs as they are, x as bf16 pairs;
// - the AVX2 FMA tiles (`avx2`, every x86-64 build, a target attribute);
// - the portable scalar loop (other CPUs, e.g. aarch64).
#pragma once

#include "torch_lite.h"

// The vector tiles need AVX512F and, for the masked 16-bit stores of the epilogue, BW and VL.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PREFIXSERVE_GEMM_AVX512 1
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16_bits.h"
#include "exp_avx2.h"
#include "exp_avx512.h"

namespace prefixserve::gemm {

constexpr int64_t kPanel = 32;        // output columns per panel
constexpr int64_t kMaxTileRows = 12;  // rows of the largest register tile

// Whether decode-sized tiles (up to 4 rows) prefetch their panels 16 pairs ahead in software: a
// gain on some CPUs, a loss on others (AMD Zen 4 streams 1.25x faster without), so the
// calibration measures it (`gemm_bf16_select`). It changes no sum.
inline std::atomic<bool> g_tile_prefetch{true};

// Panels a lone row's tile takes at once on the AVX-512 families: 4 (8 chains of sums) or 2
// (half the chains, but jobs of half the weight, which two threads share more evenly: on AMD
// Zen 4 decode at batch 1 ran ~1.1x with 2). Measured by the calibration; it changes no sum.
inline std::atomic<int> g_one_row_panels{4};

using prefixserve::bf16_bits_to_float;

// The activations of the gated epilogue (the values the Python side passes).
enum Act : int64_t { kNone = 0, kSilu = 1, kGeluTanh = 2 };

// Flush-to-zero, denormals-are-zero and rounding to nearest even for the current thread while it
// lives (the dot product's rules, which ignore the MXCSR, for the FMA families and the scalar
// epilogue): the MXCSR is restored after. Elsewhere (aarch64) one family runs, the portable one.
struct FlushDenormals {
#if defined(__x86_64__)
  unsigned saved = _mm_getcsr();
  FlushDenormals() { _mm_setcsr((saved & ~0x6000u) | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved); }
#endif
};

// Where a tile's results go: rows of `out` (ldo apart) from column n0, `cols` of them valid
// (the rest of the last panel is padding), `bias` from n0 or null. A gated tile (act != kNone):
// two panels, gate then up, `bias_up` the up half's bias, `cols` 32 outputs. `res`: rows of a
// residual (ldo apart, from n0) added to the rounded output, or null. `out_f32`: where set (a
// plain tile only, no residual), the outputs go there as the fp32 sums + bias, never rounded to
// bf16 (the LM head's logits), and `out` is unused.
struct TileOut {
  uint16_t* out;
  int64_t ldo;
  int64_t cols;
  const float* bias;
  int64_t act = kNone;
  const float* bias_up = nullptr;
  const uint16_t* res = nullptr;
  float* out_f32 = nullptr;
};

inline uint16_t float_to_bf16_bits(float f) {
  // Round to nearest even, as c10::BFloat16 and torch's .to(torch.bfloat16) do.
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (std::isnan(f)) return 0x7fc0;
  bits += 0x7fff + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

// The epilogue in scalar code (the portable and the AVX2 tiles), each step the AVX-512
// epilogue's below, lane by lane, so every family writes the same bits. No a * b + c outside
// std::fma: a contraction the vector code does not make would change a rounding.

// v rounded to bf16, as a float (NaN kept as it is; the store quiets it).
inline float round_bf16_scalar(float v) {
  if (std::isnan(v)) return v;
  return bf16_bits_to_float(float_to_bf16_bits(v));
}

// exp_nonpositive16 (exp_avx512.h) for one lane: the same clamp, reduction, polynomial and
// scaling (2^n as a float, so a denormal result is flushed as VSCALEFPS flushes it).
inline float exp_nonpositive_scalar(float x) {
  x = -87.0f > x ? -87.0f : x;  // as _mm512_max_ps(-87, x): NaN stays NaN
  const float n = std::nearbyint(x * 1.44269504088896341f);
  float r = std::fma(-n, 0.693145751953125f, x);
  r = std::fma(-n, 1.42860682030941723e-6f, r);
  float p = 0.00138889f;
  p = std::fma(p, r, 0.00833336823f);
  p = std::fma(p, r, 0.0416666418f);
  p = std::fma(p, r, 0.166666672f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  if (std::isnan(n)) return p;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// silu16 / gelu_tanh16 below, one lane: g * s / (1 + e), s = 1 for a non-negative argument and
// e otherwise, e = exp(-|g|) (SiLU) or exp(-2|y|) (GELU's tanh form).
inline float act_scalar(float g, int64_t act) {
  float e, arg;
  if (act == kSilu) {
    arg = g;
    e = exp_nonpositive_scalar(0.0f - std::fabs(g));
  } else {
    const float g3 = (g * g) * g;
    arg = 0.7978845608028654f * std::fma(0.044715f, g3, g);
    e = exp_nonpositive_scalar(-2.0f * std::fabs(arg));
  }
  const float num = arg < 0.0f ? g * e : g;
  return num / (1.0f + e);
}

// Sums [rows, cols] (`lds` apart) + bias into the fp32 rows of `out` (`ldo` apart), both from
// column n0, unrounded: an fp32 out's epilogue (the LM head's logits) for every family's tiles
// and the 8-bit kernel (the vector tiles' store_f32 below, lane by lane).
inline void store_sums_f32(void* out, int64_t ldo, const float* sums, int64_t lds, int64_t rows,
                           int64_t n0, int64_t cols, const float* bias) {
  float* dst = static_cast<float*>(out) + n0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const float sum = sums[r * lds + c];
      dst[r * ldo + c] = bias ? sum + bias[n0 + c] : sum;
    }
}

// A tile's fp32 sums (`rows` rows, `lds` apart) to its outputs: + bias, rounded to bf16, + the
// residual and rounded again where there is one; or, for a gated tile, the 32 gate sums and the
// 32 up sums after them to bf16(act(bf16(gate)) * bf16(up)).
inline void store_sums(const float* sums, int64_t lds, int rows, const TileOut& out) {
  if (out.act != kNone) {
    for (int r = 0; r < rows; ++r)
      for (int64_t c = 0; c < kPanel; ++c) {
        float gate = sums[r * lds + c], up = sums[r * lds + kPanel + c];
        if (out.bias) gate += out.bias[c];
        if (out.bias_up) up += out.bias_up[c];
        const float a = round_bf16_scalar(act_scalar(round_bf16_scalar(gate), out.act));
        out.out[r * out.ldo + c] = float_to_bf16_bits(a * round_bf16_scalar(up));
      }
    return;
  }
  if (out.out_f32) {
    return store_sums_f32(out.out_f32, out.ldo, sums, lds, rows, 0, out.cols, out.bias);
  }
  for (int r = 0; r < rows; ++r)
    for (int64_t c = 0; c < out.cols; ++c) {
      float sum = sums[r * lds + c];
      if (out.bias) sum += out.bias[c];
      uint16_t y = float_to_bf16_bits(sum);
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

// 16 sums (+ bias) stored as they are in fp32, the first `valid` of them: store_bf16 without
// the rounding (the scalar epilogue's out_f32 branch, lane by lane).
inline void store_f32(float* dst, __m512 sum, const float* bias, int64_t valid) {
  const __mmask16 mask = valid >= 16 ? __mmask16(0xffff) : __mmask16((1u << valid) - 1);
  if (bias) sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, bias));
  _mm512_mask_storeu_ps(dst, mask, sum);
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

// A tile's sums to its outputs: the gated epilogue (two panels, gate then up), else each
// column's bias, rounding and residual.
template <int MR, int NP>
inline void store_tile(__m512 (&acc)[MR][NP * 2], const TileOut& out) {
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
      if (out.out_f32) {
        store_f32(out.out_f32 + r * out.ldo + j * 16, acc[r][j], bias, out.cols - j * 16);
        continue;
      }
      uint16_t* dst = out.out + r * out.ldo + j * 16;
      if (out.res) {
        store_residual(dst, acc[r][j], bias, out.res + r * out.ldo + j * 16, out.cols - j * 16);
      } else {
        store_bf16(dst, acc[r][j], bias, out.cols - j * 16);
      }
    }
}

template <int MR, int NP>
inline void tile_kernel(const float* x, int64_t ldx, const uint16_t* panel, int64_t panel_stride,
                        int64_t pairs, const TileOut& out) {
  __m512 acc[MR][NP * 2];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP * 2; ++j) acc[r][j] = _mm512_setzero_ps();
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  const bool prefetch = MR <= 4 && g_tile_prefetch.load(std::memory_order_relaxed);
  for (int64_t p = 0; p < pairs; ++p) {
    for (int j = 0; j < NP; ++j) {
      const uint16_t* w = panel + j * panel_stride + p * (2 * kPanel);
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + 16 * 2 * kPanel), _MM_HINT_T0);
      // The four weight vectors of this panel and pair first, then each row's two broadcasts
      // against them (30 registers at 12 rows: no spills).
      const __m512i pair0 = _mm512_loadu_si512(w), pair1 = _mm512_loadu_si512(w + kPanel);
      const __m512 even0 = _mm512_castsi512_ps(_mm512_slli_epi32(pair0, 16));
      const __m512 even1 = _mm512_castsi512_ps(_mm512_slli_epi32(pair1, 16));
      const __m512 odd0 = _mm512_castsi512_ps(_mm512_and_si512(pair0, high));
      const __m512 odd1 = _mm512_castsi512_ps(_mm512_and_si512(pair1, high));
      for (int r = 0; r < MR; ++r) {
        const float* xr = x + r * ldx + 2 * p;
        const __m512 xo = _mm512_set1_ps(xr[1]);
        acc[r][2 * j] = _mm512_fmadd_ps(xo, odd0, acc[r][2 * j]);
        acc[r][2 * j + 1] = _mm512_fmadd_ps(xo, odd1, acc[r][2 * j + 1]);
        const __m512 xe = _mm512_set1_ps(xr[0]);
        acc[r][2 * j] = _mm512_fmadd_ps(xe, even0, acc[r][2 * j]);
        acc[r][2 * j + 1] = _mm512_fmadd_ps(xe, even1, acc[r][2 * j + 1]);
      }
    }
  }
  store_tile<MR, NP>(acc, out);
}

#else
// Portable: the same order (pairs ascending, k + 1 before k in each) in scalar code.
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
          o[c] = std::fma(xr[1], bf16_bits_to_float(w[2 * c + 1]), o[c]);
          o[c] = std::fma(xr[0], bf16_bits_to_float(w[2 * c]), o[c]);
        }
      }
    }
  store_sums(&sums[0][0], NP * kPanel, MR, out);
}
#endif

#if defined(__x86_64__) && defined(__GNUC__)
// AVX2 tiles, for CPUs without AVX-512: 8 columns a vector, fp32 FMAs in the order above, so
// each output's sum is the AVX-512 tile's, bit for bit; the epilogue is store_sums8. Compiled
// into every x86-64 build (a target attribute), so AVX-512 hosts check the families agree
// (`linear_bf16_packed_on`); chosen at run time where the CPU has AVX2 and FMA and the build
// has no AVX-512 tiles.
#define PREFIXSERVE_GEMM_AVX2 1
#define PREFIXSERVE_TARGET_AVX2 __attribute__((target("avx2,fma")))

namespace avx2 {

// The sums of MR rows over NP panels, into sums[r * lds + c] for the NP * kPanel columns.
// Inlined into the tile: called, the plain tiles ran 10-20% slower.
template <int MR, int NP>
PREFIXSERVE_TARGET_AVX2 __attribute__((always_inline)) inline void accumulate(
    const float* x, int64_t ldx, const uint16_t* panel, int64_t panel_stride, int64_t pairs,
    float* sums, int64_t lds) {
  constexpr int V = kPanel / 8;  // vectors of 8 columns a panel
  __m256 acc[MR][NP * V];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP * V; ++j) acc[r][j] = _mm256_setzero_ps();
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const bool prefetch = MR <= 4 && g_tile_prefetch.load(std::memory_order_relaxed);
  for (int64_t p = 0; p < pairs; ++p) {
    for (int j = 0; j < NP; ++j) {
      const uint16_t* w = panel + j * panel_stride + p * (2 * kPanel);
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + 16 * 2 * kPanel), _MM_HINT_T0);
      for (int v = 0; v < V; ++v) {
        // Eight columns' (k, k + 1) pairs: the shift gives k's floats, the mask k + 1's.
        const __m256i pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * v));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(pair, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(pair, high));
        for (int r = 0; r < MR; ++r) {
          const float* xr = x + r * ldx + 2 * p;
          __m256& a = acc[r][j * V + v];
          a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr + 1), odd, a);
          a = _mm256_fmadd_ps(_mm256_broadcast_ss(xr), even, a);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP * V; ++j) _mm256_storeu_ps(sums + r * lds + 8 * j, acc[r][j]);
}

// The epilogue (`store_sums`) on eight lanes: each step the scalar epilogue's, lane by lane, so
// the bits are every family's. The scalar one spent ~12% of the 135M model's prefill here (its
// exp and division a gate output at a time).

// v rounded to bf16, as floats (round_bf16_scalar: NaN kept as it is).
PREFIXSERVE_TARGET_AVX2 inline __m256 round_bf16_8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), v, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}

// Eight floats to bf16 bits at dst (float_to_bf16_bits: to nearest even, NaN as 0x7fc0).
PREFIXSERVE_TARGET_AVX2 inline void store_bf16_8(uint16_t* dst, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  r = _mm256_srli_epi32(r, 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
  const __m128i halves =
      _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), halves);
}

// act_scalar on eight lanes (exp_nonpositive8: exp_nonpositive_scalar's steps, exp_avx2.h).
PREFIXSERVE_TARGET_AVX2 inline __m256 act8(__m256 g, int64_t act) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 arg = g, e;
  if (act == kSilu) {
    e = exp_nonpositive8(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_andnot_ps(sign, g)));
  } else {
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    arg = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f),
                        _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
    e = exp_nonpositive8(_mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(sign, arg)));
  }
  const __m256 neg = _mm256_cmp_ps(arg, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 num = _mm256_blendv_ps(g, _mm256_mul_ps(g, e), neg);
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// bf16(act(bf16(gate + bias)) * bf16(up + bias_up)) for eight columns (bias, bias_up: those
// columns' or null), each step rounded as the unfused bf16 ops round it.
PREFIXSERVE_TARGET_AVX2 inline void store_gated8(uint16_t* dst, __m256 gate, __m256 up,
                                                 const float* bias, const float* bias_up,
                                                 int64_t act) {
  if (bias) gate = _mm256_add_ps(gate, _mm256_loadu_ps(bias));
  if (bias_up) up = _mm256_add_ps(up, _mm256_loadu_ps(bias_up));
  const __m256 a = round_bf16_8(act8(round_bf16_8(gate), act));
  store_bf16_8(dst, _mm256_mul_ps(a, round_bf16_8(up)));
}

// bf16(sum + bias) for eight columns, and where `res` is set bf16 of that plus the residual's
// eight values (a linear's output and the residual add after it: two bf16 ops).
PREFIXSERVE_TARGET_AVX2 inline void store_plain8(uint16_t* dst, __m256 sum, const float* bias,
                                                 const uint16_t* res) {
  if (bias) sum = _mm256_add_ps(sum, _mm256_loadu_ps(bias));
  if (res) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(res));
    const __m256 y = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
    sum = _mm256_add_ps(round_bf16_8(sum), y);
  }
  store_bf16_8(dst, sum);
}

// store_sums for a tile's `rows` rows: eight columns at a time, a plain tile's last few
// columns (past a multiple of eight) by the scalar epilogue.
PREFIXSERVE_TARGET_AVX2 inline void store_sums8(const float* sums, int64_t lds, int rows,
                                                const TileOut& out) {
  if (out.out_f32) return store_sums(sums, lds, rows, out);
  for (int r = 0; r < rows; ++r) {
    const float* row = sums + r * lds;
    uint16_t* dst = out.out + r * out.ldo;
    if (out.act != kNone) {
      for (int64_t c = 0; c < kPanel; c += 8)
        store_gated8(dst + c, _mm256_loadu_ps(row + c), _mm256_loadu_ps(row + kPanel + c),
                     out.bias ? out.bias + c : nullptr, out.bias_up ? out.bias_up + c : nullptr,
                     out.act);
      continue;
    }
    const uint16_t* res = out.res ? out.res + r * out.ldo : nullptr;
    const int64_t whole = out.cols / 8 * 8;
    for (int64_t c = 0; c < whole; c += 8)
      store_plain8(dst + c, _mm256_loadu_ps(row + c), out.bias ? out.bias + c : nullptr,
                   res ? res + c : nullptr);
    if (whole < out.cols) {  // the rest of this row, columns whole.. (out shifted to them)
      TileOut rest = out;
      rest.out = dst + whole;
      rest.cols = out.cols - whole;
      if (out.bias) rest.bias = out.bias + whole;
      if (res) rest.res = res + whole;
      store_sums(row + whole, lds, 1, rest);
    }
  }
}

// A tile of MR rows over NP panels. Two rows over two panels (a gated tile's gate and up) take
// the panels one after the other: their 16 accumulators would not fit the 16 registers, and a
// gated tile of one row widens each weight vector for one row only (at 8-40 rows the gated
// MLP ran at half the plain linears' speed). The sums are the same either way (each output's
// FMAs in the order of k).
template <int MR, int NP>
PREFIXSERVE_TARGET_AVX2 void tile_kernel(const float* x, int64_t ldx, const uint16_t* panel,
                                         int64_t panel_stride, int64_t pairs,
                                         const TileOut& out) {
  float sums[MR][NP * kPanel];
  if constexpr (MR > 1 && NP > 1) {
    for (int j = 0; j < NP; ++j)
      accumulate<MR, 1>(x, ldx, panel + j * panel_stride, panel_stride, pairs,
                        &sums[0][0] + j * kPanel, NP * kPanel);
  } else {
    accumulate<MR, NP>(x, ldx, panel, panel_stride, pairs, &sums[0][0], NP * kPanel);
  }
  store_sums8(&sums[0][0], NP * kPanel, MR, out);
}

// The AVX2 tile family (run_block's T).
struct Tiles {
  using X = float;
  static constexpr int64_t kMaxRows = 2;
  static constexpr int64_t kMaxGatedRows = 2;  // the gate's panel, then the up's
  // Two rows take one panel: 8 chains, and with the rows' broadcasts and a weight vector's two
  // halves 15 of the 16 vector registers. A lone row takes four panels (16 chains: four weight
  // streams in flight, which a memory-bound row needs more than registers; the compiler keeps
  // the chains it cannot hold in L1) or two (g_one_row_panels), as the calibration measures.
  static constexpr int panels_for(int rows) { return rows == 1 ? 4 : 1; }
  static constexpr bool kOneRowChoice = true;
  template <int MR, int NP>
  PREFIXSERVE_TARGET_AVX2 static void tile(const float* x, int64_t ldx, const uint16_t* panel,
                                           int64_t panel_stride, int64_t pairs,
                                           const TileOut& out) {
    avx2::tile_kernel<MR, NP>(x, ldx, panel, panel_stride, pairs, out);
  }
};

}  // namespace avx2
#endif

// The build's FMA family (AVX-512, else portable): its largest tile height, the panels a tile
// of `rows` rows takes at once (enough chains for small batches, at most 24 accumulators), and
// the tile. `X`: the type of x's rows the tiles read (fp32, or bf16 pairs for the dot product).
struct BuildTiles {
  using X = float;
  static constexpr int64_t kMaxRows = kMaxTileRows;
  static constexpr int64_t kMaxGatedRows = 6;  // two panels: 24 accumulators
  static constexpr int panels_for(int rows) { return rows <= 3 ? 4 : (rows <= 6 ? 2 : 1); }
  static constexpr bool kOneRowChoice = true;  // a lone row may take 2 panels (g_one_row_panels)
  template <int MR, int NP>
  static void tile(const float* x, int64_t ldx, const uint16_t* panel, int64_t panel_stride,
                   int64_t pairs, const TileOut& out) {
    tile_kernel<MR, NP>(x, ldx, panel, panel_stride, pairs, out);
  }
};

#if defined(PREFIXSERVE_GEMM_AVX512)
// The bf16 dot-product tiles: the AVX-512 tiles' epilogue, one VDPBF16PS per weight
// vector and row for each pair of k (a pair's two products, the odd one first, then the even,
// each rounded into the lane: the FMA tiles' order), x's (k, k + 1) broadcast as one 32-bit
// lane. Compiled into every AVX-512 build (a target attribute); run where the CPU has
// AVX512-BF16.
#define PREFIXSERVE_GEMM_DOT 1
#define PREFIXSERVE_TARGET_DOT __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

namespace dot {

template <int MR, int NP>
PREFIXSERVE_TARGET_DOT void tile_kernel(const uint16_t* x, int64_t ldx, const uint16_t* panel,
                                        int64_t panel_stride, int64_t pairs,
                                        const TileOut& out) {
  __m512 acc[MR][NP * 2];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NP * 2; ++j) acc[r][j] = _mm512_setzero_ps();
  const bool prefetch = MR <= 4 && g_tile_prefetch.load(std::memory_order_relaxed);
  for (int64_t p = 0; p < pairs; ++p) {
    for (int j = 0; j < NP; ++j) {
      const uint16_t* w = panel + j * panel_stride + p * (2 * kPanel);
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + 16 * 2 * kPanel), _MM_HINT_T0);
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + kPanel);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * ldx + 2 * p, sizeof pair);
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        acc[r][2 * j] = _mm512_dpbf16_ps(acc[r][2 * j], xv, w0);
        acc[r][2 * j + 1] = _mm512_dpbf16_ps(acc[r][2 * j + 1], xv, w1);
      }
    }
  }
  store_tile<MR, NP>(acc, out);
}

// At most 6 rows a tile, on 2 panels (the gated tile's shape): on Zen 4 a prefill's plain calls
// ran 6 x 2 near the instruction's rate (390-420 GFLOP/s on two cores at the 1B shapes) where
// 12 rows on one panel, whose twelve x streams advance 4 bytes a step, made 160-370
// (BENCHMARKS.md §47).
struct Tiles {
  using X = uint16_t;
  static constexpr int64_t kMaxRows = 6;
  static constexpr int64_t kMaxGatedRows = BuildTiles::kMaxGatedRows;
  static constexpr int panels_for(int rows) { return rows <= 3 ? 4 : 2; }
  static constexpr bool kOneRowChoice = true;
  template <int MR, int NP>
  PREFIXSERVE_TARGET_DOT static void tile(const uint16_t* x, int64_t ldx, const uint16_t* panel,
                                          int64_t panel_stride, int64_t pairs,
                                          const TileOut& out) {
    dot::tile_kernel<MR, NP>(x, ldx, panel, panel_stride, pairs, out);
  }
};

}  // namespace dot
#endif

}  // namespace prefixserve::gemm
