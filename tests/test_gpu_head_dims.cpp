// GPU tests of the head dims the Hopper kernels serve padded (a multiple of 8 below 64, 128 or
// 256: the TMA's box of the kernel's width zero-fills the missing columns, and only the caller's
// are stored), and the backward's wide kernel at 256: forward (out, lse), backward (dq, dk, dv) against the
// CPU float64 reference, bf16 and fp16, lengths 0 and 1, q != kv, GQA, every mask; the inputs' row padding
// poisoned with NaN (never read) and the outputs' (never written); bitwise repeats in the
// deterministic mode; AUTO picks the Hopper kernels; what no path serves is refused naming the
// head dim, with nothing written.
#include "core/dtype.hpp"
#include "gpu_call_checks.hpp"
#include "hopper_served.hpp"
#include "kernels/fwd/variants.hpp"
#include "testing/gpu_batch.hpp"

#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace jagflash {
namespace {

using testing::BatchSpec;
using testing::DeviceBuffer;
using testing::GpuBatch;

std::string label(const BatchSpec& s) {
  return "D=" + std::to_string(s.head_dim) + " " + dtype_name(s.dtype) + " mask=" + std::to_string(s.mask) +
         " H=" + std::to_string(s.heads) + "/" + std::to_string(s.heads_kv) +
         " seed=" + std::to_string(s.seed);
}

// The row padding (the last row_pad elements of every row) of a device tensor, set to `value`.
void fill_row_padding(DeviceBuffer& buffer, const jf_tensor& view, jf_dtype dtype, float value) {
  const size_t elem = dtype_size(dtype);
  std::vector<unsigned char> host(buffer.bytes());
  buffer.to_host(host.data());
  std::vector<unsigned char> one(elem);
  DeviceBuffer scalar(elem);
  testing::fill_buffer(scalar.get(), 1, dtype, value);
  scalar.to_host(one.data());
  const int64_t used = int64_t(view.heads) * view.head_dim;
  for (int64_t r = 0; r < view.rows; ++r)
    for (int64_t e = used; e < view.row_stride; ++e)
      std::memcpy(host.data() + (r * view.row_stride + e) * elem, one.data(), elem);
  testing::cuda_check(cudaMemcpy(buffer.get(), host.data(), host.size(), cudaMemcpyHostToDevice), "upload");
}

// Whether every row-padding element of a device tensor is NaN (never written).
bool row_padding_is_nan(const DeviceBuffer& buffer, const jf_tensor& view, jf_dtype dtype) {
  std::vector<unsigned char> host(buffer.bytes());
  buffer.to_host(host.data());
  const int64_t used = int64_t(view.heads) * view.head_dim;
  for (int64_t r = 0; r < view.rows; ++r)
    for (int64_t e = used; e < view.row_stride; ++e) {
      const int64_t i = r * view.row_stride + e;
      uint16_t x;
      std::memcpy(&x, host.data() + i * 2, 2);
      const bool nan = dtype == JF_BF16 ? ((x & 0x7f80) == 0x7f80 && (x & 0x7f) != 0)
                                        : ((x & 0x7c00) == 0x7c00 && (x & 0x3ff) != 0);
      if (!nan) return false;
    }
  return true;
}

BatchSpec awkward(int d, jf_dtype dtype, jf_mask mask, uint64_t seed) {
  return testing::awkward_batch(d, dtype, mask, seed);
}

// Forward (and with_backward, backward) with AUTO on the Hopper kernels, the inputs' row padding
// NaN, then the reference on every sequence and the outputs' row padding still NaN. A case this
// build does not serve is noted in `cases` and not run.
void run_and_check(testing::HopperCases& cases, const BatchSpec& s, bool with_backward,
                   int deterministic = 0) {
  if (!cases.serve(testing::HopperCall::of(s), with_backward)) return;
  SCOPED_TRACE(label(s));
  GpuBatch g = testing::make_gpu_batch(s);
  for (auto [buffer, view] : {std::pair<DeviceBuffer*, const jf_tensor*>{&g.q, &g.q_view},
                              {&g.k, &g.k_view},
                              {&g.v, &g.v_view},
                              {&g.dout, &g.dout_view}})
    fill_row_padding(*buffer, *view, s.dtype, std::nanf(""));
  testing::run_on_hopper(g, with_backward, deterministic);
  if (::testing::Test::HasFatalFailure()) return;
  testing::expect_matches_reference(g, with_backward);
  EXPECT_TRUE(row_padding_is_nan(g.out, g.out_view, s.dtype)) << "out's row padding was written";
  if (!with_backward) return;
  EXPECT_TRUE(row_padding_is_nan(g.dq, g.dq_view, s.dtype)) << "dq's row padding was written";
  EXPECT_TRUE(row_padding_is_nan(g.dk, g.dk_view, s.dtype)) << "dk's row padding was written";
  EXPECT_TRUE(row_padding_is_nan(g.dv, g.dv_view, s.dtype)) << "dv's row padding was written";
}

TEST(GpuHeadDims, PaddedUpTo128BothDirections) {
  testing::HopperCases cases;
  uint64_t seed = 200;
  for (int d : {8, 32, 40, 72, 80, 96, 112})
    for (jf_dtype dt : {JF_BF16, JF_FP16})
      for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW})
        run_and_check(cases, awkward(d, dt, mask, ++seed), /*with_backward=*/true);
  JF_REPORT_UNSERVED(cases);
}

// Past 128: the 256 kernels (the backward's wide one, mainloop_bwd_wide.cuh), padded below 256.
TEST(GpuHeadDims, PaddedPast128BothDirections) {
  testing::HopperCases cases;
  uint64_t seed = 300;
  for (int d : {136, 160, 192, 224, 248, 256})
    for (jf_dtype dt : {JF_BF16, JF_FP16})
      for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW}) {
        SCOPED_TRACE("D=" + std::to_string(d));
        ++seed;
        run_and_check(cases, awkward(d, dt, mask, seed), /*with_backward=*/true,
                      /*deterministic=*/static_cast<int>(seed % 2));
        if (::testing::Test::HasFatalFailure()) return;
      }
  JF_REPORT_UNSERVED(cases);
}

// A v head dim of its own (DeepSeek's 192 / 128 and others): the forward on the Hopper kernels
// (V zero-filled past its head dim, O's columns there not stored), against the reference, every
// mask, both dtypes.
TEST(GpuHeadDims, NarrowerVForward) {
  testing::HopperCases cases;
  uint64_t seed = 400;
  for (auto [d, dv] : {std::pair<int, int>{192, 128}, {128, 64}, {64, 32}, {96, 64}, {256, 128}, {80, 8}})
    for (jf_dtype dt : {JF_BF16, JF_FP16})
      for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW}) {
        BatchSpec s = awkward(d, dt, mask, ++seed);
        s.v_head_dim = dv;
        SCOPED_TRACE("Dv=" + std::to_string(dv));
        run_and_check(cases, s, /*with_backward=*/false);
        if (::testing::Test::HasFatalFailure()) return;
      }
  JF_REPORT_UNSERVED(cases);
}

// A v head dim of its own: the backward on the Hopper kernels too (DeepSeek's 192 / 128 on the
// wide 256 kernel, padded; V and dO
// zero-filled past Dv, delta over Dv, dV's columns past it never stored), against the reference,
// both dtypes, every mask, both backward modes; the inputs' and outputs' row padding NaN.
TEST(GpuHeadDims, NarrowerVBackward) {
  testing::HopperCases cases;
  uint64_t seed = 460;
  for (auto [d, dv] : {std::pair<int, int>{128, 64},
                       {64, 32},
                       {96, 64},
                       {80, 8},
                       {128, 120},
                       {192, 128},
                       {256, 128},
                       {256, 248}})
    for (jf_dtype dt : {JF_BF16, JF_FP16})
      for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW}) {
        BatchSpec s = awkward(d, dt, mask, ++seed);
        s.v_head_dim = dv;
        SCOPED_TRACE("Dv=" + std::to_string(dv));
        run_and_check(cases, s, /*with_backward=*/true, /*deterministic=*/static_cast<int>(seed % 2));
        if (::testing::Test::HasFatalFailure()) return;
      }
  // MQA, the group split over 4 tiles (the benchmark knob forces it): fp32 dK/dV partials that the
  // dK/dV postprocess sums, dv's columns bounded there too.
  setenv("JAGFLASH_BWD_GROUP_SPLITS", "4", 1);
  BatchSpec s;
  s.len_q = {1500, 900};
  s.len_kv = {1500, 1100};
  s.heads = 8;
  s.heads_kv = 1;
  s.head_dim = 128;
  s.v_head_dim = 64;
  s.mask = JF_MASK_CAUSAL;
  s.seed = 490;
  run_and_check(cases, s, /*with_backward=*/true);
  s.head_dim = 192;  // the wide kernel's split groups (its dK/dV halves into the partials)
  s.v_head_dim = 128;
  run_and_check(cases, s, /*with_backward=*/true);
  s.head_dim = 96;  // the D = 96 kernel's (48-column dQ halves, 192-byte staging rows)
  s.v_head_dim = 80;
  run_and_check(cases, s, /*with_backward=*/true);
  unsetenv("JAGFLASH_BWD_GROUP_SPLITS");
  JF_REPORT_UNSERVED(cases);
}

// A max_seqlen hint of at most 256 (every sequence short): the forward's two-pair tile (one
// warpgroup, 64 query rows a tile, two pairs a CTA) on the 64, 96 and 128 kernels, padded below
// them and at 96's own head dim; both dtypes, every mask, lengths 0 and 1, q != kv, GQA.
TEST(GpuHeadDims, ShortHintTakesThePairsBothDirections) {
  testing::HopperCases cases;
  uint64_t seed = 700;
  for (int d : {40, 80, 96, 112})
    for (jf_dtype dt : {JF_BF16, JF_FP16})
      for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW}) {
        BatchSpec s = awkward(d, dt, mask, ++seed);
        s.len_kv[3] = 256;  // every length at most the hint
        s.max_seqlen_hint = 256;
        if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/true)) continue;
        GpuBatch probe = testing::make_gpu_batch(s);
        const kernels::fwd::ForwardVariant v = kernels::fwd::choose_forward_variant(
            probe.forward_args(JF_BACKEND_AUTO), kernels::fwd::ForwardKnobs{});
        EXPECT_EQ(v.pairs, 2) << "D=" << d;
        run_and_check(cases, s, /*with_backward=*/true, /*deterministic=*/static_cast<int>(seed % 2));
        if (::testing::Test::HasFatalFailure()) return;
      }
  JF_REPORT_UNSERVED(cases);
}

// Longer sequences (the forward's mask-free bulk, several Q blocks a backward tile, MQA) in both
// backward modes.
TEST(GpuHeadDims, LongerSequencesBothModes) {
  testing::HopperCases cases;
  for (int det : {0, 1})
    for (int d : {80, 96, 192, 256}) {
      BatchSpec s;
      s.len_q = {1000, 700, 1};
      s.len_kv = {1000, 1500, 3};
      s.heads = 4;
      s.heads_kv = 1;
      s.head_dim = d;
      s.mask = JF_MASK_CAUSAL;
      s.seed = 400 + d + det;
      run_and_check(cases, s, /*with_backward=*/true, det);
    }
  JF_REPORT_UNSERVED(cases);
}

// Small enough for compute-sanitizer (scripts/gpu-check.sh SANITIZE=1).
TEST(GpuHeadDims, SmallCaseForSanitizers) {
  testing::HopperCases cases;
  for (int d : {80, 96, 192, 256}) {
    BatchSpec s = awkward(d, JF_BF16, JF_MASK_CAUSAL, 500 + d);
    s.len_q = {1, 65, 0, 130};
    s.len_kv = {2, 63, 5, 130};
    run_and_check(cases, s, /*with_backward=*/true);
  }
  // A v head dim of its own, both directions (V and dO zero-filled past it, dv's columns bounded).
  BatchSpec s = awkward(128, JF_BF16, JF_MASK_CAUSAL, 520);
  s.len_q = {1, 65, 0, 130};
  s.len_kv = {2, 63, 5, 130};
  s.v_head_dim = 64;
  run_and_check(cases, s, /*with_backward=*/true);
  JF_REPORT_UNSERVED(cases);
}

TEST(GpuHeadDims, DeterministicRepeatsAreBitwiseIdentical) {
  testing::HopperCases cases;
  for (int d : {80, 96, 192, 256}) {
    SCOPED_TRACE("D=" + std::to_string(d));
    BatchSpec s = awkward(d, JF_BF16, d == 192 ? JF_MASK_CAUSAL : JF_MASK_NONE, 600 + d);
    s.len_q = {300, 17, 513};
    s.len_kv = {300, 40, 513};
    if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/true)) continue;
    GpuBatch g = testing::make_gpu_batch(s);
    testing::expect_deterministic_backward_repeats(g, 20);
  }
  JF_REPORT_UNSERVED(cases);
}

// What no path serves: JF_ERR_UNSUPPORTED naming the head dim (or the backend asked for), out and
// the gradients untouched (still NaN).
TEST(GpuHeadDims, RefusesWhatNoPathServes) {
  struct Case {
    const char* what;
    int d;
    jf_dtype dtype;
    bool backward;
    jf_score_mod mod;
    jf_backend backend;
    const char* field;
  } cases[] = {
      {"softcap's backward at 192", 192, JF_BF16, true, JF_SCORE_MOD_SOFTCAP, JF_BACKEND_AUTO,
       "problem.q.head_dim"},
      {"softcap's backward at 224 on Hopper (no padded kernel with a modifier)", 224, JF_BF16, true,
       JF_SCORE_MOD_SOFTCAP, JF_BACKEND_HOPPER, "launch.backend"},
      {"softcap at 80", 80, JF_BF16, false, JF_SCORE_MOD_SOFTCAP, JF_BACKEND_AUTO, "problem.q.head_dim"},
      {"fp32 at 80", 80, JF_FP32, false, JF_SCORE_MOD_NONE, JF_BACKEND_AUTO, "problem.q.head_dim"},
      {"the oracle at 96", 96, JF_BF16, false, JF_SCORE_MOD_NONE, JF_BACKEND_ORACLE, "problem.q.head_dim"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    BatchSpec s = awkward(c.d, c.dtype, JF_MASK_NONE, 700);
    s.row_pad = 0;
    s.score_mod = c.mod;
    s.softcap = c.mod == JF_SCORE_MOD_SOFTCAP ? 5.f : 0.f;
    GpuBatch g = testing::make_gpu_batch(s);  // outputs NaN
    const size_t elem = dtype_size(c.dtype);
    std::vector<unsigned char> before(g.out.bytes()), after(g.out.bytes());
    g.out.to_host(before.data());
    jf_status status;
    if (c.backward) {
      jf_bwd_args ba = g.backward_args(c.backend);
      status = jagflash_bwd(&ba);
    } else {
      const jf_fwd_args fa = g.forward_args(c.backend);
      status = jagflash_fwd(&fa);
    }
    EXPECT_EQ(status, JF_ERR_UNSUPPORTED);
    EXPECT_EQ(std::string(jagflash_last_error()).rfind(c.field, 0), 0u) << jagflash_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    g.out.to_host(after.data());
    EXPECT_EQ(std::memcmp(before.data(), after.data(), before.size()), 0) << "out was written";
    (void)elem;
  }
}

}  // namespace
}  // namespace jagflash
