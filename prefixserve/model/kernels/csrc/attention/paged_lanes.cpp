// The paged kernel's keys-in-lanes path, on every CPU with AVX2 and FMA: the same work items as
// paged_attention.cpp (row tiles, cascades over a shared prefix; paged_items.h), with the tile
// arithmetic of the long-chunk kernel (attn_lanes_bf16_avx512.h: keys in lanes, VDPBF16PS scores,
// 64-key
// tiles at absolute positions; int8 caches in integer dot products, attn_lanes_int8_avx512.h). A
// query's
// output is therefore the same bits whether it is served here (decode, verification, a short
// chunk, a sliding window) or by prefill_attention.cpp (a long chunk with its K/V gathered),
// whatever else shares the call, and whichever width of tiles serves it: a CPU without
// AVX512-BF16 runs the same arithmetic on 256-bit vectors (attn_lanes_bf16_avx2.h,
// attn_lanes_int8_avx2.h).
//
// Per tile of 64 key positions, the keys any query of the item sees are read from their blocks
// once (K packed in pairs of dims with keys in lanes, V widened to fp32), then every query of
// the item meets the tile. While a tile is computed, the next one's lines are asked for a few
// at a time (line_sweep.h's LineDrip), so a decode batch's memory reads overlap its arithmetic.
#include "torch_lite.h"

#include "attn_lanes_avx2.h"
#include "attn_lanes_bf16_avx512.h"
#include "attn_lanes_bf16_avx2.h"
#include "attn_lanes_int8_avx512.h"
#include "attn_lanes_int8_avx2.h"
#include "lanes_tiles_avx512.h"
#include "line_sweep.h"
#include "paged_items.h"
#include "stream_pool.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

#if defined(__AVX2__) && defined(__FMA__)  // (every AVX512-BF16 CPU has both)
#if defined(__AVX512BF16__)
static_assert(prefixserve::lanes::kTileKeys == prefixserve::lanes_avx2::kTileKeys);
#endif
using prefixserve::lanes_avx2::kTileKeys;
using prefixserve::LineDrip;
using prefixserve::touch_lines;
using prefixserve::paged::build_items;
using prefixserve::paged::first_visible;
using prefixserve::paged::visible_slots;
using prefixserve::paged::Item;
using prefixserve::paged::kCascadeRows;
using prefixserve::paged::kLongRowTile;

// The caches: bf16 rows, or 8-bit rows (model/quant/kv_cache.py: D codes, then the row's fp32
// scale) of int8 or fp8 e4m3 codes. Offsets and strides count elements (bytes for 8 bits).
enum class CacheKind { kBf16, kInt8, kFp8 };
struct Cache {
  const void* k;
  const void* v;
  int64_t block_stride, slot_stride, head_pitch, block_size;
  CacheKind kind;
  int64_t elem() const { return kind == CacheKind::kBf16 ? 2 : 1; }
  const char* k_row(int64_t off) const { return static_cast<const char*>(k) + off * elem(); }
  const char* v_row(int64_t off) const { return static_cast<const char*>(v) + off * elem(); }
};


// The element offsets of keys [t0 + lo, t0 + hi)'s rows (KV head kvh) in the caches, into
// rows[lo, hi): one block lookup per block.
void tile_rows(const Cache& c, const int32_t* table, int64_t kvh, int64_t t0, int64_t lo,
               int64_t hi, int64_t* rows) {
  for (int64_t j = lo; j < hi;) {
    const int64_t pos = t0 + j;
    const int64_t slot = pos % c.block_size;
    const int64_t n = std::min(c.block_size - slot, hi - j);
    const int64_t base =
        table[pos / c.block_size] * c.block_stride + slot * c.slot_stride + kvh * c.head_pitch;
    for (int64_t i = 0; i < n; ++i, ++j) rows[j] = base + i * c.slot_stride;
  }
}

// Which lines a tile's loader reads first in one burst (line_sweep.h).
enum class Sweep {
  kNone,   // the lines are already near (a unit's later KV heads, after kSlots)
  kRows,   // the unit's own rows: each row's lines
  kSlots,  // whole slots, every KV head's rows (a unit that takes all heads): a run per block
};

// The sweep `how` of keys [t0 + lo, t0 + hi) (their element offsets rows[lo, hi) for kRows).
void sweep_tile(const Cache& c, const int32_t* table, int64_t t0, int64_t lo, int64_t hi,
                const int64_t* rows, Sweep how) {
  if (how == Sweep::kRows) {
    for (int64_t j = lo; j < hi; ++j) {
      touch_lines(c.k_row(rows[j]), c.v_row(rows[j]), c.head_pitch * c.elem());
    }
    return;
  }
  for (int64_t j = lo; how == Sweep::kSlots && j < hi;) {
    const int64_t pos = t0 + j, slot = pos % c.block_size;
    const int64_t count = std::min(c.block_size - slot, hi - j);
    const int64_t first = table[pos / c.block_size] * c.block_stride + slot * c.slot_stride;
    touch_lines(c.k_row(first), c.v_row(first), count * c.slot_stride * c.elem());
    j += count;
  }
}

// Every KV head's rows of keys [t0 + lo, t0 + hi) as runs of whole slots, into `drip`.
inline void slot_runs(const Cache& c, const int32_t* table, int64_t t0, int64_t lo, int64_t hi,
                      LineDrip* drip) {
  for (int64_t j = lo; j < hi;) {
    const int64_t pos = t0 + j, slot = pos % c.block_size;
    const int64_t count = std::min(c.block_size - slot, hi - j);
    const int64_t first = table[pos / c.block_size] * c.block_stride + slot * c.slot_stride;
    drip->add_runs(c.k_row(first), c.v_row(first), count * c.slot_stride * c.elem());
    j += count;
  }
}

// KV head kvh's rows of keys [t0 + lo, t0 + hi), each a run, into `drip`.
inline void own_rows(const Cache& c, const int32_t* table, int64_t kvh, int64_t t0, int64_t lo,
                     int64_t hi, LineDrip* drip) {
  int64_t rows[kTileKeys];
  tile_rows(c, table, kvh, t0, lo, hi, rows);
  for (int64_t j = lo; j < hi; ++j) {
    drip->add_runs(c.k_row(rows[j]), c.v_row(rows[j]), c.head_pitch * c.elem());
  }
}

// The tile arithmetic and loaders of one vector width: Tiles512 (AVX512-BF16 and VNNI:
// attn_lanes_bf16_avx512.h, attn_lanes_int8_avx512.h, lanes_tiles_avx512.h) or Tiles256 (AVX2 and
// FMA:
// attn_lanes_bf16_avx2.h, attn_lanes_int8_avx2.h), the same bits from both. A build runs its
// widest (`Tiles`); an AVX-512 build runs Tiles256 too where a test asks (paged_attention_avx2).
struct Tiles256 {
  static constexpr int kWidth = 256;
  static constexpr int64_t kKeysPerWord = 2;  // int8 V words: pairs of keys
  using Int8Tile = prefixserve::lanes_int8_avx2::Tile;
  using RowScales = prefixserve::lanes_bf16_avx2::RowScales;
  template <int D>
  static constexpr int64_t query_bytes() { return prefixserve::lanes_int8_avx2::query_bytes<D>(); }
  template <int D>
  static float quantize_query(const uint16_t* q, uint8_t* out) {
    return prefixserve::lanes_int8_avx2::quantize_query<D>(q, out);
  }
  template <int D, class... Args>
  static void load_int8(Args... args) { prefixserve::lanes_int8_avx2::load_tile<D>(args...); }
  template <int D, class... Args>
  static void attend_int8(Args... args) { prefixserve::lanes_int8_avx2::attend_tile<D>(args...); }
  template <int D>
  static void finish_int8(const float* acc, float l, uint16_t* out) {
    prefixserve::lanes_int8_avx2::finish<D>(acc, l, out);
  }
  template <int D, class... Args>
  static void load_bf16(Args... args) { prefixserve::lanes_bf16_avx2::load_bf16<D>(args...); }
  template <int D, class... Args>
  static void load_fp8(Args... args) { prefixserve::lanes_bf16_avx2::load_fp8<D>(args...); }
  template <int D, class... Args>
  static void attend_16(Args... args) { prefixserve::lanes_bf16_avx2::attend_tile<D>(args...); }
  template <int D>
  static void finish_16(const float* acc, float l, uint16_t* out) {
    prefixserve::lanes_bf16_avx2::finish<D>(acc, l, out);
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
struct Tiles512 {
  static constexpr int kWidth = 512;
  static constexpr int64_t kKeysPerWord = 4;  // int8 V words: quads of keys
  using Int8Tile = prefixserve::lanes_int8::Tile;
  using RowScales = prefixserve::lanes::RowScales;
  template <int D>
  static constexpr int64_t query_bytes() { return prefixserve::lanes_int8::query_bytes<D>(); }
  template <int D>
  static float quantize_query(const uint16_t* q, uint8_t* out) {
    return prefixserve::lanes_int8::quantize_query<D>(q, out);
  }
  template <int D, class... Args>
  static void load_int8(Args... args) { prefixserve::lanes::load_int8<D>(args...); }
  template <int D, class... Args>
  static void attend_int8(Args... args) { prefixserve::lanes_int8::attend_tile<D>(args...); }
  template <int D>
  static void finish_int8(const float* acc, float l, uint16_t* out) {
    prefixserve::lanes_int8::finish<D>(acc, l, out);
  }
  template <int D, class... Args>
  static void load_bf16(Args... args) { prefixserve::lanes::load_bf16<D>(args...); }
  template <int D, class... Args>
  static void load_fp8(Args... args) { prefixserve::lanes::load_fp8<D>(args...); }
  template <int D, class... Args>
  static void attend_16(Args... args) { lanes_16_tile<D>(args...); }
  template <int D>
  static void finish_16(const float* acc, float l, uint16_t* out) {
    prefixserve::lanes::finish<D>(acc, l, out);
  }

 private:  // attn_lanes_bf16_avx512.h's attend_tile takes its K tile's stride: the tile's
  template <int D>
  static void lanes_16_tile(int64_t n, const uint16_t* const* q, const int64_t* lo,
                            const int64_t* hi, const uint32_t* kp, const float* v, float scale,
                            float* const* m, float* const* l, float* const* acc, float* pbuf,
                            const RowScales* rows, LineDrip* drip) {
    prefixserve::lanes::attend_tile<D>(n, q, lo, hi, kp, kTileKeys, v, scale, m, l, acc, pbuf,
                                       rows, drip);
  }
};
using Tiles = Tiles512;
#else
using Tiles = Tiles256;
#endif

// The integer tile's buffers (int8 caches), and an fp8 tile's row scales.
struct IntTile {
  std::vector<float> kscale, vscale;
  std::vector<uint32_t> vq;
  IntTile(int64_t d, int64_t keys_per_word)
      : kscale(kTileKeys, 0.0f), vscale(kTileKeys, 0.0f), vq(kTileKeys / keys_per_word * d, 0u) {}
};

// Keys [t0 + lo, t0 + hi) of a sequence (block table `table`), KV head kvh, into the tile
// buffers in T's layouts: K into kp; V into vt (bf16, fp8: fp32 rows) or it.vq (int8); an 8-bit
// tile's row scales into `it`; `kb` (kTileKeys * D bf16) holds an fp8 tile's keys on their way.
template <int D, class T>
void load_tile(const Cache& c, const int32_t* table, int64_t kvh, int64_t t0, int64_t lo,
               int64_t hi, uint32_t* kp, float* vt, uint16_t* kb, IntTile& it, Sweep sweep,
               LineDrip* drip) {
  // The tile's lines read in one burst first (the rows of one KV head are strided: read one
  // after another, each would wait for memory on its own); mostly in L2 already, asked for by
  // the drip during the last tile. `drip` is asked on during the conversions too.
  int64_t rows[kTileKeys];
  tile_rows(c, table, kvh, t0, lo, hi, rows);
  sweep_tile(c, table, t0, lo, hi, rows, sweep);
  const char* k = static_cast<const char*>(c.k);  // rows[] counts bytes for 8-bit caches
  const char* v = static_cast<const char*>(c.v);
  if (c.kind == CacheKind::kInt8) {
    T::template load_int8<D>(k, v, rows, lo, hi, kp, it.kscale.data(), it.vq.data(),
                             it.vscale.data(), drip);
  } else if (c.kind == CacheKind::kFp8) {
    T::template load_fp8<D>(k, v, rows, lo, hi, kp, vt, kb, it.kscale.data(), it.vscale.data(),
                            drip);
  } else {
    T::template load_bf16<D>(static_cast<const uint16_t*>(c.k),
                             static_cast<const uint16_t*>(c.v), rows, lo, hi, kp, vt, drip);
  }
}

// A call's shapes, strides (in elements) and pointers, and the KV heads of a unit of work.
struct Call {
  Cache cache;
  bool integer;  // an int8 cache: integer dot products
  int64_t group, heads, max_blocks, window, max_entries;
  int64_t q_row, q_head, out_row;
  float scale;
  const uint16_t* q_ptr;
  uint16_t* out_ptr;
  const int32_t* tables;
  const int64_t* info;
};

// One thread's units (an item and `heads` of its KV heads from kvh0; paged_items.h): a row tile
// or a cascade, between `start` and `finish`. The tile buffers and the queries' state are sized
// once for the largest item and reused. The queries of a unit: index h * nq + e * group + g for
// its head h (KV head kvh0 + h), item entry e (a row) and query head g of the KV head's group.
template <int D, class T>
class UnitWork {
 public:
  explicit UnitWork(const Call& call)
      : c(call),
        max_queries(c.max_entries * c.group * c.heads),
        kp(D / 2 * kTileKeys, 0u),
        vt(c.integer ? 0 : kTileKeys * D, 0.0f),
        kb(c.cache.kind == CacheKind::kBf16 || c.integer ? 0 : kTileKeys * D),
        it(c.integer ? D : 0, T::kKeysPerWord),
        qbytes(c.integer ? max_queries * kQueryBytes : 0),
        wbuf(c.integer ? max_queries * 2 * kTileKeys : 0),
        qfac(max_queries),
        tf(max_queries),
        tqb(max_queries),
        m(max_queries),
        l(max_queries),
        acc(max_queries * D),
        pbuf(max_queries * kTileKeys),
        qv(max_queries),
        tq(max_queries),
        lo(max_queries),
        hi(max_queries),
        tm(max_queries),
        tl(max_queries),
        ta(max_queries) {}

  // The unit's query rows (an int8 cache's quantized too); their state reset.
  void start(const Item& item, int64_t kvh0) {
    const int64_t group = c.group, heads = c.heads;
    const int64_t entries = item.entries();
    const int64_t nq = entries * group, units_q = heads * nq;
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t e = 0; e < entries; ++e) {
        for (int64_t g = 0; g < group; ++g) {
          const int64_t head = (kvh0 + h) * group + g;
          qv[h * nq + e * group + g] = c.q_ptr + item.row_of(e, c.info) * c.q_row + head * c.q_head;
        }
      }
    }
    for (int64_t qi = 0; c.integer && qi < units_q; ++qi) {
      qfac[qi] = T::template quantize_query<D>(qv[qi], qbytes.data() + qi * kQueryBytes) *
                 c.scale;
    }
    std::fill(acc.begin(), acc.begin() + units_q * D, 0.0f);
    std::fill(m.begin(), m.begin() + units_q, -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.begin() + units_q, 0.0f);
  }

  // A tile of rows of one sequence.
  void row_tile(const Item& item, int64_t kvh0) {
    own_keys(item.seqs[0], item.row0, item.rows, 0, kvh0, item.entries() * c.group, 0);
  }

  // A cascade: the shared keys once for every query (each sees all of them), then each
  // sequence's own keys.
  void cascade(const Item& item, int64_t kvh0) {
    const int64_t entries = item.entries();
    const int64_t nq = entries * c.group;
    const int64_t shared_keys = item.shared_blocks * c.cache.block_size;
    const int32_t* table = c.tables + item.seqs[0] * c.max_blocks;
    for (int64_t t0 = 0; t0 < shared_keys; t0 += kTileKeys) {
      const int64_t next = t0 + kTileKeys < shared_keys ? kTileKeys : 0;
      for (int64_t h = 0; h < c.heads; ++h) {
        load(table, kvh0 + h, t0, 0, kTileKeys, next);
        int64_t nt = 0;
        for (int64_t qi = h * nq; qi < (h + 1) * nq; ++qi) add(nt, qi, 0, kTileKeys);
        attend(nt);
      }
    }
    for (int64_t e = 0; e < entries; ++e) {
      own_keys(item.seqs[e], item.row_of(e, c.info), 1, e, kvh0, nq, shared_keys);
    }
  }

  // The unit's outputs: each query's sum over its softmax weights, in bf16.
  void finish(const Item& item, int64_t kvh0) {
    const int64_t group = c.group;
    const int64_t entries = item.entries();
    const int64_t nq = entries * group;
    auto out_of = [&](int64_t h, int64_t e, int64_t g) {
      return c.out_ptr + item.row_of(e, c.info) * c.out_row + ((kvh0 + h) * group + g) * D;
    };
    for (int64_t h = 0; h < c.heads; ++h) {
      for (int64_t e = 0; e < entries; ++e) {
        for (int64_t g = 0; g < group; ++g) {
          const float* a = acc.data() + (h * nq + e * group + g) * D;
          const float lsum = l[h * nq + e * group + g];
          if (c.integer) {
            T::template finish_int8<D>(a, lsum, out_of(h, e, g));
          } else {
            T::template finish_16<D>(a, lsum, out_of(h, e, g));
          }
        }
      }
    }
  }

 private:
  static constexpr int64_t kQueryBytes = T::template query_bytes<D>();

  // The tile against the nt queries listed by `add`.
  void attend(int64_t nt) {
    if (c.integer) {
      const typename T::Int8Tile tile{kp.data(), it.kscale.data(), it.vq.data(),
                                      it.vscale.data()};
      T::template attend_int8<D>(nt, tqb.data(), tf.data(), lo.data(), hi.data(), tile, tm.data(),
                                 tl.data(), ta.data(), pbuf.data(), wbuf.data(), drip);
      return;
    }
    const typename T::RowScales fp8_rows{it.kscale.data(), it.vscale.data()};
    T::template attend_16<D>(nt, tq.data(), lo.data(), hi.data(), kp.data(), vt.data(), c.scale,
                             tm.data(), tl.data(), ta.data(), pbuf.data(),
                             c.cache.kind == CacheKind::kFp8 ? &fp8_rows : nullptr, drip);
  }
  void add(int64_t& nt, int64_t qi, int64_t jl, int64_t jh) {
    tq[nt] = qv[qi], lo[nt] = jl, hi[nt] = jh;
    tm[nt] = &m[qi], tl[nt] = &l[qi], ta[nt] = acc.data() + qi * D;
    if (c.integer) tqb[nt] = qbytes.data() + qi * kQueryBytes, tf[nt] = qfac[qi];
    ++nt;
  }
  // Keys [t0 + jl, t0 + jh) of KV head kvh (block table `table`) into the tile buffers, the
  // next tile's [0, next) asked for meanwhile. A unit of all heads sweeps the tile's whole
  // slots with its first head; a unit of one head, its own rows.
  void load(const int32_t* table, int64_t kvh, int64_t t0, int64_t jl, int64_t jh, int64_t next) {
    const int64_t heads = c.heads;
    const Sweep sweep = heads == 1 ? Sweep::kRows : kvh % heads == 0 ? Sweep::kSlots
                                                                      : Sweep::kNone;
    if (sweep != Sweep::kNone) {  // a unit's first load of the tile: list the next one's
      drip->clear();
      if (sweep == Sweep::kSlots) slot_runs(c.cache, table, t0 + kTileKeys, 0, next, drip);
      else own_rows(c.cache, table, kvh, t0 + kTileKeys, 0, next, drip);
    }
    load_tile<D, T>(c.cache, table, kvh, t0, jl, jh, kp.data(), vt.data(), kb.data(), it, sweep,
                    drip);
  }
  // Rows [row0, row0 + rows) of sequence `seq` (entries from e0 on) against its keys from
  // `start_key` (a tile boundary) on, each row up to its own position.
  void own_keys(int64_t seq, int64_t row0, int64_t rows, int64_t e0, int64_t kvh0, int64_t nq,
                int64_t start_key) {
    const int64_t group = c.group, window = c.window;
    const int64_t first_pos = c.info[3 * seq + 2] + (row0 - c.info[3 * seq]);
    const int64_t last_pos = first_pos + rows - 1;
    const int32_t* table = c.tables + seq * c.max_blocks;
    const int64_t lo_key = first_visible(first_pos, window);
    const int64_t t_start = std::max(lo_key / kTileKeys * kTileKeys, start_key);
    for (int64_t t0 = t_start; t0 <= last_pos; t0 += kTileKeys) {
      const int64_t next = std::clamp<int64_t>(last_pos - t0 - kTileKeys + 1, 0, kTileKeys);
      for (int64_t h = 0; h < c.heads; ++h) {
        load(table, kvh0 + h, t0, std::max<int64_t>(0, lo_key - t0),
             std::min<int64_t>(kTileKeys, last_pos - t0 + 1), next);
        int64_t nt = 0;
        for (int64_t r = 0; r < rows; ++r) {
          const auto [jl, jh] = visible_slots(first_pos + r, window, t0, kTileKeys);
          if (jl >= jh) continue;
          for (int64_t g = 0; g < group; ++g) add(nt, h * nq + (e0 + r) * group + g, jl, jh);
        }
        attend(nt);
      }
    }
  }

  const Call& c;
  const int64_t max_queries;
  std::vector<uint32_t> kp;
  std::vector<float> vt;
  std::vector<uint16_t> kb;
  IntTile it;
  std::vector<uint8_t> qbytes, wbuf;
  std::vector<float> qfac, tf;
  std::vector<const uint8_t*> tqb;
  std::vector<float> m, l, acc;
  std::vector<float> pbuf;
  std::vector<const uint16_t*> qv, tq;
  std::vector<int64_t> lo, hi;
  std::vector<float*> tm, tl, ta;
  LineDrip drip_lines;  // the next tile's lines, asked for while this one is computed
  LineDrip* const drip = &drip_lines;
};

template <int D, class T>
void run(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
         const torch::Tensor& v_cache, const torch::Tensor& block_tables,
         const torch::Tensor& seq_info, float scale, int64_t window, int64_t threads) {
  const int64_t num_seqs = seq_info.size(0);
  const int64_t num_heads = q.size(1);
  const int64_t num_kv_heads = k_cache.size(2);
  const int64_t max_blocks = block_tables.size(1);
  const CacheKind kind = k_cache.scalar_type() == torch::kChar   ? CacheKind::kInt8
                         : k_cache.scalar_type() == torch::kByte ? CacheKind::kFp8
                                                                 : CacheKind::kBf16;
  const Cache cache{k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1),
                    k_cache.stride(2),  k_cache.size(1),     kind};
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t* info = seq_info.data_ptr<int64_t>();
  const std::vector<Item> items =
      build_items(info, num_seqs, tables, max_blocks, cache.block_size, window, kTileKeys, true);
  int64_t max_entries = 1;  // the most query rows of one item
  for (const Item& item : items) max_entries = std::max(max_entries, item.entries());
  // A unit of work is an item and `heads` of its KV heads: all of them where the items are
  // decode-sized and many enough to give every thread several, else one. A tile's rows of all
  // KV heads share cache lines (a block slot holds the heads side by side; an 8-bit row of D + 4
  // bytes straddles lines with its neighbors'), so a unit reads each line it fetches at once.
  // Each head's queries meet the same tiles in the same order either way.
  const int64_t heads = max_entries <= kCascadeRows &&
                                static_cast<int64_t>(items.size()) >= 4 * threads
                            ? num_kv_heads
                            : 1;
  const int64_t units_per_item = num_kv_heads / heads;
  const int64_t num_units = static_cast<int64_t>(items.size()) * units_per_item;
  const Call call{cache,
                  kind == CacheKind::kInt8,
                  num_heads / num_kv_heads,
                  heads,
                  max_blocks,
                  window,
                  max_entries,
                  q.stride(0),
                  q.stride(1),
                  out.stride(0),
                  scale,
                  reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>()),
                  reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
                  tables,
                  info};

  // On the caller and the stream pool's helpers (paged_attention.cpp says why), a unit a claim.
  prefixserve::stream_pool().run(num_units, threads, [&](int64_t unit) {
    UnitWork<D, T> work(call);
    prefixserve::paged::run_item(work, items[unit / units_per_item],
                                 unit % units_per_item * heads);
  });
}

// run<D, T> for q's head dim (64, 128 or 256); false for another.
template <class T>
bool run_head_dim(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& seq_info, double scale, int64_t window, int64_t threads) {
  const float s = static_cast<float>(scale);
  const auto call = [&](auto run_d) {
    run_d(out, q, k_cache, v_cache, block_tables, seq_info, s, window, threads);
  };
  switch (q.size(2)) {
    case 64: call(run<64, T>); break;
    case 128: call(run<128, T>); break;
    case 256: call(run<256, T>); break;
    default: return false;
  }
  return true;
}
#endif  // __AVX2__ && __FMA__

}  // namespace

// paged_attention with keys in lanes, where this build has it (AVX2 and FMA; Tiles: the
// AVX-512 tiles where the build has AVX512-BF16 and VNNI): bf16 queries, a head dim of 64, 128
// or 256 and no soft-capping. Returns false (nothing written) otherwise. The caller has checked
// the shapes and the block tables.
bool paged_attention_lanes(torch::Tensor& out, const torch::Tensor& q,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& block_tables, const torch::Tensor& seq_info,
                           double scale, double softcap, int64_t window, int64_t threads) {
#if defined(__AVX2__) && defined(__FMA__)
  if (q.scalar_type() != torch::kBFloat16 || softcap > 0.0) return false;
  return run_head_dim<Tiles>(out, q, k_cache, v_cache, block_tables, seq_info, scale, window,
                             threads);
#else
  (void)out, (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)seq_info;
  (void)scale, (void)softcap, (void)window, (void)threads;
  return false;
#endif
}

// The same on the 256-bit tiles whatever the build's widest (tests compare their bits with the
// 512-bit tiles'); false (nothing written) where they would not serve the call.
bool paged_attention_256(torch::Tensor& out, const torch::Tensor& q,
                         const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const torch::Tensor& block_tables, const torch::Tensor& seq_info,
                         double scale, double softcap, int64_t window, int64_t threads) {
#if defined(__AVX2__) && defined(__FMA__)
  if (q.scalar_type() != torch::kBFloat16 || softcap > 0.0) return false;
  return run_head_dim<Tiles256>(out, q, k_cache, v_cache, block_tables, seq_info, scale, window,
                                threads);
#else
  (void)out, (void)q, (void)k_cache, (void)v_cache, (void)block_tables, (void)seq_info;
  (void)scale, (void)softcap, (void)window, (void)threads;
  return false;
#endif
}

// The width of the keys-in-lanes tiles in this build: 512 (AVX512-BF16 and VNNI), 256 (AVX2 and
// FMA), or 0 (none: the portable path serves every call).
int64_t paged_attention_lanes_width() {
#if defined(__AVX2__) && defined(__FMA__)
  return Tiles::kWidth;
#else
  return 0;
#endif
}
