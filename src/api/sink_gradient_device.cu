#include "api/sink_gradient_device.hpp"

namespace jagflash::detail {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr float kLog2e = 1.4426950408889634f;

__global__ void __launch_bounds__(kThreads) sink_gradient_kernel(SinkGradientArgs a) {
  if (*a.error_flag) return;
  const int32_t head = blockIdx.x;
  const float* lse = a.lse + int64_t(head) * a.rows;
  const float* delta = a.delta + int64_t(head) * a.delta_head_stride;
  const float sink_log2 = a.learnable_sink[head] * kLog2e;
  float sum = 0.f;
  // A row with lse = -inf (a sink of -inf, i.e. none, and no visible key) has out = 0: no share.
  for (int64_t i = threadIdx.x; i < a.rows; i += kThreads)
    if (lse[i] != -INFINITY) sum += exp2f(sink_log2 - lse[i] * kLog2e) * delta[i];
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
  __shared__ float warp_sums[kWarps];
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
  __syncthreads();
  if (threadIdx.x < 32) {
    sum = threadIdx.x < kWarps ? warp_sums[threadIdx.x] : 0.f;
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if (threadIdx.x == 0) a.dlearnable_sink[head] = -sum;
  }
}

}  // namespace

cudaError_t launch_sink_gradient(const SinkGradientArgs& args, cudaStream_t stream) {
  if (args.heads == 0) return cudaSuccess;
  sink_gradient_kernel<<<args.heads, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace jagflash::detail
