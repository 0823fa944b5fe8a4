// The light kernels around the main backward kernel.
//  preprocess: delta = rowsum(dO * O) in fp32 and the lse in log2 units (+inf where a row sees
//    no key, so every probability of it is exp2(-inf) = 0), into the workspace's [H][q_stride]
//    arrays that the main kernel loads by TMA; the rows past total_q are set likewise.
//  postprocess: dQ = scale x the fp32 accumulator, converted to the input dtype, in the caller's
//    layout.
#pragma once

#include "kernels/common/accumulator.cuh"

#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>

namespace jagflash::kernels::bwd {

struct PreprocessParams {
  const void* out;
  const void* dout;
  int64_t out_row_stride, out_head_stride, dout_row_stride, dout_head_stride;
  const float* lse;  // [H, total_q]
  float* lse_log2;   // [H][q_stride]
  float* delta;      // [H][q_stride]
  int64_t total_q, q_stride;
  int32_t num_heads;
  const int32_t* error_flag;
};

// One warp per (row, head); each lane reads D/32 contiguous elements of dO and O.
template <class Element, int kHeadDim>
__global__ void preprocess_kernel(const PreprocessParams p) {
  if (*p.error_flag) return;
  constexpr int kPerLane = kHeadDim / 32;
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / 32;
  const int64_t items = p.q_stride * p.num_heads;
  for (int64_t w = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; w < items; w += warps) {
    const int32_t h = static_cast<int32_t>(w / p.q_stride);
    const int64_t row = w - int64_t(h) * p.q_stride;
    float sum = 0.f;
    if (row < p.total_q) {
      const Element* o = static_cast<const Element*>(p.out) + row * p.out_row_stride + h * p.out_head_stride;
      const Element* d =
          static_cast<const Element*>(p.dout) + row * p.dout_row_stride + h * p.dout_head_stride;
#pragma unroll
      for (int e = 0; e < kPerLane; ++e)
        sum += static_cast<float>(o[lane * kPerLane + e]) * static_cast<float>(d[lane * kPerLane + e]);
    }
#pragma unroll
    for (int off = 16; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (lane == 0) {
      const float lse = row < p.total_q ? p.lse[int64_t(h) * p.total_q + row] : -INFINITY;
      p.lse_log2[w] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
      p.delta[w] = sum;
    }
  }
}

struct PostprocessParams {
  const float* dq_accum;  // [H][dq_rows][D]
  int64_t dq_rows;
  void* dq;
  int64_t dq_row_stride, dq_head_stride;
  int64_t total_q;
  int32_t num_heads;
  float scale;
  const int32_t* error_flag;
};

// Eight elements a thread: two 16-byte loads of the accumulator, one 16-byte store.
template <class Element, int kHeadDim>
__global__ void postprocess_kernel(const PostprocessParams p) {
  if (*p.error_flag) return;
  constexpr int kChunks = kHeadDim / 8;
  const int64_t items = p.total_q * p.num_heads * kChunks;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < items; idx += stride) {
    const int chunk = static_cast<int>(idx % kChunks);
    const int64_t row_head = idx / kChunks;
    const int32_t h = static_cast<int32_t>(row_head % p.num_heads);
    const int64_t row = row_head / p.num_heads;
    const float4* src =
        reinterpret_cast<const float4*>(p.dq_accum + (int64_t(h) * p.dq_rows + row) * kHeadDim + chunk * 8);
    const float4 a = src[0], b = src[1];
    uint4 packed;
    packed.x = common::pack2(Element{}, a.x * p.scale, a.y * p.scale);
    packed.y = common::pack2(Element{}, a.z * p.scale, a.w * p.scale);
    packed.z = common::pack2(Element{}, b.x * p.scale, b.y * p.scale);
    packed.w = common::pack2(Element{}, b.z * p.scale, b.w * p.scale);
    Element* dst = static_cast<Element*>(p.dq) + row * p.dq_row_stride + h * p.dq_head_stride + chunk * 8;
    *reinterpret_cast<uint4*>(dst) = packed;
  }
}

}  // namespace jagflash::kernels::bwd
