// The score modifier as a small policy object, as the mask is one (core/mask.hpp): every layer that
// forms scores asks it for the modified score and, where the backward forms dS, for the
// derivative of that score with respect to the scaled score.
//
// Conventions (FlashAttention-2's, flash_attn_interface.py):
//  - The scale applies first: s = scale * q_i . k_j. The modifier maps s to the score the softmax
//    sees; the lse is that of the modified scores.
//  - Softcap (cap > 0): score = cap * tanh(s / cap); dscore = 1 - tanh^2(s / cap).
//  - ALiBi (one slope per query head h): score = s - slope_h * |i + Lk - Lq - j| for query i and
//    key j of one sequence, bottom-right aligned as the masks are (shift = Lk - Lq): the bias is 0
//    on the causal diagonal j = i + shift and negative on both sides of it (FA2 documents
//    "-alibi_slope * |i + seqlen_k - seqlen_q - j|"; under a causal mask only the left side is
//    visible, where it is slope_h * (j - i - shift)); dscore = 1.
//  - None: score = s, dscore = 1.
// The modifier changes scores only; which pairs are visible is the mask's business alone.
#pragma once

#include "core/mask.hpp"

#include <jagflash/jagflash.h>

#include <cmath>
#include <cstdint>

namespace jagflash {

// Where a score sits: query head, query row i and key j within the sequence, and the sequence's
// lengths (for the bottom-right alignment).
struct ScoreCoords {
  int32_t head;
  int64_t i;
  int64_t j;
  int64_t lq;
  int64_t lk;
};

struct ScoreMod {
  jf_score_mod kind = JF_SCORE_MOD_NONE;
  float softcap = 0.0f;
  const float* alibi_slopes = nullptr;  // [H], readable where the caller evaluates the policy

  JF_HD static ScoreMod from(const jf_problem& p) {
    ScoreMod m;
    m.kind = p.score_mod;
    m.softcap = p.softcap;
    m.alibi_slopes = p.alibi_slopes;
    return m;
  }

  JF_HD bool is_none() const { return kind == JF_SCORE_MOD_NONE; }

  // The modified score of the scaled score s.
  template <typename F>
  JF_HD F score(F s, const ScoreCoords& c) const {
    if (kind == JF_SCORE_MOD_SOFTCAP) {
      const F cap = static_cast<F>(softcap);
      return cap * tanh_of(s / cap);
    }
    if (kind == JF_SCORE_MOD_ALIBI) return s + static_cast<F>(alibi_slopes[c.head]) * alibi_distance<F>(c);
    return s;
  }

  // d score / d s at the scaled score s: the factor dS takes (dS = P (dP - delta) * dscore).
  template <typename F>
  JF_HD F dscore(F s, const ScoreCoords& c) const {
    (void)c;
    if (kind == JF_SCORE_MOD_SOFTCAP) {
      const F t = tanh_of(s / static_cast<F>(softcap));
      return F(1) - t * t;
    }
    return F(1);
  }

 private:
  // -|i + shift - j|: 0 on the diagonal, negative off it.
  template <typename F>
  JF_HD static F alibi_distance(const ScoreCoords& c) {
    const int64_t d = c.j - c.i - (c.lk - c.lq);
    return static_cast<F>(d < 0 ? d : -d);
  }

  JF_HD static double tanh_of(double x) { return ::tanh(x); }
  JF_HD static float tanh_of(float x) { return ::tanhf(x); }
};

}  // namespace jagflash
