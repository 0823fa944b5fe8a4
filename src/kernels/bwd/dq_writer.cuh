// The dQ writer (one thread of the producer warpgroup): adds each dQ stage the consumers hand
// over into the fp32 accumulator with TMA reduce-adds (cp.reduce.async.bulk.tensor .add) and
// frees the stage as soon as the copy has read it, so the consumers' next dQ never waits for
// global memory. A Q block's rows past its sequence's end carry exact zeros, so a reduce that
// spans into the next sequence (or the accumulator's slack after the last row) adds nothing.
#pragma once

#include "kernels/bwd/kernel_traits_bwd.cuh"

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
    using BlockM = typename Traits::BlockM;
    using HeadDim = typename Traits::HeadDim;
    Tensor mDq = p.tma_dq.get_tma_tensor(make_shape(p.dq_total_rows, HeadDim{}));
    Tensor sDq = make_tensor(make_smem_ptr(smem.dq.data()), typename Traits::SmemLayoutDq{});
    for (uint32_t uses = 0;; ++uses) {
      const uint32_t stage = uses % Traits::kDqStages;
      EmptyBarrier::wait(&smem.dq_full[stage], (uses / Traits::kDqStages) & 1);
      const DqTarget target = smem.dq_target[stage];
      if (target.stop) break;
      Tensor gDq = local_tile(domain_offset(make_coord(static_cast<int32_t>(target.row), _0{}), mDq),
                              Shape<BlockM, HeadDim>{}, make_coord(_0{}, _0{}));
      auto parts =
          tma_partition(p.tma_dq, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sDq), group_modes<0, 2>(gDq));
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
        copy(p.tma_dq, get<1>(parts)(_, stage), get<0>(parts));
        bulk_commit();
        bulk_wait_all();  // the sums are in global memory, not only read from shared memory
        asm volatile("fence.proxy.async.global;\n" ::: "memory");
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(p.dq_sems + target.sem) : "memory");
      } else {
        copy(p.tma_dq, get<1>(parts)(_, stage), get<0>(parts));
        bulk_commit();
        bulk_wait_read_all();
      }
      EmptyBarrier::arrive(&smem.dq_empty[stage]);
    }
    bulk_wait_all();
  }
};

}  // namespace jagflash::kernels::bwd
