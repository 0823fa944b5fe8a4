// The elementwise math of one backward step (one Q block against the tile's keys), between the
// GEMMs the consumer issues (mainloop_bwd.cuh, mainloop_bwd_wide.cuh): P^T from S^T (the score modifier, the
// mask, the softmax's exp2 against the row's lse) and dS^T from dP^T (P (dP - delta), times the modifier's
// derivative). A thread holds two keys (rows) of S^T and 16 query rows (columns); the lse and
// delta of its columns are read from shared memory where they are used (kept in registers they
// pushed the consumers into spills).
#pragma once

#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/bwd/scheduler_bwd.cuh"
#include "kernels/common/accumulator.cuh"
#include "kernels/common/warpgroup_gemm.cuh"

#include <cuda_fp16.h>
#include <cute/tensor.hpp>
#include <type_traits>

namespace jagflash::kernels::bwd {

using common::AccumulatorCoords;
using common::exp2_ftz;

template <class Traits>
struct StepMath {
  using Mod = typename Traits::ScoreMod;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kRows = 2;                      // keys of S^T a thread
  static constexpr int kCols = Traits::kStepRows / 4;  // query rows of the warpgroup's S^T a thread

  // The score modifier (none in the default kernels: nothing of it is compiled). Softcap's dS
  // takes dscore = 1 - t^2 of each score's tanh t: at D = 64 kept from the tanh to dS as half
  // pairs (11 bits of a value in [0, 1], next to the 8 of the bf16 dS it scales) where the
  // registers allow; at D = 128, where dK and dV hold 128 registers a thread and those 16 spilled
  // (check_sass), and at D = 64 with 128-row Q blocks (S^T and dP^T 64 registers each),
  // recovered from P and the lse (KernelScoreMod::dscore_of_p, one MUFU.LG2 a score more).
  static constexpr bool kKeepDscore = Mod::kDerivative && Traits::kHeadDim == 64 && kBlockM == 64;
  struct KeptDscore {
    __half2 pairs[kRows][kCols / 2];
  };
  struct NoDscore {};
  using Dscore = std::conditional_t<kKeepDscore, KeptDscore, NoDscore>;

  // S^T (s_rc, keys x query rows, as the accumulator's rows and columns) into P^T in place, for
  // Q block m (query rows from row0) and keys from key0 of query head h; the S^T GEMM is the
  // older of the two in flight (the dP^T GEMM may still run). lse_c: this thread's first
  // column's lse.
  template <class Frag>
  __device__ __forceinline__ static void scores_to_p(Frag& s_rc, Dscore& dscore, const Params<Traits>& p,
                                                     const TileInfo& t, int32_t h, int32_t m, int32_t row0,
                                                     int32_t key0, const AccumulatorCoords& coords,
                                                     const float* lse_c) {
    static_assert(decltype(size<0>(s_rc))::value == kRows && decltype(size<1>(s_rc))::value == kCols,
                  "the consumer's S^T fragment");
    // Whether every (row, key) pair of the block is visible and inside both sequences (the tile's
    // range of such Q blocks, decoded with it): then no mask arithmetic at all, the bulk of a
    // long sequence's blocks.
    const bool full_block = m >= t.m_full_lo && m <= t.m_full_hi;

    cute::warpgroup_wait<1>();  // S^T is ready; dP^T may still run
    cute::warpgroup_fence_operand(s_rc);
    if constexpr (!Mod::kNone) {
      // S^T: keys along the rows, queries along the columns (KernelScoreMod::backward_scores).
      float row_base[kRows];
      int32_t key_pos[kRows];
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        row_base[r] =
            static_cast<float>(key0 + coords.row(r) - row0 - coords.col_base - (t.len_kv - t.len_q));
        key_pos[r] = key0 + coords.row(r);
      }
      Mod::backward_scores(s_rc, p.score_mod, h, row_base, key_pos, row0 + coords.col_base, t.len_q,
                           t.len_kv);
      if constexpr (kKeepDscore) {  // before the mask: t is finite, a masked score is not
#pragma unroll
        for (int r = 0; r < kRows; ++r)
#pragma unroll
          for (int c = 0; c < kCols; c += 2)
            dscore.pairs[r][c / 2] = __floats2half2_rn(Mod::dscore_of_modified(s_rc(r, c)),
                                                       Mod::dscore_of_modified(s_rc(r, c + 1)));
      }
    }
    // A block with hidden pairs (a mask edge, a sequence's end) first sets their scores to -inf
    // in place; every block then takes the same exp2 loop (exp2(-inf) = 0). Per key, the queries
    // that see it (the mask policy's query_range, empty past the sequence's keys), relative to
    // the thread's first column: two ranges a thread instead of one per column.
    if (!full_block) {
      const int32_t col0 = row0 + coords.col_base;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const int32_t j = key0 + coords.row(r);
        // j and the lengths are non-negative: widened as unsigned, their 64-bit forms in
        // query_range take no sign word (kept per tile, the 128-row consumers spilled them).
        const IndexRange queries = j < t.len_kv
                                       ? p.mask.query_range(int64_t(uint32_t(j)), int64_t(uint32_t(t.len_q)),
                                                            int64_t(uint32_t(t.len_kv)))
                                       : IndexRange{0, -1};
        const int32_t lo = static_cast<int32_t>(queries.lo) - col0;
        const int32_t hi = static_cast<int32_t>(queries.hi) - col0;
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
          const int off = AccumulatorCoords::col_offset(c);
          if (off < lo || off > hi) s_rc(r, c) = -INFINITY;
        }
      }
    }
    // Columns outermost: a column's lse serves both keys and is dead after (rows outermost, the
    // 128-row block's 32 lse values stayed live across the loop).
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const float lse = lse_c[AccumulatorCoords::col_offset(c)];
#pragma unroll
      for (int r = 0; r < kRows; ++r) s_rc(r, c) = exp2_ftz(fmaf(s_rc(r, c), p.scale_log2, -lse));
    }
  }

  // dP^T (dp_rc, landed) into dS^T in place: P (dP - delta), times the modifier's derivative
  // where it has one. p_rc: P^T from scores_to_p.
  template <class Frag>
  __device__ __forceinline__ static void ds_from_dp(Frag& dp_rc, const Frag& p_rc, const Dscore& dscore,
                                                    const Params<Traits>& p, const float* lse_c,
                                                    const float* delta_c) {
    if constexpr (Mod::kDerivative && !kKeepDscore) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int off = AccumulatorCoords::col_offset(c);
        const float delta = delta_c[off], lse = lse_c[off];
#pragma unroll
        for (int r = 0; r < kRows; ++r)
          dp_rc(r, c) = p_rc(r, c) * (dp_rc(r, c) - delta) * Mod::dscore_of_p(p_rc(r, c), lse, p.score_mod);
      }
    } else if constexpr (kKeepDscore) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < kCols; c += 2) {
          const float2 d = __half22float2(dscore.pairs[r][c / 2]);
          dp_rc(r, c) = p_rc(r, c) * (dp_rc(r, c) - delta_c[AccumulatorCoords::col_offset(c)]) * d.x;
          dp_rc(r, c + 1) =
              p_rc(r, c + 1) * (dp_rc(r, c + 1) - delta_c[AccumulatorCoords::col_offset(c + 1)]) * d.y;
        }
    } else {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {  // columns outermost, as scores_to_p's exp2
        const float delta = delta_c[AccumulatorCoords::col_offset(c)];
#pragma unroll
        for (int r = 0; r < kRows; ++r) dp_rc(r, c) = p_rc(r, c) * (dp_rc(r, c) - delta);
      }
    }
  }
};

}  // namespace jagflash::kernels::bwd
