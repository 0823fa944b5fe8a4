// The forward's named barriers (hardware ids; kernels/common/barriers.cuh), in one place.
#pragma once

#include <cstdint>

namespace jagflash::kernels::fwd {

enum class FwdBarrier : uint32_t {
  // Ping-pong turns (mainloop_fwd.cuh WarpgroupTurns): warpgroup 0 waits on kTurn0, 1 on kTurn1.
  kTurn0 = 8,
  kTurn1 = 9,
  // A consumer warpgroup's own barrier for its O staging (epilogue_fwd.cuh): kWarpgroup0 + its
  // index among all consumer warpgroups of the CTA (pairs included).
  kWarpgroup0 = 10,
};

// The barrier of consumer warpgroup `index` among the CTA's consumer warpgroups.
// (int arithmetic, as the id's other terms: unsigned arithmetic here changed the epilogue's SASS.)
constexpr int warpgroup_barrier(int index) { return static_cast<int>(FwdBarrier::kWarpgroup0) + index; }
// At most four consumer warpgroups a CTA (two pairs of two, or one of three).
static_assert(static_cast<uint32_t>(FwdBarrier::kWarpgroup0) + 3 < 16, "16 hardware named barriers");

}  // namespace jagflash::kernels::fwd
