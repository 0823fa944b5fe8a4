// The backward's tiles: (sequence, KV block, KV head) from the plan built over the KV side
// (schedule/plan_device with the roles of q and kv swapped), taken through an atomic counter
// or by a static rule, decoded with the Q blocks that see the KV block.
#pragma once

#include "kernels/bwd/kernel_traits_bwd.cuh"

#include <cstdint>

namespace jagflash::kernels::bwd {

// Plan tile `tile` = (position x heads_kv + kv head) x group_splits + split: a sequence's KV
// blocks are adjacent in the plan, in the plan's order (first block first, or last first in the
// deterministic mode), and every (KV head, split) of a block follows it (innermost), so for one
// (sequence, query head) the tiles come in the plan's KV-block order: the order the
// deterministic mode adds their dQ partials in (a tile only ever waits for tiles taken before it).
// With pooled_dq_sum the (KV head, split) is outermost instead: tile = head_split x num_pairs +
// position, so a CTA's consecutive tiles (the counter hands out neighbours to the CTAs in turn)
// mostly share a query head and sum their dQ in the CTA. Every pooled tile sees the one Q block,
// so the plan's longest-first order matters little there.
// plan_descending: the plan lists a sequence's KV blocks last to first (built by the
// deterministic mode, reused here through jf_launch.reuse_plan).
template <class Traits>
__device__ __forceinline__ TileInfo decode_tile(const Params<Traits>& p, int32_t tile, int32_t num_pairs,
                                                bool plan_descending) {
  TileInfo t;
  const int32_t tiles_per_pair = p.num_heads_kv * p.group_splits;
  const int32_t pos = p.pooled_dq_sum ? tile % num_pairs : tile / tiles_per_pair;
  int32_t head_split = p.pooled_dq_sum ? tile / num_pairs : tile - pos * tiles_per_pair;
  const int32_t pair = p.sorted_pairs[pos];
  t.batch = p.pair_batch[pair];
  t.n_block = p.pair_block[pair];
  const int32_t heads_per_split = p.group / p.group_splits;
  t.q_start = p.q_offsets[t.batch];
  t.kv_start = p.kv_offsets[t.batch];
  t.len_q = p.q_offsets[t.batch + 1] - t.q_start;
  t.len_kv = p.kv_offsets[t.batch + 1] - t.kv_start;
  if (p.l2_group_rows > 0) {
    // L2-grouped order: the sequence's pairs sit in the plan at positions first + block (or
    // first + blocks - 1 - block in a last-to-first plan); the tile is the sequence's local-th,
    // re-decoded.
    const int32_t blocks = (t.len_kv + Traits::kBlockN - 1) / Traits::kBlockN;
    const int32_t first = pos - (plan_descending ? blocks - 1 - t.n_block : t.n_block);
    const int32_t group =
        schedule::backward_l2_group(p.l2_group_rows, t.len_q, heads_per_split, tiles_per_pair);
    const schedule::BackwardTileInSequence at =
        schedule::backward_tile_in_sequence(tile - first * tiles_per_pair, blocks, tiles_per_pair, group);
    // Inside a group the KV blocks come in the plan's order: last to first in a descending plan,
    // so the deterministic mode's turns (a Q block's partials added from the highest KV block
    // down) only ever wait for tiles handed out before.
    t.n_block = plan_descending ? blocks - 1 - at.block : at.block;
    head_split = at.head_split;
  }
  t.kv_head = head_split / p.group_splits;
  t.split = head_split - t.kv_head * p.group_splits;
  t.head_lo = t.kv_head * p.group + t.split * heads_per_split;
  t.head_end = t.head_lo + heads_per_split;
  const IndexRange m =
      p.mask.q_blocks_of_kv_block(t.n_block, Traits::kBlockM, Traits::kBlockN, t.len_q, t.len_kv);
  t.m_lo = static_cast<int32_t>(m.lo);
  t.m_hi = static_cast<int32_t>(m.hi);
  const int32_t count = t.m_hi - t.m_lo + 1;
  t.m_first = p.rotated_q_order && count > 1 ? t.m_lo + t.n_block % count : t.m_lo;
  const IndexRange full =
      p.mask.unmasked_q_blocks_of_kv_block(t.n_block, Traits::kBlockM, Traits::kBlockN, t.len_q, t.len_kv);
  t.m_full_lo = static_cast<int32_t>(full.lo);
  t.m_full_hi = static_cast<int32_t>(full.hi);
  return t;
}

// The round-th tile of this CTA under the chosen schedule (past the end: no more work).
template <class Traits>
__device__ __forceinline__ int32_t next_tile(const Params<Traits>& p, int32_t round) {
  return common::next_tile_index(p.schedule, round, static_cast<int32_t>(gridDim.x),
                                 static_cast<int32_t>(blockIdx.x), p.tile_counter);
}

}  // namespace jagflash::kernels::bwd
