// GPU tests of the Hopper forward (the default GPU forward for bf16/fp16 at head dims 64/128/256):
// against the oracle on full benchmark batches, rows past the last sequence never written,
// bitwise-identical repeats, plan reuse, and the calls it must refuse.
#include "gen/distributions.hpp"
#include "hopper_served.hpp"
#include "kernels/fwd/variants.hpp"
#include "testing/gpu_batch.hpp"

#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace jagflash {
namespace {

using testing::BatchSpec;
using testing::GpuBatch;

double lse_max_abs_diff(const GpuBatch& a, const GpuBatch& b) {
  std::vector<float> la(a.lse.bytes() / 4), lb(b.lse.bytes() / 4);
  a.lse.to_host(la.data());
  b.lse.to_host(lb.data());
  double worst = 0;
  for (size_t i = 0; i < la.size(); ++i) {
    if (std::isinf(la[i]) || std::isinf(lb[i])) {
      if (la[i] != lb[i]) return INFINITY;
      continue;
    }
    const double d = std::abs(double(la[i]) - lb[i]);
    if (!(d <= worst)) worst = d;
  }
  return worst;
}

TEST(GpuHopperForward, MatchesOracleOnTheFiveDistributions) {
  testing::HopperCases cases;
  for (const std::string& name : gen::distribution_names())
    for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL})
      for (int d : {64, 128, 256}) {
        SCOPED_TRACE(name + (mask == JF_MASK_CAUSAL ? " causal" : " none") + " D=" + std::to_string(d));
        BatchSpec s;
        s.len_q = gen::generate_lengths(name, gen::kDefaultSeed);
        s.heads = 4;
        s.heads_kv = 2;
        s.head_dim = d;
        s.mask = mask;
        s.seed = 77;
        if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/false)) continue;
        GpuBatch fast = testing::make_gpu_batch(s);
        GpuBatch slow = testing::make_gpu_batch(s);  // same seed, same inputs
        const jf_fwd_args fa = fast.forward_args(JF_BACKEND_HOPPER),
                          oa = slow.forward_args(JF_BACKEND_ORACLE);
        ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
        ASSERT_EQ(jagflash_fwd(&oa), JF_OK) << jagflash_last_error();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        const double rel = testing::device_rel_error(fast.out.get(), slow.out.get(), fast.out_view, s.dtype);
        EXPECT_LE(rel, testing::forward_tolerance(s.dtype));
        EXPECT_LE(lse_max_abs_diff(fast, slow), 1e-3);
      }
  JF_REPORT_UNSERVED(cases);
}

TEST(GpuHopperForward, WindowsGqaFp16AndQNotEqualKv) {
  const std::vector<int32_t> len_q = {0, 1, 2, 63, 64, 65, 127, 129, 300, 131, 5, 0, 1000};
  const std::vector<int32_t> len_kv = {3, 1, 0, 64, 65, 63, 129, 127, 17, 500, 200, 0, 999};
  struct Mask {
    jf_mask m;
    int l, r;
  };
  uint64_t seed = 500;
  testing::HopperCases cases;
  for (int d : {128, 256})
    for (jf_dtype dtype : {JF_BF16, JF_FP16})
      for (Mask m : {Mask{JF_MASK_NONE, -1, -1}, Mask{JF_MASK_CAUSAL, -1, -1}, Mask{JF_MASK_WINDOW, 100, 0},
                     Mask{JF_MASK_WINDOW, 7, 300}, Mask{JF_MASK_WINDOW, -1, 5}, Mask{JF_MASK_WINDOW, 0, 0}})
        for (int hkv : {4, 1}) {
          BatchSpec s;
          s.len_q = len_q;
          s.len_kv = len_kv;
          s.heads = 4;
          s.heads_kv = hkv;
          s.head_dim = d;
          s.dtype = dtype;
          s.mask = m.m;
          s.window_left = m.l;
          s.window_right = m.r;
          s.seed = ++seed;
          s.row_pad = 8;
          SCOPED_TRACE("seed " + std::to_string(s.seed) + " D=" + std::to_string(d));
          if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/false)) continue;
          GpuBatch g = testing::make_gpu_batch(s);
          const jf_fwd_args fa = g.forward_args(JF_BACKEND_HOPPER);
          ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          std::vector<int32_t> seqs(len_q.size());
          for (size_t b = 0; b < seqs.size(); ++b) seqs[b] = static_cast<int32_t>(b);
          const testing::SampleCheck c =
              testing::check_sample_against_reference(g, seqs, /*with_backward=*/false);
          EXPECT_TRUE(c.finite);
          EXPECT_TRUE(c.lse_inf_match);
          EXPECT_LE(c.out_rel, testing::forward_tolerance(dtype));
          EXPECT_LE(c.lse_max_abs, 1e-3);
        }
  JF_REPORT_UNSERVED(cases);
}

// The softmax's running max kept while a block's maximum passes it by at most keep_max (log2
// units; JAGFLASH_FWD_KEEP_MAX, read at every launch): off (-1, the max always moves), 0 (kept
// only when unchanged) and the default 8, on inputs whose scores move the max in small steps
// (range 1) and in jumps far past 2^8 (range 6: scores of ~|30| in log2 units), long sequences so
// that a row sees many blocks after its max settles, both dtypes (fp16 P takes probabilities up
// to 2^8), with and without a mask, and a GQA group. Each against the float64 reference.
TEST(GpuHopperForward, RunningMaxKeptOrMovedMatchesReference) {
  const char* before = std::getenv("JAGFLASH_FWD_KEEP_MAX");
  const std::string saved = before != nullptr ? before : "";
  const std::vector<int32_t> len_q = {900, 1, 0, 300, 1300, 65};
  const std::vector<int32_t> len_kv = {900, 700, 5, 1, 1300, 1100};
  uint64_t seed = 900;
  testing::HopperCases cases;
  for (const char* keep : {"-1", "0", "8"})
    for (int d : {64, 128})
      for (jf_dtype dtype : {JF_BF16, JF_FP16})
        for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL})
          for (float range : {1.f, 6.f}) {
            ASSERT_EQ(setenv("JAGFLASH_FWD_KEEP_MAX", keep, 1), 0);
            BatchSpec s;
            s.len_q = len_q;
            s.len_kv = len_kv;
            s.heads = 4;
            s.heads_kv = 2;
            s.head_dim = d;
            s.dtype = dtype;
            s.mask = mask;
            s.input_range = range;
            s.seed = ++seed;
            SCOPED_TRACE(std::string("keep_max ") + keep + " D=" + std::to_string(d) + " range " +
                         std::to_string(range) + " seed " + std::to_string(s.seed) +
                         (mask == JF_MASK_CAUSAL ? " causal" : " none") +
                         (dtype == JF_FP16 ? " fp16" : " bf16"));
            if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/false)) continue;
            GpuBatch g = testing::make_gpu_batch(s);
            const jf_fwd_args fa = g.forward_args(JF_BACKEND_HOPPER);
            ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
            ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
            std::vector<int32_t> seqs(len_q.size());
            for (size_t b = 0; b < seqs.size(); ++b) seqs[b] = static_cast<int32_t>(b);
            const testing::SampleCheck c =
                testing::check_sample_against_reference(g, seqs, /*with_backward=*/false);
            EXPECT_TRUE(c.finite);
            EXPECT_TRUE(c.lse_inf_match);
            EXPECT_LE(c.out_rel, testing::forward_tolerance(dtype));
            EXPECT_LE(c.lse_max_abs, 1e-3 * range * range);
          }
  if (saved.empty()) {
    unsetenv("JAGFLASH_FWD_KEEP_MAX");
  } else {
    setenv("JAGFLASH_FWD_KEEP_MAX", saved.c_str(), 1);
  }
  JF_REPORT_UNSERVED(cases);
}

// The output buffer is longer than the view: the rows after the last sequence belong to the
// caller and must keep their poison, and so must the padding between rows.
TEST(GpuHopperForward, NeverWritesPastTheLastSequence) {
  testing::HopperCases cases;
  for (int d : {64, 256}) {
    SCOPED_TRACE("D=" + std::to_string(d));
    BatchSpec s;
    s.len_q = {130, 1, 77};  // every sequence ends inside a 128-row tile
    s.heads = 2;
    s.heads_kv = 2;
    s.head_dim = d;
    s.row_pad = 8;
    s.mask = JF_MASK_CAUSAL;
    if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/false)) continue;
    GpuBatch g = testing::make_gpu_batch(s);
    const int64_t extra_rows = 200;
    const int64_t row_stride = g.out_view.row_stride;
    testing::DeviceBuffer big((g.total_q() + extra_rows) * row_stride * 2);
    testing::fill_buffer(big.get(), big.bytes() / 2, JF_BF16, std::nanf(""));
    jf_fwd_args fa = g.forward_args(JF_BACKEND_HOPPER);
    fa.out.data = big.get();
    ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    std::vector<uint16_t> host(big.bytes() / 2);
    big.to_host(host.data());
    const int64_t written = int64_t(s.heads) * s.head_dim;
    for (int64_t i = 0; i < static_cast<int64_t>(host.size()); ++i) {
      const int64_t row = i / row_stride, col = i % row_stride;
      const bool must_be_written = row < g.total_q() && col < written;
      const bool is_nan = (host[i] & 0x7f80) == 0x7f80 && (host[i] & 0x7f) != 0;
      ASSERT_NE(must_be_written, is_nan) << "row " << row << " col " << col;
    }
  }
  JF_REPORT_UNSERVED(cases);
}

TEST(GpuHopperForward, HundredRunsAreBitwiseIdenticalAndPlanReuseAgrees) {
  testing::HopperCases cases;
  for (int d : {128, 256}) {
    SCOPED_TRACE("D=" + std::to_string(d));
    BatchSpec s;
    s.len_q = gen::generate_lengths("gemskew", 5);
    s.heads = 8;
    s.heads_kv = 8;
    s.head_dim = d;
    s.mask = JF_MASK_CAUSAL;
    if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/false)) continue;
    GpuBatch g = testing::make_gpu_batch(s);
    jf_fwd_args fa = g.forward_args(JF_BACKEND_HOPPER);
    std::vector<unsigned char> first(g.out.bytes()), now(g.out.bytes());
    std::vector<float> first_lse(g.lse.bytes() / 4), now_lse(g.lse.bytes() / 4);
    for (int run = 0; run < 100; ++run) {
      fa.launch.reuse_plan = run % 2;  // odd runs reuse the plan the even runs built
      ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
      g.out.to_host(run == 0 ? first.data() : now.data());
      g.lse.to_host(run == 0 ? first_lse.data() : now_lse.data());
      if (run > 0) {
        ASSERT_EQ(0, std::memcmp(first.data(), now.data(), now.size())) << "run " << run;
        ASSERT_EQ(0, std::memcmp(first_lse.data(), now_lse.data(), now_lse.size() * 4)) << "run " << run;
      }
    }
  }
  JF_REPORT_UNSERVED(cases);
}

// jf_launch.reuse_plan misused: the workspace holds no plan, or one built for another kernel
// variant (another max_seqlen_hint) or another batch. The kernel finds the stored plan key
// wrong, writes nothing (outputs keep their poison) and jagflash_read_device_error names the
// argument; a correct reuse still gives the oracle's results.
TEST(GpuHopperForward, MisusedPlanReuseWritesNothingAndIsReported) {
  BatchSpec s;
  s.len_q = {200, 37, 0, 130, 1};  // every length <= 256: hint 256 picks the two-pair variant
  s.heads = 2;
  s.heads_kv = 2;
  s.head_dim = 128;
  JF_SKIP_UNLESS_HOPPER_SERVES(testing::HopperCall::of(s), /*with_backward=*/false);
  GpuBatch g = testing::make_gpu_batch(s);
  BatchSpec other_spec = s;
  other_spec.len_q = {200, 37, 131};
  GpuBatch other = testing::make_gpu_batch(other_spec);

  jf_fwd_args fa = g.forward_args(JF_BACKEND_HOPPER), fo = other.forward_args(JF_BACKEND_HOPPER);
  size_t bytes_default = 0, bytes_pairs = 0, bytes_other = 0;
  fa.launch.max_seqlen_hint = 256;
  ASSERT_EQ(jagflash_fwd_workspace_size(&fa, &bytes_pairs), JF_OK);
  fa.launch.max_seqlen_hint = 0;
  ASSERT_EQ(jagflash_fwd_workspace_size(&fa, &bytes_default), JF_OK);
  ASSERT_EQ(jagflash_fwd_workspace_size(&fo, &bytes_other), JF_OK);
  testing::DeviceBuffer workspace(std::max({bytes_default, bytes_pairs, bytes_other}));
  ASSERT_EQ(cudaMemset(workspace.get(), 0, workspace.bytes()), cudaSuccess);
  for (jf_fwd_args* a : {&fa, &fo}) {
    a->launch.workspace = workspace.get();
    a->launch.workspace_bytes = workspace.bytes();
  }

  auto all_nan = [](const testing::DeviceBuffer& buffer, size_t element_bytes) {
    std::vector<unsigned char> host(buffer.bytes());
    buffer.to_host(host.data());
    for (size_t i = 0; i < host.size(); i += element_bytes) {
      if (element_bytes == 2) {
        uint16_t x;
        std::memcpy(&x, &host[i], 2);
        if (!((x & 0x7f80) == 0x7f80 && (x & 0x7f) != 0)) return false;
      } else {
        float x;
        std::memcpy(&x, &host[i], 4);
        if (!std::isnan(x)) return false;
      }
    }
    return true;
  };
  auto expect_refused = [&](const jf_fwd_args& a, GpuBatch& batch, const char* what) {
    SCOPED_TRACE(what);
    testing::poison_outputs(batch);
    ASSERT_EQ(jagflash_fwd(&a), JF_OK) << jagflash_last_error();  // the host cannot tell without a sync
    ASSERT_EQ(jagflash_read_device_error(a.launch.workspace, a.launch.stream), JF_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(jagflash_last_error()).find("launch.reuse_plan"), std::string::npos)
        << jagflash_last_error();
    EXPECT_TRUE(all_nan(batch.out, 2)) << "out was written";
    EXPECT_TRUE(all_nan(batch.lse, 4)) << "lse was written";
  };
  auto expect_served = [&](const jf_fwd_args& a, GpuBatch& batch, const char* what) {
    SCOPED_TRACE(what);
    testing::poison_outputs(batch);
    ASSERT_EQ(jagflash_fwd(&a), JF_OK) << jagflash_last_error();
    ASSERT_EQ(jagflash_read_device_error(a.launch.workspace, a.launch.stream), JF_OK)
        << jagflash_last_error();
    GpuBatch slow = testing::make_gpu_batch(batch.spec);  // same seed, same inputs
    const jf_fwd_args oa = slow.forward_args(JF_BACKEND_ORACLE);
    ASSERT_EQ(jagflash_fwd(&oa), JF_OK) << jagflash_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LE(testing::device_rel_error(batch.out.get(), slow.out.get(), batch.out_view, s.dtype),
              testing::forward_tolerance(s.dtype));
    EXPECT_LE(lse_max_abs_diff(batch, slow), 1e-3);
  };

  // Hint 256 picks the two-pair variant (64-row tiles) by default; under a benchmark knob that
  // forces one variant (scripts/gpu-check.sh runs these tests under each) both hints share it
  // and reusing the plan across them is valid.
  auto tiles_of = [&](int32_t hint, const kernels::fwd::ForwardKnobs& knobs) {
    jf_fwd_args x = fa;
    x.launch.max_seqlen_hint = hint;
    const kernels::fwd::ForwardVariant v = kernels::fwd::choose_forward_variant(x, knobs);
    return std::make_pair(v.block_m(), v.block_n);
  };
  ASSERT_NE(tiles_of(0, {}), tiles_of(256, {})) << "without knobs the two hints pick different tiles";
  const bool hints_share_a_variant =
      tiles_of(0, kernels::fwd::ForwardKnobs::get()) == tiles_of(256, kernels::fwd::ForwardKnobs::get());

  struct Step {
    bool other_batch;
    int32_t reuse_plan, hint;
    bool served;
    const char* what;
  };
  const Step steps[] = {
      {false, 1, 0, false, "no plan built yet (zeroed workspace)"},
      {false, 0, 0, true, "built (128-row tiles)"},
      {false, 1, 0, true, "reused as built"},
      {false, 1, 256, hints_share_a_variant, "reused under another hint"},
      {true, 1, 0, false, "reused for another batch"},
      {false, 0, 256, true, "built again under the other hint"},
      {false, 1, 256, true, "reused under it"},
  };
  for (const Step& step : steps) {
    jf_fwd_args& a = step.other_batch ? fo : fa;
    a.launch.reuse_plan = step.reuse_plan;
    a.launch.max_seqlen_hint = step.hint;
    GpuBatch& batch = step.other_batch ? other : g;
    if (step.served)
      expect_served(a, batch, step.what);
    else
      expect_refused(a, batch, step.what);
  }
}

TEST(GpuHopperForward, RefusesWhatItCannotServe) {
  BatchSpec s;
  s.len_q = {5, 9};
  s.heads = 2;
  s.heads_kv = 2;
  s.head_dim = 128;
  s.dtype = JF_FP32;  // the Hopper forward serves bf16 and fp16
  GpuBatch g = testing::make_gpu_batch(s);
  jf_fwd_args fa = g.forward_args(JF_BACKEND_HOPPER);
  EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(jagflash_last_error()).find("JF_BACKEND_HOPPER"), std::string::npos)
      << jagflash_last_error();
  fa.launch.backend = JF_BACKEND_AUTO;  // AUTO falls back to the oracle for fp32
  EXPECT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
}

}  // namespace
}  // namespace jagflash
