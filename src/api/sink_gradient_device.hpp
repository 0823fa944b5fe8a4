// The learnable sinks' gradient on the GPU (jf_bwd_args::dlearnable_sink), for the Hopper
// backward and the oracle alike: both leave delta = rowsum(dout * out) per row in their workspace,
// and the caller's lse already holds the sink, so d s_h = -sum_i exp(s_h - lse_i) * delta_i needs
// nothing else. Built with the portable gencode of the oracle's files (CMakeLists.txt).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jagflash::detail {

struct SinkGradientArgs {
  const int32_t* error_flag;  // non-zero: the offsets check failed; write nothing
  const float* lse;           // [H, rows], natural units, as the forward wrote it
  const float* delta;         // [H][delta_head_stride]
  int64_t delta_head_stride;
  int64_t rows;  // output rows (total_q, or B * Lq when pooled)
  int32_t heads;
  const float* learnable_sink;  // [H]
  float* dlearnable_sink;       // [H], overwritten
};

// One CTA per head sums its rows in a fixed order (each thread a fixed stride of rows, then a
// fixed tree): the same bits on every call, in either backward mode.
cudaError_t launch_sink_gradient(const SinkGradientArgs& args, cudaStream_t stream);

}  // namespace jagflash::detail
