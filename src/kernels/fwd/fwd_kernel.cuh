// The persistent warp-specialised forward kernel: shared storage, barriers, role dispatch.
#pragma once

#include "kernels/fwd/kernel_traits.cuh"
#include "kernels/fwd/mainloop_fwd.cuh"

#include <cutlass/arch/reg_reconfig.h>

namespace jagflash::kernels::fwd {

template <class Config>
__global__ void __launch_bounds__(Config::kThreads, 1)
    forward_kernel(const __grid_constant__ Params<KernelTraits<Config>> p) {
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
  // Built for a target without wgmma/setmaxnreg (a multi-arch build): the dispatcher only
  // launches this kernel on compute capability 9.0, where the sm_90a code is chosen.
  __trap();
#else
  using Traits = KernelTraits<Config>;
  extern __shared__ __align__(1024) char smem_raw[];
  // One storage per (producer, consumers) pair; a single pair unless kPairs = 2.
  auto* storage = reinterpret_cast<SharedStorage<Traits>*>(smem_raw);
  if (*p.error_flag) return;  // offsets failed the device check: write nothing
  // A reused plan built for another variant or batch (jf_launch.reuse_plan misused) would send
  // tiles to the wrong rows: write nothing and say so (every CTA checks, none reads the plan).
  if (!schedule::same_plan_key(*p.plan_key, p.expected_plan_key)) {
    if (threadIdx.x == 0) atomicOr(p.error_flag, schedule::kPlanMismatchFlag);
    return;
  }

  const int warp = threadIdx.x / 32;
  const bool producer = warp / 4 == 0;  // warpgroup 0 produces, the others consume
  if (threadIdx.x == 0) {
    constexpr int kConsumerWarps =
        4 * Config::kConsumerWarpgroups;  // each consumer warp of the pair arrives once
    for (int pair = 0; pair < Config::kPairs; ++pair) {
      SharedStorage<Traits>& smem = storage[pair];
      for (int b = 0; b < 2; ++b) {
        TxBarrier::init(&smem.q_full[b], 1);
        ArrivalBarrier::init(&smem.q_empty[b], kConsumerWarps);
      }
      for (uint32_t s = 0; s < SharedStorage<Traits>::kTileSlots; ++s) {
        ArrivalBarrier::init(&smem.tile_full[s], 1);  // the scheduler thread arrives by hand
        ArrivalBarrier::init(&smem.tile_empty[s], kConsumerWarps);
      }
      for (int s = 0; s < Config::kStages; ++s) {
        TxBarrier::init(&smem.k_full[s], 1);
        ArrivalBarrier::init(&smem.k_empty[s], kConsumerWarps);
        TxBarrier::init(&smem.v_full[s], 1);
        ArrivalBarrier::init(&smem.v_empty[s], kConsumerWarps);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Config::kProducerRegisters>();
    // Lane 0 of warp `pair` produces for that pair; lane 0 of warp kPairs + pair schedules it.
    if (threadIdx.x % 32 == 0 && warp >= Config::kPairs && warp < 2 * Config::kPairs) {
      const int pair = Config::kPairs == 1 ? 0 : warp - Config::kPairs;
      Scheduler<Traits>::run(p, storage[pair], pair);
    }
    if (threadIdx.x % 32 == 0 && warp < Config::kPairs) {
      if (warp == 0) {
        cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
        cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
        cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
      }
      const int pair = Config::kPairs == 1 ? 0 : warp;  // a constant with one pair: fixed addresses
      Producer<Traits>::run(p, storage[pair], pair);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Config::kConsumerRegisters>();
    constexpr int kPairThreads = 128 * Config::kConsumerWarpgroups;
    const int consumer_thread = threadIdx.x - 128;
    const int pair = Config::kPairs == 1 ? 0 : consumer_thread / kPairThreads;
    Consumer<Traits>::run(p, storage[pair], consumer_thread - pair * kPairThreads, pair);
  }
#endif
}

}  // namespace jagflash::kernels::fwd
