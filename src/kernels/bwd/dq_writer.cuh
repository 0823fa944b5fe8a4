// The dQ writer (one thread of the producer warpgroup): adds each dQ stage the consumers hand
// over into the fp32 accumulator with one bulk reduce-add (cp.reduce.async.bulk .add.f32) and
// frees the stage as soon as the copy has read it, so the consumers' next dQ never waits for
// global memory. A Q block's rows past its sequence's end carry exact zeros, so a reduce that
// spans into the next sequence (or the accumulator's slack after the last row) adds nothing.
#pragma once

#include "kernels/bwd/kernel_traits_bwd.cuh"

#include <cstdint>

namespace jagflash::kernels::bwd {

__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, const float* smem, uint32_t bytes) {
  const uint32_t src = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
               "r"(src), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_read_all() {
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

template <class Traits>
struct DqWriter {
  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem) {
    constexpr int kStageFloats = Traits::kBlockM * Traits::kHeadDim;
    for (uint32_t uses = 0;; ++uses) {
      const uint32_t stage = uses % 2;
      EmptyBarrier::wait(&smem.dq_full[stage], (uses / 2) & 1);
      const DqTarget target = smem.dq_target[stage];
      if (target.stop) break;
      float* dst = p.dq_accum + target.row * Traits::kHeadDim;
      if (p.dq_sems != nullptr) {
        // Deterministic mode: this KV block's turn on the Q block (the blocks above it added
        // theirs, completely, before releasing the semaphore).
        int32_t seen;
        do {
          asm volatile("ld.acquire.gpu.global.b32 %0, [%1];\n"
                       : "=r"(seen)
                       : "l"(p.dq_sems + target.sem)
                       : "memory");
        } while (seen != target.sem_turn);
        bulk_reduce_add_f32(dst, smem.dq.data() + stage * kStageFloats, Traits::kDqBytes);
        bulk_wait_all();  // the sums are in global memory, not only read from shared memory
        asm volatile("fence.proxy.async.global;\n" ::: "memory");
        asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(p.dq_sems + target.sem) : "memory");
      } else {
        bulk_reduce_add_f32(dst, smem.dq.data() + stage * kStageFloats, Traits::kDqBytes);
        bulk_wait_read_all();
      }
      EmptyBarrier::arrive(&smem.dq_empty[stage]);
    }
    bulk_wait_all();
  }
};

}  // namespace jagflash::kernels::bwd
