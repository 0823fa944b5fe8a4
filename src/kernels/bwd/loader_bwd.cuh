// The backward's loading thread (one thread of the producer warpgroup): per tile, K and V once,
// then Q with its lse and dO with its delta for every Q block (and query head of the tile's group
// or split of it) that sees the tile, through the kStages ring. It also decodes the tiles
// (scheduler_bwd.cuh) and hands them to the consumers (mainloop_bwd.cuh) through the tile slots.
#pragma once

#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/bwd/scheduler_bwd.cuh"
#include "kernels/common/block_sparse.cuh"
#include "kernels/common/ring.cuh"

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>

namespace jagflash::kernels::bwd {

using namespace cute;

// The stats of one Q block (kStatRows floats from element `first`) by a 1D TMA load completing on
// `bar`.
__device__ __forceinline__ void load_stats(float* smem, const CUtensorMap* map, int64_t first,
                                           uint64_t* bar) {
  cute::SM90_TMA_LOAD_1D::copy(map, bar, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL), smem,
                               static_cast<int32_t>(first));
}

// The Q block of step i (m_lo <= i <= m_hi) of a tile's loop: [m_first, m_hi], then [m_lo, m_first).
// The loader and the consumers walk the same steps, so their rings stay in step.
__device__ __forceinline__ int32_t rotated_q_block(const TileInfo& t, int32_t i) {
  const int32_t m = i + (t.m_first - t.m_lo);
  return m > t.m_hi ? m - (t.m_hi - t.m_lo + 1) : m;
}

// Whether Q block m sees the tile's KV block at all: with kBlockSparse its map byte decides (read
// from the tile and the map's offsets where it is asked, in 32-bit arithmetic: a 64-bit column
// pointer kept across the consumers' loop pushed them into local memory), else always.
template <class Traits>
__device__ __forceinline__ bool q_block_visible(const Params<Traits>& p, const TileInfo& t, int32_t m) {
  if constexpr (Traits::kBlockSparse) {
    const int32_t key_blocks = (t.len_kv + BlockMask::kBlock - 1) / BlockMask::kBlock;
    const int32_t at = p.block_mask.offsets[t.batch] +
                       (m * Traits::kBlockM / BlockMask::kBlock) * key_blocks +
                       t.n_block * Traits::kBlockN / BlockMask::kBlock;
    return __ldg(p.block_mask.blocks + at) != 0;
  } else {
    return true;
  }
}

template <class Traits>
struct Loader {
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using HeadDim = typename Traits::HeadDim;
  static constexpr int kStages = Traits::kStages;
  // Where the loop reads the tile's fields: at 24 registers (the 128 and wide kernels, whose
  // consumers need the rest) kept in registers they pushed the loader into local memory, so they
  // are read from the slot (the barrier waits clobber memory, so they are re-read after each).
  // With more registers (64: 72, 96: 56; no spills) the slot's re-reads cost more than they
  // save: there the fields stay in registers (bench/NOTES.md has the figures).
  static constexpr bool kTileFromSlot = Traits::kProducerRegisters < 56;

  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem) {
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.total_q, HeadDim{}, p.num_heads));
    Tensor mDo = p.tma_do.get_tma_tensor(make_shape(p.total_q, HeadDim{}, p.num_heads));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.total_kv, HeadDim{}, p.num_heads_kv));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.total_kv, HeadDim{}, p.num_heads_kv));
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sDo = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutK{});

    constexpr uint32_t kSlots = SharedStorage<Traits>::kTileSlots;
    const int32_t num_pairs = *p.num_pairs;
    const int32_t total_tiles = num_pairs * p.num_heads_kv * p.group_splits;
    uint32_t uses = 0;  // Q blocks loaded so far (the ring's position)
    for (uint32_t round = 0;; ++round) {
      const uint32_t slot = round % kSlots;
      smem.tile_ring().acquire(round);
      const int32_t tile = next_tile(p, static_cast<int32_t>(round));
      const bool has_tile = tile < total_tiles;
      TileInfo t_regs{};
      if (has_tile) {
        t_regs = decode_tile(p, tile, num_pairs, smem.dq_turns_descending);
        smem.tile[slot] = t_regs;
      }
      smem.has_tile[slot] = has_tile;
      smem.tile_ring().commit(slot);  // release: the consumers' wait acquires
      if (!has_tile) return;
      const TileInfo& t = kTileFromSlot ? smem.tile[slot] : t_regs;

      // K and V of the tile, once, issued right after the tile's first Q block: the first Q and
      // dO then load while the consumers finish the previous tile, and V (freed after the
      // previous tile's last dP GEMM) and K (after its last dQ GEMM) while they store its dK, dV.
      Tensor gK = local_tile(domain_offset(make_coord(t.kv_start, _0{}), mK(_, _, t.kv_head)),
                             Shape<BlockN, HeadDim>{}, make_coord(t.n_block, _0{}));
      Tensor gV = local_tile(domain_offset(make_coord(t.kv_start, _0{}), mV(_, _, t.kv_head)),
                             Shape<BlockN, HeadDim>{}, make_coord(t.n_block, _0{}));
      auto k_parts =
          tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto v_parts =
          tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      bool kv_issued = false;
      auto issue_kv = [&] {
        smem.v_ring().acquire(round);  // K and V: one buffer each, per tile
        smem.v_ring().commit_tx(0, Traits::kKBytes);
        copy(p.tma_v.with(smem.v_full), get<0>(v_parts), get<1>(v_parts));
        smem.k_ring().acquire(round);
        smem.k_ring().commit_tx(0, Traits::kKBytes);
        copy(p.tma_k.with(smem.k_full), get<0>(k_parts), get<1>(k_parts));
        kv_issued = true;
      };

      // Rows are addressed from the sequence's first token: a Q block past the sequence's end
      // reads the next sequence's rows (masked by the consumers) or zeros past the tensor. A
      // shared (pooled) query set is every sequence's, from its first row.
      const int32_t q_load_start = p.q_shared ? 0 : t.q_start;
      for (int32_t h = t.head_lo; h < t.head_end; ++h) {
        Tensor gQ = local_tile(domain_offset(make_coord(q_load_start, _0{}), mQ(_, _, h)),
                               Shape<BlockM, HeadDim>{}, make_coord(_, _0{}));
        Tensor gDo = local_tile(domain_offset(make_coord(t.q_start, _0{}), mDo(_, _, h)),
                                Shape<BlockM, HeadDim>{}, make_coord(_, _0{}));
        auto q_parts =
            tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        auto do_parts =
            tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sDo), group_modes<0, 2>(gDo));
        for (int32_t i = t.m_lo; i <= t.m_hi; ++i) {
          const int32_t m = rotated_q_block(t, i);
          if (!q_block_visible(p, t, m))
            continue;  // hidden by the block-sparse map (the consumers skip it too)
          const uint32_t stage = uses % kStages;
          smem.q_ring().acquire(uses);
          smem.q_ring().commit_tx(stage, Traits::kQBytes + Traits::kStatBytes);
          copy(p.tma_q.with(smem.q_full[stage]), get<0>(q_parts)(_, m), get<1>(q_parts)(_, stage));
          // The stats from the aligned row at or before the block's first (the consumers skip the
          // first (row % 4)); the workspace holds kStatRows rows of slack after the last.
          const int64_t stat_row = int64_t(h) * p.q_stride + ((t.q_start + m * Traits::kBlockM) & ~3);
          load_stats(smem.lse.data() + stage * Traits::kStatStride, &p.lse_map, stat_row,
                     &smem.q_full[stage]);
          if (!kv_issued) issue_kv();
          smem.do_ring().acquire(uses);
          smem.do_ring().commit_tx(stage, Traits::kQBytes + Traits::kStatBytes);
          copy(p.tma_do.with(smem.do_full[stage]), get<0>(do_parts)(_, m), get<1>(do_parts)(_, stage));
          load_stats(smem.delta.data() + stage * Traits::kStatStride, &p.delta_map, stat_row,
                     &smem.do_full[stage]);
          ++uses;
        }
      }
      if (!kv_issued) issue_kv();  // a tile no query sees still takes (and frees) its K and V
    }
  }
};

}  // namespace jagflash::kernels::bwd
