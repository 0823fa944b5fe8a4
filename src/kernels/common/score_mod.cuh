// The score modifier (core/score_mod.hpp) as the Hopper kernels apply it: to a consumer thread's
// accumulator fragment of raw scores q . k (the softmax scale not yet applied), in place, before
// the mask. The policy's math, laid out for the registers:
//  - softcap: score = cap * tanh(scale * s / cap). The fragment keeps t = tanh(s * scale / cap)
//    and the launcher folds cap into the exponent's factor (scale_log2 = cap * log2 e) and, in the
//    forward, into the lse's (lse = cap * row_max + log(sum)). The backward's dS takes
//    dscore = 1 - t^2 (ScoreMod::dscore).
//  - ALiBi: score = scale * s - slope_h * |j - i - (Lk - Lq)|; in raw-score units the bias is
//    -(slope_h / scale) * |d|, added where the fragment's (row, column) are (i, j) forward and
//    (j, i) backward (S^T).
//  - any other modifier of core/score_mod.hpp (kGeneric): its score() per element, on the scaled
//    score and the element's (query, key) coordinates, the result in raw-score units again
//    (score(scale s) / scale), so the exponent's factor stays the softmax scale's.
// KernelScoreMod<JF_SCORE_MOD_NONE> does nothing and holds nothing the kernels read: the default
// kernels compile to the code they had without a modifier.
#pragma once

#include "core/score_mod.hpp"
#include "kernels/common/accumulator.cuh"

#include <jagflash/jagflash.h>

#include <cute/tensor.hpp>

#include <type_traits>

namespace jagflash::kernels::common {

using namespace cute;

// tanh by the special-function unit (MUFU.TANH, about 2^-11 relative error: far below the bf16
// rounding of P and dS that follows it).
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The launch's modifier values, plain and the same for every kind (the Params stay one struct).
struct ScoreModArgs {
  float softcap_prescale = 0.f;         // softcap: scale / cap, tanh's argument per raw score
  float softcap_from_log2 = 0.f;        // softcap: 1 / (cap x log2 e), t of a score from its exponent
  float alibi_factor = 0.f;             // ALiBi: 1 / scale, a slope in raw-score units
  const float* alibi_slopes = nullptr;  // ALiBi: [query heads]
  ScoreModValues values;                // a generic modifier: jf_problem's fields
  float scale = 0.f;                    // a generic modifier: the softmax scale and its inverse
  float inv_scale = 0.f;
};

// ALiBi on a forward fragment as one FFMA a score: for a row whose columns all sit on one side of
// the diagonal (every d <= 0, or every d >= 0: every block but the diagonal ones), |d| is +-d and the
// bias -slope |d| = k (row_base + col_offset) with k = +-slope is linear in the column: the fragment
// takes k col_offset(c) (an FFMA with an immediate) and the row's constant k row_base goes to
// row_offset[r], which the softmax adds to the row's maximum and its exponents' offset
// (OnlineSoftmax::update_with_row_offsets) at no cost a score. A row across the diagonal takes
// the two-instruction form and offset 0. kMaxColOffset: the largest col_offset of the fragment.
template <int kMaxColOffset, class TensorS, int kRows>
__device__ __forceinline__ void alibi_with_row_offsets(TensorS& s_rc, float slope,
                                                       const float (&row_base)[kRows],
                                                       float (&row_offset)[kRows]) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const bool left = row_base[r] + float(kMaxColOffset) <= 0.f, right = row_base[r] >= 0.f;
    if (left || right) {
      const float k = left ? slope : -slope;
#pragma unroll
      for (int c = 0; c < size<1>(s_rc); ++c)
        s_rc(r, c) = fmaf(k, float(AccumulatorCoords::col_offset(c)), s_rc(r, c));
      row_offset[r] = k * row_base[r];
    } else {
#pragma unroll
      for (int c = 0; c < size<1>(s_rc); ++c)
        s_rc(r, c) = fmaf(-slope, fabsf(row_base[r] + float(AccumulatorCoords::col_offset(c))), s_rc(r, c));
      row_offset[r] = 0.f;
    }
  }
}

template <jf_score_mod kKind>
struct KernelScoreMod {
  static constexpr bool kNone = kKind == JF_SCORE_MOD_NONE;
  static constexpr bool kSoftcap = kKind == JF_SCORE_MOD_SOFTCAP;
  static constexpr bool kAlibi = kKind == JF_SCORE_MOD_ALIBI;
  static constexpr bool kGeneric = !kNone && !kSoftcap && !kAlibi;
  // The modifier's policy (core/score_mod.hpp); what a generic one evaluates.
  using Policy = typename ScoreModOf<kKind>::type;
  static_assert(!std::is_void_v<Policy>, "a jf_score_mod kind with no modifier in ScoreModTypes");

  // What the kernels read of a modifier besides its two hooks (forward_scores, backward_scores):
  //  kRowOffsets: the forward hook leaves per-row constants in row_offset that the softmax adds
  //    to the row's maximum and exponents (ALiBi's linear form off the diagonal);
  //  kDerivative: dS takes the modifier's derivative, dscore = 1 - t^2 of the modified score t
  //    (softcap: dscore_of_modified, or dscore_of_p where no register keeps t); without it
  //    dS = P (dP - delta);
  //  kElementwise: evaluated element by element from each score's (query, key) coordinates (a
  //    generic modifier's score()), which the forward's uniform-register slicing leaves no room for.
  static constexpr bool kRowOffsets = kAlibi;
  static constexpr bool kDerivative = kSoftcap;
  static constexpr bool kElementwise = kGeneric;

  // The slope of query head h in raw-score units (ALiBi; 0 otherwise): read once per head.
  __device__ static float raw_slope(const ScoreModArgs& a, int32_t head) {
    if constexpr (kAlibi)
      return __ldg(a.alibi_slopes + head) * a.alibi_factor;
    else
      return 0.f;
  }

  // The two hooks take a fragment's place in the sequence as the kernels have it: element (r, c)
  // at row row_pos[r] and column col_pos0 + col_offset(c) (rows, columns: queries, keys forward;
  // keys, queries in the backward's S^T), and its diagonal offset d = j - i - (Lk - Lq) as
  // row_base[r] + col_sign x col_offset(c) (col_sign +1 forward, -1 backward).
  //
  // The forward's hook, on a consumer's fragment of raw scores, before the mask. slope: the head's
  // raw_slope, read once per tile. row_offset: the rows' constants the softmax adds
  // (kRowOffsets), untouched otherwise.
  template <class TensorS, int kRows>
  __device__ __forceinline__ static void forward_scores(TensorS& s_rc, float (&row_offset)[kRows],
                                                        const ScoreModArgs& a, float slope, int32_t head,
                                                        const float (&row_base)[kRows],
                                                        const int32_t (&row_pos)[kRows], int32_t col_pos0,
                                                        int32_t len_q, int32_t len_kv) {
    if constexpr (kAlibi) {
      alibi_with_row_offsets<AccumulatorCoords::col_offset(decltype(size<1>(s_rc))::value - 1)>(
          s_rc, slope, row_base, row_offset);
    } else if constexpr (kGeneric) {
      apply_generic<true>(s_rc, a, head, row_pos, col_pos0, len_q, len_kv);
    } else {
      apply<1>(s_rc, a, slope, row_base);
    }
  }

  // The backward's hook, on a consumer's fragment of raw scores of S^T, before the mask.
  template <class TensorS, int kRows>
  __device__ __forceinline__ static void backward_scores(TensorS& s_rc, const ScoreModArgs& a, int32_t head,
                                                         const float (&row_base)[kRows],
                                                         const int32_t (&row_pos)[kRows], int32_t col_pos0,
                                                         int32_t len_q, int32_t len_kv) {
    if constexpr (kGeneric) {
      // Its dS is P (dP - delta): no derivative (kDerivative).
      static_assert(Policy::kUnitDerivative,
                    "the Hopper backward serves generic modifiers whose dscore is 1");
      apply_generic<false>(s_rc, a, head, row_pos, col_pos0, len_q, len_kv);
    } else {
      // The slope read per block (an L1 hit), not kept across the loop: a register less.
      apply<-1>(s_rc, a, raw_slope(a, head), row_base);
    }
  }

  // dscore of a score the forward or backward hook modified into t (kDerivative).
  __device__ __forceinline__ static float dscore_of_modified(float t) { return fmaf(-t, t, 1.f); }

  // Softcap's dscore = 1 - t^2 of a score whose probability p = exp2(cap log2e t - lse_log2) is
  // known, t recovered from p's exponent (one MUFU.LG2): for a kernel with no registers to keep t
  // from the tanh to dS. t is clamped to [-1, 1]: p = 0 (hidden, or below 2^-126) gives dscore 0,
  // where dS is 0 anyway.
  __device__ static float dscore_of_p(float p, float lse_log2, const ScoreModArgs& a) {
    const float t = fminf(fmaxf((log2_approx(p) + lse_log2) * a.softcap_from_log2, -1.f), 1.f);
    return fmaf(-t, t, 1.f);
  }

  // A generic modifier (kGeneric) on a fragment of raw scores, in place: element (r, c) sits at
  // row row_pos[r] and column col_pos0 + col_offset(c) of the sequence; rows are queries forward
  // (kRowsAreQueries) and keys in the backward's S^T. Padding rows and keys past the sequence get
  // coordinates past it too (the mask hides them afterwards): a modifier's score() must stay in
  // bounds there (core/score_mod.hpp).
  template <bool kRowsAreQueries, class TensorS, int kRows>
  __device__ static void apply_generic(TensorS& s_rc, const ScoreModArgs& a, int32_t head,
                                       const int32_t (&row_pos)[kRows], int32_t col_pos0, int32_t len_q,
                                       int32_t len_kv) {
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int c = 0; c < size<1>(s_rc); ++c) {
        const int32_t col = col_pos0 + AccumulatorCoords::col_offset(c);
        const ScoreCoordsOf<int32_t> at{head, kRowsAreQueries ? row_pos[r] : col,
                                        kRowsAreQueries ? col : row_pos[r], len_q, len_kv};
        s_rc(r, c) = Policy::score(a.values, s_rc(r, c) * a.scale, at) * a.inv_scale;
      }
  }

  // s_rc: (rows, cols) view of raw scores. Diagonal offset of element (r, c):
  //   d(r, c) = row_base[r] + col_sign * AccumulatorCoords::col_offset(c),
  // where the caller puts the sequence coordinates of its fragment into row_base and col_sign
  // (forward: d = j - i - shift with j along the columns, col_sign = +1; backward's S^T: keys
  // along the rows, queries along the columns, col_sign = -1).
  template <int kColSign, class TensorS, int kRows>
  __device__ static void apply(TensorS& s_rc, const ScoreModArgs& a, float slope,
                               const float (&row_base)[kRows]) {
    if constexpr (kSoftcap) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < size<1>(s_rc); ++c) s_rc(r, c) = tanh_approx(s_rc(r, c) * a.softcap_prescale);
    } else if constexpr (kAlibi) {
#pragma unroll
      for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int c = 0; c < size<1>(s_rc); ++c)
          s_rc(r, c) = fmaf(-slope, fabsf(row_base[r] + float(kColSign * AccumulatorCoords::col_offset(c))),
                            s_rc(r, c));
    }
    (void)s_rc;
    (void)a;
    (void)slope;
    (void)row_base;
  }
};

// The host's side: the modifier's values for a launch with softmax scale `scale`, and the factors
// the exponent and (forward) the lse take instead of the scale's.
struct ScoreModLaunch {
  ScoreModArgs args;
  float exp_factor;  // multiplies the fragment's values in exp2: log2 e x (scale, or cap with softcap)
  float lse_factor;  // multiplies the row maximum in the lse: scale, or cap with softcap
};
inline ScoreModLaunch score_mod_launch(const jf_problem& pb, float scale) {
  ScoreModLaunch l{};
  constexpr float kLog2e = 1.4426950408889634f;
  l.exp_factor = scale * kLog2e;
  l.lse_factor = scale;
  if (pb.score_mod == JF_SCORE_MOD_SOFTCAP) {
    l.args.softcap_prescale = scale / pb.softcap;
    l.args.softcap_from_log2 = 1.f / (pb.softcap * kLog2e);
    l.exp_factor = pb.softcap * kLog2e;
    l.lse_factor = pb.softcap;
  } else if (pb.score_mod == JF_SCORE_MOD_ALIBI) {
    l.args.alibi_factor = 1.f / scale;
    l.args.alibi_slopes = pb.alibi_slopes;
  } else if (pb.score_mod != JF_SCORE_MOD_NONE) {
    l.args.values = ScoreModValues::of(pb);
    l.args.scale = scale;
    l.args.inv_scale = 1.f / scale;
  }
  return l;
}

}  // namespace jagflash::kernels::common
