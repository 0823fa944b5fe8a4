// What this build's Hopper kernels serve, for the GPU tests: a trimmed build (JAGFLASH_HOPPER_DTYPES=bf16,
// fewer head dims) has no kernel for some of their cases, and a test that called it anyway would fail
// with "as instantiated in this build". Each test asks the registry (the dispatcher's own lookup) and
// skips, with the reason, the cases the build does not serve, so the rest pass or fail for real.
//
// A test with one case: JF_SKIP_UNLESS_HOPPER_SERVES(call, with_backward). A test over many cases keeps
// a HopperCases, asks it per case (`if (!cases.serve(call, true)) continue;`) and ends with
// JF_REPORT_UNSERVED(cases): skipped when the build serves none of them, else the skipped cases
// printed beside the result of the ones that ran.
#pragma once

#include "core/dtype.hpp"
#include "kernels/hopper_backward.hpp"
#include "kernels/hopper_forward.hpp"
#include "oracle/oracle.hpp"
#include "testing/gpu_batch.hpp"

#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

namespace jagflash::testing {

// The registry's key of a call: what decides whether a kernel exists for it.
struct HopperCall {
  jf_dtype dtype = JF_BF16;
  int head_dim = 128;
  int v_head_dim = 0;  // 0: head_dim
  jf_score_mod score_mod = JF_SCORE_MOD_NONE;
  bool block_sparse = false;

  static HopperCall of(const BatchSpec& s) {
    return {s.dtype, s.head_dim, s.v_head_dim, s.score_mod, s.block_mask};
  }
};

// Whether a kernel serves the call in that direction: the registry's tables, or a host test's.
using HopperServes = bool (*)(jf_direction, const HopperCall&);

inline bool registry_serves(jf_direction direction, const HopperCall& c) {
  return direction == JF_DIRECTION_FORWARD
             ? kernels::find_hopper_forward(c.dtype, c.head_dim, c.score_mod, c.block_sparse, c.v_head_dim) !=
                   nullptr
             : kernels::find_hopper_backward(c.dtype, c.head_dim, c.score_mod, c.block_sparse,
                                             c.v_head_dim) != nullptr;
}

// The head dim of the kernel that serves the call in that direction; 0: none.
inline int registry_kernel_head_dim(jf_direction direction, const HopperCall& c) {
  if (direction == JF_DIRECTION_FORWARD) {
    const auto* e =
        kernels::find_hopper_forward(c.dtype, c.head_dim, c.score_mod, c.block_sparse, c.v_head_dim);
    return e != nullptr ? e->head_dim : 0;
  }
  const auto* e =
      kernels::find_hopper_backward(c.dtype, c.head_dim, c.score_mod, c.block_sparse, c.v_head_dim);
  return e != nullptr ? e->head_dim : 0;
}

inline std::string describe(const HopperCall& c) {
  std::string s = std::string(dtype_name(c.dtype)) + "/" + std::to_string(c.head_dim);
  if (c.v_head_dim != 0 && c.v_head_dim != c.head_dim) s += " (v " + std::to_string(c.v_head_dim) + ")";
  if (c.score_mod == JF_SCORE_MOD_SOFTCAP) s += " softcap";
  if (c.score_mod == JF_SCORE_MOD_ALIBI) s += " alibi";
  if (c.score_mod == JF_SCORE_MOD_RELATIVE_BIAS) s += " relative bias";
  if (c.block_sparse) s += " block mask";
  return s;
}

// Empty when `serves` has the call in each direction asked for; else why not.
inline std::string hopper_unserved(const HopperCall& c, bool forward, bool backward,
                                   HopperServes serves = registry_serves) {
  const bool no_forward = forward && !serves(JF_DIRECTION_FORWARD, c);
  const bool no_backward = backward && !serves(JF_DIRECTION_BACKWARD, c);
  if (!no_forward && !no_backward) return "";
  const char* which = no_forward && no_backward ? "forward and backward"
                      : no_forward              ? "forward"
                                                : "backward";
  return describe(c) + ": this build instantiates no Hopper " + which +
         " for it (JAGFLASH_HOPPER_DTYPES, JAGFLASH_HEAD_DIMS, JAGFLASH_FORWARD_HEAD_DIMS, "
         "JAGFLASH_BACKWARD_HEAD_DIMS)";
}

// Empty when the build's GPU oracle has (dtype, head dim) (oracle::find: a trimmed build
// instantiates it for JAGFLASH_HEAD_DIMS only); else why not.
inline std::string oracle_unserved(jf_dtype dtype, int head_dim) {
  if (oracle::find(dtype, head_dim) != nullptr) return "";
  return std::string(dtype_name(dtype)) + "/" + std::to_string(head_dim) +
         ": this build instantiates no GPU oracle for it (JAGFLASH_HOPPER_DTYPES, JAGFLASH_HEAD_DIMS)";
}

// The cases of one test: those served run, the others are kept with their reason.
class HopperCases {
 public:
  explicit HopperCases(HopperServes serves = registry_serves) : serves_(serves) {}

  // True when the build serves the call (forward, and with_backward the backward); else false,
  // the case noted as skipped.
  bool serve(const HopperCall& c, bool with_backward) {
    return note(hopper_unserved(c, true, with_backward, serves_));
  }
  // The same for one direction.
  bool serve_in(jf_direction direction, const HopperCall& c) {
    return note(
        hopper_unserved(c, direction == JF_DIRECTION_FORWARD, direction == JF_DIRECTION_BACKWARD, serves_));
  }
  // A case skipped for a reason of the test's own.
  void skip(const std::string& why) { note(why); }
  // True when the build's GPU oracle has (dtype, head dim); else false, the case noted as skipped.
  bool oracle_has(jf_dtype dtype, int head_dim) { return note(oracle_unserved(dtype, head_dim)); }
  int ran() const { return ran_; }
  bool any_skipped() const { return !skipped_.empty(); }
  std::string summary() const {
    std::string s = "not run, " + std::to_string(skipped_.size()) + " kind(s) of case:";
    for (const std::string& why : skipped_) s += "\n  " + why;
    return s;
  }

 private:
  bool note(const std::string& why) {
    if (why.empty()) {
      ++ran_;
      return true;
    }
    for (const std::string& s : skipped_)
      if (s == why) return false;  // one line per distinct reason
    skipped_.push_back(why);
    return false;
  }

  HopperServes serves_;
  int ran_ = 0;
  std::vector<std::string> skipped_;
};

}  // namespace jagflash::testing

// In a test body: skips it, with the reason, unless the build serves `call`.
#define JF_SKIP_UNLESS_HOPPER_SERVES(call, with_backward)                                                 \
  do {                                                                                                    \
    const std::string jf_unserved_ = ::jagflash::testing::hopper_unserved((call), true, (with_backward)); \
    if (!jf_unserved_.empty()) GTEST_SKIP() << jf_unserved_;                                              \
  } while (0)

// At the end of a test body over `cases`: skipped when none ran; else the skipped ones printed and
// kept as the test's "unserved" property (in the XML report).
#define JF_REPORT_UNSERVED(cases)                                                       \
  do {                                                                                  \
    if ((cases).ran() == 0 && (cases).any_skipped()) GTEST_SKIP() << (cases).summary(); \
    if ((cases).any_skipped()) {                                                        \
      std::printf("[ PARTIAL  ] %s\n", (cases).summary().c_str());                      \
      ::testing::Test::RecordProperty("unserved", (cases).summary());                   \
    }                                                                                   \
  } while (0)
