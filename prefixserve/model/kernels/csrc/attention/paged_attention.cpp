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
// own query and keys: not on the other rows of the call nor on which of its keys were cached.
// K/V are converted to fp32 a key tile at a time and shared by the item's rows and by the query
// heads of that KV head (GQA); the tile arithmetic is attn_tiles_fp32.h's.
#include "torch_lite.h"
#include <ATen/Parallel.h>

#if defined(__SSE__)  // every x86-64 CPU; with AVX-512 it brings the intrinsics below too
#include <immintrin.h>
#endif

#include "attn_tiles_fp32.h"
#include "kv8_rows.h"
#include "line_sweep.h"
#include "kernels.h"
#include "paged_items.h"
#include "stream_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using prefixserve::paged::Item;
using prefixserve::paged::build_items;
using prefixserve::paged::first_visible;
using prefixserve::paged::visible_slots;
using prefixserve::paged::kCascadeRows;
using prefixserve::paged::kLongRowTile;
using prefixserve::kv8::row_to_float;
using prefixserve::LineDrip;
using prefixserve::touch_lines;
using prefixserve::tiles_fp32::attend_tiles;
#if defined(__AVX512F__)
using prefixserve::tiles_fp32::attend_rows_avx512;
#endif

inline void store(float* dst, float x) { *dst = x; }
inline void store(c10::BFloat16* dst, float x) { *dst = c10::BFloat16(x); }


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


// Keys are converted to fp32 a tile of this many slots at a time (whole blocks).
constexpr int64_t kKeyTile = 128;

// A call's shapes, strides (in elements) and pointers. scalar_t: q's and out's dtype; cache_t:
// the cache's (scalar_t, or an 8-bit format's codes, each row followed by its scale: a head's
// rows are then head_dim + 4 elements apart).
template <typename scalar_t, typename cache_t>
struct Call {
  int64_t group, head_dim;
  int64_t q_row_stride, q_head_stride, out_row_stride;
  int64_t block_size, cache_block_stride, cache_slot_stride, head_pitch;
  int64_t max_blocks, tile_blocks, tile_slots, window;
  float scale, softcap;
  const scalar_t* q_ptr;
  const cache_t* k_ptr;
  const cache_t* v_ptr;
  scalar_t* out_ptr;
  const int32_t* tables;
  const int64_t* info;
};

// One thread's items, each for one KV head (paged_items.h): a row tile or a cascade, between
// `start` and `finish`. The scratch (the item's queries in fp32 with their online-softmax state,
// the key tile in fp32, the drip of the next tile's lines) is sized once for the largest item
// and reused.
template <typename scalar_t, typename cache_t, int HD>
class ItemWork {
 public:
  explicit ItemWork(const Call<scalar_t, cache_t>& call)
      : c(call),
        max_queries(std::max(kLongRowTile, kCascadeRows) * c.group),
        kt(c.tile_slots * c.head_dim),
        vt(c.tile_slots * c.head_dim),
        qf(max_queries * c.head_dim),
        acc(max_queries * c.head_dim),
        s_stride(c.tile_slots + 16),
        m(max_queries),
        l(max_queries),
        s(max_queries * s_stride),
        his(kLongRowTile) {}

  // The item's query vectors in fp32, pre-scaled (index qi = e * group + g); their state reset.
  void start(const Item& item, int64_t kvh) {
    const int64_t group = c.group, head_dim = c.head_dim;
    const float scale = c.scale;
    const int64_t entries = item.entries();
    const int64_t nq = entries * group;
    for (int64_t e = 0; e < entries; ++e) {
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* src = c.q_ptr + item.row_of(e, c.info) * c.q_row_stride +
                              (kvh * group + g) * c.q_head_stride;
        float* dst = qf.data() + (e * group + g) * head_dim;
        row_to_float(src, dst, head_dim);
        for (int64_t d = 0; d < head_dim; ++d) dst[d] *= scale;
      }
    }
    std::fill(acc.begin(), acc.begin() + nq * head_dim, 0.0f);
    std::fill(m.begin(), m.begin() + nq, -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.begin() + nq, 0.0f);
  }

  // A tile of rows of one sequence.
  void row_tile(const Item& item, int64_t kvh) {
    own_blocks(item.seqs[0], item.row0, item.rows, 0, kvh, 0);
  }

  // A cascade: the shared blocks once for every query (each sees all of their slots), then each
  // sequence's own blocks.
  void cascade(const Item& item, int64_t kvh) {
    const int64_t tile_blocks = c.tile_blocks, block_size = c.block_size;
    const int64_t entries = item.entries();
    const int64_t nq = entries * c.group;
    const int32_t* table = c.tables + item.seqs[0] * c.max_blocks;
    for (int64_t b0 = 0; b0 < item.shared_blocks; b0 += tile_blocks) {
      const int64_t slots = (std::min(b0 + tile_blocks, item.shared_blocks) - b0) * block_size;
      const int64_t next =
          std::clamp<int64_t>((item.shared_blocks - b0 - tile_blocks) * block_size, 0,
                              c.tile_slots);
      load_tile(table, kvh, b0, 0, slots, next);
      attend_tiles<HD>(qf.data(), nq, kt.data(), vt.data(), c.head_dim, 0, slots, c.softcap,
                       s.data(), s_stride, m.data(), l.data(), acc.data(), &drip);
    }
    for (int64_t e = 0; e < entries; ++e) {
      own_blocks(item.seqs[e], item.row_of(e, c.info), 1, e, kvh, item.shared_blocks);
    }
  }

  // The item's outputs: each query's sum over its softmax weights.
  void finish(const Item& item, int64_t kvh) {
    const int64_t group = c.group, head_dim = c.head_dim;
    for (int64_t e = 0; e < item.entries(); ++e) {
      for (int64_t g = 0; g < group; ++g) {
        const int64_t qi = e * group + g;
        const float inv = 1.0f / l[qi];
        scalar_t* dst =
            c.out_ptr + item.row_of(e, c.info) * c.out_row_stride + (kvh * group + g) * head_dim;
        const float* a = acc.data() + qi * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) store(dst + d, a[d] * inv);
      }
    }
  }

 private:
  // Convert slots [lo, hi) of the tile starting at block b0 of `table` into kt/vt; the next
  // tile's slots [0, next) go into the drip, asked for while this one is computed.
  void load_tile(const int32_t* table, int64_t kvh, int64_t b0, int64_t lo, int64_t hi,
                 int64_t next) {
    const int64_t head_dim = c.head_dim, head_pitch = c.head_pitch, block_size = c.block_size;
    const int64_t cache_block_stride = c.cache_block_stride;
    const int64_t cache_slot_stride = c.cache_slot_stride;
    const cache_t* k_ptr = c.k_ptr;
    const cache_t* v_ptr = c.v_ptr;
    auto row_at = [&](int64_t b, int64_t j) {  // of slot j's row of head kvh, in elements
      return table[b + j / block_size] * cache_block_stride +
             (j % block_size) * cache_slot_stride + kvh * head_pitch;
    };
    auto offset = [&](int64_t j) { return row_at(b0, j); };
    drip.clear();
    // 8-bit rows: the conversions bound the tile here, not the reads (extra prefetches measured
    // slower on the AVX2 build, BENCHMARKS.md), so none.
    for (int64_t j = 0; sizeof(cache_t) > 1 && j < next; ++j) {
      const int64_t row = row_at(b0 + c.tile_blocks, j);
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
  }

  // Rows [row0, row0 + rows) of sequence `seq` (query vectors from index e0 * group on)
  // against its blocks from `start_block` on, each row up to its own position.
  void own_blocks(int64_t seq, int64_t row0, int64_t rows, int64_t e0, int64_t kvh,
                  int64_t start_block) {
    const int64_t group = c.group, head_dim = c.head_dim, window = c.window;
    const int64_t block_size = c.block_size, tile_blocks = c.tile_blocks;
    const int64_t tile_slots = c.tile_slots;
    const int64_t first_pos = c.info[3 * seq + 2] + (row0 - c.info[3 * seq]);
    const int64_t last_pos = first_pos + rows - 1;
    const int32_t* table = c.tables + seq * c.max_blocks;
    const int64_t lo = first_visible(first_pos, window);
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
                                 vt.data(), c.softcap, s.data(), s_stride, m.data() + qi,
                                 l.data() + qi, acc.data() + qi * HD);
          continue;
        }
      }
#endif
      for (int64_t r = 0; r < rows; ++r) {
        const auto [j_lo, j_hi] = visible_slots(first_pos + r, window, kpos0, tile_slots);
        if (j_lo >= j_hi) continue;
        const int64_t qi = (e0 + r) * group;  // the row's query heads, consecutive
        attend_tiles<HD>(qf.data() + qi * head_dim, group, kt.data(), vt.data(), head_dim, j_lo,
                         j_hi, c.softcap, s.data(), s_stride, m.data() + qi, l.data() + qi,
                         acc.data() + qi * head_dim, &drip);
      }
    }
  }

  const Call<scalar_t, cache_t>& c;
  const int64_t max_queries;
  std::vector<float> kt, vt;  // [slot][dim]
  std::vector<float> qf, acc;
  const int64_t s_stride;
  std::vector<float> m, l, s;
  std::vector<int64_t> his;
  LineDrip drip;
};

template <typename scalar_t, typename cache_t, int HD>
void run(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
         const torch::Tensor& v_cache, const torch::Tensor& block_tables,
         const torch::Tensor& seq_info, double scale_d, double softcap_d, int64_t window,
         int64_t threads) {
  const int64_t num_seqs = seq_info.size(0);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t tile_blocks = std::max<int64_t>(1, kKeyTile / block_size);
  const Call<scalar_t, cache_t> call{num_heads / num_kv_heads,
                                     head_dim,
                                     q.stride(0),
                                     q.stride(1),
                                     out.stride(0),
                                     block_size,
                                     k_cache.stride(0),
                                     k_cache.stride(1),
                                     k_cache.stride(2),
                                     max_blocks,
                                     tile_blocks,
                                     tile_blocks * block_size,
                                     window,
                                     static_cast<float>(scale_d),
                                     static_cast<float>(softcap_d),
                                     q.data_ptr<scalar_t>(),
                                     static_cast<const cache_t*>(k_cache.data_ptr()),
                                     static_cast<const cache_t*>(v_cache.data_ptr()),
                                     out.data_ptr<scalar_t>(),
                                     block_tables.data_ptr<int32_t>(),
                                     seq_info.data_ptr<int64_t>()};

  const std::vector<Item> items = build_items(call.info, num_seqs, call.tables, max_blocks,
                                              block_size, window, call.tile_slots);
  const int64_t num_items = static_cast<int64_t>(items.size()) * num_kv_heads;

  prefixserve::stream_pool().run(num_items, threads, [&](int64_t idx) {
    ItemWork<scalar_t, cache_t, HD> work(call);
    prefixserve::paged::run_item(work, items[idx / num_kv_heads], idx % num_kv_heads);
  });
}

template <typename scalar_t, typename cache_t>
void dispatch(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
              const torch::Tensor& v_cache, const torch::Tensor& block_tables,
              const torch::Tensor& seq_info, double scale, double softcap, int64_t window,
              int64_t threads) {
  switch (q.size(2)) {
    case 64:
      return run<scalar_t, cache_t, 64>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                        softcap, window, threads);
    case 128:
      return run<scalar_t, cache_t, 128>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                         softcap, window, threads);
    case 256:
      return run<scalar_t, cache_t, 256>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                         softcap, window, threads);
    default:
      return run<scalar_t, cache_t, 0>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                       softcap, window, threads);
  }
}

// The cache's element type for queries of scalar_t: the same, or an 8-bit format's codes.
template <typename scalar_t>
void dispatch_cache(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                    const torch::Tensor& seq_info, double scale, double softcap, int64_t window,
                    int64_t threads) {
  switch (k_cache.scalar_type()) {
    case torch::kChar:
      return dispatch<scalar_t, int8_t>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                        softcap, window, threads);
    case torch::kByte:
      return dispatch<scalar_t, uint8_t>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                         softcap, window, threads);
    default:
      return dispatch<scalar_t, scalar_t>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                          softcap, window, threads);
  }
}

}  // namespace

// paged_lanes.cpp
bool paged_attention_lanes(torch::Tensor& out, const torch::Tensor& q,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_info,
                           double scale, double softcap, int64_t window, int64_t threads);
bool paged_attention_256(torch::Tensor& out, const torch::Tensor& q,
                         const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const torch::Tensor& block_tables, const torch::Tensor& seq_info,
                         double scale, double softcap, int64_t window, int64_t threads);

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

// The workers of a call: `threads`, or OpenMP's thread count where it is 0 or less.
int64_t pool_threads(int64_t threads) {
  return threads > 0 ? threads : static_cast<int64_t>(at::get_num_threads());
}

// The portable path: fp32 tiles, each score a tree sum over its dims (every dtype, every CPU).
void paged_attention_tiles(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                           torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor seq_info, double scale, double softcap, int64_t window,
                           int64_t threads) {
  if (q.scalar_type() == torch::kFloat) {
    dispatch_cache<float>(out, q, k_cache, v_cache, block_tables, seq_info, scale, softcap,
                          window, threads);
  } else if (q.scalar_type() == torch::kBFloat16) {
    dispatch_cache<c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_info, scale,
                                  softcap, window, threads);
  }
}

}  // namespace

// out [T, H * D] (written), q [T, H, D] (last dim contiguous), caches [blocks, block_size,
// kv_heads, D] contiguous (q's dtype, or int8 / uint8 rows of D codes and a 4-byte scale: the
// 8-bit KV cache, int8 or fp8 e4m3), block_tables [S, max_blocks] int32, seq_info [S, 3] int64
// rows (q_start, q_end, position of the first query); softcap 0 = none, window 0 = none. bf16
// queries take the keys-in-lanes path where it is built (paged_lanes.cpp: CPUs with AVX2 and
// FMA), else the portable one. The work items run on the caller and up to `threads - 1` of the
// stream pool's helpers (stream_pool.h), as the linears of the step do: a decode step never wakes
// OpenMP's sleeping threads; `threads` 0: OpenMP's thread count. Items are independent, so no
// output depends on the thread count.
void paged_attention(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                     torch::Tensor v_cache, torch::Tensor block_tables, torch::Tensor seq_info,
                     double scale, double softcap, int64_t window, int64_t threads) {
  check_paged_args(out, q, k_cache, v_cache, block_tables, seq_info);
  threads = pool_threads(threads);
  if (paged_attention_lanes(out, q, k_cache, v_cache, block_tables, seq_info, scale, softcap,
                            window, threads)) {
    return;
  }
  paged_attention_tiles(out, q, k_cache, v_cache, block_tables, seq_info, scale, softcap, window,
                        threads);
}

// The same call on the portable path whatever the CPU (benchmarks and tests compare the two).
void paged_attention_portable(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                              torch::Tensor v_cache, torch::Tensor block_tables,
                              torch::Tensor seq_info, double scale, double softcap,
                              int64_t window, int64_t threads) {
  check_paged_args(out, q, k_cache, v_cache, block_tables, seq_info);
  paged_attention_tiles(out, q, k_cache, v_cache, block_tables, seq_info, scale, softcap, window,
                        pool_threads(threads));
}

// The width of the portable path's vectors in this build: 512 where its fp32 tiles take AVX-512
// intrinsics (head dims 64, 128 and 256), else 0 (loops the compiler vectorizes): two builds'
// portable paths give the same bits only where this is the same.
int64_t paged_attention_portable_width() {
#if defined(__AVX512F__)
  return 512;
#else
  return 0;
#endif
}

// The keys-in-lanes path on its 256-bit tiles whatever the build's widest (tests compare their
// bits with the 512-bit tiles'); false (nothing written) where they do not serve the call.
bool paged_attention_avx2(torch::Tensor out, torch::Tensor q, torch::Tensor k_cache,
                          torch::Tensor v_cache, torch::Tensor block_tables,
                          torch::Tensor seq_info, double scale, double softcap, int64_t window,
                          int64_t threads) {
  check_paged_args(out, q, k_cache, v_cache, block_tables, seq_info);
  return paged_attention_256(out, q, k_cache, v_cache, block_tables, seq_info, scale, softcap,
                             window, pool_threads(threads));
}
