// GPU tests of the score modifiers (tanh softcap, ALiBi) on the Hopper kernels: forward (out, lse)
// and backward (dq, dk, dv) against the CPU float64 reference, which evaluates the same policy
// (core/score_mod.hpp), on awkward batches (lengths 0 and 1, q != kv, GQA, causal and windows,
// fp16 and bf16, D = 64, 128 and 256); AUTO picks the Hopper kernels for them; the
// modifier is really applied (the result moves away from the unmodified one); bitwise repeats
// in the deterministic mode; bad modifier arguments refused with nothing written.
#include "core/dtype.hpp"
#include "gpu_call_checks.hpp"
#include "hopper_served.hpp"
#include "testing/gpu_batch.hpp"

#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace jagflash {
namespace {

using testing::BatchSpec;
using testing::DeviceBuffer;
using testing::GpuBatch;

std::string label(const BatchSpec& s) {
  const std::string mod = s.score_mod == JF_SCORE_MOD_SOFTCAP ? "softcap(" + std::to_string(s.softcap) + ")"
                          : s.score_mod == JF_SCORE_MOD_ALIBI ? std::string("alibi")
                                                              : std::string("none");
  return mod + " mask=" + std::to_string(s.mask) + " " + dtype_name(s.dtype) +
         " D=" + std::to_string(s.head_dim) + " H=" + std::to_string(s.heads) + "/" +
         std::to_string(s.heads_kv) + " seed=" + std::to_string(s.seed);
}

// ALiBi's usual slopes (2^(-8 (h + 1) / H)), times `gain`.
std::vector<float> alibi_slopes(int heads, float gain = 1.f) {
  std::vector<float> s(heads);
  for (int h = 0; h < heads; ++h) s[h] = gain * std::exp2(-8.f * float(h + 1) / float(heads));
  return s;
}

// testing::run_and_check with this file's label of the case.
void run_and_check(testing::HopperCases& cases, const BatchSpec& s, bool with_backward,
                   int deterministic = 0) {
  testing::run_and_check(cases, s, label(s), with_backward, deterministic);
}

// The awkward batch; tests of the softcap widen the inputs' range so the scaled scores reach past
// the cap (with U(-1, 1) inputs they stay below 1).
BatchSpec awkward(int head_dim, jf_dtype dtype, jf_mask mask, uint64_t seed) {
  return testing::awkward_batch(head_dim, dtype, mask, seed);
}

TEST(GpuScoreMod, SoftcapAgainstReference) {
  testing::HopperCases cases;
  uint64_t seed = 10;
  for (int d : {64, 128})
    for (jf_dtype dt : {JF_BF16, JF_FP16})
      for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW})
        for (float cap : {5.f, 30.f}) {
          BatchSpec s = awkward(d, dt, mask, ++seed);
          s.score_mod = JF_SCORE_MOD_SOFTCAP;
          s.softcap = cap;
          s.input_range = cap < 10.f ? 2.5f : 5.f;
          run_and_check(cases, s, /*with_backward=*/true);
        }
  JF_REPORT_UNSERVED(cases);
}

TEST(GpuScoreMod, AlibiAgainstReference) {
  testing::HopperCases cases;
  uint64_t seed = 40;
  for (int d : {64, 128})
    for (jf_dtype dt : {JF_BF16, JF_FP16})
      for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW})
        for (float gain : {1.f, 8.f}) {
          BatchSpec s = awkward(d, dt, mask, ++seed);
          s.score_mod = JF_SCORE_MOD_ALIBI;
          s.alibi_slopes = alibi_slopes(s.heads, gain);
          run_and_check(cases, s, /*with_backward=*/true);
        }
  JF_REPORT_UNSERVED(cases);
}

// Small enough for compute-sanitizer (scripts/gpu-check.sh SANITIZE=1): each modifier, both head
// dims, forward and backward, causal, the awkward lengths.
TEST(GpuScoreMod, SmallCaseForSanitizers) {
  testing::HopperCases cases;
  for (jf_score_mod mod : {JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI})
    for (int d : {64, 128}) {
      BatchSpec s = awkward(d, JF_BF16, JF_MASK_CAUSAL, 60 + d + mod);
      s.len_q = {1, 65, 0, 130};
      s.len_kv = {2, 63, 5, 130};
      s.score_mod = mod;
      s.softcap = mod == JF_SCORE_MOD_SOFTCAP ? 5.f : 0.f;
      s.input_range = 2.f;
      if (mod == JF_SCORE_MOD_ALIBI) s.alibi_slopes = alibi_slopes(s.heads, 2.f);
      run_and_check(cases, s, /*with_backward=*/true);
    }
  JF_REPORT_UNSERVED(cases);
}

// D = 256: both directions on the Hopper kernels (the backward on the wide kernel).
TEST(GpuScoreMod, HeadDim256AgainstReference) {
  testing::HopperCases cases;
  for (jf_score_mod mod : {JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI})
    for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL}) {
      BatchSpec s = awkward(256, JF_BF16, mask, 70 + mod * 2 + mask);
      s.score_mod = mod;
      s.softcap = mod == JF_SCORE_MOD_SOFTCAP ? 5.f : 0.f;
      s.input_range = 2.f;
      if (mod == JF_SCORE_MOD_ALIBI) s.alibi_slopes = alibi_slopes(s.heads, 4.f);
      run_and_check(cases, s, /*with_backward=*/true);
    }
  JF_REPORT_UNSERVED(cases);
}

// A longer batch (several KV blocks, the forward's mask-free bulk, the backward's full blocks and
// several Q blocks a tile) in both backward modes.
TEST(GpuScoreMod, LongerSequencesBothModes) {
  testing::HopperCases cases;
  for (jf_score_mod mod : {JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI})
    for (int det : {0, 1}) {
      BatchSpec s;
      s.len_q = {1000, 700, 1};
      s.len_kv = {1000, 1500, 3};
      s.heads = 4;
      s.heads_kv = 4;
      s.head_dim = 128;
      s.mask = JF_MASK_CAUSAL;
      s.seed = 90 + mod * 2 + det;
      s.score_mod = mod;
      s.softcap = 10.f;
      s.input_range = mod == JF_SCORE_MOD_SOFTCAP ? 3.f : 1.f;
      if (mod == JF_SCORE_MOD_SOFTCAP) s.alibi_slopes.clear();
      if (mod == JF_SCORE_MOD_ALIBI) {
        s.softcap = 0.f;
        s.alibi_slopes = alibi_slopes(s.heads, 0.25f);  // slopes small enough to see far keys
      }
      run_and_check(cases, s, /*with_backward=*/true, det);
    }
  JF_REPORT_UNSERVED(cases);
}

// The modifier is applied: out moves away from the unmodified call's by far more than rounding.
TEST(GpuScoreMod, ChangesTheResult) {
  for (jf_score_mod mod : {JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI}) {
    BatchSpec plain = awkward(128, JF_BF16, JF_MASK_NONE, 99);
    plain.input_range = 2.5f;
    BatchSpec modified = plain;
    modified.score_mod = mod;
    modified.softcap = mod == JF_SCORE_MOD_SOFTCAP ? 2.f : 0.f;
    if (mod == JF_SCORE_MOD_ALIBI) modified.alibi_slopes = alibi_slopes(plain.heads, 4.f);
    GpuBatch a = testing::make_gpu_batch(plain), b = testing::make_gpu_batch(modified);
    const jf_fwd_args fa = a.forward_args(JF_BACKEND_AUTO), fb = b.forward_args(JF_BACKEND_AUTO);
    ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
    ASSERT_EQ(jagflash_fwd(&fb), JF_OK) << jagflash_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_GT(testing::device_rel_error(b.out.get(), a.out.get(), a.out_view, JF_BF16), 0.1)
        << label(modified);
  }
}

// Deterministic mode: dq, dk, dv bitwise identical over repeats.
TEST(GpuScoreMod, DeterministicRepeatsAreBitwiseIdentical) {
  testing::HopperCases cases;
  for (jf_score_mod mod : {JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI})
    for (int d : {64, 128}) {
      BatchSpec s = awkward(d, JF_BF16, JF_MASK_CAUSAL, 120 + d + mod);
      s.len_q = {300, 17, 513};
      s.len_kv = {300, 40, 513};
      s.score_mod = mod;
      s.softcap = mod == JF_SCORE_MOD_SOFTCAP ? 8.f : 0.f;
      s.input_range = 2.f;
      if (mod == JF_SCORE_MOD_ALIBI) s.alibi_slopes = alibi_slopes(s.heads);
      SCOPED_TRACE(label(s));
      if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/true)) continue;
      GpuBatch g = testing::make_gpu_batch(s);
      testing::expect_deterministic_backward_repeats(g, 20);
      if (HasFatalFailure()) return;
    }
  JF_REPORT_UNSERVED(cases);
}

// Bad modifier arguments on a CUDA call: refused naming the field, out and lse untouched.
TEST(GpuScoreMod, BadArgumentsRefusedWritingNothing) {
  BatchSpec s = awkward(128, JF_BF16, JF_MASK_NONE, 150);
  GpuBatch g = testing::make_gpu_batch(s);  // outputs poisoned with NaN
  std::vector<unsigned char> before(g.out.bytes());
  g.out.to_host(before.data());
  const std::vector<float> host_slopes = alibi_slopes(s.heads);
  struct Case {
    const char* what;
    jf_score_mod mod;
    float cap;
    const float* slopes;
    const char* field;
  } cases[] = {
      {"negative cap", JF_SCORE_MOD_SOFTCAP, -1.f, nullptr, "problem.softcap"},
      {"infinite cap", JF_SCORE_MOD_SOFTCAP, INFINITY, nullptr, "problem.softcap"},
      {"slopes on the host", JF_SCORE_MOD_ALIBI, 0.f, host_slopes.data(), "problem.alibi_slopes"},
      {"no slopes", JF_SCORE_MOD_ALIBI, 0.f, nullptr, "problem.alibi_slopes"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
    fa.problem.score_mod = c.mod;
    fa.problem.softcap = c.cap;
    fa.problem.alibi_slopes = c.slopes;
    EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(jagflash_last_error()).find(c.field), std::string::npos) << jagflash_last_error();
    jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
    ba.problem = fa.problem;
    EXPECT_EQ(jagflash_bwd(&ba), JF_ERR_INVALID_ARGUMENT);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<unsigned char> after(g.out.bytes());
  g.out.to_host(after.data());
  EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size()), 0) << "out was written";
}

}  // namespace
}  // namespace jagflash
