// GGUF Q6_K weights as the file has them, in 6 bits, multiplied in super-blocks (as llama.cpp's
// Q6_K x Q8_K dot product): a weight row's 256 columns are sixteen sub-blocks of 16 codes q in
// [0, 63], each with an int8 sub-scale sc, and the super-block's fp16 d; value = d sc (q - 32).
// With x quantized per super-block as for Q4_K (kquant.h `quantize_x`, the same codes):
//
//   sum over the super-block of value x = d xs S,
//   S = sum_j sc_j (sum over sub-block j of q x) - 32 sum_j sc_j (sum of sub-block j's x codes),
//
// an exact integer (|S| <= 256 x 63 x 127 x 128 + 32 x 16 x 128 x 2032 < 2^29). Every family
// computes it exactly: the unsigned 6-bit codes times the signed x codes into 32-bit lanes of
// four products (VPDPBUSD, at most 4 x 63 x 127: a 16-bit word), two such vectors packed into
// words (VPACKSSDW) and those times the sub-scales (VPDPWSSD) on AVX-512 VNNI; into 16-bit pairs
// (VPMADDUBSW: 2 x 63 x 127 never saturates) and those times the sub-scales (VPMADDWD) on AVX2;
// 32 sc_j times minus the x sums into 32-bit lanes the same way; the portable loop in scalars.
// The float work, once per super-block and pair of rows, in one order:
//
//   acc = fma(float(S), d * xs, acc)
//
// from acc = 0 over the super-blocks in order (float(S) rounds to nearest even above 2^24 on
// every family alike). So every family writes the same bits (tests/model/test_linear_kquant.py).
//
// The layout (model/quant/weights.py `pack_q6_k`): codes uint8 [ceil(N / 4), K / 256, 832], a
// group of four rows' super-block in 832 bytes: each row's 128 bytes of low nibbles, then each
// row's 64 bytes of high bit pairs, then each row's 16 sub-scales; d fp16 [N, K / 256]. 6.5625
// bits a weight, the file's. The codes are in x's column order (kquant.h `x_column`, Q4_K's):
// byte 64p + i of a row's low nibbles holds position 128p + i's low 4 bits in its low nibble and
// position 128p + 64 + i's in its high one; bit pair t of byte 32p + l of its high bits holds
// position 128p + 32t + l's top 2 bits. A 64-byte load and a 32-byte one make two vectors of 64
// codes (a mask, a shift, a variable shift and a ternary logic op each).
#include "torch_lite.h"  // first: the build's precompiled header (kernels/pch.py)
#include "kquant.h"

#include <cmath>

#include "kquant_tiles.h"

namespace prefixserve::kquant {
namespace {

constexpr int64_t kLowBytes = 128;                          // a row's low nibbles
constexpr int64_t kHighAt = kGroupRows * kLowBytes;         // the group's high bit pairs, 64 a row
constexpr int64_t kScalesAt = kHighAt + 64 * kGroupRows;    // and sub-scales, 16 a row
constexpr int64_t kPrefetchAhead = 6;  // super-blocks a decode's stream is prefetched ahead

// The 16-column sub-block of lane l (four positions) of the vector of positions 128p + 64h ..
// + 63, of either nibble h: columns 128p + 8l + 4h .. + 3 (`x_column`), so 8p + l / 2.
constexpr int lane_sub_block(int p, int l) { return 8 * p + l / 2; }

struct Q6KTiles {
#if defined(PREFIXSERVE_KQUANT_VNNI)
  template <int NW, int NX>
  static void tile(const uint8_t* group, int64_t slot, const uint16_t* d, int64_t d_row,
                   const XSuper& xq, int64_t x0, float* out) {
    static_assert(NW <= 4 && NX <= 4, "a tile of at most 4 x 4");
    const int64_t blocks = xq.blocks;
    const __m512i low = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    // The high bit pairs to bits 4-5: positions 0-31 of a vector from bits 0-1 (low nibbles)
    // or 4-5 (high), positions 32-63 from bits 2-3 or 6-7.
    const __m512i shift_low =
        _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);  // left
    const __m512i shift_high =
        _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);  // right
    // Load p's sub-scale dwords beside its packed sums (below): in 128-bit lane L, dword m
    // sums words 2m, 2m + 1: lanes 4L + 2 (m % 2) and the next of the low nibbles' vector (m <
    // 2, h = 0) or of the high ones' (h = 1), one sub-block.
    __m512i lanes[2];
    for (int p = 0; p < 2; ++p) {
      alignas(64) int32_t idx[16];
      for (int l = 0; l < 16; ++l)
        idx[l] = lane_sub_block(p, 4 * (l / 4) + 2 * (l % 2));
      lanes[p] = _mm512_load_si512(idx);
    }
    const __m512i lane_d = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const int8_t* xc[NX];
    for (int j = 0; j < NX; ++j) xc[j] = xq.codes.data() + (x0 + j) * blocks * kSuper;
    __m512 acc_f = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = group + b * kQ6KGroupBytes;
      if constexpr (NX == 1)
        for (int64_t line = 0; line < kQ6KGroupBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchAhead * kQ6KGroupBytes + line),
                       _MM_HINT_T0);
      __m512i acc[NW][NX], scd[NW];
      for (int i = 0; i < NW; ++i) {
        // Row i's sub-scales as dwords (sc, sc) of 16-bit words; and 32 sc times minus x's
        // sums per 16 (-32 sc fits 16 bits), its offset's part.
        const __m128i sc =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kScalesAt + 16 * (slot + i)));
        const __m512i wide = _mm512_cvtepi8_epi32(sc);
        scd[i] = _mm512_ternarylogic_epi32(wide, _mm512_set1_epi32(0xFFFF),
                                           _mm512_slli_epi32(wide, 16), 0xEA);
        const __m512i sc32 = _mm512_zextsi256_si512(_mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 5));
        for (int j = 0; j < NX; ++j) {
          const __m256i sums = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(xq.sums16.data() + ((x0 + j) * blocks + b) * 16));
          acc[i][j] = _mm512_madd_epi16(
              sc32, _mm512_zextsi256_si512(_mm256_sub_epi16(_mm256_setzero_si256(), sums)));
        }
      }
      // Per load p and row, two vectors of 64 codes (h = 0, 1), each times x's codes by
      // VPDPBUSD into 32-bit lanes of four products of one sub-block (|sum| <= 4 x 63 x 127: a
      // 16-bit word), the two packed into words (VPACKSSDW, exact) and those times their
      // sub-scales by one VPDPWSSD, as the Q4_K tile (linear_q4k.cpp).
      const __m512i zero = _mm512_setzero_si512();
      for (int p = 0; p < 2; ++p)
        for (int i = 0; i < NW; ++i) {
          const __m512i lo4 = _mm512_loadu_si512(blk + kLowBytes * (slot + i) + 64 * p);
          const __m512i hi2 = _mm512_broadcast_i64x4(_mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(blk + kHighAt + 64 * (slot + i) + 32 * p)));
          // (pair & top) | nibble: the low nibbles with their top bit pairs, then the high ones.
          const __m512i w0 = _mm512_ternarylogic_epi32(_mm512_sllv_epi16(hi2, shift_low), top,
                                                       _mm512_and_si512(lo4, low), 0xEA);
          const __m512i w1 =
              _mm512_ternarylogic_epi32(_mm512_srlv_epi16(hi2, shift_high), top,
                                        _mm512_and_si512(_mm512_srli_epi16(lo4, 4), low), 0xEA);
          const __m512i s = _mm512_permutexvar_epi32(lanes[p], scd[i]);
          for (int j = 0; j < NX; ++j) {
            const int8_t* x = xc[j] + b * kSuper + 128 * p;
            const __m512i t0 = _mm512_dpbusd_epi32(zero, w0, _mm512_loadu_si512(x));
            const __m512i t1 = _mm512_dpbusd_epi32(zero, w1, _mm512_loadu_si512(x + 64));
            acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], _mm512_packs_epi32(t0, t1), s);
          }
        }
      const __m512i S = sum_pairs<NW, NX>(acc);
      const __m512 ds = _mm512_castps128_ps512(_mm_cvtph_ps(d_of<NW>(d, d_row, b)));
      const __m512 dx = _mm512_mul_ps(_mm512_permutexvar_ps(lane_d, ds), x_scales<NX>(xq, x0, b));
      acc_f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), dx, acc_f);
    }
    store_pairs<NW, NX>(acc_f, out);
  }
#elif defined(PREFIXSERVE_KQUANT_AVX2)
  // A decode's tile (one x row, 4 x 1): its own loop, measured faster at batch 1 on the AVX2
  // EPYC than the shared tile below; at most 4 pairs, lane i NX + j of one 128-bit vector. Its
  // stream is prefetched kPrefetchAhead super-blocks ahead, as the VNNI tile's: on the EPYC a
  // 1B Q4_K_M decode went from 0.86x to 1.15-1.26x llama.cpp's (BENCHMARKS.md §38).
  template <int NW, int NX>
  static void tile4(const uint8_t* group, int64_t slot, const uint16_t* d, int64_t d_row,
                    const XSuper& xq, int64_t x0, float* out) {
    static_assert(NW * NX <= 4, "a tile of at most 4 pairs");
    const int64_t blocks = xq.blocks;
    const __m256i low = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
    const int8_t* xc[NX];
    for (int j = 0; j < NX; ++j) xc[j] = xq.codes.data() + (x0 + j) * blocks * kSuper;
    alignas(16) int32_t lane_d[4];
    for (int p = 0; p < 4; ++p) lane_d[p] = p < NW * NX ? p / NX : 0;
    const __m256i idx_d =
        _mm256_castsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(lane_d)));
    __m128 acc_f = _mm_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = group + b * kQ6KGroupBytes;
      if constexpr (NX == 1)  // a decode's stream, ahead of the prefetchers
        for (int64_t line = 0; line < kQ6KGroupBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchAhead * kQ6KGroupBytes + line),
                       _MM_HINT_T0);
      __m256i acc[4], scd[NW][2];
      for (int p = 0; p < 4; ++p) acc[p] = _mm256_setzero_si256();
      for (int i = 0; i < NW; ++i) {
        const __m128i sc =
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kScalesAt + 16 * (slot + i)));
        for (int half = 0; half < 2; ++half) {  // sub-blocks 8 half .. + 7 as dwords (sc, sc)
          const __m256i wide = _mm256_cvtepi8_epi32(half ? _mm_srli_si128(sc, 8) : sc);
          scd[i][half] = _mm256_or_si256(_mm256_and_si256(wide, _mm256_set1_epi32(0xFFFF)),
                                         _mm256_slli_epi32(wide, 16));
        }
        const __m256i sc32 = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 5);
        for (int j = 0; j < NX; ++j) {
          const __m256i sums = _mm256_loadu_si256(
              reinterpret_cast<const __m256i*>(xq.sums16.data() + ((x0 + j) * blocks + b) * 16));
          acc[i * NX + j] = _mm256_madd_epi16(sc32, _mm256_sub_epi16(_mm256_setzero_si256(), sums));
        }
      }
      for (int p = 0; p < 2; ++p)
        for (int s = 0; s < 2; ++s)
          for (int h = 0; h < 2; ++h) {
            // Lane l of this half is the VNNI vector's lane 8s + l.
            const __m256i idx = _mm256_setr_epi32(
                lane_sub_block(p, 8 * s) - 8 * p, lane_sub_block(p, 8 * s + 1) - 8 * p,
                lane_sub_block(p, 8 * s + 2) - 8 * p, lane_sub_block(p, 8 * s + 3) - 8 * p,
                lane_sub_block(p, 8 * s + 4) - 8 * p, lane_sub_block(p, 8 * s + 5) - 8 * p,
                lane_sub_block(p, 8 * s + 6) - 8 * p, lane_sub_block(p, 8 * s + 7) - 8 * p);
            __m256i w[NW], sc[NW];
            for (int i = 0; i < NW; ++i) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                  blk + kLowBytes * (slot + i) + 64 * p + 32 * s));
              const __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, low);
              const __m256i hb = _mm256_loadu_si256(
                  reinterpret_cast<const __m256i*>(blk + kHighAt + 64 * (slot + i) + 32 * p));
              const int t = 2 * h + s;  // the bit pair: to bits 4-5
              const __m256i pair = t < 2    ? _mm256_slli_epi16(hb, 4 - 2 * t)
                                   : t == 2 ? hb
                                            : _mm256_srli_epi16(hb, 2);
              w[i] = _mm256_or_si256(nib, _mm256_and_si256(pair, top));
              sc[i] = _mm256_permutevar8x32_epi32(scd[i][p], idx);
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
      const __m256 ds = _mm256_castps128_ps256(_mm_cvtph_ps(d_of<NW>(d, d_row, b)));
      const __m128 dx = _mm_mul_ps(_mm256_castps256_ps128(_mm256_permutevar8x32_ps(ds, idx_d)),
                                   x_scales4<NW, NX>(xq, x0, b));
      acc_f = _mm_fmadd_ps(_mm_cvtepi32_ps(S), dx, acc_f);
    }
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, acc_f);
    for (int p = 0; p < NW * NX; ++p) out[p] = lanes[p];
  }
  // More x rows: kquant_tiles.h's `avx2_tile` (2 x 4 or 2 x 2: eight pairs at most).
  template <int NW, int NX>
  static void tile(const uint8_t* group, int64_t slot, const uint16_t* d, int64_t d_row,
                   const XSuper& xq, int64_t x0, float* out) {
    avx2_tile_or_decode<Q6KTiles, NW, NX>(group, slot, d, d_row, xq, x0, out);
  }

  static constexpr int64_t kGroupBytes = kQ6KGroupBytes;
  // The offset's part of a pair's sum: 32 sc times minus x row j's sums per 16 (-32 sc fits
  // 16 bits).
  static __m256i start(const uint8_t* blk, int64_t slot, const XSuper& xq, int64_t x,
                       int64_t b) {
    const __m128i sc =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kScalesAt + 16 * slot));
    const __m256i sc32 = _mm256_slli_epi16(_mm256_cvtepi8_epi16(sc), 5);
    const __m256i sums = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(xq.sums16.data() + (x * xq.blocks + b) * 16));
    return _mm256_madd_epi16(sc32, _mm256_sub_epi16(_mm256_setzero_si256(), sums));
  }
  // Step (p, s, h): 32 codes (low nibble, high bit pair to bits 4-5) and each dword lane's
  // sub-scale: lane l is the VNNI vector's lane 8 s + l.
  template <int p, int s, int h>
  static void decode(const uint8_t* blk, int64_t slot, __m256i& w, __m256i& sc) {
    const __m256i v = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(blk + kLowBytes * slot + 64 * p + 32 * s));
    const __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    const __m256i hb = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(blk + kHighAt + 64 * slot + 32 * p));
    constexpr int t = 2 * h + s;  // the bit pair: to bits 4-5
    const __m256i pair = t < 2    ? _mm256_slli_epi16(hb, 4 - 2 * t)
                         : t == 2 ? hb
                                  : _mm256_srli_epi16(hb, 2);
    w = _mm256_or_si256(nib, _mm256_and_si256(pair, _mm256_set1_epi8(0x30)));
    // Lanes 0-1 take sub-block k, 2-3 k + 1, 4-5 k + 2, 6-7 k + 3 (the VNNI vector's lanes
    // 8 s .. 8 s + 7: `lane_sub_block`), as 16-bit words (four a sub-block).
    constexpr int k = 8 * p + 4 * s;
    static_assert(lane_sub_block(p, 8 * s) == k && lane_sub_block(p, 8 * s + 7) == k + 3,
                  "a step's lanes take four sub-blocks");
    const __m128i sub =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + kScalesAt + 16 * slot));
    sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(
        sub, _mm_setr_epi8(k, k, k, k, k + 1, k + 1, k + 1, k + 1, k + 2, k + 2, k + 2, k + 2,
                           k + 3, k + 3, k + 3, k + 3)));
  }
  template <int NW, int NX>
  static __m256 finish(__m256i S, const uint8_t* blk, int64_t slot, const uint16_t* d,
                       int64_t d_row, const XSuper& xq, int64_t x0, int64_t b, __m256 acc) {
    const __m256 dx = _mm256_mul_ps(row_lanes<NW, NX>(d_of<NW>(d, d_row, b), 1, 0),
                                    x_scales<NW, NX>(xq, x0, b));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), dx, acc);
  }
#else
  template <int NW, int NX>
  static void tile(const uint8_t* group, int64_t slot, const uint16_t* d, int64_t /*d_row*/,
                   const XSuper& xq, int64_t x0, float* out) {
    static_assert(NW == 1 && NX == 1, "the portable tile is one pair");
    const int64_t blocks = xq.blocks;
    const int8_t* xc = xq.codes.data() + x0 * blocks * kSuper;
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = group + b * kQ6KGroupBytes;
      const uint8_t* lo4 = blk + kLowBytes * slot;
      const uint8_t* hi2 = blk + kHighAt + 64 * slot;
      const auto* sc = reinterpret_cast<const int8_t*>(blk + kScalesAt + 16 * slot);
      int32_t dots[16] = {0};
      for (int64_t pos = 0; pos < kSuper; ++pos) {
        const int64_t p = pos / 128, h = (pos / 64) % 2, i = pos % 64;
        const int32_t nib = (lo4[64 * p + i] >> (4 * h)) & 0x0F;
        const int32_t pair = (hi2[32 * p + i % 32] >> (2 * (2 * h + i / 32))) & 3;
        dots[x_column(pos) / 16] += (nib | (pair << 4)) * xc[b * kSuper + pos];
      }
      int32_t S = 0;
      for (int k = 0; k < 16; ++k)
        S += sc[k] * dots[k] - 32 * sc[k] * xq.sums16[(x0 * blocks + b) * 16 + k];
      const float dx = half_to_float(d[b]) * xq.scale[b * xq.rows + x0];
      acc = std::fma(static_cast<float>(S), dx, acc);
    }
    out[0] = acc;
  }
#endif

#if defined(PREFIXSERVE_KQUANT_VNNI) || defined(PREFIXSERVE_KQUANT_AVX2)
  // Rows 0..NW-1's d of super-block b: halves [d0, d1, d2, d3] (0 past NW).
  template <int NW>
  static __m128i d_of(const uint16_t* d, int64_t d_row, int64_t b) {
    const auto at = [&](int i) { return i < NW ? static_cast<int16_t>(d[i * d_row + b]) : 0; };
    return _mm_setr_epi16(at(0), at(1), at(2), at(3), 0, 0, 0, 0);
  }
#endif
};

}  // namespace

void sum_range_q6k(const uint8_t* codes, const uint16_t* d, int64_t scales_per_row,
                   const XSuper& xq, int64_t n0, int64_t width, float* sums, int64_t ld) {
  walk<Rows<Q6KTiles>>(codes, kQ6KGroupBytes, d, scales_per_row, xq, n0, width, sums, ld);
}

}  // namespace prefixserve::kquant
