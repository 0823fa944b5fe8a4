// Online softmax on a consumer thread's S fragment, in the log2 domain with the scale folded in.
#pragma once

#include "kernels/common/accumulator.cuh"

#include <cute/tensor.hpp>

#include <cmath>

namespace jagflash::kernels::fwd {

using namespace cute;

// The accumulator views and coordinates, and exp2 by the special-function unit: shared with the
// backward (kernels/common/accumulator.cuh).
using common::acc_as_a_operand_layout;
using common::AccumulatorCoords;
using common::exp2_ftz;
using common::rowcol_layout;

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
  // keep_max (log2 units, >= 0; < 0: off): a row keeps its running max while the block's maximum
  // passes it by at most this much. Its probabilities then reach 2^keep_max instead of 1 (fp32 sums
  // and bf16/fp16 P hold that exactly as well), its correction is exactly 1, and O's rescale can
  // be skipped (rescale); the result is the same sum, taken against another reference point.
  template <class TensorS>
  __device__ void update(TensorS& s, float scale_log2, float keep_max, float (&correction)[kRows]) {
    update_rows<false>(s, scale_log2, keep_max, correction, nullptr);
  }

  // The same for a fragment whose row r holds its scores less row_offset[r] (raw units, this
  // thread's own: ALiBi's linear form, common::alibi_with_row_offsets). The offset joins the row's
  // maximum and the exponents' per-row term, so it costs no instruction a score.
  template <class TensorS>
  __device__ void update_with_row_offsets(TensorS& s, float scale_log2, float keep_max,
                                          float (&correction)[kRows], const float (&row_offset)[kRows]) {
    update_rows<true>(s, scale_log2, keep_max, correction, row_offset);
  }

 private:
  template <bool kRowOffsets, class TensorS>
  __device__ void update_rows(TensorS& s, float scale_log2, float keep_max, float (&correction)[kRows],
                              const float* row_offset) {
    static_assert(decltype(size<0>(s))::value == kRows, "row count mismatch");
    static_assert(decltype(size<1>(s))::value % 2 == 0, "columns come in pairs");
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      // Two independent chains halve the dependent FMNMX latency of the row maximum. With row
      // offsets the fragment holds scores less this thread's offset: its maximum takes the offset
      // before the quad's (each thread of the quad has its own) and the running maximum after.
      float m0 = kRowOffsets ? -INFINITY : row_max[r], m1 = m0;
#pragma unroll
      for (int c = 0; c < size<1>(s); c += 2) {
        m0 = fmaxf(m0, s(r, c));
        m1 = fmaxf(m1, s(r, c + 1));
      }
      float m;
      if constexpr (kRowOffsets)
        m = fmaxf(row_max[r], quad_max(fmaxf(m0, m1) + row_offset[r]));  // -inf + offset stays -inf
      else
        m = quad_max(fmaxf(m0, m1));
      // The running max stays while the new one passes it by at most keep_max (the quad's four
      // threads decide alike: same m, same row_max). A row that has seen no key yet (row_max =
      // -inf) always moves: the difference is +inf, or NaN when m is -inf too.
      if ((m - row_max[r]) * scale_log2 <= keep_max) m = row_max[r];
      // A row that has seen no key yet keeps -inf; exponents are taken against 0 then, so every
      // p is exp2(-inf) = 0 instead of NaN.
      const float m_scaled = m == -INFINITY ? 0.f : m * scale_log2;
      // The exponents' per-row term: -m (scaled), plus the row's offset with kRowOffsets.
      float exp_offset = -m_scaled;
      if constexpr (kRowOffsets) exp_offset = fmaf(row_offset[r], scale_log2, -m_scaled);
      correction[r] = exp2_ftz(row_max[r] * scale_log2 - m_scaled);
      row_max[r] = m;
      float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
      for (int c = 0; c < size<1>(s); c += 2) {
        const float p0 = exp2_ftz(fmaf(s(r, c), scale_log2, exp_offset));
        const float p1 = exp2_ftz(fmaf(s(r, c + 1), scale_log2, exp_offset));
        s(r, c) = p0;
        s(r, c + 1) = p1;
        sum0 += p0;
        sum1 += p1;
      }
      row_sum[r] = row_sum[r] * correction[r] + (sum0 + sum1);
    }
  }

 public:
  // O *= correction, row by row; skipped when the warp's rows all kept their max (keep_max >= 0:
  // every correction exactly 1). keep_max < 0 multiplies always (the vote's cost measured apart).
  template <class TensorO>
  __device__ static void rescale(TensorO& o, const float (&correction)[kRows], float keep_max) {
    if (keep_max >= 0.f) {
      bool moved = false;
#pragma unroll
      for (int r = 0; r < kRows; ++r) moved |= correction[r] != 1.f;
      if (!__any_sync(0xffffffffu, moved)) return;
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int c = 0; c < size<1>(o); ++c) o(r, c) *= correction[r];
  }
};

}  // namespace jagflash::kernels::fwd
