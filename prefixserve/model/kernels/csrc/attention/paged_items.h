// The work items of a paged-attention call (paged_attention.cpp, paged_lanes.cpp), each run
// once per KV head: a tile of query rows of one sequence, or a cascade: up to kCascadeRows
// single-token sequences whose block tables start with the same blocks (a shared cached prefix),
// whose shared blocks are read once for all their queries; and which keys of a tile a query sees.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

namespace prefixserve::paged {

// Query rows per item of a short chunk.
constexpr int64_t kRowTile = 16;
// Rows per work item of a long chunk under full attention: each item converts every K/V tile
// its rows see, so fewer, larger items convert less (a 512-token prompt: 8 items a KV head
// instead of 32).
constexpr int64_t kLongRowTile = 64;
// Decode sequences sharing a cached prefix are attended together, this many at most per work
// item (a cap that keeps several items per KV head for a batch of 8+ rows on two threads).
constexpr int64_t kCascadeRows = 4;

// The first key position a query at `pos` sees: 0 under full attention (window 0), else the
// start of its sliding window.
inline int64_t first_visible(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// The slots [lo, hi) of the tile of `slots` keys from position t0 that a query at `pos` sees
// (lo >= hi: none).
struct SlotRange {
  int64_t lo, hi;
};
inline SlotRange visible_slots(int64_t pos, int64_t window, int64_t t0, int64_t slots) {
  return {std::max<int64_t>(0, first_visible(pos, window) - t0),
          std::min<int64_t>(slots, pos - t0 + 1)};
}

struct Item {
  std::vector<int64_t> seqs;    // a cascade's sequences; one sequence otherwise
  int64_t row0 = 0, rows = 0;   // the row tile (one-sequence items)
  int64_t shared_blocks = 0;    // leading blocks common to all `seqs` (0: not a cascade)

  bool cascade() const { return shared_blocks > 0; }
  // Its entries: a cascade's sequences, or the tile's rows.
  int64_t entries() const { return cascade() ? static_cast<int64_t>(seqs.size()) : rows; }
  // The batch row of entry e (`info` as build_items'): a cascade sequence's one query row, or
  // a row of the tile.
  int64_t row_of(int64_t e, const int64_t* info) const {
    return cascade() ? info[3 * seqs[e]] : row0 + e;
  }
};

// `info` rows (q_start, q_end, position of the first query) of num_seqs sequences, their block
// tables (max_blocks each). A cascade's shared part ends on a key-tile boundary (tiles of
// `tile_keys` keys from position 0), so every query meets its keys in the same tiles (the same
// online-softmax updates, the same sums) as alone: batch invariance. `long_windowed`: chunks
// under a sliding window take long row tiles too (the keys-in-lanes path walks any rows' tiles
// together; the portable path only full attention's).
inline std::vector<Item> build_items(const int64_t* info, int64_t num_seqs, const int32_t* tables,
                                     int64_t max_blocks, int64_t block_size, int64_t window,
                                     int64_t tile_keys, bool long_windowed = false) {
  std::vector<Item> items;
  auto is_single = [&](int64_t s) { return info[3 * s + 1] - info[3 * s] == 1; };
  std::vector<int64_t> singles;
  for (int64_t s = 0; s < num_seqs; ++s) {
    // A decode row at position p can share the blocks before p's own block with others.
    if (window == 0 && is_single(s) && info[3 * s + 2] >= block_size) {
      singles.push_back(s);
      continue;
    }
    const int64_t n = info[3 * s + 1] - info[3 * s];
    const bool long_rows = n >= kLongRowTile && (window == 0 || long_windowed);
    const int64_t row_tile = long_rows ? kLongRowTile : kRowTile;
    for (int64_t r = info[3 * s]; r < info[3 * s + 1]; r += row_tile) {
      items.push_back(Item{{s}, r, std::min(row_tile, info[3 * s + 1] - r), 0});
    }
  }
  // Sort single-token sequences by their fully visible blocks, compared block by block, so that
  // those sharing the longest prefixes become adjacent.
  std::stable_sort(singles.begin(), singles.end(), [&](int64_t a, int64_t b) {
    return std::lexicographical_compare(
        tables + a * max_blocks, tables + a * max_blocks + info[3 * a + 2] / block_size,
        tables + b * max_blocks, tables + b * max_blocks + info[3 * b + 2] / block_size);
  });
  // Shared parts are whole multiples of this many blocks (a whole number of key tiles).
  const int64_t unit = tile_keys / std::gcd(block_size, tile_keys);
  for (size_t i = 0; i < singles.size();) {
    const int64_t first = singles[i];
    const int32_t* t0 = tables + first * max_blocks;
    // Blocks fully visible to a decode query at position p: those before p's own block.
    int64_t shared = info[3 * first + 2] / block_size;
    size_t j = i + 1;
    while (j < singles.size() && static_cast<int64_t>(j - i) < kCascadeRows) {
      const int64_t s = singles[j];
      const int32_t* ts = tables + s * max_blocks;
      int64_t common = 0;
      const int64_t limit = std::min(shared, info[3 * s + 2] / block_size);
      while (common < limit && ts[common] == t0[common]) ++common;
      // Start a new group rather than cut the shared part by more than half.
      if (common == 0 || 2 * common < shared) break;
      shared = common;
      ++j;
    }
    const int64_t aligned = shared / unit * unit;
    if (j - i >= 2 && aligned > 0) {
      items.push_back(Item{std::vector<int64_t>(singles.begin() + i, singles.begin() + j), 0, 0,
                           aligned});
    } else {
      items.push_back(Item{{first}, info[3 * first], 1, 0});
      j = i + 1;
    }
    i = j;
  }
  return items;
}

// One work item of a paged call (KV head kvh, or the first of a unit's heads) on `work`
// (paged_attention.cpp's ItemWork, paged_lanes.cpp's UnitWork): start, the cascade or the row
// tile, finish.
template <class Work>
void run_item(Work& work, const Item& item, int64_t kvh) {
  work.start(item, kvh);
  if (item.cascade()) {
    work.cascade(item, kvh);
  } else {
    work.row_tile(item, kvh);
  }
  work.finish(item, kvh);
}

}  // namespace prefixserve::paged
