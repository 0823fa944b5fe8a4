// Where one side of an mbarrier ring stands (CUTLASS's PipelineState idea): a ring of kDepth
// buffers, each with a full barrier (data landed) and an empty barrier (buffer released), and a
// side that has taken `uses` buffers so far. Use u goes to stage u % kDepth in round u / kDepth;
// each round completes each barrier once, so
//  - the side waiting for data waits on the stage's full barrier for parity round & 1;
//  - the side refilling a stage waits on its empty barrier for the previous round's parity,
//    (round - 1) & 1, and not at all in round 0 (the stage was never used).
// Every barrier wait of the kernels goes through these, instead of parity expressions by hand, and
// every ring of them is a Ring (below), which knows its two barrier arrays.
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

// A ring of kDepth stages: its full barriers (a stage's data is in: a TMA load's bytes, or a
// thread's arrival) and empty barriers (the stage's readers are done), and what each side does at
// use `uses` of the ring (stage uses % kDepth, round uses / kDepth; the parities are
// RingPosition's):
//  - the side that fills: acquire(uses) waits until the stage may be refilled, then
//    commit_tx(stage, bytes) (the TMA loads complete it) or commit(stage) (one thread's arrival);
//  - the side that reads: wait(uses) or ready(uses) for the data, then release(stage) from one
//    thread, or release_by_warp(stage, lane) from lane 0 of each warp that the empty barrier
//    counts (the consumers' rings count warps).
// A kernel's SharedStorage hands out its rings (q_ring(), k_ring(), ...), so no barrier array is
// named, and no parity computed, at a use.
template <uint32_t kDepth>
struct Ring {
  uint64_t* full;
  uint64_t* empty;

  __device__ __forceinline__ void acquire(uint32_t uses) const {
    wait_released(empty, RingPosition<kDepth>{uses});
  }
  __device__ __forceinline__ void commit(uint32_t stage) const { ArrivalBarrier::arrive(&full[stage]); }
  __device__ __forceinline__ void commit_tx(uint32_t stage, uint32_t bytes) const {
    TxBarrier::arrive_and_expect_tx(&full[stage], bytes);
  }

  __device__ __forceinline__ void wait(uint32_t uses) const { wait_full(full, RingPosition<kDepth>{uses}); }
  __device__ __forceinline__ bool ready(uint32_t uses) const {
    return test_full(full, RingPosition<kDepth>{uses});
  }
  __device__ __forceinline__ void release(uint32_t stage) const { ArrivalBarrier::arrive(&empty[stage]); }
  __device__ __forceinline__ void release_by_warp(uint32_t stage, int lane) const {
    if (lane == 0) release(stage);
  }
};

}  // namespace jagflash::kernels::common
