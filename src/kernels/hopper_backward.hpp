// The Hopper (sm_90a) backward kernels as the dispatcher sees them: one entry per instantiated
// (dtype, head dim), and the pieces of the workspace they use.
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
};

using HopperBackwardFn = cudaError_t (*)(const jf_bwd_args&, const HopperBackwardLaunch&, cudaStream_t);

struct HopperBackwardEntry {
  jf_dtype dtype;
  int head_dim;
  HopperBackwardFn run;
};

// nullptr when this build did not instantiate (dtype, head_dim).
const HopperBackwardEntry* find_hopper_backward(jf_dtype dtype, int head_dim);

// The backward's tile shape (the plan is built over KV blocks of kBackwardBlockN keys; each
// visits Q blocks of kBackwardBlockM rows).
constexpr int kBackwardBlockM = 64;
constexpr int kBackwardBlockN = 128;

}  // namespace jagflash::kernels
