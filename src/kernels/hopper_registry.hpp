// Names of the per-(dtype, head dim) Hopper forward and backward entry points, shared by the generated
// instantiation files and the generated registry.
#pragma once

#include "kernels/hopper_backward.hpp"
#include "kernels/hopper_forward.hpp"

#include <cutlass/numeric_types.h>

#define JF_HOPPER_FORWARD_DECLARE(dt, hd)                                                                 \
  namespace jagflash::kernels {                                                                           \
  cudaError_t hopper_forward_##dt##_hd##hd(const jf_fwd_args&, const HopperForwardLaunch&, cudaStream_t); \
  }

#define JF_HOPPER_FORWARD_DEFINE(dt, hd)                                                       \
  namespace jagflash::kernels {                                                                \
  cudaError_t hopper_forward_##dt##_hd##hd(const jf_fwd_args& a, const HopperForwardLaunch& l, \
                                           cudaStream_t s) {                                   \
    return fwd::run_forward<hopper_##dt##_t, hd>(a, l, s);                                     \
  }                                                                                            \
  }

#define JF_HOPPER_BACKWARD_DECLARE(dt, hd)                                                                  \
  namespace jagflash::kernels {                                                                             \
  cudaError_t hopper_backward_##dt##_hd##hd(const jf_bwd_args&, const HopperBackwardLaunch&, cudaStream_t); \
  }

#define JF_HOPPER_BACKWARD_DEFINE(dt, hd)                                                        \
  namespace jagflash::kernels {                                                                  \
  cudaError_t hopper_backward_##dt##_hd##hd(const jf_bwd_args& a, const HopperBackwardLaunch& l, \
                                            cudaStream_t s) {                                    \
    return bwd::run_backward<hopper_##dt##_t, hd>(a, l, s);                                      \
  }                                                                                              \
  }

namespace jagflash::kernels {
using hopper_bf16_t = cutlass::bfloat16_t;
using hopper_fp16_t = cutlass::half_t;
}  // namespace jagflash::kernels
