// The consumers' side of the dQ ring: each Q block's dQ partial goes into a dQ stage, with the
// rows it adds into (and, in the deterministic mode, its turn among the KV blocks adding into
// them), and the stage is handed to the dQ writer (dq_writer.cuh), which adds it into the fp32
// accumulator with one bulk reduce. With pooled_dq_sum (a query set shared by every sequence:
// pooled.hpp) a CTA's partials of one query head are first summed in an open stage and handed
// over when the head changes or the CTA runs out of tiles.
#pragma once

#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/bwd/scheduler_bwd.cuh"
#include "kernels/bwd/smem_stores_bwd.cuh"
#include "kernels/common/ring.cuh"

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>

namespace jagflash::kernels::bwd {

using common::RingPosition;

// Deterministic mode with a block-sparse map: the turn of the tile's KV block among the visible
// KV blocks of Q block m (of the mask's range `blocks`), in the plan's order of them.
template <class Traits>
__device__ __forceinline__ int32_t sparse_dq_turn(const Params<Traits>& p, const TileInfo& t, int32_t m,
                                                  IndexRange blocks, bool descending) {
  const uint8_t* row = p.block_mask.row(t.batch, m * Traits::kBlockM / BlockMask::kBlock, t.len_kv);
  const int32_t lo = descending ? t.n_block + 1 : static_cast<int32_t>(blocks.lo);
  const int32_t hi = descending ? static_cast<int32_t>(blocks.hi) : t.n_block - 1;
  int32_t turn = 0;
  for (int32_t n = lo; n <= hi; ++n) turn += row[n * Traits::kBlockN / BlockMask::kBlock] != 0 ? 1 : 0;
  return turn;
}

template <class Traits>
struct DqHandoff {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr uint32_t kDqStages = Traits::kDqStages;
  static constexpr uint32_t kDqStageBytes = Traits::kDqStageBytes;
  using StoreOffsets = StoreOffsetsOf<Traits>;

  // Without pooled_dq_sum the dQ ring moves with the Q/dO ring (one stage a Q block: the
  // consumers' `uses`, one counter for both); with it, it counts handed-over stages (flushes),
  // and the open stage (if any) sums the partials of query head open_head.
  uint32_t flushes = 0;
  int32_t open_head = -1;

  // At a tile's start: a pooled sum of another head is handed over first.
  __device__ __forceinline__ void begin_tile(const Params<Traits>& p, SharedStorage<Traits>& smem,
                                             const TileInfo& t, int lane) {
    if (p.pooled_dq_sum && open_head != t.head_lo) flush_open_stage(smem, lane);
  }

  // Q block m's (first row row0, query head h) dQ partial, the uses-th Q block of the CTA, into
  // its dQ stage.
  template <class Fragment>
  __device__ __forceinline__ void hand_over(const Params<Traits>& p, SharedStorage<Traits>& smem,
                                            const TileInfo& t, int32_t h, int32_t m, int32_t row0,
                                            uint32_t uses, const Fragment& dq_frag, int thread, int lane) {
    if (p.pooled_dq_sum) {
      const uint32_t dq_stage = flushes % kDqStages;
      const uint32_t stage_smem = cute::cast_smem_ptr_to_uint(smem.dq.data()) + dq_stage * kDqStageBytes;
      if (open_head >= 0) {
        add_dq_smem<StoreOffsets>(dq_frag, stage_smem, fresh_consumer_thread());
        return;
      }
      // Opened here with the shared rows as its target, handed over later.
      if (flushes >= kDqStages) smem.dq_ring().acquire(flushes);
      store_dq_smem<StoreOffsets>(dq_frag, stage_smem, fresh_consumer_thread());
      if (thread == 0) {
        DqTarget target{};
        target.row = int64_t(h) * p.dq_rows + row0;
        target.rows = min(kBlockM, t.len_q - row0);
        smem.dq_target[dq_stage] = target;
      }
      open_head = h;
      return;
    }
    store_dq_smem<StoreOffsets>(dq_frag, open_block_stage(smem, uses), fresh_consumer_thread());
    close_block_stage(p, smem, t, h, m, row0, uses, thread, lane);
  }

  // A Q block's dQ stage (not pooled_dq_sum), taken in two halves by the wide kernels
  // (mainloop_bwd_wide.cuh), which store their partial in parts between them: the stage's shared
  // address, once the writer has released it;
  __device__ __forceinline__ static uint32_t open_block_stage(SharedStorage<Traits>& smem, uint32_t uses) {
    smem.dq_ring().acquire(uses);
    return cute::cast_smem_ptr_to_uint(smem.dq.data()) + (uses % kDqStages) * kDqStageBytes;
  }
  // then, with the partial stored, its target and the hand-over.
  __device__ __forceinline__ static void close_block_stage(const Params<Traits>& p,
                                                           SharedStorage<Traits>& smem, const TileInfo& t,
                                                           int32_t h, int32_t m, int32_t row0, uint32_t uses,
                                                           int thread, int lane) {
    const uint32_t dq_stage = uses % kDqStages;
    if (thread == 0) {
      DqTarget target{};
      target.row = int64_t(h) * p.dq_rows + t.q_start + row0;
      target.rows = min(kBlockM, t.len_q - row0);
      if (p.dq_sems != nullptr) {
        // The KV blocks that see this Q block add in the plan's order of them (first to last,
        // or last to first): this one's turn comes after those handed out before.
        const IndexRange n = p.mask.kv_blocks_of_q_block(m, kBlockM, kBlockN, t.len_q, t.len_kv);
        target.sem = h * p.total_q + t.q_start + row0;
        if constexpr (Traits::kBlockSparse)
          target.sem_turn = sparse_dq_turn(p, t, m, n, smem.dq_turns_descending);
        else
          target.sem_turn = smem.dq_turns_descending ? static_cast<int32_t>(n.hi) - t.n_block
                                                     : t.n_block - static_cast<int32_t>(n.lo);
      }
      smem.dq_target[dq_stage] = target;
    }
    publish(smem, dq_stage, lane);
  }

  // No tile left (uses: the Q blocks consumed): the open stage handed over, then a stage that
  // tells the writer to stop.
  __device__ __forceinline__ void finish(const Params<Traits>& p, SharedStorage<Traits>& smem, uint32_t uses,
                                         int thread, int lane) {
    if (p.pooled_dq_sum) flush_open_stage(smem, lane);
    const uint32_t ring = p.pooled_dq_sum ? flushes : uses;
    const uint32_t stage = ring % kDqStages;
    smem.dq_ring().acquire(ring);
    if (thread == 0) smem.dq_target[stage].stop = 1;
    publish(smem, stage, lane);
  }

 private:
  // Hands a dQ stage to the writer: the targets (thread 0) and the partial, made visible to the
  // bulk copy's async proxy before the arrival.
  __device__ __forceinline__ static void publish(SharedStorage<Traits>& smem, uint32_t stage, int lane) {
    cutlass::arch::fence_view_async_shared();
    __syncwarp();
    if (lane == 0) smem.dq_ring().commit(stage);
  }

  __device__ __forceinline__ void flush_open_stage(SharedStorage<Traits>& smem, int lane) {
    if (open_head >= 0) {
      publish(smem, flushes % kDqStages, lane);
      ++flushes;
      open_head = -1;
    }
  }
};

}  // namespace jagflash::kernels::bwd
