// The persistent warp-specialised backward kernel: shared storage, barriers, role dispatch.
#pragma once

#include "kernels/bwd/dq_writer.cuh"
#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/bwd/mainloop_bwd.cuh"
#include "kernels/bwd/mainloop_bwd_wide.cuh"

#include <cutlass/arch/reg_reconfig.h>

namespace jagflash::kernels::bwd {

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1)
    backward_kernel(const __grid_constant__ Params<KernelTraits<Config>> p) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  __trap();  // built for a target without wgmma/setmaxnreg: only launched on compute capability 9.0
#else
  using Traits = KernelTraits<Config>;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& smem = *reinterpret_cast<SharedStorage<Traits>*>(smem_raw);
  if (*p.error_flag) return;  // offsets failed the device check: write nothing
  const schedule::PlanKey stored_key = *p.plan_key;
  if (!schedule::same_plan_key_either_order(stored_key, p.expected_plan_key)) {
    if (threadIdx.x == 0) atomicOr(p.error_flag, schedule::kPlanMismatchFlag);
    return;
  }
  const int warp = threadIdx.x / 32;
  if (threadIdx.x == 0) {
    constexpr int kConsumerWarps = 4 * Config::kConsumerWarpgroups;  // each consumer warp arrives once
    for (uint32_t s = 0; s < SharedStorage<Traits>::kTileSlots; ++s) {
      ArrivalBarrier::init(&smem.tile_full[s], 1);
      ArrivalBarrier::init(&smem.tile_empty[s], kConsumerWarps);
    }
    TxBarrier::init(&smem.k_full, 1);
    ArrivalBarrier::init(&smem.k_empty, kConsumerWarps);
    TxBarrier::init(&smem.v_full, 1);
    ArrivalBarrier::init(&smem.v_empty, kConsumerWarps);
    for (int s = 0; s < Config::kStages; ++s) {
      TxBarrier::init(&smem.q_full[s], 1);
      ArrivalBarrier::init(&smem.q_empty[s], kConsumerWarps);
      TxBarrier::init(&smem.do_full[s], 1);
      ArrivalBarrier::init(&smem.do_empty[s], kConsumerWarps);
    }
    for (int s = 0; s < Config::kDqStages; ++s) {
      ArrivalBarrier::init(&smem.dq_full[s], kConsumerWarps);
      ArrivalBarrier::init(&smem.dq_empty[s], 1);
    }
    // The deterministic mode's turns follow the plan's order of a sequence's KV blocks.
    smem.dq_turns_descending = (stored_key.tag_and_tiles & schedule::kPlanFirstBlockFirst) == 0;
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (warp / 4 == 0) {  // the producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegisters>();
    if (threadIdx.x == 0) {
      cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_do.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
      cute::prefetch_tma_descriptor(&p.dq_map);
      cute::prefetch_tma_descriptor(&p.lse_map);
      cute::prefetch_tma_descriptor(&p.delta_map);
      Loader<Traits>::run(p, smem);
    } else if (threadIdx.x == 32) {
      DqWriter<Traits>::run(p, smem);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegisters>();
    if constexpr (Config::kWide) {
      ConsumerWide<Traits>::run(p, smem, threadIdx.x - 128);
    } else {
      Consumer<Traits>::run(p, smem, threadIdx.x - 128);
    }
  }
#endif
}

}  // namespace jagflash::kernels::bwd
