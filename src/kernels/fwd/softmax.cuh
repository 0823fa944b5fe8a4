// Online softmax on a consumer thread's S fragment, in the log2 domain with the scale folded in.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

namespace jagflash::kernels::fwd {

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
// consecutive col groups of S make one k-block of P.
template <class Layout>
__device__ __forceinline__ auto acc_as_a_operand_layout(Layout l) {
  auto col_groups = logical_divide(get<0, 2>(l), Tile<_2>{});  // ((2, N/16))
  return make_layout(make_layout(get<0, 0>(l), get<0, 1>(l), get<0, 0>(col_groups)), get<1>(l),
                     coalesce(make_layout(get<0, 1>(col_groups), get<2>(l))));
}

// Where a consumer thread's accumulator elements sit in the tile, for the SM90 wgmma C layout
// (m64nNk16, f32): thread t of warpgroup g, warp w = (t % 128) / 32, lane l holds rows
// g*64 + w*16 + l/4 (+8) and, in rowcol column c, column (c/2)*8 + (l%4)*2 + c%2. Computing this
// from the thread index keeps two registers live instead of a coordinate per element;
// tests/test_cute_headers.cu checks it against CuTe's own partitioning.
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
// and two predicated multiplies around every MUFU.EX2 (seen in the SASS: 3 extra instructions per
// probability, about a third of the softmax); a probability below 2^-126 is worth nothing next
// to the row's maximum, whose own probability is 1.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];  // raw scores (unscaled)
  float row_sum[kRows];  // this thread's partial sum; the quad is reduced at the end

  __device__ void reset() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  __device__ static float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  }
  __device__ static float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
  }

  // Turns scores into probabilities in place (S in rowcol view) and returns, per row, the factor
  // by which O must be rescaled for the new running max. O is not touched here: with the
  // intra-warpgroup overlap the previous block's O += P V may still be running.
  template <class TensorS>
  __device__ void update(TensorS& s, float scale_log2, float (&correction)[kRows]) {
    static_assert(decltype(size<0>(s))::value == kRows, "row count mismatch");
    static_assert(decltype(size<1>(s))::value % 2 == 0, "columns come in pairs");
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      // Two independent chains halve the dependent FMNMX latency of the row maximum.
      float m0 = row_max[r], m1 = row_max[r];
#pragma unroll
      for (int c = 0; c < size<1>(s); c += 2) {
        m0 = fmaxf(m0, s(r, c));
        m1 = fmaxf(m1, s(r, c + 1));
      }
      const float m = quad_max(fmaxf(m0, m1));
      // A row that has seen no key yet keeps -inf; exponents are taken against 0 then, so every
      // p is exp2(-inf) = 0 instead of NaN.
      const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      correction[r] = exp2_ftz(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
      for (int c = 0; c < size<1>(s); c += 2) {
        const float p0 = exp2_ftz(fmaf(s(r, c), scale_log2, -m_scaled));
        const float p1 = exp2_ftz(fmaf(s(r, c + 1), scale_log2, -m_scaled));
        s(r, c) = p0;
        s(r, c + 1) = p1;
        sum0 += p0;
        sum1 += p1;
      }
      row_sum[r] = row_sum[r] * correction[r] + (sum0 + sum1);
    }
  }

  template <class TensorO>
  __device__ static void rescale(TensorO& o, const float (&correction)[kRows]) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= correction[r];
  }
};

}  // namespace jagflash::kernels::fwd
