// A linear over 8-bit weights: out[m, n] = epilogue(sum over k of x[m, k] w[n, k]) with the weight
// as int8 codes q [N, K] (nn.Linear's layout) and scales s [N, K / G] (G the group size: 32 for GGUF
// Q8_0, Q5_0 and Q4_0, 16 for Q6_K, K for per-channel int8; fp32, or fp16 for a scale per 32 where
// fp16 holds them: `Scales`), x bf16 [rows, K]. The weight stays 8-bit in memory, half the bytes of
// bf16 (decode streams every weight once per step).
//
// As llama.cpp multiplies Q8_0 weights, each row of x is quantized too, per group of 32 (scale
// amax / 127, codes rounded to nearest even, in [-127, 127]), and the products are integer dot
// products: VPDPBUSD where the CPU has AVX512-VNNI (the weight codes offset to unsigned by 128,
// the offset's 128 x sum(x codes) taken off once a span's products are summed), VPMADDUBSW +
// VPMADDWD on AVX2 (|x| times the weight with x's sign, so no pair saturates), a scalar loop
// elsewhere. Every family computes the same exact integer sums in the same lanes. A row's K
// columns are cut into spans of whole groups of 32: 16 groups (512 columns) while they last, then
// 8, 4 and 2 (K is a multiple of 64); where the weight's groups are 16 columns (Q6_K's, per 16),
// every span is 2 groups. A span of n groups is n / 2 steps of 64 columns in sixteen lanes: in
// step t, lane l holds the four products of columns 4 (t (16 / n) + l / n) .. + 3 of the span's
// group l % n, so a lane stays in one group of x (and of the weight) for the whole span and sums
// its products there in integers (at most 32 x 255 x 127: exact in int32). The codes of x and of
// the weight are stored in that order (`pack_codes`). At the span's end each lane's sum becomes
// fp32 (exact) and goes into the lane's accumulator by one fused multiply-add with the scale
// (weight scale times x scale, one rounding) of its group: one float step a lane per span, not
// per 64 columns, an eighth of the float work in full spans (which, not the integer products,
// bounded the tile on AMD Zen 4: BENCHMARKS.md §47). The sixteen accumulators then reduce
// as (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1). So every family writes the same bits
// (tests/model/test_linear_int8.py), and a row's result never depends on the other rows of the
// call: the kernel is batch-invariant by itself. The epilogues (bias, the residual add, the gated
// MLP's act(gate) * up) are gemm_bf16's scalar ones, with its roundings.
//
// The codes may also be stored in 4 or 5 bits (GGUF Q4_0 and Q5_0, whose codes lie in [-8, 7] and
// [-16, 15]): unsigned, offset by the zero point z (8 or 16), a row's 64 codes of a step in 32
// bytes (byte b: code b in the low nibble, code b + 32 in the high one, in the lane order above),
// Q5_0's fifth bits after them in 8 bytes (bit p of the little-endian 64: code p's). The kernel
// widens them to bytes in registers (a mask and a shift; the fifth bit by a byte mask) and takes
// z x sum(x codes) off once a span is summed, as the 8-bit codes' 128: the lanes' integer
// sums are the same exact integers, so a weight gives the same bits in 4, 5 or 8 bits, at a half
// or five eighths of the bytes.
//
// GGUF's K-quants, Q4_K and Q6_K, come in super-blocks of 256 columns whose sub-scales are
// integers: their sums are linear_q4k.cpp's and linear_q6k.cpp's (x quantized per 256, exact
// integer sums per super-block, one or two fused multiply-adds per 256 weights: kquant.h), which
// this file's chunks and epilogues take as any other sums.
#include "torch_lite.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "bf16_bits.h"
#include "gemm_bf16_tiles.h"
#include "int8_epilogue.h"
#include "kernels.h"
#include "kquant.h"
#include "stream_pool.h"

namespace {

using prefixserve::int8::Epilogue;
using prefixserve::int8::store_gated_sums;
using prefixserve::int8::store_plain;
using prefixserve::gemm::kGeluTanh;
using prefixserve::gemm::kNone;
using prefixserve::gemm::kSilu;

constexpr int kLanes = 16;
constexpr int64_t kStep = 64;  // columns a step of sixteen lanes covers
constexpr int kSpanGroups = 16;  // groups of 32 columns in a full span (512 columns)
// The codes are packed in groups of four rows (`pack_codes`): a group's step c holds the four
// rows' 64 codes of step c (columns of the span order) one after the other, so a tile of the four
// rows reads one contiguous stream (four rows of K bytes each read at half the speed on AMD Zen 4:
// streams that short escape the hardware prefetchers).
constexpr int64_t kGroupRows = 4;

// How a row's 64 codes of a step are stored: B bits each (8, 5 or 4) in kBytes<B> bytes, and
// the zero point the stored (unsigned) codes carry; 8-bit codes are signed, flipped to unsigned
// (+128) in registers.
template <int B>
constexpr int64_t kBytes = B == 8 ? 64 : B == 5 ? 40 : 32;
template <int B>
constexpr int32_t kZero = B == 8 ? 128 : B == 5 ? 16 : 8;
// Batches of more rows than this are arithmetic-bound (gemm_bf16.cpp's threshold): the stream
// pool keeps its helpers for them however long a chunk takes (stream_pool.h).
constexpr int64_t kComputeBoundRows = 24;
// Calls of at most this many rows prefetch the next linear's weight (gemm_bf16's kMaxTileRows).
constexpr int64_t kPrefetchNextRows = 12;
// Bytes of codes a chunk of the call covers (`chunk_columns`): calls of at most kStreamRows rows
// stream the weight once, in chunks of at most ~kStreamChunkBytes; larger ones in
// ~kBatchChunkBytes.
constexpr int64_t kStreamRows = 4;
constexpr int64_t kStreamChunkBytes = 2 * 1024 * 1024;
constexpr int64_t kBatchChunkBytes = 32 * 1024;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define PREFIXSERVE_INT8_VNNI 1
constexpr const char* kFamily = "avx512-vnni";
// Weight rows x batch rows of one register tile.
constexpr int kTileW = 4, kTileX = 4;
constexpr int kTileW1 = 4;  // weight rows of a tile with one batch row
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PREFIXSERVE_INT8_AVX2 1
constexpr const char* kFamily = "avx2";
constexpr int kTileW = 2, kTileX = 2;
// One batch row (decode at batch 1) over 8-bit codes: four weight rows a tile, so each x step's
// load and |x| serve four rows. Measured before the span order (when a tile held float sums,
// eight accumulators as the 2 x 2 tile's): Q8_0's gate_up took 39 us against 53-72 with two rows;
// the 4- and 5-bit codes' widening left no registers for it (Q5_0's LM head 1.15-1.21 ms against
// 0.91), so they keep two.
constexpr int kTileW1 = 4;
#else
constexpr const char* kFamily = "portable";
constexpr int kTileW = 1, kTileX = 1;
constexpr int kTileW1 = 1;
#endif

// Weight rows of a tile with one batch row, for codes of B bits.
template <int B>
constexpr int kTileW1Of = B == 8 ? std::max(kTileW, kTileW1) : kTileW;

// The lane reduction every family makes: (l, l + 8), (l, l + 4), (l, l + 2), (l, l + 1).
inline float reduce_lanes(const float* a) {
  float t[8], u[4];
  for (int l = 0; l < 8; ++l) t[l] = a[l] + a[l + 8];
  for (int l = 0; l < 4; ++l) u[l] = t[l] + t[l + 4];
  const float v0 = u[0] + u[2], v1 = u[1] + u[3];
  return v0 + v1;
}

#if defined(__AVX2__)
// reduce_lanes of lanes 0-7 in `lo` and 8-15 in `hi`, step for step.
inline float reduce_halves(__m256 lo, __m256 hi) {
  const __m256 t = _mm256_add_ps(lo, hi);
  const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));  // [u0 + u2, u1 + u3, ...]
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}
#endif

// Groups of 32 columns a span takes where `left` groups of the row are left: `widest` (16, or 2
// for a weight with groups of 16) while they last, then 8, 4, 2 (K is a multiple of 64, so
// `left` is even).
inline int span_groups(int64_t left, int widest) {
  int n = widest;
  while (n > left) n /= 2;
  return n;
}

// The widest span for a weight whose groups are G columns: 16 groups of 32 where G is a multiple
// of 32 (each lane's columns then lie in one weight group), else 2 (one step: four columns).
inline int widest_span(int64_t G) { return G % 32 == 0 ? kSpanGroups : 2; }

// Rows of x quantized: codes [rows, K] in the span order; per span of each row, at its first
// step's sixteen lane slots (K / 4 slots a row, 16 a step), each lane's x scale (its group's) and
// -z times the sum of the lane's codes in the span (z the weight codes' zero point: the unsigned
// codes' offset, taken off once the span is summed). Later steps' slots stay unused.
struct XRows {
  std::vector<int8_t> codes;
  std::vector<float> lane_scale;
  std::vector<int32_t> offset;
};

// Rows of x quantized on the caller and up to `threads - 1` helpers (a prefill's x is large), in
// spans of at most `widest` groups.
XRows quantize_x(const uint16_t* x, int64_t rows, int64_t K, int64_t threads, int32_t zero,
                 int widest) {
  XRows q{std::vector<int8_t>(rows * K), std::vector<float>(rows * K / 4),
          std::vector<int32_t>(rows * K / 4)};
  prefixserve::stream_pool().run(rows, rows < 8 ? 1 : threads, [&](int64_t r) {
    for (int64_t g0 = 0; g0 < K / 32;) {
      const int n = span_groups(K / 32 - g0, widest), per = kLanes / n;
      const int64_t first = r * K / 4 + g0 / 2 * kLanes;  // the span's lane slots
      for (int gi = 0; gi < n; ++gi) {
        const int64_t g = 32 * (g0 + gi);
        float v[32], amax = 0.0f;
        for (int t = 0; t < 32; ++t) {
          v[t] = prefixserve::bf16_bits_to_float(x[r * K + g + t]);
          amax = std::max(amax, std::fabs(v[t]));
        }
        const float scale = amax / 127.0f;
        int8_t c[32];
        for (int t = 0; t < 32; ++t) {
          const float code = scale > 0.0f ? std::nearbyint(v[t] / scale) : 0.0f;
          c[t] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, code)));
        }
        // Unit u (columns 4u..4u+3) of the span's group gi: lane gi + n (u % per) of step u / per.
        for (int u = 0; u < 8; ++u) {
          const int64_t lane = gi + n * (u % per), step = g0 / 2 + u / per;
          std::memcpy(&q.codes[r * K + step * kStep + lane * 4], &c[4 * u], 4);
          q.lane_scale[first + lane] = scale;
          q.offset[first + lane] -= zero * (c[4 * u] + c[4 * u + 1] + c[4 * u + 2] + c[4 * u + 3]);
        }
      }
      g0 += n;
    }
  }, /*compute_bound=*/rows > kComputeBoundRows);
  return q;
}

// A weight's scales from some row on: float32, or float16 where every scale is one (GGUF Q8_0,
// Q5_0 and Q4_0 store theirs so: the same values in half the bytes; a full span's converted in
// one vector). G = 16 scales are float32 always.
struct Scales {
  const float* f = nullptr;
  const uint16_t* h = nullptr;

  Scales operator+(int64_t n) const { return {f ? f + n : nullptr, h ? h + n : nullptr}; }
  float operator[](int64_t i) const {
    return h ? static_cast<float>(c10::Half(h[i], c10::Half::from_bits())) : f[i];
  }
};

// The weight scale of lane l in the span of n groups from group g0 (of 32) of a weight row: the
// scale of the group its columns lie in (for G = 16, one step a span, its four columns').
inline float lane_weight_scale(Scales s, int64_t G, int64_t g0, int n, int l) {
  return s[(32 * (g0 + l % n) + 4 * (l / n)) / G];
}

#if defined(PREFIXSERVE_INT8_VNNI)
// A row's 64 codes of a step as unsigned bytes (code + z), in the lane order.
template <int B>
inline __m512i load_codes(const uint8_t* p) {
  if constexpr (B == 8) {
    return _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    // The 32 bytes in both halves, the upper half shifted right by 4: low nibbles below, high
    // ones above (one broadcast load, one variable shift, one mask).
    const __m512i both =
        _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    __m512i u = _mm512_and_si512(_mm512_srlv_epi16(both, shift), _mm512_set1_epi8(0x0F));
    if constexpr (B == 5) {  // + 16 where the fifth bit is set (the mask read from memory)
      __mmask64 fifth;
      std::memcpy(&fifth, p + 32, sizeof fifth);
      u = _mm512_mask_add_epi8(u, fifth, u, _mm512_set1_epi8(0x10));
    }
    return u;
  }
}
#elif defined(PREFIXSERVE_INT8_AVX2)
// Byte j of the result 0xFF where bit j of `bits` is set, else 0.
inline __m256i bits_to_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                       3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

// Half h (lanes 8h..8h + 7) of a row's 64 codes of a step: the signed codes where B = 8, else
// the unsigned stored ones (code + z).
template <int B>
inline __m256i load_half(const uint8_t* p, int h) {
  if constexpr (B == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * h));
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m256i low = _mm256_set1_epi8(0x0F);
    __m256i u = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, low);
    if constexpr (B == 5) {
      uint32_t fifth;
      std::memcpy(&fifth, p + 32 + 4 * h, sizeof fifth);
      u = _mm256_or_si256(u, _mm256_and_si256(bits_to_bytes(fifth), _mm256_set1_epi8(0x10)));
    }
    return u;
  }
}
#endif

// Code `col` (in the lane order) of a row's step, signed: the portable loop's.
template <int B>
inline int32_t code_at(const uint8_t* p, int64_t col) {
  if constexpr (B == 8) {
    return static_cast<int8_t>(p[col]);
  } else {
    int32_t u = (p[col % 32] >> (4 * (col / 32))) & 0x0F;
    if constexpr (B == 5) u |= ((p[32 + col / 8] >> (col % 8)) & 1) << 4;
    return u - kZero<B>;
  }
}

#if defined(PREFIXSERVE_INT8_VNNI)
// The sixteen lanes' weight scales (`lane_weight_scale`) of a span of a weight row.
inline __m512 span_scales(Scales s, int64_t G, int64_t groups, int64_t g0, int n) {
  if (groups == 1) return _mm512_set1_ps(s[0]);
  if (G == 32) {  // the span's n scales, lane l taking scale l % n
    const __m512 v = s.h ? _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(
                               static_cast<__mmask32>((1u << n) - 1), s.h + g0)))
                         : _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), s.f + g0);
    if (n == kLanes) return v;
    const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_permutexvar_ps(_mm512_and_si512(iota, _mm512_set1_epi32(n - 1)), v);
  }
  if (G == 16) {  // one step: lane l's columns in group 2 (l % 2) + (l >= 8) of the four
    const __m512i by_16 = _mm512_setr_epi32(0, 2, 0, 2, 0, 2, 0, 2, 1, 3, 1, 3, 1, 3, 1, 3);
    return _mm512_permutexvar_ps(by_16, _mm512_castps128_ps512(_mm_loadu_ps(s.f + 2 * g0)));
  }
  alignas(64) float t[kLanes];
  for (int l = 0; l < kLanes; ++l) t[l] = lane_weight_scale(s, G, g0, n, l);
  return _mm512_load_ps(t);
}
#elif defined(PREFIXSERVE_INT8_AVX2)
// Lanes 8h..8h + 7 of the span's weight scales (`lane_weight_scale`).
inline __m256 span_scales_half(Scales s, int64_t G, int64_t groups, int64_t g0, int n, int h) {
  if (groups == 1) return _mm256_set1_ps(s[0]);
  if (G == 32 && n == kLanes) {  // scales g0 + 8h .. g0 + 8h + 7
    if (!s.h) return _mm256_loadu_ps(s.f + g0 + 8 * h);
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s.h + g0 + 8 * h)));
  }
  if (G == 16) {  // as the VNNI family's: lane 8h + k takes scale 2 (k % 2) + h of the four
    const __m256i by_16 = h ? _mm256_setr_epi32(1, 3, 1, 3, 1, 3, 1, 3)
                            : _mm256_setr_epi32(0, 2, 0, 2, 0, 2, 0, 2);
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(s.f + 2 * g0)), by_16);
  }
  alignas(32) float t[8];
  for (int k = 0; k < 8; ++k) t[k] = lane_weight_scale(s, G, g0, n, 8 * h + k);
  return _mm256_load_ps(t);
}
#endif

// Sums of NW weight rows of one packed group of four (codes from q, the group's first step of
// the tile's first row, B bits a code; scales K / G apart) with NX quantized x rows (from row x0
// of xq) into sums[i * NX + j], span by span (`span_groups`): the lanes' integer sums over a
// span, then one fused multiply-add a lane.
template <int B, int NW, int NX>
inline void dot_tile(const uint8_t* q, Scales s, int64_t K, int64_t G, const XRows& xq,
                     int64_t x0, float* sums) {
  const int64_t groups = K / G, groups32 = K / 32;
  const int widest = widest_span(G);
  constexpr int64_t row_bytes = kBytes<B>, step_bytes = kGroupRows * row_bytes;
  // x's codes, offsets and lane scales from row x0 (a row's slots K / 4 apart).
  const int8_t* xc = xq.codes.data() + x0 * K;
  const int32_t* xo = xq.offset.data() + x0 * K / 4;
  const float* xl = xq.lane_scale.data() + x0 * K / 4;
#if defined(PREFIXSERVE_INT8_VNNI)
  // The float accumulators wait in memory while a span's steps run (they are touched once a
  // span): the NW x NX integer sums, the weight codes and x's step then fit the 32 registers.
  alignas(64) float acc[NW][NX][kLanes] = {};
  for (int64_t g0 = 0; g0 < groups32;) {
    const int n = span_groups(groups32 - g0, widest);
    const int64_t c0 = g0 / 2;
    __m512i dot[NW][NX];
    for (int i = 0; i < NW; ++i)
      for (int j = 0; j < NX; ++j) dot[i][j] = _mm512_setzero_si512();
    const auto step = [&](int64_t c) {
      __m512i w[NW];
      for (int i = 0; i < NW; ++i) w[i] = load_codes<B>(q + i * row_bytes + c * step_bytes);
      for (int j = 0; j < NX; ++j) {
        const __m512i xv = _mm512_loadu_si512(xc + j * K + c * kStep);
        for (int i = 0; i < NW; ++i) dot[i][j] = _mm512_dpbusd_epi32(dot[i][j], w[i], xv);
      }
    };
    // A full span's eight steps unrolled where several x rows share them (as a loop, GCC moved
    // the sums between registers each step); a decode tile (one x row) ran slower so.
    if (NX > 1 && n == kSpanGroups) {
#pragma GCC unroll 8
      for (int t = 0; t < kSpanGroups / 2; ++t) step(c0 + t);
    } else {
      for (int64_t c = c0; c < c0 + n / 2; ++c) step(c);
    }
    for (int i = 0; i < NW; ++i) {
      const __m512 ws = span_scales(s + i * groups, G, groups, g0, n);
      for (int j = 0; j < NX; ++j) {
        // The zero point's offset, added once the products are summed (exact in integers).
        const __m512i sum =
            _mm512_add_epi32(dot[i][j], _mm512_loadu_si512(xo + j * K / 4 + c0 * kLanes));
        const __m512 xs = _mm512_loadu_ps(xl + j * K / 4 + c0 * kLanes);
        _mm512_store_ps(acc[i][j], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum),
                                                   _mm512_mul_ps(ws, xs),
                                                   _mm512_load_ps(acc[i][j])));
      }
    }
    g0 += n;
  }
  for (int i = 0; i < NW; ++i)
    for (int j = 0; j < NX; ++j) {
      // One load as wide as the store before it (halves of it would wait for the store).
      const __m512 a = _mm512_load_ps(acc[i][j]);
      const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
      sums[i * NX + j] = reduce_halves(_mm512_castps512_ps256(a), hi);
    }
#elif defined(PREFIXSERVE_INT8_AVX2)
  // Lanes 0-7 (each step's first 32 bytes) in [0], 8-15 in [1]: a span's halves are summed one
  // after the other (its codes stay in L1 meanwhile), so a tile's integer sums need NW x NX
  // registers, not twice that; the float accumulators wait in memory, as the VNNI family's.
  const __m256i ones = _mm256_set1_epi16(1);
  alignas(32) float acc[NW][NX][kLanes] = {};
  for (int64_t g0 = 0; g0 < groups32;) {
    const int n = span_groups(groups32 - g0, widest);
    const int64_t c0 = g0 / 2;
    for (int h = 0; h < 2; ++h) {
      __m256i dot[NW][NX];
      for (int i = 0; i < NW; ++i)
        for (int j = 0; j < NX; ++j) dot[i][j] = _mm256_setzero_si256();
      const auto step = [&](int64_t c) {
        __m256i w[NW];
        for (int i = 0; i < NW; ++i) w[i] = load_half<B>(q + i * row_bytes + c * step_bytes, h);
        for (int j = 0; j < NX; ++j) {
          const __m256i xv =
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xc + j * K + c * kStep + 32 * h));
          // 8-bit codes: |x| times the code with x's sign (no pair saturates). Stored unsigned
          // codes (<= 31): the code times x, then the zero point's z x sum(x) taken off.
          const __m256i ax = B == 8 ? _mm256_abs_epi8(xv) : xv;
          for (int i = 0; i < NW; ++i) {
            const __m256i pairs = B == 8 ? _mm256_maddubs_epi16(ax, _mm256_sign_epi8(w[i], xv))
                                         : _mm256_maddubs_epi16(w[i], xv);
            dot[i][j] = _mm256_add_epi32(dot[i][j], _mm256_madd_epi16(pairs, ones));
          }
        }
      };
      for (int64_t c = c0; c < c0 + n / 2; ++c) step(c);
      for (int i = 0; i < NW; ++i) {
        const __m256 ws = span_scales_half(s + i * groups, G, groups, g0, n, h);
        for (int j = 0; j < NX; ++j) {
          const int64_t slot = j * K / 4 + c0 * kLanes + 8 * h;
          // Stored unsigned codes: the zero point's offset, added once the products are summed.
          const __m256i sum = B == 8 ? dot[i][j]
                                     : _mm256_add_epi32(dot[i][j], _mm256_loadu_si256(
                                           reinterpret_cast<const __m256i*>(xo + slot)));
          const __m256 xs = _mm256_loadu_ps(xl + slot);
          float* a = acc[i][j] + 8 * h;
          _mm256_store_ps(a, _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(ws, xs),
                                             _mm256_load_ps(a)));
        }
      }
    }
    g0 += n;
  }
  for (int i = 0; i < NW; ++i)
    for (int j = 0; j < NX; ++j)
      sums[i * NX + j] = reduce_halves(_mm256_load_ps(acc[i][j]), _mm256_load_ps(acc[i][j] + 8));
#else
  (void)xo;  // the portable loop multiplies signed codes: no zero point to take off
  for (int i = 0; i < NW; ++i)
    for (int j = 0; j < NX; ++j) {
      float acc[kLanes] = {0.0f};
      for (int64_t g0 = 0; g0 < groups32;) {
        const int n = span_groups(groups32 - g0, widest);
        const int64_t c0 = g0 / 2;
        int32_t dot[kLanes] = {0};
        for (int64_t c = c0; c < c0 + n / 2; ++c)
          for (int l = 0; l < kLanes; ++l)
            for (int t = 0; t < 4; ++t)
              dot[l] += code_at<B>(q + i * row_bytes + c * step_bytes, 4 * l + t) *
                        static_cast<int32_t>(xc[j * K + c * kStep + 4 * l + t]);
        for (int l = 0; l < kLanes; ++l) {
          const float scale =
              lane_weight_scale(s + i * groups, G, g0, n, l) * xl[j * K / 4 + c0 * kLanes + l];
          acc[l] = std::fma(static_cast<float>(dot[l]), scale, acc[l]);
        }
        g0 += n;
      }
      sums[i * NX + j] = reduce_lanes(acc);
    }
#endif
}

// A tile of up to kTileW weight rows by up to kTileX batch rows (the remainders dispatched to
// their own instantiations).
template <int B, int NW>
inline void dot_rows_x(const uint8_t* q, Scales s, int64_t K, int64_t G, const XRows& xq,
                       int64_t x0, int64_t nx, float* sums) {
  if constexpr (kTileX >= 4 && NW <= kTileW) {
    if (nx >= 4) return dot_tile<B, NW, 4>(q, s, K, G, xq, x0, sums);
  }
  if constexpr (kTileX >= 2 && NW <= kTileW) {
    if (nx >= 2) return dot_tile<B, NW, 2>(q, s, K, G, xq, x0, sums);
  }
  dot_tile<B, NW, 1>(q, s, K, G, xq, x0, sums);
}

template <int B>
inline void dot_rows(const uint8_t* q, Scales s, int64_t K, int64_t G, const XRows& xq,
                     int64_t x0, int64_t nw, int64_t nx, float* sums) {
  if constexpr (kTileW1Of<B> >= 4) {  // VNNI's tiles; AVX2's one-row tiles of 8-bit codes
    if (nw >= 4) return dot_rows_x<B, 4>(q, s, K, G, xq, x0, nx, sums);
  }
  if constexpr (kTileW >= 2) {
    if (nw >= 2) return dot_rows_x<B, 2>(q, s, K, G, xq, x0, nx, sums);
  }
  dot_rows_x<B, 1>(q, s, K, G, xq, x0, nx, sums);
}

// Sums of weight rows [n0, n0 + width) for every batch row into sums [rows, width]. Tiles never
// cross a packed group of four rows (a range that starts inside one takes single rows up to it).
template <int B>
void sum_range(const uint8_t* q, Scales s, int64_t K, int64_t G, const XRows& xq, int64_t rows,
               int64_t n0, int64_t width, float* sums) {
  const int64_t groups = K / G;
  float tile[std::max(kTileW * kTileX, kTileW1)];
  for (int64_t m0 = 0; m0 < rows;) {
    // The batch rows of this tile, as the instantiation dot_rows takes them: 4, 2 or 1.
    const int64_t more = rows - m0;
    const int64_t tx = kTileX >= 4 && more >= 4 ? 4 : kTileX >= 2 && more >= 2 ? 2 : 1;
    for (int64_t n = 0; n < width;) {
      const int64_t r = n0 + n, slot = r % kGroupRows, left = width - n;
      const int64_t tile_w = tx == 1 ? kTileW1Of<B> : kTileW;
      const int64_t nw = slot == 0 && left >= 4 && tile_w >= 4   ? 4
                         : slot % 2 == 0 && left >= 2 && tile_w >= 2 ? 2
                                                                     : 1;
      const uint8_t* base =
          q + (r / kGroupRows) * kGroupRows * (K / kStep) * kBytes<B> + slot * kBytes<B>;
      dot_rows<B>(base, s + r * groups, K, G, xq, m0, nw, tx, tile);
      for (int64_t i = 0; i < nw; ++i)
        for (int64_t j = 0; j < tx; ++j) sums[(m0 + j) * width + n + i] = tile[i * tx + j];
      n += nw;
    }
    m0 += tx;
  }
}

// Output columns a chunk of the call covers (a multiple of 16 rows, the vector epilogue's width):
// ~32 KB of codes where several batch rows pass a chunk's rows (they stay in L2 meanwhile). A
// decode-sized call reads each weight row once: it is cut into a multiple of `threads` chunks
// of one width (rounded up to 16 columns, so the last may be narrower), as few as keep each
// under ~kStreamChunkBytes, so every thread streams an even share in long runs. A chunk's start
// costs the pool's claim and a ramp of the hardware prefetchers on new streams (the codes', the
// scales'): on AMD Zen 4, 1B and 3B decode at
// batch 1 ran 1.10-1.19x faster (median of 12-20 interleaved pairs) in these chunks than in
// chunks of 192 KB, two a thread at least (BENCHMARKS.md §48); at batch 1 a 32 KB chunk is ~1.4
// us of reading, and SmolLM2 Q8_0's LM head took 1.27-1.44 ms in 32 KB chunks against 0.84-1.02
// in 192 KB ones.
int64_t chunk_columns(int64_t rows, int64_t width_out, int64_t K, int64_t code_bytes, bool gated,
                      int64_t threads) {
  if (rows > kStreamRows) return std::max<int64_t>(16, (kBatchChunkBytes / K) / 16 * 16);
  // A row's codes (B bits each), twice for a gated column (its gate and up rows).
  const int64_t column_bytes = std::max<int64_t>(1, (gated ? 2 : 1) * code_bytes);
  const int64_t t = std::max<int64_t>(1, threads);
  const int64_t share = t * kStreamChunkBytes;  // bytes one chunk per thread covers at most
  const int64_t chunks = t * std::max<int64_t>(1, (width_out * column_bytes + share - 1) / share);
  const int64_t columns = (width_out + chunks - 1) / chunks;
  return std::max<int64_t>(16, (columns + 15) / 16 * 16);
}

// The call's sums (`sum(n0, width, sums)`: weight rows [n0, n0 + width) into sums [rows, width])
// and epilogues, chunk by chunk (`chunk_columns`, a weight row `row_bytes` long) on the caller and
// up to `threads - 1` helpers.
template <class Sum>
void run_chunks(const Sum& sum, int64_t row_bytes, int64_t K, int64_t rows, int64_t width_out,
                bool gated, const Epilogue& e, int64_t threads) {
  const int64_t chunk = chunk_columns(rows, width_out, K, row_bytes, gated, threads);
  const int64_t chunks = (width_out + chunk - 1) / chunk;
  prefixserve::stream_pool().run(chunks, threads, [&](int64_t c) {
    const int64_t c0 = c * chunk, width = std::min(width_out, c0 + chunk) - c0;
    // Each thread's own buffer, grown once and kept: a prefill's sums are hundreds of KB, which
    // malloc would map and unmap on every chunk.
    thread_local std::vector<float> sums;
    sums.resize(rows * width * (gated ? 2 : 1));
    sum(c0, width, sums.data());
    if (!gated) return store_plain(sums.data(), width, rows, c0, width, e);
    float* up = sums.data() + rows * width;
    sum(width_out + c0, width, up);
    store_gated_sums(sums.data(), up, width, rows, c0, width, width_out, e);
  }, /*compute_bound=*/rows > kComputeBoundRows);
}

// run_chunks over codes of B bits.
template <int B>
void run_codes(const uint8_t* q, Scales s, int64_t K, int64_t G, const XRows& xq, int64_t rows,
               int64_t width_out, bool gated, const Epilogue& e, int64_t threads) {
  const auto sum = [&](int64_t n0, int64_t width, float* sums) {
    sum_range<B>(q, s, K, G, xq, rows, n0, width, sums);
  };
  run_chunks(sum, K / kStep * kBytes<B>, K, rows, width_out, gated, e, threads);
}

// A decode-sized call has the pool's helpers bring the next linear's codes toward their caches
// while the caller runs what lies between the two (gemm_bf16's prefetch_next).
void prefetch_next(int64_t rows, const c10::optional<torch::Tensor>& prefetch) {
  if (rows <= kPrefetchNextRows && prefetch.has_value() && prefetch->defined())
    prefixserve::stream_pool().prefetch(prefetch->data_ptr(),
                                        prefetch->numel() * prefetch->element_size());
}

// The bits of a code by the packed tensor's type and last dimension: int8 [.., 64] 8 bits,
// uint8 [.., 40] 5 bits, uint8 [.., 32] 4 bits; 0 for anything else.
int code_bits(const torch::Tensor& codes) {
  if (codes.dim() != 4) return 0;
  if (codes.scalar_type() == torch::kChar) return codes.size(3) == kBytes<8> ? 8 : 0;
  if (codes.scalar_type() != torch::kByte) return 0;
  return codes.size(3) == kBytes<5> ? 5 : codes.size(3) == kBytes<4> ? 4 : 0;
}

}  // namespace

std::string linear_int8_family() { return kFamily; }

// out [rows, N] (or [rows, N / 2] gated) from x [rows, K] bf16, codes packed in groups of four
// rows [ceil(N / 4), K / 64, 4, bytes] (model/quant/weights.py `pack_codes`: int8 with 64 bytes,
// or uint8 with 40 (5-bit) or 32 (4-bit)), scales [N, K / G] fp32, or fp16 for a scale per 32
// (`Scales`); or a K-quant's super-blocks (kquant.h: codes uint8 [ceil(N / 4), K / 256, 576 or
// 832], scales fp16 [N, 2 K / 256 or K / 256]); bias [N] bf16 or none; act 0 plain, 1 SiLU, 2
// GELU tanh (gated); residual [rows, N] bf16 added after the rounding, or none. A plain call
// (no act, no residual) may give a float32 out: the sums and bias unrounded (the LM head's logits).
// Chunks of weight rows run on the caller and up to `threads - 1` helpers of the stream pool;
// `prefetch`: the next linear's weight, or none.
void linear_int8(torch::Tensor out, torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                 c10::optional<torch::Tensor> bias, int64_t act,
                 c10::optional<torch::Tensor> residual, int64_t threads,
                 c10::optional<torch::Tensor> prefetch) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu() &&
                  out.device().is_cpu(),
              "linear_int8 runs on CPU tensors only");
  const int bits = code_bits(codes);
  namespace kquant = prefixserve::kquant;
  const kquant::Format super = kquant::format_of(codes, scales);  // Q4_K, Q6_K: kquant.h
  const bool out_f32 = out.scalar_type() == torch::kFloat && act == kNone;  // plain: unrounded
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 &&
                  (out.scalar_type() == torch::kBFloat16 || out_f32) && (bits != 0 || super) &&
                  (scales.scalar_type() == torch::kFloat || scales.scalar_type() == torch::kHalf),
              "linear_int8 needs bfloat16 x and out (or a plain call's float32 out), packed codes "
              "(int8 [.., 64], uint8 [.., 40] or [.., 32]; Q4_K's and Q6_K's uint8 [.., 576] and "
              "[.., 832], or both flat), float32 (or float16) scales");
  TORCH_CHECK(x.dim() == 2 && scales.dim() == 2 && out.dim() == 2 && x.is_contiguous() &&
                  codes.is_contiguous() && scales.is_contiguous() && out.is_contiguous(),
              "linear_int8 needs contiguous 2-D x, out and scales, and packed codes");
  const int64_t rows = x.size(0), K = x.size(1), N = scales.size(0), groups = scales.size(1);
  TORCH_CHECK(act == kNone || act == kSilu || act == kGeluTanh, "linear_int8: unknown act");
  const bool gated = act != kNone;
  const int64_t width_out = gated ? N / 2 : N;
  const bool codes_fit =
      super ? kquant::shapes_fit(super, codes, scales, N, K)
            : codes.size(0) == (N + kGroupRows - 1) / kGroupRows &&
                  codes.size(1) * kStep == K && codes.size(2) == kGroupRows &&
                  K % kStep == 0 && groups > 0 && K % groups == 0 &&
                  (K / groups == 16 || K / groups == 32 || (K / groups) % kStep == 0);
  TORCH_CHECK(codes_fit && (!gated || N % 2 == 0) && out.size(0) == rows &&
                  out.size(1) == width_out,
              "linear_int8: shapes x [rows, K], codes [N / 4, K / 64, 4, bytes], scales [N, K / G] "
              "with K a multiple of 64 and G 16, 32 or a multiple of 64 (Q4_K, Q6_K: codes "
              "[N / 4, K / 256, 576 or 832], scales [N, 2 K / 256 or K / 256] with K a multiple "
              "of 256), out [rows, N] (gated: [rows, N / 2])");
  std::vector<float> bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() &&
                    bias->dim() == 1 && bias->size(0) == N,
                "linear_int8: bias must be a contiguous bfloat16 [N]");
    const auto* b = reinterpret_cast<const uint16_t*>(bias->data_ptr<c10::BFloat16>());
    bias_f.resize(N);
    for (int64_t n = 0; n < N; ++n) bias_f[n] = prefixserve::bf16_bits_to_float(b[n]);
  }
  const uint16_t* res = nullptr;
  if (residual.has_value() && residual->defined()) {
    TORCH_CHECK(!gated && !out_f32 && residual->scalar_type() == torch::kBFloat16 &&
                    residual->is_contiguous() && residual->dim() == 2 &&
                    residual->size(0) == rows && residual->size(1) == N,
                "linear_int8: residual must be a contiguous bfloat16 [rows, N], plain, bf16 out");
    res = reinterpret_cast<const uint16_t*>(residual->data_ptr<c10::BFloat16>());
  }
  const int64_t G = K / groups;
  const bool half = scales.scalar_type() == torch::kHalf;
  TORCH_CHECK(!half || super || G == 32, "linear_int8: float16 scales go with a scale per 32");
  const Epilogue e{static_cast<uint16_t*>(out.data_ptr()), width_out,
                   bias_f.empty() ? nullptr : bias_f.data(), act, res, out_f32};
  const auto* x_bits = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* q = static_cast<const uint8_t*>(codes.data_ptr());
  if (super) {  // x quantized per super-block of 256 (kquant.h)
    const auto xq = kquant::quantize_x(x_bits, rows, K, threads,
                                       /*compute_bound=*/rows > kComputeBoundRows);
    const kquant::Weight w{super, q, reinterpret_cast<const uint16_t*>(scales.data_ptr()), K,
                           kquant::mixed_split(super, codes, N, K)};
    const auto sum = [&](int64_t n0, int64_t width, float* sums) {
      kquant::sum_range(w, xq, n0, width, sums);
    };
    run_chunks(sum, kquant::row_bytes(super, K), K, rows, width_out, gated, e, threads);
    return prefetch_next(rows, prefetch);
  }
  // x quantized once per call, per row and group of 32, with the codes' zero point, in the
  // weight's spans.
  const int32_t zero = bits == 8 ? kZero<8> : bits == 5 ? kZero<5> : kZero<4>;
  const XRows xq = quantize_x(x_bits, rows, K, threads, zero, widest_span(G));
  const Scales s = half ? Scales{nullptr, reinterpret_cast<const uint16_t*>(scales.data_ptr())}
                        : Scales{scales.data_ptr<float>(), nullptr};
  if (bits == 8)
    run_codes<8>(q, s, K, G, xq, rows, width_out, gated, e, threads);
  else if (bits == 5)
    run_codes<5>(q, s, K, G, xq, rows, width_out, gated, e, threads);
  else
    run_codes<4>(q, s, K, G, xq, rows, width_out, gated, e, threads);
  prefetch_next(rows, prefetch);
}
