// Where one side of an mbarrier ring stands (CUTLASS's PipelineState idea): a ring of kDepth
// buffers, each with a full barrier (data landed) and an empty barrier (buffer released), and a
// side that has taken `uses` buffers so far. Use u goes to stage u % kDepth in round u / kDepth;
// each round completes each barrier once, so
//  - the side waiting for data waits on the stage's full barrier for parity round & 1;
//  - the side refilling a stage waits on its empty barrier for the previous round's parity,
//    (round - 1) & 1, and not at all in round 0 (the stage was never used).
// Every barrier wait of the kernels goes through these, instead of parity expressions by hand.
#pragma once

#include "kernels/common/barriers.cuh"

#include <cstdint>

namespace jagflash::kernels::common {

template <uint32_t kDepth>
struct RingPosition {
  uint32_t uses;

  __device__ __forceinline__ uint32_t stage() const { return uses % kDepth; }
  __device__ __forceinline__ uint32_t round() const { return uses / kDepth; }
  // The parity of this use's round: what its full barrier completes with.
  __device__ __forceinline__ uint32_t phase() const { return round() & 1; }
  // Whether the stage held an earlier use, and the parity its release completed with.
  __device__ __forceinline__ bool refills() const { return uses >= kDepth; }
  __device__ __forceinline__ uint32_t previous_phase() const { return (round() - 1) & 1; }
};

// The data of use `at` landed: waits on its stage's full barrier (barriers: the ring's array).
template <uint32_t kDepth>
__device__ __forceinline__ void wait_full(uint64_t* barriers, RingPosition<kDepth> at) {
  ArrivalBarrier::wait(&barriers[at.stage()], at.phase());
}

// Whether the data of use `at` has landed, without blocking.
template <uint32_t kDepth>
__device__ __forceinline__ bool test_full(uint64_t* barriers, RingPosition<kDepth> at) {
  return ArrivalBarrier::test_wait(&barriers[at.stage()], at.phase(), 1);
}

// The stage of use `at` may be refilled: its earlier use (if any) was released.
template <uint32_t kDepth>
__device__ __forceinline__ void wait_released(uint64_t* barriers, RingPosition<kDepth> at) {
  if (at.refills()) ArrivalBarrier::wait(&barriers[at.stage()], at.previous_phase());
}

}  // namespace jagflash::kernels::common
