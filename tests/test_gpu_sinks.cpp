// GPU tests of learnable sinks (jf_problem::learnable_sink): forward (out, lse) and backward (dq,
// dk, dv and d sink) on the Hopper kernels and the oracle against the CPU float64 reference, on
// the awkward batches (lengths 0 and 1: rows that see no key get out = 0, lse = the sink; q != kv;
// GQA), every mask, both dtypes, the head dims of the narrow and the wide kernels, with a softcap
// or ALiBi beside them and gpt-oss's shape (64 query / 8 KV heads, D = 64, a 128-token causal
// window); d sink bitwise repeatable in both modes; sinks change the result; bad sink arguments
// refused with nothing written.
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
using testing::GpuBatch;

// Sinks from far below the scores to above them (U(-1, 1) inputs give scaled scores within about
// one unit of 0), so the sink's share of a row runs from nothing to most of it.
std::vector<float> sinks_for(int heads) {
  const float pattern[] = {-6.f, 0.f, 1.5f, 4.f};
  std::vector<float> s(heads);
  for (int h = 0; h < heads; ++h) s[h] = pattern[h % 4] + 0.1f * float(h / 4);
  return s;
}

std::string label(const BatchSpec& s) {
  return std::string(dtype_name(s.dtype)) + " D=" + std::to_string(s.head_dim) +
         " mask=" + std::to_string(s.mask) + " mod=" + std::to_string(s.score_mod) +
         " H=" + std::to_string(s.heads) + "/" + std::to_string(s.heads_kv) +
         " seed=" + std::to_string(s.seed);
}

BatchSpec sink_batch(int head_dim, jf_dtype dtype, jf_mask mask, uint64_t seed) {
  BatchSpec s = testing::awkward_batch(head_dim, dtype, mask, seed);
  s.learnable_sink = sinks_for(s.heads);
  return s;
}

// testing::run_and_check with this file's label of the case.
void run_and_check(testing::HopperCases& cases, const BatchSpec& s, bool with_backward,
                   int deterministic = 0) {
  testing::run_and_check(cases, s, label(s), with_backward, deterministic);
}

TEST(GpuSinks, AgainstReferenceEveryMask) {
  testing::HopperCases cases;
  uint64_t seed = 200;
  for (int d : {64, 96, 128})
    for (jf_dtype dt : {JF_BF16, JF_FP16})
      for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW})
        for (int det : {0, 1})
          run_and_check(cases, sink_batch(d, dt, mask, ++seed), /*with_backward=*/true, det);
  JF_REPORT_UNSERVED(cases);
}

// The wide kernels (192, 256) and a v head dim of its own (DeepSeek's 192 / 128).
TEST(GpuSinks, WideHeadDimsAgainstReference) {
  testing::HopperCases cases;
  uint64_t seed = 260;
  for (int d : {192, 256})
    for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL})
      run_and_check(cases, sink_batch(d, JF_BF16, mask, ++seed), true);
  BatchSpec mla = sink_batch(192, JF_BF16, JF_MASK_CAUSAL, ++seed);
  mla.v_head_dim = 128;
  run_and_check(cases, mla, true);
  JF_REPORT_UNSERVED(cases);
}

// With the score modifiers: the sink is not modified, the scores are.
TEST(GpuSinks, WithSoftcapAndAlibi) {
  testing::HopperCases cases;
  uint64_t seed = 280;
  for (int d : {64, 128})
    for (jf_mask mask : {JF_MASK_CAUSAL, JF_MASK_WINDOW}) {
      BatchSpec cap = sink_batch(d, JF_BF16, mask, ++seed);
      cap.score_mod = JF_SCORE_MOD_SOFTCAP;
      cap.softcap = 5.f;
      cap.input_range = 2.f;
      run_and_check(cases, cap, true);
      BatchSpec alibi = sink_batch(d, JF_BF16, mask, ++seed);
      alibi.score_mod = JF_SCORE_MOD_ALIBI;
      alibi.alibi_slopes.assign(alibi.heads, 0.125f);
      run_and_check(cases, alibi, true);
    }
  JF_REPORT_UNSERVED(cases);
}

// gpt-oss's attention: 64 query / 8 KV heads at D = 64, layers alternating full causal and a
// 128-token sliding window, both with sinks; sequences long enough for several KV blocks.
TEST(GpuSinks, GptOssShapes) {
  testing::HopperCases cases;
  for (jf_mask mask : {JF_MASK_CAUSAL, JF_MASK_WINDOW}) {
    BatchSpec s;
    s.len_q = {700, 1, 300, 0, 129};
    s.len_kv = s.len_q;
    s.heads = 64;
    s.heads_kv = 8;
    s.head_dim = 64;
    s.mask = mask;
    if (mask == JF_MASK_WINDOW) {
      s.window_left = 127;
      s.window_right = 0;
    }
    s.seed = 300 + mask;
    s.learnable_sink = sinks_for(s.heads);
    run_and_check(cases, s, true);
  }
  JF_REPORT_UNSERVED(cases);
}

// The oracle (JF_BACKEND_ORACLE): the same contract on its own kernels.
TEST(GpuSinks, OracleAgainstReference) {
  testing::HopperCases cases;
  uint64_t seed = 320;
  for (int d : {64, 128})
    for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW}) {
      if (!cases.oracle_has(JF_BF16, d)) continue;
      BatchSpec s = sink_batch(d, JF_BF16, mask, ++seed);
      SCOPED_TRACE(label(s) + " oracle");
      GpuBatch g = testing::make_gpu_batch(s);
      const jf_fwd_args fa = g.forward_args(JF_BACKEND_ORACLE);
      ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
      const jf_bwd_args ba = g.backward_args(JF_BACKEND_ORACLE);
      ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      testing::expect_matches_reference(g, /*with_backward=*/true);
    }
  JF_REPORT_UNSERVED(cases);
}

TEST(GpuSinks, DeterministicRepeatsAreBitwiseIdentical) {
  testing::HopperCases cases;
  for (int d : {64, 128}) {
    BatchSpec s = sink_batch(d, JF_BF16, JF_MASK_CAUSAL, 340 + d);
    s.len_q = {300, 17, 513};
    s.len_kv = {300, 40, 513};
    SCOPED_TRACE(label(s));
    if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/true)) continue;
    GpuBatch g = testing::make_gpu_batch(s);
    testing::expect_deterministic_backward_repeats(g, 10);
    if (HasFatalFailure()) return;
  }
  JF_REPORT_UNSERVED(cases);
}

// The sinks are applied: out moves away from the call without them by far more than rounding.
TEST(GpuSinks, ChangeTheResult) {
  BatchSpec plain = testing::awkward_batch(128, JF_BF16, JF_MASK_NONE, 360);
  BatchSpec with_sinks = plain;
  with_sinks.learnable_sink.assign(plain.heads, 1.f);
  GpuBatch a = testing::make_gpu_batch(plain), b = testing::make_gpu_batch(with_sinks);
  const jf_fwd_args fa = a.forward_args(JF_BACKEND_AUTO), fb = b.forward_args(JF_BACKEND_AUTO);
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_fwd(&fb), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_GT(testing::device_rel_error(b.out.get(), a.out.get(), a.out_view, JF_BF16), 0.1);
}

// Sinks in host memory on a CUDA call, or a gradient without sinks: refused naming the field,
// outputs untouched.
TEST(GpuSinks, BadArgumentsRefusedWritingNothing) {
  BatchSpec s = sink_batch(128, JF_BF16, JF_MASK_NONE, 380);
  GpuBatch g = testing::make_gpu_batch(s);  // outputs poisoned with NaN
  std::vector<unsigned char> before(g.out.bytes());
  g.out.to_host(before.data());
  const std::vector<float> host_sinks = sinks_for(s.heads);
  jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  fa.problem.learnable_sink = host_sinks.data();
  EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("problem.learnable_sink"), std::string::npos)
      << jagflash_last_error();
  jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
  ba.problem.learnable_sink = nullptr;
  EXPECT_EQ(jagflash_bwd(&ba), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("dlearnable_sink"), std::string::npos)
      << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<unsigned char> after(g.out.bytes());
  g.out.to_host(after.data());
  EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size()), 0) << "out was written";
}

}  // namespace
}  // namespace jagflash
