// The backward's named barriers, by hardware id (kernels/common/barriers.cuh), in one place so
// that no two roles share an id by accident. Id 0 is __syncthreads; 16 in all.
#pragma once

#include <cstdint>

namespace jagflash::kernels::bwd {

enum class BwdBarrier : uint32_t {
  // A consumer warpgroup's signal to the other after its step u (mainloop_bwd.cuh): its dS of
  // the step is in buffer u % 2 and its dQ of the step before has read buffer (u - 1) % 2.
  // One id per warpgroup and parity of u (2 + 2 warpgroup + u % 2), so that an arrival for step
  // u + 2 cannot complete a phase the other warpgroup has not yet synced on for step u.
  kDsReady = 2,
  // The wide kernel's step (mainloop_bwd_wide.cuh, 256 threads): both warpgroups' halves of P^T
  // and dS^T are in shared memory, before the GEMMs that read all of them; and at a tile's end,
  // the buffers free for the dK/dV staging, then free again for the next tile's steps.
  kWideStored = 6,
  // Both warpgroups' last dQ GEMM of a tile done, before the dK/dV staging overwrites the dS
  // buffers (256 threads; epilogue_bwd.cuh).
  kDsFree = 10,
  // A warpgroup's own barrier, 11 + its index (128 threads): its dK/dV staging
  // (epilogue_bwd.cuh, epilogue_bwd_wide.cuh), and in the wide kernel its own dS stored
  // (mainloop_bwd_wide.cuh).
  kWarpgroup0 = 11,
};

// Warpgroup `wg`'s (0 or 1) ds_ready barrier for its step u.
__host__ __device__ constexpr uint32_t ds_ready_barrier(int wg, uint32_t u) {
  return static_cast<uint32_t>(BwdBarrier::kDsReady) + 2 * wg + (u & 1);
}
// The barrier of consumer warpgroup `wg` (0 or 1).
__host__ __device__ constexpr uint32_t warpgroup_barrier(int wg) {
  return static_cast<uint32_t>(BwdBarrier::kWarpgroup0) + wg;
}
static_assert(ds_ready_barrier(1, 1) < static_cast<uint32_t>(BwdBarrier::kWideStored) &&
                  static_cast<uint32_t>(BwdBarrier::kWideStored) <
                      static_cast<uint32_t>(BwdBarrier::kDsFree) &&
                  static_cast<uint32_t>(BwdBarrier::kDsFree) < static_cast<uint32_t>(BwdBarrier::kWarpgroup0),
              "the roles' ids do not overlap");
static_assert(warpgroup_barrier(1) < 16, "16 hardware named barriers");

}  // namespace jagflash::kernels::bwd
