// The Hopper (sm_90a) forward kernels as the dispatcher sees them: one entry per instantiated
// (dtype, head dim, score modifier), and the workspace they need.
#pragma once

#include "kernels/common/schedule.hpp"
#include "schedule/plan_device.hpp"

#include <jagflash/jagflash.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jagflash::kernels {

namespace fwd {
// The tile shape of a forward call (chosen by choose_forward_variant, kernels/fwd/variants.hpp).
struct ForwardVariant {
  int block_n = 128;
  int warpgroups = 2;  // consumer warpgroups per tile; the tile has 64 x warpgroups query rows
  int pairs = 1;       // independent (producer, consumers) pairs per CTA
  bool ping_pong = false;
  common::Schedule schedule = common::Schedule::kDynamic;
  int block_m() const { return 64 * warpgroups; }
};
}  // namespace fwd

struct HopperForwardLaunch {
  int32_t* error_flag;  // set by the device offsets check (the kernels then write nothing) and by
                        // the kernels on a mismatched plan (schedule::kPlanMismatchFlag)
  void* workspace;
  schedule::PlanKey* plan_key;  // in the workspace, at a place every variant shares
  schedule::DevicePlanLayout plan;
  bool build_plan;  // false: the workspace already holds the plan for these offsets
  // The tile shape the dispatcher chose once for the call: its plan is built for it and the
  // launcher runs it.
  fwd::ForwardVariant variant;
};

using HopperForwardFn = cudaError_t (*)(const jf_fwd_args&, const HopperForwardLaunch&, cudaStream_t);

// The tile shape a call runs with (and its plan is built for) comes from
// fwd::choose_forward_variant (kernels/fwd/variants.hpp), once a call, in HopperForwardLaunch.
struct HopperForwardEntry {
  jf_dtype dtype;
  int head_dim;
  jf_score_mod score_mod;
  bool padded;        // serves the head dims below head_dim (multiples of 8), zero-filled by the TMA
  bool block_sparse;  // takes a block-sparse map (jf_block_mask)
  HopperForwardFn run;
};

// The entry serving a caller's (dtype, head dim, score modifier, block-sparse map or not, v head dim:
// 0 = q's): the narrowest kernel at or above the head dim that has the variant (96's forward serves
// 72-96 and 192's 136-192 without a modifier or map; otherwise kernel_head_dim's), padded when below it or
// when v's head dim is narrower (V zero-filled past it, O's columns there zero and not stored); nullptr when
// this build has none.
const HopperForwardEntry* find_hopper_forward(jf_dtype dtype, int head_dim, jf_score_mod score_mod,
                                              bool block_sparse = false, int v_head_dim = 0);

// The kernel head dim that serves a caller's head dim d in the backward (and in the forward where
// no forward-only head dim does): 64, 128 or 256, the smallest not below d, for d a multiple of 8
// up to 256 (0 otherwise). Below it the kernel runs padded (PaddedHeadDim).
inline int kernel_head_dim(int head_dim) {
  if (head_dim <= 0 || head_dim % 8 != 0 || head_dim > 256) return 0;
  return head_dim <= 64 ? 64 : head_dim <= 128 ? 128 : 256;
}

// The key block of the forward's kernels past head dim 128 (one shape each: shared memory): 64 at
// 192 (Q 48 KB, the O staging 50 KB, two K/V stages of 48 KB), 32 at 256.
constexpr int forward_block_n_past_128(int kernel_head_dim) { return kernel_head_dim == 192 ? 64 : 32; }

// The key block of the forward's two-pair tile (one warpgroup, 64 query rows a tile, two
// independent pairs a CTA, half the shared memory each) at kernel head dims 64, 96 and 128: 128 at
// 64 (two K/V stages fit beside two Q buffers), 64 at 96 (three stages) and 128 (two).
constexpr int forward_pairs_block_n(int kernel_head_dim) { return kernel_head_dim == 64 ? 128 : 64; }

// True when the current device can run sm_90a code (compute capability 9.0).
bool hopper_device_present();

}  // namespace jagflash::kernels
