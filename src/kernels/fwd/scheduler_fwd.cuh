// The forward's scheduler thread (one thread of the producer warpgroup, per pair): takes tiles
// from the plan (schedule/plan_device) through an atomic counter, or by a static rule, and
// decodes them into the ring of tile slots in shared memory, a few tiles ahead of the producer.
#pragma once

#include "kernels/common/ring.cuh"
#include "kernels/fwd/kernel_traits.cuh"
#include "schedule/plan.hpp"

#include <cstdint>

namespace jagflash::kernels::fwd {

// Where the plan's tile-th entry lies: sequence, q block, head, and the KV blocks it visits.
template <class Traits>
__device__ __forceinline__ TileInfo decode_tile(const Params<Traits>& p, int32_t tile) {
  TileInfo t;
  const int32_t pair =
      p.schedule == Schedule::kGrid ? tile / p.num_heads : p.sorted_pairs[tile / p.num_heads];
  t.batch = p.pair_batch[pair];
  t.m_block = p.pair_block[pair];
  t.q_start = p.q_offsets[t.batch];
  t.kv_start = p.kv_offsets[t.batch];
  t.len_q = p.q_offsets[t.batch + 1] - t.q_start;
  t.len_kv = p.kv_offsets[t.batch + 1] - t.kv_start;
  if (p.schedule != Schedule::kGrid) {  // the plan's order: heads in groups (plan.hpp)
    const int32_t q_blocks = (t.len_q + Traits::kBlockM - 1) / Traits::kBlockM;
    const int32_t group = schedule::forward_head_group(p.head_order, t.len_kv, p.num_heads);
    const schedule::TileInSequence at =
        schedule::tile_in_sequence(tile, p.num_heads, t.m_block, q_blocks, group);
    t.head = at.head;
    t.m_block = at.block;
  } else {  // the plain grid's (batch, block, head) order
    t.head = tile % p.num_heads;
  }
  t.kv_head = t.head / p.group;
  t.kv_blocks = p.mask.kv_blocks_of_q_block(t.m_block, Traits::kBlockM, Traits::kBlockN, t.len_q, t.len_kv);
  t.unmasked =
      p.mask.unmasked_kv_blocks_of_q_block(t.m_block, Traits::kBlockM, Traits::kBlockN, t.len_q, t.len_kv);
  return t;
}

// The round-th tile of this CTA's pair under the chosen schedule (past the end: no more work).
// The static schedules treat each pair as a CTA of its own.
template <class Traits>
__device__ __forceinline__ int32_t next_tile(const Params<Traits>& p, int32_t round, int pair) {
  const int32_t ctas = static_cast<int32_t>(gridDim.x) * Traits::kPairs;
  const int32_t cta = static_cast<int32_t>(blockIdx.x) * Traits::kPairs + pair;
  return common::next_tile_index(p.schedule, round, ctas, cta, p.tile_counter);
}

// Takes the CTA's tiles from the plan and decodes them into the tile ring, ahead of the
// producer: the atomic and the decode's dependent loads then overlap the loads and GEMMs of the
// tiles before. It waits for a slot before taking a tile, so a CTA never holds more than
// kTileSlots tiles the others could have taken (the last ones: the lightest sequences come last).
template <class Traits>
struct Scheduler {
  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem, int pair) {
    constexpr uint32_t kSlots = SharedStorage<Traits>::kTileSlots;
    const int32_t total_tiles = *p.num_pairs * p.num_heads;
    for (uint32_t round = 0;; ++round) {
      const uint32_t slot = round % kSlots;
      smem.tile_ring().acquire(round);
      const int32_t tile = next_tile(p, static_cast<int32_t>(round), pair);
      const bool has_tile = tile < total_tiles;
      if (has_tile) smem.tile[slot] = decode_tile(p, tile);
      smem.has_tile[slot] = has_tile;
      smem.tile_ring().commit(slot);  // release: the producer's wait acquires
      if (!has_tile) return;
    }
  }
};

}  // namespace jagflash::kernels::fwd
