// GGUF Q4_K weights as the file has them, multiplied in super-blocks (as llama.cpp's Q4_K x Q8_K
// dot product): a weight row's 256 columns are eight sub-blocks of 32 codes q in [0, 15], each
// with a 6-bit sub-scale sc and sub-min m, and the super-block's fp16 d and dmin; value =
// d sc q - dmin m. x is quantized per super-block (scale amax / 127, codes rounded to nearest
// even in [-127, 127], as linear_int8's per 32), with the sum of each sub-block's codes. Then
//
//   sum over the super-block of value x = d xs S - dmin xs M,
//   S = sum_j sc_j (sum over sub-block j of q x),  M = sum_j m_j (sum of sub-block j's x codes),
//
// with S and M exact integers (|S| <= 8 x 63 x 32 x 15 x 127 < 2^25, |M| < 2^21: int32). Every
// family computes them exactly, in whatever order suits its instructions: AVX-512 VNNI multiplies
// the unsigned codes by the signed x codes into 16-bit pairs (VPMADDUBSW: 2 x 15 x 127 never
// saturates) and those by the sub-scales into 32-bit lanes (VPDPWSSD); AVX2 the same with
// VPMADDWD; the portable loop in scalars. The float work is once per super-block and pair of a
// weight row and an x row, in one order everywhere:
//
//   acc = fma(float(S), d * xs, acc);  acc = fma(-float(M), dmin * xs, acc)
//
// (float(S) rounds to nearest even above 2^24, on every family alike), from acc = 0 over the
// super-blocks in order. So every family writes the same bits (tests/model/test_linear_q4k.py),
// and a row's result never depends on the other rows of the call. The float arithmetic is one
// fused multiply-add pair per 256 weights where the per-32 path took two per 4 columns' lane.
//
// The layout (model/quant/weights.py `pack_q4_k`): codes uint8 [ceil(N / 4), K / 256, 576], a
// group of four rows' super-block in 576 bytes: the four rows' 128 bytes of nibbles in the
// file's order (byte 32c + l: column 64c + l in the low nibble, 64c + 32 + l in the high one),
// then their sub-scales (8 bytes a row), then their sub-mins (8 a row); d_dmin fp16 [N, 2 K / 256]
// (each super-block's d, dmin). 4.625 bits a weight (the file's 4.5 packs the sub-scales in 6
// bits). A 64-byte load of a row is 128 columns: its low nibbles are columns 0-31 and 64-95 of
// them, its high nibbles 32-63 and 96-127, so x's codes are stored in that order (`x_column`) and
// each 32-bit lane's four products lie in one sub-block.
#include "linear_q4k.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>

#include "bf16_bits.h"
#include "stream_pool.h"

namespace prefixserve::q4k {
namespace {

constexpr int64_t kCodeBytes = 128;                       // a row's nibbles of a super-block
constexpr int64_t kScalesAt = kGroupRows * kCodeBytes;    // the group's sub-scales, 8 a row
constexpr int64_t kMinsAt = kScalesAt + 8 * kGroupRows;   // and sub-mins, 8 a row
#ifndef PREFIXSERVE_Q4K_AHEAD
#define PREFIXSERVE_Q4K_AHEAD 8
#endif
constexpr int64_t kPrefetchAhead = PREFIXSERVE_Q4K_AHEAD;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define PREFIXSERVE_Q4K_VNNI 1
constexpr int kTileW = 4, kTileX = 4, kMaxPairs = 16;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PREFIXSERVE_Q4K_AVX2 1
// Pairs of a tile at most 4 (one 128-bit vector of accumulators): 4 x 1 at batch 1, else 2 x 2.
constexpr int kTileW = 4, kTileX = 2, kMaxPairs = 4;
#else
constexpr int kTileW = 1, kTileX = 1, kMaxPairs = 1;
#endif

// The column (within its super-block) of x's code at position q: the order of the weight's
// nibbles, 64 bytes (128 columns) at a time, low nibbles first.
constexpr int64_t x_column(int64_t q) {
  const int64_t pair = q / 128, high = (q / 64) % 2, r = q % 64;
  return 64 * (2 * pair + r / 32) + 32 * high + r % 32;
}

inline float half_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// Sub-block of the 32 codes at byte half s (0: bytes 0-31, 1: 32-63) of 64-byte load `pair`,
// nibble `high`: 4 pair + 2 s + high.
constexpr int sub_block(int pair, int s, int high) { return 4 * pair + 2 * s + high; }

#if defined(PREFIXSERVE_Q4K_VNNI) || defined(PREFIXSERVE_Q4K_AVX2)
// Rows 0..NW-1's (d, dmin) of super-block b as 8 halves [d0, dmin0, d1, dmin1, ...] (0 past NW).
template <int NW>
inline __m128i d_dmin_of(const uint16_t* dd, int64_t dd_row, int64_t b) {
  const auto at = [&](int i) {
    int32_t two = 0;
    if (i < NW) std::memcpy(&two, dd + i * dd_row + 2 * b, sizeof two);
    return two;
  };
  return _mm_setr_epi32(at(0), at(1), at(2), at(3));
}
#endif

#if defined(PREFIXSERVE_Q4K_VNNI)
// Sums of 16-lane vectors, four steps of halving: a pair's lanes folded together, exact.
inline __m512i fold_a(__m512i a, __m512i b) {  // [a's 8 | b's 8]
  return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x44), _mm512_shuffle_i64x2(a, b, 0xEE));
}
inline __m512i fold_b(__m512i a, __m512i b) {  // 128-bit lanes: a's halves' 4, then b's
  return _mm512_add_epi32(_mm512_shuffle_i64x2(a, b, 0x88), _mm512_shuffle_i64x2(a, b, 0xDD));
}
inline __m512i fold_c(__m512i a, __m512i b) {  // within 128 bits: [a 2, b 2]
  return _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
}
inline __m512i fold_d(__m512i a, __m512i b) {  // within 128 bits: [a 1, a 1, b 1, b 1]
  const __m512 fa = _mm512_castsi512_ps(a), fb = _mm512_castsi512_ps(b);
  return _mm512_add_epi32(_mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0x88)),
                          _mm512_castps_si512(_mm512_shuffle_ps(fa, fb, 0xDD)));
}

// The sums of vectors given as the 128-bit stage (u[k]'s 128-bit lane q: four partial sums of
// pair (q, k)) in lane 4q + k; u[k] for k >= NX is absent (zero).
template <int NX>
inline __m512i fold_pairs(const __m512i (&u)[4]) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i w0 = fold_c(u[0], NX > 1 ? u[1] : zero);
  if constexpr (NX <= 2) return fold_d(w0, zero);
  const __m512i w1 = fold_c(u[2], NX > 3 ? u[3] : zero);
  return fold_d(w0, w1);
}

// Lane 4i + j: the sum of acc[i][j]'s sixteen lanes.
template <int NW, int NX>
inline __m512i sum_pairs(const __m512i (&acc)[NW][NX]) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i u[4];
  for (int j = 0; j < 4; ++j) {
    if (j >= NX) {
      u[j] = zero;
      continue;
    }
    // Rows 0-1 and 2-3 folded to 8 lanes each, then to four 128-bit lanes (row i in lane i).
    const __m512i t0 = fold_a(acc[0][j], NW > 1 ? acc[NW > 1 ? 1 : 0][j] : zero);
    const __m512i t1 = NW > 2 ? fold_a(acc[NW > 2 ? 2 : 0][j], acc[NW > 3 ? 3 : 0][j]) : zero;
    u[j] = fold_b(t0, t1);
  }
  return fold_pairs<NX>(u);
}

// A tile of NW weight rows (slots slot.. of one packed group) by NX x rows (from x0).
template <int NW, int NX>
void tile(const uint8_t* group, int64_t slot, const uint16_t* dd, int64_t dd_row,
          const XSuper& xq, int64_t x0, float* out) {
  static_assert(NW <= 4 && NX <= 4, "a tile of at most 4 x 4");
  const int64_t blocks = xq.blocks;
  const __m512i low = _mm512_set1_epi8(0x0F);
  // The sub-scale of each lane's sub-block as 16-bit words (pshufb of the row's 8 bytes).
  __m512i masks[4];
  for (int p = 0; p < 2; ++p)
    for (int h = 0; h < 2; ++h)
      masks[2 * p + h] = _mm512_inserti64x4(
          _mm512_castsi256_si512(
              _mm256_set1_epi16(static_cast<int16_t>(0x8000 | sub_block(p, 0, h)))),
          _mm256_set1_epi16(static_cast<int16_t>(0x8000 | sub_block(p, 1, h))), 1);
  // Lane 4i + j of the float work takes row i's d (or dmin) and x row j's scale.
  const __m512i lane_d = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
  const __m512i lane_x = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  const __mmask8 x_rows = static_cast<__mmask8>((1u << NX) - 1);
  const int8_t* xc[NX];
  for (int j = 0; j < NX; ++j) xc[j] = xq.codes.data() + (x0 + j) * blocks * kSuper;
  __m512 acc_f = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kGroupBytes;
    if constexpr (NX == 1 && kPrefetchAhead > 0)  // a decode's stream, ahead of the prefetchers
      for (int64_t line = 0; line < kGroupBytes; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchAhead * kGroupBytes + line),
                     _MM_HINT_T0);
    __m512i acc[NW][NX];
    for (int i = 0; i < NW; ++i)
      for (int j = 0; j < NX; ++j) acc[i][j] = _mm512_setzero_si512();
    for (int p = 0; p < 2; ++p)
      for (int h = 0; h < 2; ++h) {
        __m512i w[NW], s[NW];
        for (int i = 0; i < NW; ++i) {
          const __m512i v = _mm512_loadu_si512(blk + kCodeBytes * (slot + i) + 64 * p);
          w[i] = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, low);
          int64_t sc;
          std::memcpy(&sc, blk + kScalesAt + 8 * (slot + i), sizeof sc);
          s[i] = _mm512_shuffle_epi8(_mm512_set1_epi64(sc), masks[2 * p + h]);
        }
        for (int j = 0; j < NX; ++j) {
          const __m512i xv = _mm512_loadu_si512(xc[j] + b * kSuper + 128 * p + 64 * h);
          for (int i = 0; i < NW; ++i)
            acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], _mm512_maddubs_epi16(w[i], xv), s[i]);
        }
      }
    const __m512i S = sum_pairs<NW, NX>(acc);
    // M: the group's sub-mins (row i's eight in 128-bit lane i) times x row j's sub-block sums.
    const __m512i mins = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kMinsAt)));
    __m512i u[4];
    for (int j = 0; j < 4; ++j) {
      if (j >= NX) {
        u[j] = _mm512_setzero_si512();
        continue;
      }
      const __m128i sums = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(xq.sums.data() + ((x0 + j) * blocks + b) * 8));
      u[j] = _mm512_madd_epi16(mins, _mm512_broadcast_i32x4(sums));
    }
    const __m512i M = fold_pairs<NX>(u);
    // Rows' (d, dmin) as floats [d0, dmin0, d1, dmin1, ...]; x rows' scales.
    const __m512 d_dmin = _mm512_castps256_ps512(_mm256_cvtph_ps(d_dmin_of<NW>(dd, dd_row, b)));
    const __m512 xs = NX == 1 ? _mm512_set1_ps(xq.scale[b * xq.rows + x0])
                              : _mm512_castps128_ps512(
                                    _mm_maskz_loadu_ps(x_rows, xq.scale.data() + b * xq.rows + x0));
    const __m512 xs_lanes = NX == 1 ? xs : _mm512_permutexvar_ps(lane_x, xs);
    const __m512 dx = _mm512_mul_ps(_mm512_permutexvar_ps(lane_d, d_dmin), xs_lanes);
    const __m512 mx = _mm512_mul_ps(
        _mm512_permutexvar_ps(_mm512_add_epi32(lane_d, _mm512_set1_epi32(1)), d_dmin), xs_lanes);
    acc_f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), dx, acc_f);
    acc_f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(M), mx, acc_f);
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc_f);
  for (int i = 0; i < NW; ++i)
    for (int j = 0; j < NX; ++j) out[i * NX + j] = lanes[4 * i + j];
}
#elif defined(PREFIXSERVE_Q4K_AVX2)
// Lane p of the result: the sum of v[p]'s eight lanes (p < 4).
inline __m128i sum_four(const __m256i (&v)[4]) {
  const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// As the VNNI tile, on 256-bit vectors, with pairs at most 4 (lane i NX + j).
template <int NW, int NX>
void tile(const uint8_t* group, int64_t slot, const uint16_t* dd, int64_t dd_row,
          const XSuper& xq, int64_t x0, float* out) {
  static_assert(NW * NX <= 4, "a tile of at most 4 pairs");
  const int64_t blocks = xq.blocks;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const int8_t* xc[NX];
  for (int j = 0; j < NX; ++j) xc[j] = xq.codes.data() + (x0 + j) * blocks * kSuper;
  alignas(16) int32_t lane_d[4], lane_x[4];
  for (int p = 0; p < 4; ++p) {
    lane_d[p] = p < NW * NX ? 2 * (p / NX) : 0;
    lane_x[p] = p < NW * NX ? p % NX : 0;
  }
  const __m256i idx_d = _mm256_castsi128_si256(_mm_load_si128(reinterpret_cast<__m128i*>(lane_d)));
  const __m256i idx_x = _mm256_castsi128_si256(_mm_load_si128(reinterpret_cast<__m128i*>(lane_x)));
  __m128 acc_f = _mm_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kGroupBytes;
    __m256i acc[4];
    for (int p = 0; p < 4; ++p) acc[p] = _mm256_setzero_si256();
    for (int p = 0; p < 2; ++p)
      for (int s = 0; s < 2; ++s)
        for (int h = 0; h < 2; ++h) {
          const __m256i mask = _mm256_set1_epi16(static_cast<int16_t>(0x8000 | sub_block(p, s, h)));
          __m256i w[NW], sc[NW];
          for (int i = 0; i < NW; ++i) {
            const __m256i v = _mm256_loadu_si256(
                reinterpret_cast<const __m256i*>(blk + kCodeBytes * (slot + i) + 64 * p + 32 * s));
            w[i] = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, low);
            int64_t eight;
            std::memcpy(&eight, blk + kScalesAt + 8 * (slot + i), sizeof eight);
            sc[i] = _mm256_shuffle_epi8(_mm256_set1_epi64x(eight), mask);
          }
          for (int j = 0; j < NX; ++j) {
            const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                xc[j] + b * kSuper + 128 * p + 64 * h + 32 * s));
            for (int i = 0; i < NW; ++i)
              acc[i * NX + j] = _mm256_add_epi32(
                  acc[i * NX + j], _mm256_madd_epi16(_mm256_maddubs_epi16(w[i], xv), sc[i]));
          }
        }
    const __m128i S = sum_four(acc);
    // M, pair by pair: row i's sub-mins times x row j's sub-block sums.
    __m128i m[4];
    for (int p = 0; p < 4; ++p) {
      if (p >= NW * NX) {
        m[p] = _mm_setzero_si128();
        continue;
      }
      const int i = p / NX, j = p % NX;
      const __m128i mins = _mm_cvtepu8_epi16(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + kMinsAt + 8 * (slot + i))));
      const __m128i sums = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(xq.sums.data() + ((x0 + j) * blocks + b) * 8));
      m[p] = _mm_madd_epi16(mins, sums);
    }
    const __m128i M = _mm_hadd_epi32(_mm_hadd_epi32(m[0], m[1]), _mm_hadd_epi32(m[2], m[3]));
    const __m256 d_dmin = _mm256_cvtph_ps(d_dmin_of<NW>(dd, dd_row, b));
    float xs_rows[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int j = 0; j < NX; ++j) xs_rows[j] = xq.scale[b * xq.rows + x0 + j];
    const __m256 xs = _mm256_castps128_ps256(_mm_loadu_ps(xs_rows));
    const __m128 xs_lanes = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(xs, idx_x));
    const __m128 dx = _mm_mul_ps(
        _mm256_castps256_ps128(_mm256_permutevar8x32_ps(d_dmin, idx_d)), xs_lanes);
    const __m128 mx = _mm_mul_ps(
        _mm256_castps256_ps128(_mm256_permutevar8x32_ps(
            d_dmin, _mm256_add_epi32(idx_d, _mm256_set1_epi32(1)))),
        xs_lanes);
    acc_f = _mm_fmadd_ps(_mm_cvtepi32_ps(S), dx, acc_f);
    acc_f = _mm_fnmadd_ps(_mm_cvtepi32_ps(M), mx, acc_f);
  }
  alignas(16) float lanes[4];
  _mm_store_ps(lanes, acc_f);
  for (int p = 0; p < NW * NX; ++p) out[p] = lanes[p];
}
#else
// One weight row by one x row in scalars.
template <int NW, int NX>
void tile(const uint8_t* group, int64_t slot, const uint16_t* dd, int64_t /*dd_row*/,
          const XSuper& xq, int64_t x0, float* out) {
  static_assert(NW == 1 && NX == 1, "the portable tile is one pair");
  const int64_t blocks = xq.blocks;
  const int8_t* xc = xq.codes.data() + x0 * blocks * kSuper;
  float acc = 0.0f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = group + b * kGroupBytes;
    const uint8_t* codes = blk + kCodeBytes * slot;
    int32_t S = 0;
    for (int p = 0; p < 2; ++p)
      for (int s = 0; s < 2; ++s)
        for (int h = 0; h < 2; ++h) {
          int32_t dot = 0;
          for (int t = 0; t < 32; ++t) {
            const int32_t q = (codes[64 * p + 32 * s + t] >> (4 * h)) & 0x0F;
            dot += q * xc[b * kSuper + 128 * p + 64 * h + 32 * s + t];
          }
          S += blk[kScalesAt + 8 * slot + sub_block(p, s, h)] * dot;
        }
    int32_t M = 0;
    for (int k = 0; k < 8; ++k)
      M += blk[kMinsAt + 8 * slot + k] * xq.sums[(x0 * blocks + b) * 8 + k];
    const float xs = xq.scale[b * xq.rows + x0];
    const float dx = half_to_float(dd[2 * b]) * xs;
    const float mx = half_to_float(dd[2 * b + 1]) * xs;
    acc = std::fma(static_cast<float>(S), dx, acc);
    acc = std::fma(-static_cast<float>(M), mx, acc);
  }
  out[0] = acc;
}
#endif

// A tile of up to kTileW weight rows by up to kTileX x rows (the remainders their own
// instantiations).
template <int NW>
void tile_x(const uint8_t* group, int64_t slot, const uint16_t* dd, int64_t dd_row,
            const XSuper& xq, int64_t x0, int64_t nx, float* out) {
  if constexpr (kTileX >= 4 && NW * 4 <= kMaxPairs) {
    if (nx >= 4) return tile<NW, 4>(group, slot, dd, dd_row, xq, x0, out);
  }
  if constexpr (kTileX >= 2 && NW * 2 <= kMaxPairs) {
    if (nx >= 2) return tile<NW, 2>(group, slot, dd, dd_row, xq, x0, out);
  }
  tile<NW, 1>(group, slot, dd, dd_row, xq, x0, out);
}

}  // namespace

bool is_layout(const torch::Tensor& codes, const torch::Tensor& scales) {
  return codes.dim() == 3 && codes.scalar_type() == torch::kByte &&
         codes.size(2) == kGroupBytes && scales.dim() == 2 &&
         scales.scalar_type() == torch::kHalf;
}

bool shapes_fit(const torch::Tensor& codes, const torch::Tensor& scales, int64_t N, int64_t K) {
  return K % kSuper == 0 && codes.size(0) == (N + kGroupRows - 1) / kGroupRows &&
         codes.size(1) == K / kSuper && scales.size(0) == N && scales.size(1) == 2 * K / kSuper &&
         codes.is_contiguous() && scales.is_contiguous();
}

XSuper quantize_x(const uint16_t* x, int64_t rows, int64_t K, int64_t threads,
                  bool compute_bound) {
  const int64_t blocks = K / kSuper;
  XSuper q{rows, blocks, std::vector<int8_t>(rows * K), std::vector<float>(rows * blocks),
           std::vector<int16_t>(rows * blocks * 8)};
  prefixserve::stream_pool().run(rows, rows < 8 ? 1 : threads, [&](int64_t r) {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* src = x + r * K + b * kSuper;
      float v[kSuper], amax = 0.0f;
      for (int t = 0; t < kSuper; ++t) {
        v[t] = prefixserve::bf16_bits_to_float(src[t]);
        amax = std::max(amax, std::fabs(v[t]));
      }
      const float scale = amax / 127.0f;
      int8_t c[kSuper];
      for (int t = 0; t < kSuper; ++t) {
        const float code = scale > 0.0f ? std::nearbyint(v[t] / scale) : 0.0f;
        c[t] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, code)));
      }
      int8_t* dst = q.codes.data() + r * K + b * kSuper;
      for (int64_t pos = 0; pos < kSuper; ++pos) dst[pos] = c[x_column(pos)];
      q.scale[b * rows + r] = scale;
      for (int k = 0; k < 8; ++k) {
        int32_t sum = 0;
        for (int t = 0; t < 32; ++t) sum += c[32 * k + t];
        q.sums[(r * blocks + b) * 8 + k] = static_cast<int16_t>(sum);
      }
    }
  }, compute_bound);
  return q;
}

void sum_range(const uint8_t* codes, const uint16_t* d_dmin, int64_t K, const XSuper& xq,
               int64_t n0, int64_t width, float* sums) {
  const int64_t blocks = K / kSuper, dd_row = 2 * blocks, rows = xq.rows;
  float out[kTileW * kTileX];
  for (int64_t m0 = 0; m0 < rows;) {
    const int64_t more = rows - m0;
    const int64_t tx = kTileX >= 4 && more >= 4 ? 4 : kTileX >= 2 && more >= 2 ? 2 : 1;
    // Weight rows a tile takes with tx x rows: kTileW with one, fewer where pairs are bounded.
    const int64_t tile_w = std::max<int64_t>(1, std::min<int64_t>(kTileW, kMaxPairs / tx));
    for (int64_t n = 0; n < width;) {
      const int64_t r = n0 + n, slot = r % kGroupRows, left = width - n;
      const int64_t nw = slot == 0 && left >= 4 && tile_w >= 4       ? 4
                         : slot % 2 == 0 && left >= 2 && tile_w >= 2 ? 2
                                                                     : 1;
      const uint8_t* group = codes + (r / kGroupRows) * blocks * kGroupBytes;
      const uint16_t* dd = d_dmin + r * dd_row;
      if (nw == 4) {
        if constexpr (kTileW >= 4) tile_x<4>(group, slot, dd, dd_row, xq, m0, tx, out);
      } else if (nw == 2) {
        if constexpr (kTileW >= 2) tile_x<2>(group, slot, dd, dd_row, xq, m0, tx, out);
      } else {
        tile_x<1>(group, slot, dd, dd_row, xq, m0, tx, out);
      }
      for (int64_t i = 0; i < nw; ++i)
        for (int64_t j = 0; j < tx; ++j) sums[(m0 + j) * width + n + i] = out[i * tx + j];
      n += nw;
    }
    m0 += tx;
  }
}

}  // namespace prefixserve::q4k
