// Names of the per-(dtype, head dim, score modifier) Hopper forward and backward entry points, shared by the
// generated instantiation files and the generated registry.
#pragma once

#include "kernels/hopper_backward.hpp"
#include "kernels/hopper_forward.hpp"

#include <cutlass/numeric_types.h>

// One entry point per (dtype, kernel head dim, variant): mod names it (none, softcap, alibi,
// padded, sparse), kind is its jf_score_mod, padded whether it serves the head dims below the
// kernel's and sparse whether it takes a block-sparse map.
#define JF_HOPPER_FORWARD_DECLARE(dt, hd, mod)                                                     \
  namespace jagflash::kernels {                                                                    \
  cudaError_t hopper_forward_##dt##_hd##hd##_##mod(const jf_fwd_args&, const HopperForwardLaunch&, \
                                                   cudaStream_t);                                  \
  }

#define JF_HOPPER_FORWARD_DEFINE(dt, hd, mod, kind, padded, sparse)                                    \
  namespace jagflash::kernels {                                                                        \
  cudaError_t hopper_forward_##dt##_hd##hd##_##mod(const jf_fwd_args& a, const HopperForwardLaunch& l, \
                                                   cudaStream_t s) {                                   \
    return fwd::run_forward_for<hopper_##dt##_t, hd, kind, padded, sparse>(a, l, s);                   \
  }                                                                                                    \
  }

#define JF_HOPPER_BACKWARD_DECLARE(dt, hd, mod)                                                      \
  namespace jagflash::kernels {                                                                      \
  cudaError_t hopper_backward_##dt##_hd##hd##_##mod(const jf_bwd_args&, const HopperBackwardLaunch&, \
                                                    cudaStream_t);                                   \
  }

#define JF_HOPPER_BACKWARD_DEFINE(dt, hd, mod, kind, padded, sparse)                                     \
  namespace jagflash::kernels {                                                                          \
  cudaError_t hopper_backward_##dt##_hd##hd##_##mod(const jf_bwd_args& a, const HopperBackwardLaunch& l, \
                                                    cudaStream_t s) {                                    \
    return bwd::run_backward<hopper_##dt##_t, hd, kind, padded, sparse>(a, l, s);                        \
  }                                                                                                      \
  }

namespace jagflash::kernels {
using hopper_bf16_t = cutlass::bfloat16_t;
using hopper_fp16_t = cutlass::half_t;
}  // namespace jagflash::kernels
