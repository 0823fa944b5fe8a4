// The Hopper (sm_90a) backward kernels as the dispatcher sees them: one entry per instantiated
// (dtype, head dim, score modifier), and the pieces of the workspace they use.
#pragma once

#include "schedule/plan_device.hpp"

#include <jagflash/jagflash.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jagflash::kernels {

struct HopperBackwardLaunch {
  int32_t* error_flag;  // set by the device offsets check (the kernels then write nothing)
  void* workspace;
  schedule::PlanKey* plan_key;
  schedule::DevicePlanLayout plan;  // the plan over (sequence, KV block) pairs
  bool build_plan;                  // false: the workspace already holds the plan for these offsets
  float* lse_log2;                  // [H][q_stride]: lse in log2 units, +inf for rows that see no key
  float* delta;                     // [H][q_stride]: rowsum(dO * O)
  int64_t q_stride;                 // total_q rounded up to 4 rows, plus slack for the stats' bulk copies
  float* dq_accum;                  // [H][dq_rows][D] fp32
  int64_t dq_rows;                  // total_q + one Q block of slack
  int32_t* dq_sems;                 // [H][total_q]: deterministic mode only, else null
  int32_t group_splits;             // tiles a query-head group is split over (backward_group_splits)
  float* dk_partial;                // [group_splits][total_kv][H_kv][D] fp32 when group_splits > 1, else null
  float* dv_partial;
};

using HopperBackwardFn = cudaError_t (*)(const jf_bwd_args&, const HopperBackwardLaunch&, cudaStream_t);

struct HopperBackwardEntry {
  jf_dtype dtype;
  int head_dim;
  jf_score_mod score_mod;
  bool padded;        // serves the head dims below head_dim (multiples of 8), zero-filled by the TMA
  bool block_sparse;  // takes a block-sparse map (jf_block_mask)
  HopperBackwardFn run;
};

// The entry serving a caller's (dtype, head dim, score modifier, block-sparse map or not, v's head dim,
// 0 = q's): the narrowest kernel at or above the head dim that has the variant (64, 96, 128, 192, 256),
// padded when below it or when v's head dim is narrower (V and dO zero-filled past it, dV's columns
// there not stored); nullptr when this build has none.
const HopperBackwardEntry* find_hopper_backward(jf_dtype dtype, int head_dim, jf_score_mod score_mod,
                                                bool block_sparse = false, int v_head_dim = 0);

// The backward's tile shape (the plan is built over KV blocks of backward_block_n keys; each
// visits Q blocks of backward_block_m rows): 128 keys up to head dim 128 (96 too); the wide kernels (192,
// 256: tile_config_bwd.hpp) take 64, as their K and V and the warpgroups' dK, dV halves must fit.
// Q blocks of 128 rows at head dim 64 without a modifier or a block map (its dK, dV leave the
// registers for them: tile_config_bwd.hpp), else 64.
constexpr int kBackwardBlockM = 64;
constexpr int kNarrowBackwardBlockM = 128;
constexpr int backward_block_m(int kernel_head_dim, jf_score_mod score_mod = JF_SCORE_MOD_NONE,
                               bool block_sparse = false) {
  return kernel_head_dim == 64 && score_mod == JF_SCORE_MOD_NONE && !block_sparse ? kNarrowBackwardBlockM
                                                                                  : kBackwardBlockM;
}
constexpr int kBackwardBlockN = 128;
constexpr int kWideBackwardBlockN = 64;
constexpr int backward_block_n(int kernel_head_dim) {
  return kernel_head_dim > 128 ? kWideBackwardBlockN : kBackwardBlockN;
}

// How many tiles each query-head group is split over (a power of two dividing the group): 1, a
// tile covering the whole group whose dK/dV then sum in registers, unless
//  - the tiles would not fill kGroupSplitWaves waves of the GPU's SMs (MQA/GQA on a few long
//    sequences): split until they do;
//  - a mask makes a sequence's tiles unequal (causal, window: its first KV block is seen by every
//    Q block, its last by few) and a tile would hold more than kMaskedHeadsPerTile query heads:
//    the plan orders sequences, not tiles, by cost, so a sequence's heaviest tile can come last
//    and hold the GPU's tail; split until a tile holds that many heads.
// Both rules and their constants are bench/gqa_bwd.py's fastest (bench/NOTES.md, "The
// measurements behind the code's defaults", backward group splits). max_tiles: the plan's
// bound on tiles (pairs x KV heads), known from the shapes
// alone, so the workspace size needs no look at the offsets. forced > 0 (the benchmark knob
// JAGFLASH_BWD_GROUP_SPLITS) takes that value where it divides the group.
constexpr int64_t kGroupSplitWaves = 2;
constexpr int32_t kMaskedHeadsPerTile = 4;
constexpr int32_t backward_group_splits(int64_t max_tiles, int32_t group, int32_t sm_count, bool masked,
                                        int32_t forced) {
  if (forced > 0) return group % forced == 0 ? forced : 1;
  int32_t splits = 1;
  while (group % (2 * splits) == 0 && (max_tiles * splits < kGroupSplitWaves * sm_count ||
                                       (masked && group / splits > kMaskedHeadsPerTile)))
    splits *= 2;
  return splits;
}

}  // namespace jagflash::kernels
