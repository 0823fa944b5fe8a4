// The dQ writer (one thread of the producer warpgroup): adds each dQ stage the consumers hand
// over into the fp32 accumulator with TMA reduce-adds (cp.reduce.async.bulk.tensor .add) and
// frees the stage as soon as the copy has read it, so the consumers' next dQ never waits for
// global memory. Only the row groups (16 rows) that hold rows of the Q block's sequence are
// added: a short sequence's (or a pooled query set's) block does not add 64 rows of which most
// are padding (4x the bytes of 16 rows). The padding rows of the last group carry
// exact zeros, so where it spans into the next sequence (or the slack after the last row) it adds
// nothing.
#pragma once

#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/common/ring.cuh"

#include <cute/tensor.hpp>

#include <cstdint>

namespace jagflash::kernels::bwd {

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void bulk_wait_read_all() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

template <class Traits>
struct DqWriter {
  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem) {
    const uint32_t dq_smem = cute::cast_smem_ptr_to_uint(smem.dq.data());
    // Every (row group, 32-column box) of the stage that holds the block's rows.
    auto reduce_stage = [&](uint32_t stage, const DqTarget& target) {
      const int groups = (target.rows + Traits::kDqRowGroup - 1) / Traits::kDqRowGroup;
#pragma unroll
      for (int box = 0; box < Traits::kHeadDim / Traits::kDqBoxCols; ++box)
        for (int g = 0; g < groups; ++g) {
          const uint32_t src = dq_smem + stage * Traits::kDqStageBytes + box * Traits::kDqBoxBytes +
                               g * Traits::kDqRowGroup * Traits::kDqBoxCols * sizeof(float);
          asm volatile(
              "cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%2, %3}], "
              "[%1];\n" ::"l"(reinterpret_cast<uint64_t>(&p.dq_map)),
              "r"(src), "r"(box * Traits::kDqBoxCols),
              "r"(static_cast<int32_t>(target.row) + g * Traits::kDqRowGroup)
              : "memory");
        }
      bulk_commit();
    };
    for (uint32_t uses = 0;; ++uses) {
      const uint32_t stage = uses % Traits::kDqStages;
      smem.dq_ring().wait(uses);
      const DqTarget target = smem.dq_target[stage];
      if (target.stop) break;
      if (p.dq_sems != nullptr) {
        // Deterministic mode: this KV block's turn on the Q block (the blocks before it added
        // theirs, completely, before releasing the semaphore).
        int32_t seen;
        do {
          asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n"
                       : "=r"(seen)
                       : "l"(p.dq_sems + target.sem)
                       : "memory");
        } while (seen != target.sem_turn);
        reduce_stage(stage, target);
        bulk_wait_all();  // the sums are in global memory, not only read from shared memory
        asm volatile("fence.proxy.async.global;\n" ::: "memory");
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(p.dq_sems + target.sem) : "memory");
      } else {
        reduce_stage(stage, target);
        bulk_wait_read_all();
      }
      smem.dq_ring().release(stage);
    }
    bulk_wait_all();
  }
};

}  // namespace jagflash::kernels::bwd
