// GGUF Q4_K weights as the file has them, multiplied in super-blocks (as llama.cpp's Q4_K x Q8_K
// dot product): a weight row's 256 columns are eight sub-blocks of 32 codes q in [0, 15], each
// with a 6-bit sub-scale sc and sub-min m, and the super-block's fp16 d and dmin; value =
// d sc q - dmin m. x is quantized per super-block (scale amax / 127, codes rounded to nearest
// even in [-127, 127], as linear_int8's per 32; kquant.h `quantize_x`), with the sum of each
// sub-block's codes. Then
//
//   sum over the super-block of value x = d xs S - dmin xs M,
//   S = sum_j sc_j (sum over sub-block j of q x),  M = sum_j m_j (sum of sub-block j's x codes),
//
// with S and M exact integers (|S| <= 8 x 63 x 32 x 15 x 127 < 2^25, |M| < 2^21: int32). Every
// family computes them exactly, in whatever order suits its instructions: AVX-512 VNNI multiplies
// the unsigned codes by the signed x codes into 32-bit lanes of eight products of one sub-block
// (two VPDPBUSD, a load's low and high nibbles: each lane's sum, at most 8 x 15 x 127, fits a
// 16-bit word), packs two such vectors into words (VPACKSSDW) and those by the sub-scales into
// 32-bit lanes (VPDPWSSD); AVX2 multiplies into
// 16-bit pairs (VPMADDUBSW: 2 x 15 x 127 never saturates) and those by the sub-scales (VPMADDWD);
// the portable loop in scalars. The float work is once per super-block and pair of a
// weight row and an x row, in one order everywhere:
//
//   acc = fma(float(S), d * xs, acc);  acc = fma(-float(M), dmin * xs, acc)
//
// (float(S) rounds to nearest even above 2^24, on every family alike), from acc = 0 over the
// super-blocks in order. So every family writes the same bits (tests/model/test_linear_kquant.py),
// and a row's result never depends on the other rows of the call. The float arithmetic is one
// fused multiply-add pair per 256 weights where the per-32 path took two per 4 columns' lane.
//
// The layout (model/quant/weights.py `pack_q4_k`): codes uint8 [ceil(N / 4), K / 256, 576], a
// group of four rows' super-block in 576 bytes: the four rows' 128 bytes of nibbles (byte 4 L +
// t of load p, the row's bytes 64 p..: column 128 p + 8 L + t in the low nibble, + 4 in the high
// one), then their sub-scales (8 bytes a row), then their sub-mins (8 a row); d_dmin fp16
// [N, 2 K / 256] (each super-block's d, dmin). 4.625 bits a weight (the file's 4.5 packs the
// sub-scales in 6 bits). A 64-byte load of a row is 128 columns, four sub-blocks: 32-bit lane L
// holds eight codes of sub-block 4 p + L / 4, four in its low nibbles and four in its high ones,
// and x's codes are stored in that order (kquant.h `x_column`), so both nibbles' products of a
// lane are summed in one 32-bit lane.
//
// Tiles (kquant_tiles.h): up to 4 weight rows by 4 x rows on AVX-512 (the 16 pairs' integer sums
// folded into one vector's lanes, then the float work for all 16 at once); on AVX2 4 x 1 at batch
// 1 and 2 x 4 above (the tile kquant_tiles.h's `avx2_tile` shares with Q6_K: eight pairs' float
// work in one vector); one pair on the portable loop. A decode's tile (one x row) prefetches its
// stream kPrefetchAhead super-blocks ahead.
#include "torch_lite.h"  // first: the build's precompiled header (kernels/pch.py)
#include "kquant.h"

#include <cmath>

#include "bf16_bits.h"
#include "kquant_tiles.h"
#include "stream_pool.h"

namespace prefixserve::kquant {
namespace {

constexpr int64_t kCodeBytes = 128;                       // a row's nibbles of a super-block
constexpr int64_t kScalesAt = kGroupRows * kCodeBytes;    // the group's sub-scales, 8 a row
constexpr int64_t kMinsAt = kScalesAt + 8 * kGroupRows;   // and sub-mins, 8 a row
// Super-blocks a decode's stream is prefetched ahead (the hardware's prefetchers ramp up on each
// chunk's new stream).
constexpr int64_t kPrefetchAhead = 8;

// Sub-block of the codes in bytes 16 q .. 16 q + 15 of 64-byte load `pair` (both nibbles:
// `x_column`'s lanes 4 q .. 4 q + 3): 4 pair + q.
constexpr int sub_block(int pair, int q) { return 4 * pair + q; }

#if defined(PREFIXSERVE_KQUANT_AVX2)
// The pshufb mask of half s (bytes 32 s..) of load p's sub-scale words, of the row's 8 bytes
// set twice in each 128-bit lane: words 0-7 (bytes 0-15 of the half, VPMADDUBSW's pairs) take
// sub-block sub_block(p, 2 s), words 8-15 the next.
inline __m256i sub_scale_mask(int p, int s) {
  return _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>(0x8000 | sub_block(p, 2 * s))),
                           _mm_set1_epi16(static_cast<int16_t>(0x8000 | sub_block(p, 2 * s + 1))));
}
#endif

struct Q4KTiles {
#if defined(PREFIXSERVE_KQUANT_VNNI)
  // A tile of NW weight rows (slots slot.. of one packed group) by NX x rows (from x0).
  template <int NW, int NX>
  static void tile(const uint8_t* group, int64_t slot, const uint16_t* dd, int64_t dd_row,
                   const XSuper& xq, int64_t x0, float* out) {
    static_assert(NW <= 4 && NX <= 4, "a tile of at most 4 x 4");
    const int64_t blocks = xq.blocks;
    const __m512i low = _mm512_set1_epi8(0x0F);
    // The sub-scales as 16-bit words beside the packed sums of both loads (below): in 128-bit
    // lane L, words 0-3 load 0's lanes 4 L.. (sub-block L), words 4-7 load 1's (4 + L) (pshufb
    // of the row's 8 bytes).
    alignas(64) int16_t words[32];
    for (int k = 0; k < 32; ++k)
      words[k] = static_cast<int16_t>(0x8000 | sub_block((k % 8) / 4, k / 8));
    const __m512i mask = _mm512_load_si512(words);
    // Lane 4i + j of the float work takes row i's d (or dmin): [d0, dmin0, d1, dmin1, ...].
    const __m512i lane_d = _mm512_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2, 4, 4, 4, 4, 6, 6, 6, 6);
    const __m512i lane_m = _mm512_add_epi32(lane_d, _mm512_set1_epi32(1));
    const int8_t* xc[NX];
    for (int j = 0; j < NX; ++j) xc[j] = xq.codes.data() + (x0 + j) * blocks * kSuper;
    __m512 acc_f = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = group + b * kQ4KGroupBytes;
      if constexpr (NX == 1)  // a decode's stream, ahead of the prefetchers
        for (int64_t line = 0; line < kQ4KGroupBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchAhead * kQ4KGroupBytes + line),
                       _MM_HINT_T0);
      __m512i acc[NW][NX];
      for (int i = 0; i < NW; ++i)
        for (int j = 0; j < NX; ++j) acc[i][j] = _mm512_setzero_si512();
      // A 64-byte load of row i (load p) is two vectors of codes, its low and high nibbles,
      // whose 32-bit lanes' codes lie in one sub-block (`x_column`): both times x's codes by
      // VPDPBUSD into the same 32-bit lanes, eight products of one sub-block each (|sum| <= 8 x
      // 15 x 127: a 16-bit word); the two loads' lanes packed into words (VPACKSSDW, exact) and
      // those times their sub-scales into the pair's sums (VPDPWSSD). Five multiplies for 256
      // columns, on the one port Zen 4 multiplies on, where packing each load's nibbles apart
      // (two sub-blocks a lane pair) took six and twice the packs (BENCHMARKS.md §46, §53).
      const __m512i zero = _mm512_setzero_si512();
      for (int i = 0; i < NW; ++i) {
        const uint8_t* row = blk + kCodeBytes * (slot + i);
        const __m512i v0 = _mm512_loadu_si512(row), v1 = _mm512_loadu_si512(row + 64);
        const __m512i lo0 = _mm512_and_si512(v0, low);
        const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), low);
        const __m512i lo1 = _mm512_and_si512(v1, low);
        const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), low);
        int64_t sc;
        std::memcpy(&sc, blk + kScalesAt + 8 * (slot + i), sizeof sc);
        const __m512i s = _mm512_shuffle_epi8(_mm512_set1_epi64(sc), mask);
        for (int j = 0; j < NX; ++j) {
          const int8_t* x = xc[j] + b * kSuper;
          const __m512i t0 = _mm512_dpbusd_epi32(
              _mm512_dpbusd_epi32(zero, lo0, _mm512_loadu_si512(x)), hi0,
              _mm512_loadu_si512(x + 64));
          const __m512i t1 = _mm512_dpbusd_epi32(
              _mm512_dpbusd_epi32(zero, lo1, _mm512_loadu_si512(x + 128)), hi1,
              _mm512_loadu_si512(x + 192));
          acc[i][j] = _mm512_dpwssd_epi32(acc[i][j], _mm512_packs_epi32(t0, t1), s);
        }
      }
      const __m512i S = sum_pairs<NW, NX>(acc);
      // M: the group's sub-mins (row i's eight in 128-bit lane i) times x row j's sums per 32.
      const __m512i mins = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kMinsAt)));
      __m512i u[4];
      for (int j = 0; j < 4; ++j) {
        if (j >= NX) {
          u[j] = _mm512_setzero_si512();
          continue;
        }
        const __m128i sums = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(xq.sums32.data() + ((x0 + j) * blocks + b) * 8));
        u[j] = _mm512_madd_epi16(mins, _mm512_broadcast_i32x4(sums));
      }
      const __m512i M = fold_pairs<NX>(u);
      const __m512 d_dmin =
          _mm512_castps256_ps512(_mm256_cvtph_ps(d_dmin_of<NW>(dd, dd_row, b)));
      const __m512 xs = x_scales<NX>(xq, x0, b);
      const __m512 dx = _mm512_mul_ps(_mm512_permutexvar_ps(lane_d, d_dmin), xs);
      const __m512 mx = _mm512_mul_ps(_mm512_permutexvar_ps(lane_m, d_dmin), xs);
      acc_f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), dx, acc_f);
      acc_f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(M), mx, acc_f);
    }
    store_pairs<NW, NX>(acc_f, out);
  }
#elif defined(PREFIXSERVE_KQUANT_AVX2)
  // A decode's tile (one x row, 4 x 1): its own loop, measured faster at batch 1 on the AVX2
  // EPYC than the shared tile below; at most 4 pairs, lane i NX + j of one 128-bit vector. Its
  // stream is prefetched kPrefetchAhead super-blocks ahead, as the VNNI tile's: on the EPYC a
  // 1B Q4_K_M decode went from 0.86x to 1.15-1.26x llama.cpp's (BENCHMARKS.md §38).
  template <int NW, int NX>
  static void tile4(const uint8_t* group, int64_t slot, const uint16_t* dd, int64_t dd_row,
                    const XSuper& xq, int64_t x0, float* out) {
    static_assert(NW * NX <= 4, "a tile of at most 4 pairs");
    const int64_t blocks = xq.blocks;
    const __m256i low = _mm256_set1_epi8(0x0F);
    const int8_t* xc[NX];
    for (int j = 0; j < NX; ++j) xc[j] = xq.codes.data() + (x0 + j) * blocks * kSuper;
    alignas(16) int32_t lane_d[4];
    for (int p = 0; p < 4; ++p) lane_d[p] = p < NW * NX ? 2 * (p / NX) : 0;
    const __m256i idx_d =
        _mm256_castsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(lane_d)));
    const __m256i idx_m = _mm256_add_epi32(idx_d, _mm256_set1_epi32(1));
    __m128 acc_f = _mm_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = group + b * kQ4KGroupBytes;
      if constexpr (NX == 1)  // a decode's stream, ahead of the prefetchers
        for (int64_t line = 0; line < kQ4KGroupBytes; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetchAhead * kQ4KGroupBytes + line),
                       _MM_HINT_T0);
      __m256i acc[4];
      for (int p = 0; p < 4; ++p) acc[p] = _mm256_setzero_si256();
      for (int p = 0; p < 2; ++p)
        for (int s = 0; s < 2; ++s)
          for (int h = 0; h < 2; ++h) {
            const __m256i mask = sub_scale_mask(p, s);
            __m256i w[NW], sc[NW];
            for (int i = 0; i < NW; ++i) {
              const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                  blk + kCodeBytes * (slot + i) + 64 * p + 32 * s));
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
      // M, pair by pair: row i's sub-mins times x row j's sums per 32.
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
            reinterpret_cast<const __m128i*>(xq.sums32.data() + ((x0 + j) * blocks + b) * 8));
        m[p] = _mm_madd_epi16(mins, sums);
      }
      const __m128i M = _mm_hadd_epi32(_mm_hadd_epi32(m[0], m[1]), _mm_hadd_epi32(m[2], m[3]));
      const __m256 d_dmin = _mm256_cvtph_ps(d_dmin_of<NW>(dd, dd_row, b));
      const __m128 xs = x_scales4<NW, NX>(xq, x0, b);
      const __m128 dx =
          _mm_mul_ps(_mm256_castps256_ps128(_mm256_permutevar8x32_ps(d_dmin, idx_d)), xs);
      const __m128 mx =
          _mm_mul_ps(_mm256_castps256_ps128(_mm256_permutevar8x32_ps(d_dmin, idx_m)), xs);
      acc_f = _mm_fmadd_ps(_mm_cvtepi32_ps(S), dx, acc_f);
      acc_f = _mm_fnmadd_ps(_mm_cvtepi32_ps(M), mx, acc_f);
    }
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, acc_f);
    for (int p = 0; p < NW * NX; ++p) out[p] = lanes[p];
  }
  // More x rows: kquant_tiles.h's `avx2_tile` (2 x 4 or 2 x 2: eight pairs at most).
  template <int NW, int NX>
  static void tile(const uint8_t* group, int64_t slot, const uint16_t* dd, int64_t dd_row,
                   const XSuper& xq, int64_t x0, float* out) {
    avx2_tile_or_decode<Q4KTiles, NW, NX>(group, slot, dd, dd_row, xq, x0, out);
  }

  static constexpr int64_t kGroupBytes = kQ4KGroupBytes;
  static __m256i start(const uint8_t*, int64_t, const XSuper&, int64_t, int64_t) {
    return _mm256_setzero_si256();
  }
  // Step (p, s, h): 32 codes, half s of load p's nibbles h (sub-blocks sub_block(p, 2 s) and
  // the next, 16 bytes each), and their sub-scales as words.
  template <int p, int s, int h>
  static void decode(const uint8_t* blk, int64_t slot, __m256i& w, __m256i& sc) {
    const __m256i v = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(blk + kCodeBytes * slot + 64 * p + 32 * s));
    w = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    int64_t eight;
    std::memcpy(&eight, blk + kScalesAt + 8 * slot, sizeof eight);
    sc = _mm256_shuffle_epi8(_mm256_set1_epi64x(eight), sub_scale_mask(p, s));
  }
  // M, pair by pair: row i's sub-mins times x row j's sums per 32; then both fused
  // multiply-adds of every pair's lane.
  template <int NW, int NX>
  static __m256 finish(__m256i S, const uint8_t* blk, int64_t slot, const uint16_t* dd,
                       int64_t dd_row, const XSuper& xq, int64_t x0, int64_t b, __m256 acc) {
    __m256i m[NW * NX];
    for (int i = 0; i < NW; ++i) {
      const __m128i mins = _mm_cvtepu8_epi16(
          _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + kMinsAt + 8 * (slot + i))));
      for (int j = 0; j < NX; ++j) {
        const __m128i sums = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(xq.sums32.data() + ((x0 + j) * xq.blocks + b) * 8));
        m[i * NX + j] = _mm256_zextsi128_si256(_mm_madd_epi16(mins, sums));
      }
    }
    const __m256i M = sum_eight<NW * NX>(m);
    const __m128i halves = d_dmin_of<NW>(dd, dd_row, b);
    const __m256 xs = x_scales<NW, NX>(xq, x0, b);
    const __m256 dx = _mm256_mul_ps(row_lanes<NW, NX>(halves, 2, 0), xs);
    const __m256 mx = _mm256_mul_ps(row_lanes<NW, NX>(halves, 2, 1), xs);
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), dx, acc);
    return _mm256_fnmadd_ps(_mm256_cvtepi32_ps(M), mx, acc);
  }
#else
  // One weight row by one x row in scalars.
  template <int NW, int NX>
  static void tile(const uint8_t* group, int64_t slot, const uint16_t* dd, int64_t /*dd_row*/,
                   const XSuper& xq, int64_t x0, float* out) {
    static_assert(NW == 1 && NX == 1, "the portable tile is one pair");
    const int64_t blocks = xq.blocks;
    const int8_t* xc = xq.codes.data() + x0 * blocks * kSuper;
    float acc = 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = group + b * kQ4KGroupBytes;
      const uint8_t* codes = blk + kCodeBytes * slot;
      int32_t S = 0;
      for (int p = 0; p < 2; ++p)
        for (int q = 0; q < 4; ++q) {  // bytes 16 q.. of load p, both nibbles: one sub-block
          int32_t dot = 0;
          for (int h = 0; h < 2; ++h)
            for (int t = 16 * q; t < 16 * q + 16; ++t) {
              const int32_t code = (codes[64 * p + t] >> (4 * h)) & 0x0F;
              dot += code * xc[b * kSuper + 128 * p + 64 * h + t];
            }
          S += blk[kScalesAt + 8 * slot + sub_block(p, q)] * dot;
        }
      int32_t M = 0;
      for (int k = 0; k < 8; ++k)
        M += blk[kMinsAt + 8 * slot + k] * xq.sums32[(x0 * blocks + b) * 8 + k];
      const float xs = xq.scale[b * xq.rows + x0];
      const float dx = half_to_float(dd[2 * b]) * xs;
      const float mx = half_to_float(dd[2 * b + 1]) * xs;
      acc = std::fma(static_cast<float>(S), dx, acc);
      acc = std::fma(-static_cast<float>(M), mx, acc);
    }
    out[0] = acc;
  }
#endif

#if defined(PREFIXSERVE_KQUANT_VNNI) || defined(PREFIXSERVE_KQUANT_AVX2)
  // Rows 0..NW-1's (d, dmin) of super-block b: 8 halves [d0, dmin0, d1, ...] (0 past NW).
  template <int NW>
  static __m128i d_dmin_of(const uint16_t* dd, int64_t dd_row, int64_t b) {
    const auto at = [&](int i) {
      int32_t two = 0;
      if (i < NW) std::memcpy(&two, dd + i * dd_row + 2 * b, sizeof two);
      return two;
    };
    return _mm_setr_epi32(at(0), at(1), at(2), at(3));
  }
#endif
};

}  // namespace

Format format_of(const torch::Tensor& codes, const torch::Tensor& scales) {
  if (codes.scalar_type() != torch::kByte || scales.dim() != 2 ||
      scales.scalar_type() != torch::kHalf)
    return kNone;
  if (codes.dim() == 1) return kMixed;
  if (codes.dim() != 3) return kNone;
  return codes.size(2) == kQ4KGroupBytes ? kQ4K : codes.size(2) == kQ6KGroupBytes ? kQ6K : kNone;
}

int64_t mixed_split(Format format, const torch::Tensor& codes, int64_t N, int64_t K) {
  if (format != kMixed) return format == kQ4K ? N : 0;
  // groups x 576 + q6k_groups x (832 - 576) bytes a super-block: the Q6_K groups' count.
  const int64_t blocks = K / kSuper, groups = (N + kGroupRows - 1) / kGroupRows;
  const int64_t extra = codes.numel() - groups * blocks * kQ4KGroupBytes;
  const int64_t step = blocks * (kQ6KGroupBytes - kQ4KGroupBytes);
  if (blocks == 0 || extra <= 0 || extra % step != 0 || extra / step >= groups) return -1;
  return (groups - extra / step) * kGroupRows;
}

bool shapes_fit(Format format, const torch::Tensor& codes, const torch::Tensor& scales,
                int64_t N, int64_t K) {
  if (K % kSuper != 0 || scales.size(0) != N || !codes.is_contiguous() ||
      !scales.is_contiguous())
    return false;
  if (format == kMixed) {
    const int64_t split = mixed_split(format, codes, N, K);
    return split > 0 && split < N && scales.size(1) == 2 * K / kSuper;
  }
  const int64_t per_row = format == kQ4K ? 2 : 1;  // (d, dmin) or d per super-block
  return codes.size(0) == (N + kGroupRows - 1) / kGroupRows && codes.size(1) == K / kSuper &&
         scales.size(1) == per_row * K / kSuper;
}

namespace {

// One super-block of x: its 256 codes in natural order into c, the sum of each 16 into sums16,
// and its scale (returned): scale = amax / 127, code = v / scale rounded to nearest even and
// clamped to [-127, 127] (0 for all where the scale is not positive), as every family reads it.
#if defined(__AVX512F__) && defined(__AVX512BW__)
// In vectors: the same divisions, roundings and clamps lane by lane, so the same codes (a NaN
// is passed over by the maximum and clamped to -127, as std::max and std::min order them).
float quantize_super(const uint16_t* src, int8_t* c, int16_t* sums16) {
  __m512 v[16];
  __m512 amax = _mm512_setzero_ps();
  for (int k = 0; k < 16; ++k) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * k));
    v[k] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    amax = _mm512_max_ps(_mm512_abs_ps(v[k]), amax);  // a NaN lane keeps amax
  }
  const float scale = _mm512_reduce_max_ps(amax) / 127.0f;
  if (!(scale > 0.0f)) {
    std::memset(c, 0, kSuper);
    std::memset(sums16, 0, 16 * sizeof(int16_t));
    return scale;
  }
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.0f),
               hi = _mm512_set1_ps(127.0f);
  for (int k = 0; k < 16; ++k) {
    const __m512 code = _mm512_roundscale_ps(_mm512_div_ps(v[k], s),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i ci = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(code, lo), hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c + 16 * k), _mm512_cvtepi32_epi8(ci));
    sums16[k] = static_cast<int16_t>(_mm512_reduce_add_epi32(ci));
  }
  return scale;
}
#else
float quantize_super(const uint16_t* src, int8_t* c, int16_t* sums16) {
  float v[kSuper], amax = 0.0f;
  for (int t = 0; t < kSuper; ++t) {
    v[t] = prefixserve::bf16_bits_to_float(src[t]);
    amax = std::max(amax, std::fabs(v[t]));
  }
  const float scale = amax / 127.0f;
  for (int t = 0; t < kSuper; ++t) {
    const float code = scale > 0.0f ? std::nearbyint(v[t] / scale) : 0.0f;
    c[t] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, code)));
  }
  for (int k = 0; k < 16; ++k) {
    int32_t sum = 0;
    for (int t = 0; t < 16; ++t) sum += c[16 * k + t];
    sums16[k] = static_cast<int16_t>(sum);
  }
  return scale;
}
#endif

}  // namespace

XSuper quantize_x(const uint16_t* x, int64_t rows, int64_t K, int64_t threads,
                  bool compute_bound) {
  const int64_t blocks = K / kSuper;
  XSuper q{rows, blocks, std::vector<int8_t>(rows * K), std::vector<float>(rows * blocks),
           std::vector<int16_t>(rows * blocks * 8), std::vector<int16_t>(rows * blocks * 16)};
  prefixserve::stream_pool().run(rows, rows < 8 ? 1 : threads, [&](int64_t r) {
    for (int64_t b = 0; b < blocks; ++b) {
      int8_t c[kSuper];
      int16_t* sums16 = q.sums16.data() + (r * blocks + b) * 16;
      q.scale[b * rows + r] = quantize_super(x + r * K + b * kSuper, c, sums16);
      // The codes in the kernels' column order (`x_column` keeps runs of 4 together).
      int8_t* dst = q.codes.data() + r * K + b * kSuper;
      for (int64_t pos = 0; pos < kSuper; pos += 4) std::memcpy(dst + pos, c + x_column(pos), 4);
      for (int k = 0; k < 8; ++k)
        q.sums32[(r * blocks + b) * 8 + k] =
            static_cast<int16_t>(sums16[2 * k] + sums16[2 * k + 1]);
    }
  }, compute_bound);
  return q;
}

void sum_range_q4k(const uint8_t* codes, const uint16_t* d_dmin, int64_t scales_per_row,
                   const XSuper& xq, int64_t n0, int64_t width, float* sums, int64_t ld) {
  walk<Rows<Q4KTiles>>(codes, kQ4KGroupBytes, d_dmin, scales_per_row, xq, n0, width, sums, ld);
}

void sum_range(const Weight& w, const XSuper& xq, int64_t n0, int64_t width, float* sums) {
  const int64_t blocks = w.K / kSuper;
  const int64_t per_row = w.format == kQ6K ? blocks : 2 * blocks;
  // Rows below the split are Q4_K's, from it on Q6_K's (whose groups follow the Q4_K ones').
  const int64_t q4 = std::clamp<int64_t>(w.split - n0, 0, width);
  if (q4 > 0) sum_range_q4k(w.codes, w.scales, per_row, xq, n0, q4, sums, width);
  if (q4 == width) return;
  const uint8_t* q6 = w.codes + w.split / kGroupRows * blocks * kQ4KGroupBytes;
  sum_range_q6k(q6, w.scales + w.split * per_row, per_row, xq, n0 + q4 - w.split, width - q4,
                sums + q4, width);
}

}  // namespace prefixserve::kquant
