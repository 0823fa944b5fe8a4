// The attention mask as a small policy object shared by the CPU reference, the GPU oracle and the
// scheduler, so that every layer agrees on which (query, key) pairs are visible.
//
// Everything is per sequence. With shift = Lk - Lq (bottom-right alignment), query i sees key j
// when  i + shift - left <= j <= i + shift + right,  where left/right == -1 means unbounded.
// none = (-1, -1), causal = (-1, 0).
#pragma once

#include <jagflash/jagflash.h>

#include <cstdint>

#if defined(__CUDACC__)
#define JF_HD __host__ __device__ __forceinline__
#else
#define JF_HD inline
#endif

namespace jagflash {

// An inclusive index range; empty when lo > hi.
struct IndexRange {
  int64_t lo;
  int64_t hi;
  JF_HD bool empty() const { return lo > hi; }
  JF_HD int64_t size() const { return lo > hi ? 0 : hi - lo + 1; }
};

struct MaskPolicy {
  int32_t left = -1;
  int32_t right = -1;

  JF_HD static MaskPolicy from(jf_mask mask, int32_t window_left, int32_t window_right) {
    MaskPolicy m;
    if (mask == JF_MASK_CAUSAL) {
      m.left = -1;
      m.right = 0;
    } else if (mask == JF_MASK_WINDOW) {
      m.left = window_left;
      m.right = window_right;
    }
    return m;
  }

  JF_HD bool is_full() const { return left < 0 && right < 0; }

  // Keys visible to query i: the window clipped to [0, lk).
  JF_HD IndexRange key_range(int64_t i, int64_t lq, int64_t lk) const {
    const int64_t shift = lk - lq;
    int64_t lo = left < 0 ? 0 : i + shift - left;
    int64_t hi = right < 0 ? lk - 1 : i + shift + right;
    if (lo < 0) lo = 0;
    if (hi > lk - 1) hi = lk - 1;
    return {lo, hi};
  }

  // Queries that see key j (the transpose of key_range), clipped to [0, lq).
  JF_HD IndexRange query_range(int64_t j, int64_t lq, int64_t lk) const {
    const int64_t shift = lk - lq;
    int64_t lo = right < 0 ? 0 : j - shift - right;
    int64_t hi = left < 0 ? lq - 1 : j - shift + left;
    if (lo < 0) lo = 0;
    if (hi > lq - 1) hi = lq - 1;
    return {lo, hi};
  }

  // Rows (or keys) of block `block` of `tile` rows in a sequence of `len`: the last block is cut short.
  JF_HD static IndexRange block_rows(int64_t block, int tile, int64_t len) {
    const int64_t first = block * tile;
    const int64_t last = first + tile - 1 < len - 1 ? first + tile - 1 : len - 1;
    return {first, last};
  }

  JF_HD bool visible(int64_t i, int64_t j, int64_t lq, int64_t lk) const {
    const IndexRange r = key_range(i, lq, lk);
    return j >= r.lo && j <= r.hi;
  }

  // KV blocks (of tile_n keys) touched by query block m_block (of tile_m queries). Both window
  // bounds are non-decreasing in i and a window is never narrower than one key, so the union of
  // the rows' key ranges is one contiguous range and every block in it holds a visible pair:
  // the count is exact, which the scheduler's costs rely on.
  JF_HD IndexRange kv_blocks_of_q_block(int64_t m_block, int tile_m, int tile_n, int64_t lq,
                                        int64_t lk) const {
    const IndexRange rows = block_rows(m_block, tile_m, lq);
    const int64_t row_first = rows.lo, row_last = rows.hi;
    if (rows.empty() || lk <= 0) return {0, -1};
    // The rows' ranges are clipped separately; take the union only over rows that see a key.
    int64_t lo = -1, hi = -2;
    const IndexRange first = key_range(row_first, lq, lk);
    const IndexRange last = key_range(row_last, lq, lk);
    // Rows whose range is empty sit at the top (window start beyond lk is impossible for
    // earlier rows than a non-empty one) or the bottom; find the union by the outer bounds and
    // fall back to a scan only when an end row is empty.
    if (!first.empty() && !last.empty()) {
      lo = first.lo;
      hi = last.hi;
    } else {
      for (int64_t i = row_first; i <= row_last; ++i) {
        const IndexRange r = key_range(i, lq, lk);
        if (r.empty()) continue;
        if (lo < 0) lo = r.lo;
        hi = r.hi;
      }
      if (lo < 0) return {0, -1};
    }
    return {lo / tile_n, hi / tile_n};
  }

  // The KV blocks every row of query block m_block sees completely: the mask-free bulk of the
  // forward's loop (loop peeling). The rows' lower bounds grow with the row and so do the upper
  // bounds, so the block must start at or after the last row's first key and end at or before
  // the first row's last key. Rows past lq (another sequence's) are never stored, so they do not
  // restrict it.
  JF_HD IndexRange unmasked_kv_blocks_of_q_block(int64_t m_block, int tile_m, int tile_n, int64_t lq,
                                                 int64_t lk) const {
    const IndexRange rows = block_rows(m_block, tile_m, lq);
    if (rows.empty() || lk <= 0) return {0, -1};
    const IndexRange first = key_range(rows.lo, lq, lk);
    const IndexRange last = key_range(rows.hi, lq, lk);
    if (first.empty() || last.empty()) return {0, -1};
    return {(last.lo + tile_n - 1) / tile_n, (first.hi + 1) / tile_n - 1};
  }

  // Query blocks that see any key of kv block n_block: the backward's trip count.
  JF_HD IndexRange q_blocks_of_kv_block(int64_t n_block, int tile_m, int tile_n, int64_t lq,
                                        int64_t lk) const {
    const IndexRange keys = block_rows(n_block, tile_n, lk);
    const int64_t key_first = keys.lo, key_last = keys.hi;
    if (keys.empty() || lq <= 0) return {0, -1};
    int64_t lo = -1, hi = -2;
    const IndexRange first = query_range(key_first, lq, lk);
    const IndexRange last = query_range(key_last, lq, lk);
    if (!first.empty() && !last.empty()) {
      lo = first.lo;
      hi = last.hi;
    } else {
      for (int64_t j = key_first; j <= key_last; ++j) {
        const IndexRange r = query_range(j, lq, lk);
        if (r.empty()) continue;
        if (lo < 0) lo = r.lo;
        hi = r.hi;
      }
      if (lo < 0) return {0, -1};
    }
    return {lo / tile_m, hi / tile_m};
  }

  // The query blocks whose every row sees every key of kv block n_block, all tile_n keys of it
  // inside lk: the mask-free steps of the backward's loop over a KV block. The transpose of
  // unmasked_kv_blocks_of_q_block: the keys' query ranges grow with the key, so the block must
  // start at or after the last key's first query and end at or before the first key's last
  // query (query_range is clipped to lq, so the block's rows are inside the sequence).
  JF_HD IndexRange unmasked_q_blocks_of_kv_block(int64_t n_block, int tile_m, int tile_n, int64_t lq,
                                                 int64_t lk) const {
    const int64_t key_first = n_block * tile_n, key_last = key_first + tile_n - 1;
    if (lq <= 0 || key_last > lk - 1) return {0, -1};
    const IndexRange first = query_range(key_first, lq, lk);
    const IndexRange last = query_range(key_last, lq, lk);
    if (first.empty() || last.empty()) return {0, -1};
    return {(last.lo + tile_m - 1) / tile_m, (first.hi + 1) / tile_m - 1};
  }

  // Visible (query, key) pairs of a whole sequence: useful-FLOP counts.
  JF_HD int64_t visible_pairs(int64_t lq, int64_t lk) const {
    int64_t pairs = 0;
    for (int64_t i = 0; i < lq; ++i) pairs += key_range(i, lq, lk).size();
    return pairs;
  }
};

}  // namespace jagflash
