// The score modifier as a small policy object, as the mask is one (core/mask.hpp): every layer that
// forms scores asks it for the modified score and, where the backward forms dS, for the
// derivative of that score with respect to the scaled score.
//
// Conventions (FlashAttention-2's, flash_attn_interface.py):
//  - The scale applies first: s = scale * q_i . k_j. The modifier maps s to the score the softmax
//    sees; the lse is that of the modified scores.
//  - Positions are bottom-right aligned, as the masks are: for query i and key j of a sequence of
//    lengths (Lq, Lk), the relative position is r = j - i - (Lk - Lq), 0 on the causal diagonal.
// The modifier changes scores only; which pairs are visible is the mask's business alone.
//
// A modifier is one struct below: its kind (jf_score_mod), its name (the C API's and Python's),
// which of jf_problem's modifier fields it reads, a host check of their values, score() and
// dscore(). ScoreModTypes lists them; everything else (validation, the CPU reference, the GPU
// oracle, the dispatcher, the Hopper kernels' per-score path in kernels/common/score_mod.cuh) is
// written once over that list. A modifier whose dscore is 1 (a bias) runs on the Hopper backward
// as it is; one that reshapes the score (softcap) needs the backward to keep what dscore reads.
#pragma once

#include "core/mask.hpp"

#include <jagflash/jagflash.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

namespace jagflash {

// Where a score sits: query head, query row i and key j within the sequence, and the sequence's
// lengths. I: int64_t on the CPU, int32_t in the kernels (a sequence's rows fit int32: offsets do).
template <class I>
struct ScoreCoordsOf {
  int32_t head;
  I i;
  I j;
  I lq;
  I lk;
  // j - i - (Lk - Lq), summed so that no intermediate leaves I's range.
  JF_HD I relative() const { return (j - lk) + (lq - i); }
};
using ScoreCoords = ScoreCoordsOf<int64_t>;

// jf_problem's modifier fields, as the CPU reads them and a kernel's parameters carry them.
struct ScoreModValues {
  float softcap = 0.0f;
  const float* alibi_slopes = nullptr;  // [H]
  const float* table = nullptr;         // [H][table_width]
  int32_t table_width = 0;

  JF_HD static ScoreModValues of(const jf_problem& p) {
    ScoreModValues v;
    v.softcap = p.softcap;
    v.alibi_slopes = p.alibi_slopes;
    v.table = p.score_mod_table;
    v.table_width = p.score_mod_table_width;
    return v;
  }
};

// The fields a modifier reads (ScoreModField bits): the others must be left unset, so a value
// given by mistake is never silently ignored.
enum ScoreModField : unsigned { kSoftcapField = 1u, kAlibiSlopesField = 2u, kTableField = 4u };

// What a modifier's host check found wrong: the argument and what it should be (nullptr: fine).
struct ScoreModCheck {
  const char* argument = nullptr;
  const char* expected = nullptr;
};

namespace score_mods {

JF_HD double tanh_of(double x) { return ::tanh(x); }
JF_HD float tanh_of(float x) { return ::tanhf(x); }

// score = s, dscore = 1.
struct None {
  static constexpr jf_score_mod kKind = JF_SCORE_MOD_NONE;
  static constexpr const char* kName = "none";
  static constexpr unsigned kFields = 0;
  static constexpr bool kUnitDerivative = true;
  static ScoreModCheck check(const jf_problem&) { return {}; }
  template <class F, class C>
  JF_HD static F score(const ScoreModValues&, F s, const C&) {
    return s;
  }
  template <class F, class C>
  JF_HD static F dscore(const ScoreModValues&, F, const C&) {
    return F(1);
  }
};

// Tanh softcap (Gemma 2, Grok): score = cap * tanh(s / cap), dscore = 1 - tanh^2(s / cap).
struct Softcap {
  static constexpr jf_score_mod kKind = JF_SCORE_MOD_SOFTCAP;
  static constexpr const char* kName = "softcap";
  static constexpr unsigned kFields = kSoftcapField;
  static constexpr bool kUnitDerivative = false;
  static ScoreModCheck check(const jf_problem& p) {
    if (!std::isfinite(p.softcap) || p.softcap <= 0.0f)
      return {"problem.softcap", "a finite number > 0 with JF_SCORE_MOD_SOFTCAP"};
    return {};
  }
  template <class F, class C>
  JF_HD static F score(const ScoreModValues& v, F s, const C&) {
    const F cap = static_cast<F>(v.softcap);
    return cap * tanh_of(s / cap);
  }
  template <class F, class C>
  JF_HD static F dscore(const ScoreModValues& v, F s, const C&) {
    const F t = tanh_of(s / static_cast<F>(v.softcap));
    return F(1) - t * t;
  }
};

// ALiBi (BLOOM, MPT), one slope per query head h: score = s - slope_h * |r| (FA2 documents
// "-alibi_slope * |i + seqlen_k - seqlen_q - j|"; under a causal mask only r <= 0 is visible),
// dscore = 1.
struct Alibi {
  static constexpr jf_score_mod kKind = JF_SCORE_MOD_ALIBI;
  static constexpr const char* kName = "alibi";
  static constexpr unsigned kFields = kAlibiSlopesField;
  static constexpr bool kUnitDerivative = true;
  static ScoreModCheck check(const jf_problem& p) {
    if (p.alibi_slopes == nullptr)
      return {"problem.alibi_slopes", "a non-null pointer to H float32 with JF_SCORE_MOD_ALIBI"};
    return {};
  }
  template <class F, class C>
  JF_HD static F score(const ScoreModValues& v, F s, const C& c) {
    const auto r = c.relative();
    return s - static_cast<F>(v.alibi_slopes[c.head]) * static_cast<F>(r < 0 ? -r : r);
  }
  template <class F, class C>
  JF_HD static F dscore(const ScoreModValues&, F, const C&) {
    return F(1);
  }
};

// A relative-position bias by bucket (T5, HSTU): score = s + table[h][r' + R] for query head h,
// with the relative position r clipped to r' in [-R, R] and the table [H][2R + 1]
// (problem.score_mod_table, problem.score_mod_table_width = 2R + 1): one learned bias per head and
// clipped distance (Shaw et al.'s clipping). T5's logarithmic buckets are this table with each
// distance's entry copied from its bucket's (max_distance = R); a one-sided (causal) bias leaves
// the r > 0 half unused. dscore = 1. Past the sequence (padding rows and keys) r is clipped as
// any other, so the table is never read out of bounds.
struct RelativeBias {
  static constexpr jf_score_mod kKind = JF_SCORE_MOD_RELATIVE_BIAS;
  static constexpr const char* kName = "relative_bias";
  static constexpr unsigned kFields = kTableField;
  static constexpr bool kUnitDerivative = true;
  static ScoreModCheck check(const jf_problem& p) {
    if (p.score_mod_table_width % 2 != 1)
      return {"problem.score_mod_table_width",
              "an odd width 2R + 1 (relative positions -R..R) with JF_SCORE_MOD_RELATIVE_BIAS"};
    return {};
  }
  template <class F, class C>
  JF_HD static F score(const ScoreModValues& v, F s, const C& c) {
    const auto reach = static_cast<decltype(c.relative())>(v.table_width / 2);
    const auto r = c.relative();
    const auto clipped = r < -reach ? -reach : (r > reach ? reach : r);
    return s + static_cast<F>(v.table[static_cast<int64_t>(c.head) * v.table_width + (clipped + reach)]);
  }
  template <class F, class C>
  JF_HD static F dscore(const ScoreModValues&, F, const C&) {
    return F(1);
  }
};

}  // namespace score_mods

// Every modifier, in jf_score_mod's order. A new one: its struct above, its enum value in
// jagflash.h, its name here, and its kernels' line in CMakeLists.txt.
template <class... Mods>
struct ScoreModList {
  // f(Mod{}) for the modifier of `kind`, or f(score_mods::None{}) for an unknown kind (validation
  // refuses those before anything evaluates a modifier). Host code.
  template <class Fn>
  static std::invoke_result_t<Fn&, score_mods::None> visit(jf_score_mod kind, Fn&& f) {
    using R = std::invoke_result_t<Fn&, score_mods::None>;
    return visit_from<R, Fn, Mods...>(kind, f);
  }
  // f(Mod{}) for each modifier in turn (host code: names, validation).
  template <class Fn>
  static void for_each(Fn&& f) {
    (f(Mods{}), ...);
  }
  static constexpr bool contains(jf_score_mod kind) { return ((Mods::kKind == kind) || ...); }

  // The score and dscore of the modifier of `kind` (host and device: the reference, the oracle).
  template <class F, class C>
  JF_HD static F score(jf_score_mod kind, const ScoreModValues& v, F s, const C& c) {
    return score_from<F, C, Mods...>(kind, v, s, c);
  }
  template <class F, class C>
  JF_HD static F dscore(jf_score_mod kind, const ScoreModValues& v, F s, const C& c) {
    return dscore_from<F, C, Mods...>(kind, v, s, c);
  }

 private:
  template <class R, class Fn, class First, class... Rest>
  static R visit_from(jf_score_mod kind, Fn& f) {
    if (kind == First::kKind) return f(First{});
    if constexpr (sizeof...(Rest) == 0)
      return f(score_mods::None{});
    else
      return visit_from<R, Fn, Rest...>(kind, f);
  }
  template <class F, class C, class First, class... Rest>
  JF_HD static F score_from(jf_score_mod kind, const ScoreModValues& v, F s, const C& c) {
    if (kind == First::kKind) return First::score(v, s, c);
    if constexpr (sizeof...(Rest) == 0)
      return s;
    else
      return score_from<F, C, Rest...>(kind, v, s, c);
  }
  template <class F, class C, class First, class... Rest>
  JF_HD static F dscore_from(jf_score_mod kind, const ScoreModValues& v, F s, const C& c) {
    if (kind == First::kKind) return First::dscore(v, s, c);
    if constexpr (sizeof...(Rest) == 0)
      return F(1);
    else
      return dscore_from<F, C, Rest...>(kind, v, s, c);
  }
};
using ScoreModTypes =
    ScoreModList<score_mods::None, score_mods::Softcap, score_mods::Alibi, score_mods::RelativeBias>;

// The modifier of a compile-time kind (the Hopper kernels' template argument).
template <jf_score_mod kKind, class List = ScoreModTypes>
struct ScoreModOf;
template <jf_score_mod kKind, class First, class... Rest>
struct ScoreModOf<kKind, ScoreModList<First, Rest...>> {
  using type = typename std::conditional_t<First::kKind == kKind, First,
                                           typename ScoreModOf<kKind, ScoreModList<Rest...>>::type>;
};
template <jf_score_mod kKind>
struct ScoreModOf<kKind, ScoreModList<>> {
  using type = void;
};

// The modifier a call names, chosen at run time: what the CPU reference and the oracle evaluate
// (the branch is the same for every pair of a call).
struct ScoreMod {
  jf_score_mod kind = JF_SCORE_MOD_NONE;
  ScoreModValues values;

  JF_HD static ScoreMod from(const jf_problem& p) {
    ScoreMod m;
    m.kind = p.score_mod;
    m.values = ScoreModValues::of(p);
    return m;
  }

  JF_HD bool is_none() const { return kind == JF_SCORE_MOD_NONE; }

  // The modified score of the scaled score s.
  template <typename F, class C>
  JF_HD F score(F s, const C& c) const {
    return ScoreModTypes::score(kind, values, s, c);
  }

  // d score / d s at the scaled score s: the factor dS takes (dS = P (dP - delta) * dscore).
  template <typename F, class C>
  JF_HD F dscore(F s, const C& c) const {
    return ScoreModTypes::dscore(kind, values, s, c);
  }
};

// A modifier's name (jf_score_mod's kName), "" for an unknown kind; and the kind of a name, or -1.
inline const char* score_mod_name(jf_score_mod kind) {
  bool known = false;
  const char* name = ScoreModTypes::visit(kind, [&](auto mod) {
    known = decltype(mod)::kKind == kind;
    return decltype(mod)::kName;
  });
  return known ? name : "";
}

}  // namespace jagflash
