// One warpgroup GEMM (wgmma) over the K blocks of its operands, issued as one batch.
#pragma once

#include <cute/tensor.hpp>

namespace jagflash::kernels::common {

using namespace cute;

// kARegisters: A is a register fragment (P, dS), which must be fenced like the accumulator.
// kWait: wait for the batch here; otherwise the caller waits with warpgroup_wait<N>() and then
// fences the accumulator before touching it. kCommit = false leaves the commit to the caller.
// kKBlocks > 0: only the first kKBlocks K blocks (the rest of A's K extent is known to be zero).
template <bool kZeroInit, bool kARegisters, bool kWait, bool kCommit = true, int kKBlocks = 0, class TiledMma,
          class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, TA const& a, TB const& b, TC& c) {
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int k = 0; k < (kKBlocks > 0 ? kKBlocks : int(size<2>(a))); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  if constexpr (kCommit) warpgroup_commit_batch();
  if constexpr (kWait) {
    warpgroup_wait<0>();
    warpgroup_fence_operand(c);
    if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TA&>(a));
  }
}

}  // namespace jagflash::kernels::common
