// Views and coordinates of a wgmma accumulator fragment, the conversions of its registers, and
// the special-function exp2 both directions use.
#pragma once

#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jagflash::kernels::common {

using namespace cute;

// A wgmma accumulator fragment ((2 cols, 2 rows, N/8 col groups), M tiles, N tiles) viewed as
// (rows, cols) so row reductions are plain loops.
template <class Layout>
__host__ __device__ __forceinline__ auto rowcol_layout(Layout l) {
  static_assert(rank(Layout{}) == 3 && rank(get<0>(Layout{})) == 3, "expects a wgmma C layout");
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<0, 2>(l), get<2>(l)));
}

// The same registers as the A operand of a 16-bit wgmma: ((2, 2, 2), M tiles, K/16). Two
// consecutive col groups of the accumulator make one k-block of the operand.
template <class Layout>
__device__ __forceinline__ auto acc_as_a_operand_layout(Layout l) {
  auto col_groups = logical_divide(get<0, 2>(l), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(col_groups)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(col_groups), get<2>(l))));
}

// Where a consumer thread's accumulator elements sit in the tile, for the SM90 wgmma C layout
// (m64nNk16, f32) with the warpgroups stacked along M: thread t of warpgroup g, warp
// w = (t % 128) / 32, lane l holds rows g*64 + w*16 + l/4 (+8) and, in rowcol column c, column
// (c/2)*8 + (l%4)*2 + c%2. Computing this from the thread index keeps two registers live instead
// of a coordinate per element; tests/test_cute_headers.cu checks it against CuTe's partitioning.
struct AccumulatorCoords {
  int row0;      // tile row of rowcol row 0 (row 1 is row0 + 8)
  int col_base;  // (l%4)*2

  __host__ __device__ explicit AccumulatorCoords(int thread)
      : row0((thread / 128) * 64 + ((thread % 128) / 32) * 16 + (thread % 32) / 4),
        col_base((thread % 4) * 2) {}
  __host__ __device__ int row(int r) const { return row0 + 8 * r; }
  __host__ __device__ static constexpr int col_offset(int c) { return (c / 2) * 8 + (c % 2); }
  __host__ __device__ int col(int c) const { return col_base + col_offset(c); }
};

// 2^x by the special-function unit alone. exp2f keeps denormal results, which costs a compare
// and two predicated multiplies around every MUFU.EX2; a probability below 2^-126 is worth
// nothing next to the row's maximum, whose own probability is 1.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Two floats rounded to the 16-bit type and packed in one 32-bit word (one store per pair).
__device__ __forceinline__ uint32_t pack2(cutlass::bfloat16_t, float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return reinterpret_cast<const uint32_t&>(v);
}
__device__ __forceinline__ uint32_t pack2(cutlass::half_t, float a, float b) {
  const __half2 v = __floats2half2_rn(a, b);
  return reinterpret_cast<const uint32_t&>(v);
}

}  // namespace jagflash::kernels::common
