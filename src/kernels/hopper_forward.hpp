// The Hopper (sm_90a) forward kernels as the dispatcher sees them: one entry per instantiated
// (dtype, head dim, score modifier), and the workspace they need.
#pragma once

#include "schedule/plan_device.hpp"

#include <jagflash/jagflash.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jagflash::kernels {

struct HopperForwardLaunch {
  int32_t* error_flag;  // set by the device offsets check (the kernels then write nothing) and by
                        // the kernels on a mismatched plan (schedule::kPlanMismatchFlag)
  void* workspace;
  schedule::PlanKey* plan_key;  // in the workspace, at a place every variant shares
  schedule::DevicePlanLayout plan;
  bool build_plan;  // false: the workspace already holds the plan for these offsets
};

using HopperForwardFn = cudaError_t (*)(const jf_fwd_args&, const HopperForwardLaunch&, cudaStream_t);

// The tile shape a call runs with (and its plan is built for) comes from
// fwd::choose_forward_variant (kernels/fwd/variants.hpp).
struct HopperForwardEntry {
  jf_dtype dtype;
  int head_dim;
  jf_score_mod score_mod;
  HopperForwardFn run;
};

// nullptr when this build did not instantiate (dtype, head_dim, score_mod).
const HopperForwardEntry* find_hopper_forward(jf_dtype dtype, int head_dim, jf_score_mod score_mod);

// True when the current device can run sm_90a code (compute capability 9.0).
bool hopper_device_present();

}  // namespace jagflash::kernels
