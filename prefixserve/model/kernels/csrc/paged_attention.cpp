// Paged attention read straight from the block-structured K/V cache.
//
// For each sequence s of a step, its queries are rows [q_start, q_end) of `q` at positions
// pos0, pos0 + 1, ...; a query at position p attends to the keys at positions
// [max(0, p - window + 1), p] (window 0: [0, p]), found through the sequence's block table
// (key position j lives in block block_tables[s][j / block_size], slot j % block_size).
// Softmax is computed online (one pass over the blocks) in fp32 whatever the cache dtype.
//
// Work is split over KV heads and items (see `run`): a tile of query rows of one sequence, or a
// cascade of decode rows sharing cached prefix blocks. Whatever the item, a query meets its keys
// in the same tiles of kKeyTile slots from position 0, so its result depends on nothing but its
// own query and keys: not on the other rows of the call nor on which of its keys were cached. K/V are converted to fp32 a key tile at a
// time and shared by the item's rows and by the query heads of that KV head (GQA). With AVX-512
// and a head dim of 64/128/256 the inner loops are intrinsics (attend_tile_avx512); otherwise
// portable loops the compiler vectorizes (-O3 -march=native).
#include "torch_lite.h"
#include <ATen/Parallel.h>

#if defined(__SSE__)  // every x86-64 CPU; with AVX-512 it brings the intrinsics below too
#include <immintrin.h>
#endif

#include "exp_avx512.h"
#include "kv8_rows.h"
#include "line_sweep.h"
#include "kernels.h"
#include "paged_items.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using prefixserve::paged::Item;
using prefixserve::paged::build_items;
using prefixserve::paged::kCascadeRows;
using prefixserve::paged::kLongRowTile;
using prefixserve::kv8::row_to_float;
using prefixserve::LineDrip;
using prefixserve::touch_lines;

// Lines of the next tile asked for at each coarse step of the arithmetic (a query group).
constexpr int kDripLines = 8;

inline void store(float* dst, float x) { *dst = x; }
inline void store(c10::BFloat16* dst, float x) { *dst = c10::BFloat16(x); }

// exp(x) for x <= 0 to ~2 ulp: range reduction to [-ln2/2, ln2/2] and a degree-6 polynomial,
// written so the compiler vectorizes loops over it (std::exp does not vectorize here). Every
// multiply-add is an explicit std::fma: left to -ffp-contract, the compiler fused them or not
// depending on where the function was inlined, and two call sites of one softmax update gave
// results an ulp apart (a batch-invariance test caught it).
inline float exp_nonpositive(float x) {
  if (x != x) return x;  // NaN (a corrupted cache slot) propagates to the output
  x = std::max(x, -87.0f);
  const float n = std::floor(std::fma(x, 1.44269504088896341f, 0.5f));
  const float r = std::fma(-n, 1.42860682030941723e-6f, std::fma(-n, 0.693145751953125f, x));
  float p = std::fma(r, 0.00138889f, 0.00833336823f);
  p = std::fma(r, p, 0.0416666418f);
  p = std::fma(r, p, 0.166666672f);
  p = std::fma(r, p, 0.5f);
  p = std::fma(r, p, 1.0f);
  p = std::fma(r, p, 1.0f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Rows of `n` cache elements to fp32 (contiguous, so the loop vectorizes).
inline void row_to_float(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}
inline void row_to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}


// Bring a row of n elements toward L1 (a hint: never faults, and a no-op without SSE).
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t n) {
#if defined(__SSE__)
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < n * static_cast<int64_t>(sizeof(scalar_t)); b += 64) {
    _mm_prefetch(p + b, _MM_HINT_T0);
  }
#else
  (void)row;
  (void)n;
#endif
}

// Dot product with 16 independent partial sums (vectorizes without reassociating math flags).
template <int HD>
inline float dot(const float* a, const float* b, int64_t n) {
  if constexpr (HD > 0) n = HD;
  float part[16] = {0.0f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int t = 0; t < 16; ++t) part[t] += a[i + t] * b[i + t];
  }
  for (int t = 0; t < 8; ++t) part[t] += part[t + 8];
  for (int t = 0; t < 4; ++t) part[t] += part[t + 4];
  float sum = (part[0] + part[2]) + (part[1] + part[3]);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

inline float sum16(const float* x, int64_t lo, int64_t hi, bool take_max) {
  float part[16];
  const float init = take_max ? -std::numeric_limits<float>::infinity() : 0.0f;
  for (int t = 0; t < 16; ++t) part[t] = init;
  int64_t j = lo;
  for (; j + 16 <= hi; j += 16) {
    for (int t = 0; t < 16; ++t) {
      part[t] = take_max ? std::max(part[t], x[j + t]) : part[t] + x[j + t];
    }
  }
  for (; j < hi; ++j) part[0] = take_max ? std::max(part[0], x[j]) : part[0] + x[j];
  float r = part[0];
  for (int t = 1; t < 16; ++t) r = take_max ? std::max(r, part[t]) : r + part[t];
  return r;
}

#if defined(__AVX512F__)
// r[i] = sum of the 16 lanes of v[i], for 16 vectors at once (transpose-and-add tree).
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 y0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 y1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(y0, y1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// exp(x) for x <= 0, 16 lanes: the same reduction and polynomial as exp_nonpositive.
using prefixserve::exp_nonpositive16;

inline __mmask16 lanes_below(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// attend_tile for head_dim HD (a multiple of 16) with AVX-512: 16 scores per reduce16, the
// exponentials 16 at a time, the accumulator in registers. `s` has 16 floats of slack.
// The raw (soft-capped) scores of keys [j0, j0 + n), n <= 16, of the query q (C = HD / 16
// vectors) into s + j0: each key's 16 lane products chained over the dims, then reduce16's tree.
// A key's score depends on nothing but the query and the key (reduce16 never mixes keys).
template <int HD>
inline void score_block_avx512(const __m512* q, const float* kt, int64_t j0, int64_t n,
                               float softcap, float* s) {
  constexpr int C = HD / 16;
  __m512 part[16];
  // Unrolled, so that the 16 keys' chains stay in registers and overlap (a loop kept part[] on
  // the stack and ran one key's four dependent FMAs after another: 2.5x slower).
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    __m512 a = _mm512_setzero_ps();
    if (t < n) {
      const float* kr = kt + (j0 + t) * HD;
      for (int c = 0; c < C; ++c) a = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(kr + 16 * c), a);
    }
    part[t] = a;
  }
  __m512 sc = reduce16(part);
  if (softcap > 0.0f) {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, sc);
    for (int t = 0; t < 16; ++t) tmp[t] = softcap * std::tanh(tmp[t] / softcap);
    sc = _mm512_load_ps(tmp);
  }
  _mm512_mask_storeu_ps(s + j0, lanes_below(n), sc);
}

// The online-softmax update of one query over its raw scores s[lo, hi) of a tile: the new
// running max, the exponentials (into s) summed 16 lanes at a time from lo, the new sum; returns
// the factor by which the old accumulator is to be scaled.
inline float softmax_tile_avx512(float* s, int64_t lo, int64_t hi, float& m, float& l) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j0 = lo; j0 < hi; j0 += 16) {
    const __mmask16 k = lanes_below(hi - j0);
    vmax = _mm512_mask_max_ps(vmax, k, vmax, _mm512_maskz_loadu_ps(k, s + j0));
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  const float correction = exp_nonpositive(m - m_new);
  const __m512 mv = _mm512_set1_ps(m_new);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j0 = lo; j0 < hi; j0 += 16) {
    const __mmask16 k = lanes_below(hi - j0);
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j0), mv));
    _mm512_mask_storeu_ps(s + j0, k, e);
    vsum = _mm512_mask_add_ps(vsum, k, vsum, e);
  }
  l = std::fma(l, correction, _mm512_reduce_add_ps(vsum));
  m = m_new;
  return correction;
}

// The first half of attend_tile_avx512: the scores of slots [lo, hi) in blocks of 16 from lo,
// then the softmax update; returns the correction factor of the old accumulator.
template <int HD>
inline float scores_tile_avx512(const float* qv, const float* kt, int64_t lo, int64_t hi,
                                float softcap, float* s, float& m, float& l) {
  constexpr int C = HD / 16;
  __m512 q[C];
  for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(qv + 16 * c);
  for (int64_t j0 = lo; j0 < hi; j0 += 16)
    score_block_avx512<HD>(q, kt, j0, std::min<int64_t>(16, hi - j0), softcap, s);
  return softmax_tile_avx512(s, lo, hi, m, l);
}

// The second half: acc = acc * correction + sum over j in [lo, hi) of s[j] * v[j], j ascending,
// for NQ queries at once (their s rows `s_stride` apart, accumulators HD apart): each query's
// sums are the one-query loop's, while the NQ * HD / 16 chains hide the FMA latency that one
// query's HD / 16 chains cannot, and each V row is loaded once for all of them.
template <int HD, int NQ>
inline void values_tile_avx512(const float* vt, int64_t lo, int64_t hi, const float* s,
                               int64_t s_stride, const float* correction, float* acc) {
  constexpr int C = HD / 16;
  __m512 a[NQ][C];
  for (int i = 0; i < NQ; ++i) {
    const __m512 corr = _mm512_set1_ps(correction[i]);
    for (int c = 0; c < C; ++c)
      a[i][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * HD + 16 * c), corr);
  }
  for (int64_t j = lo; j < hi; ++j) {
    const float* vr = vt + j * HD;
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = _mm512_loadu_ps(vr + 16 * c);
    for (int i = 0; i < NQ; ++i) {
      const __m512 pj = _mm512_set1_ps(s[i * s_stride + j]);
      for (int c = 0; c < C; ++c) a[i][c] = _mm512_fmadd_ps(pj, v[c], a[i][c]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + i * HD + 16 * c, a[i][c]);
}

template <int HD>
inline void attend_tile_avx512(const float* qv, const float* kt, const float* vt, int64_t lo,
                               int64_t hi, float softcap, float* s, float& m, float& l,
                               float* acc) {
  const float correction = scores_tile_avx512<HD>(qv, kt, lo, hi, softcap, s, m, l);
  values_tile_avx512<HD, 1>(vt, lo, hi, s, 0, &correction, acc);
}
#endif

// One query vector against key slots [lo, hi) of a converted tile (rows of `head_dim` floats):
// the online-softmax update of its running max `m`, sum `l` and unnormalized output `acc`.
// HD > 0 fixes head_dim at compile time.
template <int HD>
inline void attend_tile(const float* qv, const float* kt, const float* vt, int64_t head_dim,
                        int64_t lo, int64_t hi, float softcap, float* s, float& m, float& l,
                        float* acc, LineDrip* drip) {
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0) {
    if (drip != nullptr) drip->step(kDripLines);
    attend_tile_avx512<HD>(qv, kt, vt, lo, hi, softcap, s, m, l, acc);
    return;
  }
#endif
  if constexpr (HD > 0) head_dim = HD;
  for (int64_t j = lo; j < hi; ++j) {
    if (drip != nullptr) drip->step(1);
    s[j] = dot<HD>(qv, kt + j * head_dim, head_dim);
  }
  if (softcap > 0.0f) {
    for (int64_t j = lo; j < hi; ++j) s[j] = softcap * std::tanh(s[j] / softcap);
  }
  const float m_new = std::max(m, sum16(s, lo, hi, true));
  const float correction = exp_nonpositive(m - m_new);
  for (int64_t j = lo; j < hi; ++j) s[j] = exp_nonpositive(s[j] - m_new);
  l = std::fma(l, correction, sum16(s, lo, hi, false));
  m = m_new;
  for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
  for (int64_t j = lo; j < hi; ++j) {
    if (drip != nullptr) drip->step(1);
    const float pj = s[j];
    const float* vr = vt + j * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) acc[d] += pj * vr[d];
  }
}

// Queries attended together over one range of a tile (attend_tiles).
constexpr int64_t kQueryGroup = 4;

// attend_tile for nq consecutive query vectors (head_dim apart; their m, l and acc too) that see
// the same slots [lo, hi): GQA's query heads of one KV head, a cascade's shared blocks. Each
// query's arithmetic is attend_tile's; with AVX-512 the value pass runs up to kQueryGroup
// queries at once. `s` holds kQueryGroup rows of s_stride floats.
template <int HD>
inline void attend_tiles(const float* qv, int64_t nq, const float* kt, const float* vt,
                         int64_t head_dim, int64_t lo, int64_t hi, float softcap, float* s,
                         int64_t s_stride, float* m, float* l, float* acc, LineDrip* drip) {
#if defined(__AVX512F__)
  if constexpr (HD > 0 && HD % 16 == 0) {
    for (int64_t q0 = 0; q0 < nq; q0 += kQueryGroup) {
      const int64_t n = std::min(kQueryGroup, nq - q0);
      if (drip != nullptr) drip->step(kDripLines);
      float correction[kQueryGroup];
      for (int64_t i = 0; i < n; ++i) {
        const int64_t qi = q0 + i;
        correction[i] = scores_tile_avx512<HD>(qv + qi * HD, kt, lo, hi, softcap, s + i * s_stride,
                                               m[qi], l[qi]);
      }
      float* a = acc + q0 * HD;
      switch (n) {
        case 1: values_tile_avx512<HD, 1>(vt, lo, hi, s, s_stride, correction, a); break;
        case 2: values_tile_avx512<HD, 2>(vt, lo, hi, s, s_stride, correction, a); break;
        case 3: values_tile_avx512<HD, 3>(vt, lo, hi, s, s_stride, correction, a); break;
        default: values_tile_avx512<HD, 4>(vt, lo, hi, s, s_stride, correction, a); break;
      }
    }
    return;
  }
#endif
  (void)s_stride;
  for (int64_t qi = 0; qi < nq; ++qi)
    attend_tile<HD>(qv + qi * head_dim, kt, vt, head_dim, lo, hi, softcap, s, m[qi], l[qi],
                    acc + qi * head_dim, drip);
}

#if defined(__AVX512F__)
// attend_tiles for every query of `rows` rows of one chunk against a tile they see from its slot
// 0 (full attention), row r up to its own slot his[r] (exclusive; <= 0: nothing). The same
// arithmetic per query as attend_tile (the same blocks of 16 keys from slot 0, the same softmax
// update, the same value sums in slot order), in another loop order: block by block of 16 keys
// for all the queries, so that the block's K and V rows are read from L1 by every query instead
// of the whole tile (64 KB of fp32 K and V at 128 slots, more than L1) once per query. The
// query heads of a row (`group`, consecutive) share each V load. `s` holds rows * group rows of
// s_stride floats.
template <int HD>
inline void attend_rows_avx512(const float* qv, int64_t rows, int64_t group, const int64_t* his,
                               const float* kt, const float* vt, float softcap, float* s,
                               int64_t s_stride, float* m, float* l, float* acc) {
  constexpr int C = HD / 16;
  int64_t hi_max = 0;
  for (int64_t r = 0; r < rows; ++r) hi_max = std::max(hi_max, his[r]);
  for (int64_t j0 = 0; j0 < hi_max; j0 += 16) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t n = std::min<int64_t>(16, his[r] - j0);
      for (int64_t g = 0; n > 0 && g < group; ++g) {
        const int64_t qi = r * group + g;
        __m512 q[C];
        for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(qv + qi * HD + 16 * c);
        score_block_avx512<HD>(q, kt, j0, n, softcap, s + qi * s_stride);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; his[r] > 0 && g < group; ++g) {
      const int64_t qi = r * group + g;
      const float correction = softmax_tile_avx512(s + qi * s_stride, 0, his[r], m[qi], l[qi]);
      const __m512 corr = _mm512_set1_ps(correction);
      for (int c = 0; c < C; ++c) {
        float* a = acc + qi * HD + 16 * c;
        _mm512_storeu_ps(a, _mm512_mul_ps(_mm512_loadu_ps(a), corr));
      }
    }
  }
  const float ones[kQueryGroup] = {1.0f, 1.0f, 1.0f, 1.0f};  // acc * 1.0f is acc, exactly
  for (int64_t j0 = 0; j0 < hi_max; j0 += 16) {
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t hi = std::min(j0 + 16, his[r]);
      for (int64_t g0 = 0; hi > j0 && g0 < group; g0 += kQueryGroup) {
        const int64_t qi = r * group + g0;
        const float* sr = s + qi * s_stride;
        float* a = acc + qi * HD;
        switch (std::min(kQueryGroup, group - g0)) {
          case 1: values_tile_avx512<HD, 1>(vt, j0, hi, sr, s_stride, ones, a); break;
          case 2: values_tile_avx512<HD, 2>(vt, j0, hi, sr, s_stride, ones, a); break;
          case 3: values_tile_avx512<HD, 3>(vt, j0, hi, sr, s_stride, ones, a); break;
          default: values_tile_avx512<HD, 4>(vt, j0, hi, sr, s_stride, ones, a); break;
        }
      }
    }
  }
}
#endif

// Keys are converted to fp32 a tile of this many slots at a time (whole blocks).
constexpr int64_t kKeyTile = 128;

// scalar_t: q's and out's dtype; cache_t: the cache's (scalar_t, or an 8-bit format's codes,
// each row followed by its scale: a head's rows are then head_dim + 4 elements apart).
template <typename scalar_t, typename cache_t, int HD>
void run(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
         const torch::Tensor& v_cache, const torch::Tensor& block_tables,
         const torch::Tensor& seq_info, double scale_d, double softcap_d, int64_t window) {
  const int64_t num_seqs = seq_info.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_row_stride = q.stride(0), q_head_stride = q.stride(1);
  const int64_t out_row_stride = out.stride(0);
  const int64_t cache_block_stride = k_cache.stride(0), cache_slot_stride = k_cache.stride(1);
  const int64_t head_pitch = k_cache.stride(2);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t tile_blocks = std::max<int64_t>(1, kKeyTile / block_size);
  const int64_t tile_slots = tile_blocks * block_size;
  const float scale = static_cast<float>(scale_d);
  const float softcap = static_cast<float>(softcap_d);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  const cache_t* k_ptr = static_cast<const cache_t*>(k_cache.data_ptr());
  const cache_t* v_ptr = static_cast<const cache_t*>(v_cache.data_ptr());
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* info = seq_info.data_ptr<int64_t>();

  const std::vector<Item> items =
      build_items(info, num_seqs, tables, max_blocks, block_size, window, tile_slots);
  const int64_t num_items = static_cast<int64_t>(items.size()) * num_kv_heads;

  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_queries = std::max(kLongRowTile, kCascadeRows) * group;
    std::vector<float> kt(tile_slots * head_dim), vt(tile_slots * head_dim);  // [slot][dim]
    std::vector<float> qf(max_queries * head_dim), acc(max_queries * head_dim);
    const int64_t s_stride = tile_slots + 16;
    std::vector<float> m(max_queries), l(max_queries), s(max_queries * s_stride);
    std::vector<int64_t> his(kLongRowTile);

    LineDrip drip;
    // Convert slots [lo, hi) of the tile starting at block b0 of `table` into kt/vt; the next
    // tile's slots [0, next) go into the drip, asked for while this one is computed.
    auto load_tile = [&](const int32_t* table, int64_t kvh, int64_t b0, int64_t lo, int64_t hi,
                         int64_t next) {
      auto row_at = [&](int64_t b, int64_t j) {  // of slot j's row of head kvh, in elements
        return table[b + j / block_size] * cache_block_stride +
               (j % block_size) * cache_slot_stride + kvh * head_pitch;
      };
      auto offset = [&](int64_t j) { return row_at(b0, j); };
      drip.clear();
      // 8-bit rows: the conversions bound the tile here, not the reads (extra prefetches measured
      // slower on the AVX2 build, BENCHMARKS.md), so none.
      for (int64_t j = 0; sizeof(cache_t) > 1 && j < next; ++j) {
        const int64_t row = row_at(b0 + tile_blocks, j);
        drip.add_runs(reinterpret_cast<const char*>(k_ptr + row),
                      reinterpret_cast<const char*>(v_ptr + row), head_pitch * sizeof(cache_t));
      }
      // Ask for every row of the tile first: the rows of one KV head are strided (the other
      // heads lie between them), and read one after another each waits for memory on its own
      // (decode from a cold cache: 36 us a layer without this at 129 slots, BENCHMARKS.md);
      // then read them in one burst (line_sweep.h).
      for (int64_t j = lo; j < hi; ++j) {
        prefetch_row(k_ptr + offset(j), head_pitch);
        prefetch_row(v_ptr + offset(j), head_pitch);
      }
      for (int64_t j = lo; j < hi; ++j) {
        touch_lines(reinterpret_cast<const char*>(k_ptr + offset(j)),
                    reinterpret_cast<const char*>(v_ptr + offset(j)), head_pitch * sizeof(cache_t));
      }
      for (int64_t j = lo; j < hi; ++j) {
        drip.step(1);
        row_to_float(k_ptr + offset(j), kt.data() + j * head_dim, head_dim);
        row_to_float(v_ptr + offset(j), vt.data() + j * head_dim, head_dim);
      }
    };
    // Rows [row0, row0 + rows) of sequence `seq` (query vectors from index e0 * group on)
    // against its blocks from `start_block` on, each row up to its own position.
    auto own_blocks = [&](int64_t seq, int64_t row0, int64_t rows, int64_t e0, int64_t kvh,
                          int64_t start_block) {
      const int64_t first_pos = info[3 * seq + 2] + (row0 - info[3 * seq]);
      const int64_t last_pos = first_pos + rows - 1;
      const int32_t* table = tables + seq * max_blocks;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
      // Tiles start at multiples of tile_blocks (absolute key positions), whatever rows this
      // item holds: a sliding window's first visible slot lies inside a tile, not at its start.
      const int64_t b_start = std::max(lo / block_size / tile_blocks * tile_blocks, start_block);
      for (int64_t b0 = b_start; b0 <= last_pos / block_size; b0 += tile_blocks) {
        const int64_t kpos0 = b0 * block_size;  // position of the tile's slot 0
        // Slots of this tile any query of the rows can see.
        const int64_t used_lo = std::max<int64_t>(0, lo - kpos0);
        const int64_t used_hi = std::min<int64_t>(tile_slots, last_pos - kpos0 + 1);
        const int64_t next = std::clamp<int64_t>(last_pos - kpos0 - tile_slots + 1, 0, tile_slots);
        load_tile(table, kvh, b0, used_lo, used_hi, next);
#if defined(__AVX512F__)
        if constexpr (HD > 0 && HD % 16 == 0) {
          if (window == 0 && rows > 1) {  // every row sees the tile from slot 0
            for (int64_t r = 0; r < rows; ++r)
              his[r] = std::min<int64_t>(tile_slots, first_pos + r - kpos0 + 1);
            const int64_t qi = e0 * group;
            attend_rows_avx512<HD>(qf.data() + qi * HD, rows, group, his.data(), kt.data(),
                                   vt.data(), softcap, s.data(), s_stride, m.data() + qi,
                                   l.data() + qi, acc.data() + qi * HD);
            continue;
          }
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t qpos = first_pos + r;
          const int64_t vis_lo = window > 0 ? std::max<int64_t>(0, qpos - window + 1) : 0;
          // Visible slots [j_lo, j_hi) of this tile for this query row.
          const int64_t j_lo = std::max<int64_t>(0, vis_lo - kpos0);
          const int64_t j_hi = std::min<int64_t>(tile_slots, qpos - kpos0 + 1);
          if (j_lo >= j_hi) continue;
          const int64_t qi = (e0 + r) * group;  // the row's query heads, consecutive
          attend_tiles<HD>(qf.data() + qi * head_dim, group, kt.data(), vt.data(), head_dim, j_lo,
                           j_hi, softcap, s.data(), s_stride, m.data() + qi, l.data() + qi,
                           acc.data() + qi * head_dim, &drip);
        }
      }
    };

    for (int64_t idx = begin; idx < end; ++idx) {
      const Item& item = items[idx / num_kv_heads];
      const int64_t kvh = idx % num_kv_heads;
      const bool cascade = item.cascade();
      const int64_t entries = item.entries();
      auto row_of = [&](int64_t e) { return item.row_of(e, info); };
      const int64_t nq = entries * group;
      // Query vectors in fp32, pre-scaled; index qi = e * group + g.
      for (int64_t e = 0; e < entries; ++e) {
        for (int64_t g = 0; g < group; ++g) {
          const scalar_t* src = q_ptr + row_of(e) * q_row_stride + (kvh * group + g) * q_head_stride;
          float* dst = qf.data() + (e * group + g) * head_dim;
          row_to_float(src, dst, head_dim);
          for (int64_t d = 0; d < head_dim; ++d) dst[d] *= scale;
        }
      }
      std::fill(acc.begin(), acc.begin() + nq * head_dim, 0.0f);
      std::fill(m.begin(), m.begin() + nq, -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.begin() + nq, 0.0f);

      if (cascade) {
        // The shared blocks: every query of the cascade sees all of their slots.
        const int32_t* table = tables + item.seqs[0] * max_blocks;
        for (int64_t b0 = 0; b0 < item.shared_blocks; b0 += tile_blocks) {
          const int64_t slots = (std::min(b0 + tile_blocks, item.shared_blocks) - b0) * block_size;
          const int64_t next =
              std::clamp<int64_t>((item.shared_blocks - b0 - tile_blocks) * block_size, 0,
                                  tile_slots);
          load_tile(table, kvh, b0, 0, slots, next);
          attend_tiles<HD>(qf.data(), nq, kt.data(), vt.data(), head_dim, 0, slots, softcap,
                           s.data(), s_stride, m.data(), l.data(), acc.data(), &drip);
        }
        for (int64_t e = 0; e < entries; ++e) {
          own_blocks(item.seqs[e], row_of(e), 1, e, kvh, item.shared_blocks);
        }
      } else {
        own_blocks(item.seqs[0], item.row0, item.rows, 0, kvh, 0);
      }

      for (int64_t e = 0; e < entries; ++e) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t qi = e * group + g;
          const float inv = 1.0f / l[qi];
          scalar_t* dst = out_ptr + row_of(e) * out_row_stride + (kvh * group + g) * head_dim;
          const float* a = acc.data() + qi * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) store(dst + d, a[d] * inv);
        }
      }
    }
  });
}

template <typename scalar_t, typename cache_t>
void dispatch(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
              const torch::Tensor& seq_info, double scale, double softcap, int64_t window) {
  switch (q.size(2)) {
    case 64:
      return run<scalar_t, cache_t, 64>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                        softcap, window);
    case 128:
      return run<scalar_t, cache_t, 128>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                         softcap, window);
    case 256:
      return run<scalar_t, cache_t, 256>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                         softcap, window);
    default:
      return run<scalar_t, cache_t, 0>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                       softcap, window);
  }
}

// The cache's element type for queries of scalar_t: the same, or an 8-bit format's codes.
template <typename scalar_t>
void dispatch_cache(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                    const torch::Tensor& seq_info, double scale, double softcap, int64_t window) {
  switch (k_cache.scalar_type()) {
    case torch::kChar:
      return dispatch<scalar_t, int8_t>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                        softcap, window);
    case torch::kByte:
      return dispatch<scalar_t, uint8_t>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                         softcap, window);
    default:
      return dispatch<scalar_t, scalar_t>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                          softcap, window);
  }
}

}  // namespace

// paged_lanes_bf16.cpp
bool paged_attention_lanes(torch::Tensor& out, const torch::Tensor& q,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_info,
                           double scale, double softcap, int64_t window);

namespace {

void check_paged_args(const torch::Tensor& out, const torch::Tensor& q,
                      const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& block_tables, const torch::Tensor& seq_info) {
  TORCH_CHECK(q.device().is_cpu() && out.device().is_cpu() && k_cache.device().is_cpu() &&
                  v_cache.device().is_cpu() && block_tables.device().is_cpu() &&
                  seq_info.device().is_cpu(),
              "paged_attention runs on CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, H, D] with a contiguous last dim");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              "caches must be contiguous [blocks, block_size, kv_heads, D] of one shape");
  const bool quantized =
      k_cache.scalar_type() == torch::kChar || k_cache.scalar_type() == torch::kByte;
  // An 8-bit cache's rows hold head_dim codes and a 4-byte scale (model/quant/kv_cache.py).
  TORCH_CHECK(q.size(2) + (quantized ? 4 : 0) == k_cache.size(3) &&
                  q.size(1) % k_cache.size(2) == 0,
              "q heads/dim do not match the cache");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == q.size(0) && out.size(1) == q.size(1) * q.size(2) &&
                  out.stride(1) == 1,
              "out must be [T, H * D] with a contiguous last dim");
  TORCH_CHECK((quantized || q.scalar_type() == k_cache.scalar_type()) &&
                  q.scalar_type() == out.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "q and out must share a dtype, and the caches q's or one 8-bit format");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt && block_tables.is_contiguous() &&
                  block_tables.dim() == 2,
              "block_tables must be a contiguous int32 [S, max_blocks]");
  TORCH_CHECK(seq_info.scalar_type() == torch::kLong && seq_info.is_contiguous() &&
                  seq_info.dim() == 2 && seq_info.size(1) == 3 &&
                  seq_info.size(0) == block_tables.size(0),
              "seq_info must be a contiguous int64 [S, 3]");
  // Every block a query can reach must be in its table and in the cache (no reads out of bounds).
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* info = seq_info.data_ptr<int64_t>();
  for (int64_t s = 0; s < seq_info.size(0); ++s) {
    const int64_t q_start = info[3 * s], q_end = info[3 * s + 1], pos0 = info[3 * s + 2];
    TORCH_CHECK(0 <= q_start && q_start < q_end && q_end <= q.size(0) && pos0 >= 0,
                "seq_info row ", s, " is not a non-empty row range of q");
    TORCH_CHECK((pos0 + q_end - q_start - 1) / block_size < max_blocks, "sequence ", s,
                " reaches past its block table");
  }
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  for (int64_t i = 0; i < block_tables.numel(); ++i) {
    TORCH_CHECK(0 <= tables[i] && tables[i] < num_blocks, "block id ", tables[i],
                " is not in the cache");
  }
  TORCH_CHECK(q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16,
              "paged_attention supports float32 and bfloat16, got ", q.scalar_type());
}

// The portable path: fp32 tiles, each score a tree sum over its dims (every dtype, every CPU).
void paged_attention_tiles(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                           torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor seq_info, double scale, double softcap, int64_t window) {
  if (q.scalar_type() == torch::kFloat) {
    dispatch_cache<float>(out, q, k_cache, v_cache, block_tables, seq_info, scale, softcap,
                          window);
  } else if (q.scalar_type() == torch::kBFloat16) {
    dispatch_cache<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                  softcap, window);
  }
}

}  // namespace

// out [T, H * D] (written), q [T, H, D] (last dim contiguous), caches [blocks, block_size,
// kv_heads, D] contiguous (q's dtype, or int8 / uint8 rows of D codes and a 4-byte scale: the
// 8-bit KV cache, int8 or fp8 e4m3, read on the portable path), block_tables [S, max_blocks] int32, seq_info [S, 3] int64 rows
// (q_start, q_end, position of the first query); softcap 0 = none, window 0 = none. bf16 takes
// the keys-in-lanes path where it is built (paged_lanes_bf16.cpp), else the portable one.
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_info,
                     double scale, double softcap, int64_t window) {
  check_paged_args(out, q, k_cache, v_cache, block_tables, seq_info);
  if (paged_attention_lanes(out, q, k_cache, v_cache, block_tables, seq_info, scale, softcap,
                            window)) {
    return;
  }
  paged_attention_tiles(out, q, k_cache, v_cache, block_tables, seq_info, scale, softcap, window);
}

// The same call on the portable path whatever the CPU (benchmarks and tests compare the two).
void paged_attention_portable(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                              torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor seq_info, double scale, double softcap,
                              int64_t window) {
  check_paged_args(out, q, k_cache, v_cache, block_tables, seq_info);
  paged_attention_tiles(out, q, k_cache, v_cache, block_tables, seq_info, scale, softcap, window);
}

bool paged_attention_lanes_ready() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

bool paged_attention_int8_dot() {
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  return true;  // paged_lanes_bf16.cpp's kIntegerInt8: int8 caches take the lanes path
#else
  return false;
#endif
}
