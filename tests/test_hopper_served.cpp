// The "is this served" question the GPU tests ask before each case (tests/hopper_served.hpp), on a
// trimmed build's table (no GPU needed): the registry's search (kernels/hopper_lookup.hpp) over the
// Hopper tables a JAGFLASH_HOPPER_DTYPES=bf16 build generates finds bf16's kernels and no fp16 one,
// and the GPU tests' skip logic over it runs the served cases and names the others with the reason.
#include "hopper_served.hpp"
#include "kernels/hopper_lookup.hpp"

#include <gtest/gtest.h>

#include <string>

namespace jagflash {
namespace {

using testing::HopperCall;
using testing::HopperCases;

cudaError_t fake_forward(const jf_fwd_args&, const kernels::HopperForwardLaunch&, cudaStream_t) {
  return cudaSuccess;
}
cudaError_t fake_backward(const jf_bwd_args&, const kernels::HopperBackwardLaunch&, cudaStream_t) {
  return cudaSuccess;
}

// A part of what a bf16-only build instantiates (CMakeLists.txt's table with JAGFLASH_HOPPER_DTYPES=
// bf16): the modifiers at their own head dims only, padded kernels without one, a block map at 64,
// the relative bias's backward not at 128.
constexpr jf_score_mod kNone = JF_SCORE_MOD_NONE;
const kernels::HopperForwardEntry kForward[] = {
    {JF_BF16, 64, kNone, false, false, fake_forward},
    {JF_BF16, 64, kNone, true, false, fake_forward},
    {JF_BF16, 64, kNone, false, true, fake_forward},
    {JF_BF16, 96, kNone, false, false, fake_forward},
    {JF_BF16, 96, kNone, true, false, fake_forward},
    {JF_BF16, 128, kNone, false, false, fake_forward},
    {JF_BF16, 128, kNone, true, false, fake_forward},
    {JF_BF16, 128, JF_SCORE_MOD_SOFTCAP, false, false, fake_forward},
    {JF_BF16, 128, JF_SCORE_MOD_RELATIVE_BIAS, false, false, fake_forward},
    {JF_BF16, 256, kNone, false, false, fake_forward},
    {JF_BF16, 256, kNone, true, false, fake_forward},
    {JF_BF16, 0, kNone, false, false, nullptr},  // the generated tables' terminator
};
const kernels::HopperBackwardEntry kBackward[] = {
    {JF_BF16, 64, kNone, false, false, fake_backward},
    {JF_BF16, 64, kNone, true, false, fake_backward},
    {JF_BF16, 128, kNone, false, false, fake_backward},
    {JF_BF16, 128, kNone, true, false, fake_backward},
    {JF_BF16, 128, JF_SCORE_MOD_SOFTCAP, false, false, fake_backward},
    {JF_BF16, 0, kNone, false, false, nullptr},
};

bool trimmed_serves(jf_direction direction, const HopperCall& c) {
  return direction == JF_DIRECTION_FORWARD
             ? kernels::find_narrowest(kForward, c.dtype, c.head_dim, c.score_mod, c.block_sparse,
                                       c.v_head_dim) != nullptr
             : kernels::find_narrowest(kBackward, c.dtype, c.head_dim, c.score_mod, c.block_sparse,
                                       c.v_head_dim) != nullptr;
}

TEST(HopperServed, TheRegistrySearchOnABf16OnlyTable) {
  struct Case {
    jf_dtype dtype;
    int d, dv;
    jf_score_mod mod;
    bool sparse;
    int kernel;  // 0: none
    bool padded;
  };
  const Case cases[] = {
      {JF_BF16, 64, 0, kNone, false, 64, false},
      {JF_FP16, 64, 0, kNone, false, 0, false},  // the dtype the build left out
      {JF_FP16, 128, 0, kNone, false, 0, false},
      {JF_BF16, 40, 0, kNone, false, 64, true},
      {JF_BF16, 80, 0, kNone, false, 96, true},
      {JF_BF16, 96, 64, kNone, false, 96, true},  // a narrower v: padded
      {JF_BF16, 104, 0, kNone, false, 128, true},
      {JF_BF16, 200, 0, kNone, false, 256, true},
      {JF_BF16, 128, 0, JF_SCORE_MOD_SOFTCAP, false, 128, false},
      {JF_BF16, 112, 0, JF_SCORE_MOD_SOFTCAP, false, 0, false},  // no padded modifier kernel
      {JF_BF16, 64, 0, kNone, true, 64, false},
      {JF_BF16, 128, 0, kNone, true, 0, false},
      {JF_BF16, 36, 0, kNone, false, 0, false},  // not a multiple of 8
      {JF_BF16, 264, 0, kNone, false, 0, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "dtype=" << c.dtype << " D=" << c.d << " Dv=" << c.dv
                                      << " mod=" << c.mod << " sparse=" << c.sparse);
    const kernels::HopperForwardEntry* e =
        kernels::find_narrowest(kForward, c.dtype, c.d, c.mod, c.sparse, c.dv);
    if (c.kernel == 0) {
      EXPECT_EQ(e, nullptr);
      continue;
    }
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->head_dim, c.kernel);
    EXPECT_EQ(e->padded, c.padded);
  }
}

TEST(HopperServed, CasesRunWhatTheTableServesAndNameTheRest) {
  HopperCases cases(trimmed_serves);
  EXPECT_TRUE(cases.serve({JF_BF16, 128}, /*with_backward=*/true));
  EXPECT_TRUE(cases.serve({JF_BF16, 80}, /*with_backward=*/false));
  EXPECT_FALSE(cases.serve({JF_FP16, 128}, /*with_backward=*/false));
  EXPECT_FALSE(cases.serve({JF_FP16, 128}, /*with_backward=*/false));  // the same reason, kept once
  EXPECT_FALSE(cases.serve({JF_FP16, 64}, /*with_backward=*/true));
  HopperCall relative_bias{JF_BF16, 128};
  relative_bias.score_mod = JF_SCORE_MOD_RELATIVE_BIAS;
  EXPECT_TRUE(cases.serve(relative_bias, /*with_backward=*/false));
  EXPECT_FALSE(cases.serve(relative_bias, /*with_backward=*/true));  // the forward alone is built
  EXPECT_EQ(cases.ran(), 3);
  ASSERT_TRUE(cases.any_skipped());
  const std::string summary = cases.summary();
  EXPECT_NE(summary.find("3 kind(s)"), std::string::npos) << summary;
  EXPECT_NE(summary.find("fp16/128: this build instantiates no Hopper forward for it ("), std::string::npos)
      << summary;
  EXPECT_NE(summary.find("fp16/64: this build instantiates no Hopper forward and backward"),
            std::string::npos)
      << summary;
  EXPECT_NE(summary.find("bf16/128 relative bias: this build instantiates no Hopper backward"),
            std::string::npos)
      << summary;
  EXPECT_NE(summary.find("JAGFLASH_HOPPER_DTYPES"), std::string::npos) << summary;

  EXPECT_TRUE(cases.serve_in(JF_DIRECTION_BACKWARD, {JF_BF16, 128}));
  EXPECT_FALSE(cases.serve_in(JF_DIRECTION_BACKWARD, {JF_BF16, 200}));  // 256's forward alone in the table
  EXPECT_NE(cases.summary().find("bf16/200: this build instantiates no Hopper backward"), std::string::npos);

  HopperCases none(trimmed_serves);
  EXPECT_FALSE(none.any_skipped());
  EXPECT_EQ(none.ran(), 0);
}

// The GPU tests ask this build's registry: its answer is the dispatcher's lookup (a build without
// the Hopper kernels, this PTX-only one included, serves nothing and skips every Hopper case).
TEST(HopperServed, TheGpuTestsAskThisBuildsRegistry) {
  for (jf_dtype dt : {JF_BF16, JF_FP16})
    for (int d : {64, 80, 128, 256}) {
      const HopperCall c{dt, d};
      const bool fwd = kernels::find_hopper_forward(dt, d, kNone) != nullptr;
      const bool bwd = kernels::find_hopper_backward(dt, d, kNone) != nullptr;
      EXPECT_EQ(testing::hopper_unserved(c, true, false).empty(), fwd) << testing::describe(c);
      EXPECT_EQ(testing::hopper_unserved(c, true, true).empty(), fwd && bwd) << testing::describe(c);
    }
}

}  // namespace
}  // namespace jagflash
