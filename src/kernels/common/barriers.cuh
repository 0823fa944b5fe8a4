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

// Named barriers by their hardware id (0 is __syncthreads; 16 in all). A kernel names the ids it
// uses in one enum (bwd/barrier_ids_bwd.hpp). CUTLASS's NamedBarrier adds 8 to the id it is
// given; these take the id as it is. named_barrier_sync is CUTLASS's asm (bar.sync, the .aligned
// form: every thread of the CTA that reaches it executes the same instruction).
template <class Id>
__device__ __forceinline__ void named_barrier_sync(Id id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(static_cast<uint32_t>(id)), "r"(threads));
}
// The same barrier where the participating warps may reach it from different instructions:
// barrier.sync without .aligned.
template <class Id>
__device__ __forceinline__ void named_barrier_sync_unaligned(Id id, uint32_t threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(static_cast<uint32_t>(id)), "r"(threads) : "memory");
}

// Arrives on a named barrier without waiting (barrier.arrive, not .aligned: the arriving warps may
// reach it from different instructions): with `threads` counting the arrivals and the waiters,
// a one-way signal from the arriving warps to those that sync on the same id.
template <class Id>
__device__ __forceinline__ void named_barrier_arrive_unaligned(Id id, uint32_t threads) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(static_cast<uint32_t>(id)), "r"(threads) : "memory");
}

}  // namespace jagflash::kernels::common
