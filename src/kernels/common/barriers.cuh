// The mbarrier types every pipeline of the Hopper kernels uses.
#pragma once

#include <cutlass/arch/barrier.h>

namespace jagflash::kernels::common {

// Named by what they count, not by which side of a ring they guard: a transaction barrier also
// counts the bytes its TMA loads deliver (a ring's "full" barrier of TMA-loaded data); an arrival
// barrier counts arrivals only (every "empty" barrier, and the "full" ones a thread fills by
// hand: tile slots, dQ stages). Both wait the same way (kernels/common/ring.cuh).
using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
using ArrivalBarrier = cutlass::arch::ClusterBarrier;

// A named barrier that the participating warps may reach from different instructions.
// cutlass::arch::NamedBarrier::sync is bar.sync, the .aligned form, which requires every thread
// of the CTA to execute the same instruction; barrier.sync without .aligned does not.
__device__ __forceinline__ void named_barrier_sync_unaligned(uint32_t id, uint32_t threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrives on a named barrier without waiting (barrier.arrive, not .aligned: the arriving warps may
// reach it from different instructions): with `threads` counting the arrivals and the waiters,
// a one-way signal from the arriving warps to those that sync on the same id.
__device__ __forceinline__ void named_barrier_arrive_unaligned(uint32_t id, uint32_t threads) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace jagflash::kernels::common
