// Forward epilogue: O normalised by the softmax sum, converted, and stored for the rows inside
// the sequence only (the rows after its end belong to the next sequence and are never touched);
// lse per row, -inf and O = 0 for rows that see no key.
#pragma once

#include "kernels/fwd/kernel_traits.cuh"
#include "kernels/fwd/softmax.cuh"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace jagflash::kernels::fwd {

using namespace cute;

__device__ __forceinline__ uint32_t pack2(cutlass::bfloat16_t, float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return reinterpret_cast<const uint32_t&>(v);
}
__device__ __forceinline__ uint32_t pack2(cutlass::half_t, float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return reinterpret_cast<const uint32_t&>(v);
}

template <class Traits, class TensorO, class Softmax>
__device__ __forceinline__ void store_tile(const Params<Traits>& p, const TileInfo& t, TensorO& o_rc,
                                           const AccumulatorCoords& coords, Softmax& softmax, int thread) {
  using Element = typename Traits::Element;
  constexpr int kRows = decltype(size<0>(o_rc))::value;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float l = Softmax::quad_sum(softmax.row_sum[r]);
    const float inv_l = l > 0.f ? 1.f / l : 0.f;
    const int32_t i = t.m_block * Traits::kBlockM + coords.row(r);
    if (i >= t.len_q) continue;
    const int64_t row = int64_t(t.q_start) + i;
    Element* out_row = p.out + row * p.out_row_stride + int64_t(t.head) * p.out_head_stride;
    // Column pairs (c, c+1) are adjacent in the accumulator: one 32-bit store each.
#pragma unroll
    for (int c = 0; c < size<1>(o_rc); c += 2) {
      const int col = coords.col(c);
      *reinterpret_cast<uint32_t*>(out_row + col) = pack2(Element{}, o_rc(r, c) * inv_l, o_rc(r, c + 1) * inv_l);
    }
    if (p.lse != nullptr && thread % 4 == 0)
      p.lse[int64_t(t.head) * p.total_q + row] = l > 0.f ? softmax.row_max[r] * p.scale + logf(l) : -INFINITY;
  }
}

}  // namespace jagflash::kernels::fwd
