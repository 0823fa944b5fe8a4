// The elementwise math of one forward step (one KV block against the tile's query rows), between
// the GEMMs the consumer issues (mainloop_fwd.cuh): on S, the score modifier, the mask (on the
// blocks outside the mask-free bulk) and the online softmax against the rows' running max, which
// leave P in place; then P into the input dtype as the A operand of O += P V. A thread holds
// kRows query rows of S (the accumulator's rows) and its keys along the columns; the rows' running
// max and sum stay in the consumer's OnlineSoftmax (softmax.cuh), which the epilogue reads at the
// tile's end. The consumer keeps the waits, the GEMM issues and the stage releases, and which
// blocks take the mask.
// Plain inline functions, not __forceinline__ as the backward's StepMath: the inliner then takes
// each in after simplifying it on its own, and the consumer's loop compiles to the SASS the
// benchmarks measured; forced in before that, its mask test and the next block's probe come out in
// another order (same work, other SASS).
#pragma once

#include "core/mask.hpp"
#include "kernels/common/accumulator.cuh"
#include "kernels/common/score_mod.cuh"
#include "kernels/fwd/kernel_traits.cuh"
#include "kernels/fwd/softmax.cuh"

#include <cute/tensor.hpp>

#include <cmath>
#include <cstdint>

namespace jagflash::kernels::fwd {

template <class Traits>
struct StepMath {
  using Element = typename Traits::Element;
  using Mod = typename Traits::ScoreMod;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;

  // The score modifier's hook (called only by a kernel that has one; KernelScoreMod::forward_scores)
  // on the raw scores of KV block n (s_rc: query rows i along the rows, keys j along the columns),
  // before the mask. row_offset: the rows' constants it leaves for the softmax (Mod::kRowOffsets).
  // alibi_slope: the tile's head's (Mod::raw_slope, read once per tile).
  template <class Frag, int kRows>
  __device__ static void modify_scores(Frag& s_rc, float (&row_offset)[kRows], const Params<Traits>& p,
                                       const TileInfo& t, int32_t n, const AccumulatorCoords& coords,
                                       float alibi_slope) {
    // An elementwise modifier reads the rows' positions, the others the diagonal offsets.
    float row_base[kRows] = {};
    int32_t row_pos[kRows] = {};
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if constexpr (Mod::kElementwise)
        row_pos[r] = t.m_block * kBlockM + coords.row(r);
      else
        row_base[r] = static_cast<float>(n * kBlockN + coords.col_base -
                                         (t.m_block * kBlockM + coords.row(r)) - (t.len_kv - t.len_q));
    }
    Mod::forward_scores(s_rc, row_offset, p.score_mod, alibi_slope, t.head, row_base, row_pos,
                        n * kBlockN + coords.col_base, t.len_q, t.len_kv);
  }

  // Sets the scores of the keys of KV block n that the mask hides to -inf. Only the peeled blocks
  // (outside the bulk the mask policy proves mask-free) pay for it.
  template <class Frag>
  __device__ static void mask_block(Frag& s_rc, const Params<Traits>& p, const TileInfo& t, int32_t n,
                                    const AccumulatorCoords& coords) {
    constexpr int kRows = decltype(size<0>(s_rc))::value;
    // Without a left window edge every row's visible keys start at key 0 (MaskPolicy::key_range),
    // so only the right edge needs a compare: one instruction less per score on the masked blocks
    // of causal and unmasked (sequence-end) tiles.
    const bool left_edge = p.mask.left >= 0;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const IndexRange keys = p.mask.key_range(t.m_block * kBlockM + coords.row(r), t.len_q, t.len_kv);
      // Visible columns of this block, relative to the thread's first column.
      const int first_col = static_cast<int>(keys.lo) - n * kBlockN - coords.col_base;
      const int last_col = static_cast<int>(keys.hi) - n * kBlockN - coords.col_base;
      if (left_edge) {
#pragma unroll
        for (int c = 0; c < size<1>(s_rc); ++c) {
          const int col = AccumulatorCoords::col_offset(c);
          if (col < first_col || col > last_col) s_rc(r, c) = -INFINITY;
        }
      } else {
#pragma unroll
        for (int c = 0; c < size<1>(s_rc); ++c)
          if (AccumulatorCoords::col_offset(c) > last_col) s_rc(r, c) = -INFINITY;
      }
    }
  }

  // The online softmax of a block's scores (modified, masked) into P in place, against the rows'
  // running max; correction: per row, the factor by which O must be rescaled for the new max (the
  // rows' earlier sum is rescaled here). With Mod::kRowOffsets, row_offset holds the rows' constants
  // that modify_scores left.
  template <class Frag, int kRows>
  __device__ static void update_softmax(Frag& s_rc, OnlineSoftmax<kRows>& softmax, float (&correction)[kRows],
                                        float (&row_offset)[kRows], const Params<Traits>& p) {
    if constexpr (Mod::kRowOffsets)
      softmax.update_with_row_offsets(s_rc, p.scale_log2, p.keep_max, correction, row_offset);
    else
      softmax.update(s_rc, p.scale_log2, p.keep_max, correction);
  }

  // P (the accumulator's fp32, tSrS) into the input dtype (tOrP), the registers that the A
  // operand of O += P V reads.
  template <class FragP, class FragS>
  __device__ static void p_to_a_operand(FragP& tOrP, const FragS& tSrS) {
#pragma unroll
    for (int e = 0; e < size(tSrS); ++e) tOrP(e) = static_cast<Element>(tSrS(e));
  }
};

}  // namespace jagflash::kernels::fwd
