// Which Hopper forward variant a call gets by default (host-only: no GPU needed). The
// benchmark knobs are unset in the test environment, so these are the defaults of
// kernels/fwd/variants.hpp.
#include "kernels/fwd/variants.hpp"

#include <gtest/gtest.h>

#include <initializer_list>

namespace jagflash {
namespace {

using kernels::fwd::choose_forward_variant;
using kernels::fwd::ForwardVariant;

jf_fwd_args call(int head_dim, jf_mask mask, int32_t batch = 8, int64_t rows = 4096) {
  jf_fwd_args a{};
  a.problem.dtype = JF_BF16;
  a.problem.device = JF_DEVICE_CUDA;
  a.problem.batch_size = batch;
  a.problem.q = {nullptr, rows, 16, head_dim, int64_t(16) * head_dim, head_dim};
  a.problem.k = a.problem.q;
  a.problem.v = a.problem.q;
  a.problem.mask = mask;
  a.problem.window_left = a.problem.window_right = -1;
  return a;
}

TEST(ForwardVariants, DefaultsFollowHeadDimAndMask) {
  ASSERT_EQ(std::getenv("JAGFLASH_FWD_BLOCK_N"), nullptr) << "the defaults are tested without knobs";
  ASSERT_EQ(std::getenv("JAGFLASH_FWD_WARPGROUPS"), nullptr) << "the defaults are tested without knobs";
  ASSERT_EQ(std::getenv("JAGFLASH_FWD_PAIRS"), nullptr) << "the defaults are tested without knobs";
  struct Case {
    int head_dim;
    jf_mask mask;
    int32_t batch;
    int64_t rows;
    int block_n, warpgroups;
  };
  const Case cases[] = {
      {128, JF_MASK_NONE, 8, 4096, 128, 2},
      {128, JF_MASK_NONE, 2048, 2048 * 136, 128, 2},  // short sequences: 64-key blocks are no faster
      {128, JF_MASK_CAUSAL, 8, 4096, 128, 2},
      {64, JF_MASK_NONE, 8, 4096, 128, 3},  // D = 64 unmasked: three consumer warpgroups
      {64, JF_MASK_NONE, 2048, 2048 * 136, 128, 3},
      {64, JF_MASK_CAUSAL, 8, 4096, 128, 2},
      {64, JF_MASK_WINDOW, 8, 4096, 128, 2},
  };
  for (const Case& c : cases) {
    jf_fwd_args a = call(c.head_dim, c.mask, c.batch, c.rows);
    if (c.mask == JF_MASK_WINDOW) a.problem.window_left = a.problem.window_right = 32;
    const ForwardVariant v = choose_forward_variant(a);
    SCOPED_TRACE(testing::Message() << "D=" << c.head_dim << " mask=" << c.mask << " B=" << c.batch);
    EXPECT_EQ(v.block_n, c.block_n);
    EXPECT_EQ(v.warpgroups, c.warpgroups);
    EXPECT_EQ(v.block_m(), 64 * c.warpgroups);
    EXPECT_EQ(v.pairs, 1);
    EXPECT_FALSE(v.ping_pong);
  }
}

// Two independent pairs: one warpgroup and 64 rows per tile whatever else is forced, 64-key
// blocks at D = 128 (two 128-key K/V stages per pair would not fit), no ping-pong.
TEST(ForwardVariants, PairsKnobGivesSingleWarpgroupTiles) {
  kernels::fwd::ForwardKnobs knobs;
  knobs.pairs = 2;
  knobs.ping_pong = 1;
  knobs.warpgroups = 3;
  for (int head_dim : {64, 128})
    for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL}) {
      const ForwardVariant v = choose_forward_variant(call(head_dim, mask), knobs);
      SCOPED_TRACE(testing::Message() << "D=" << head_dim << " mask=" << mask);
      EXPECT_EQ(v.pairs, 2);
      EXPECT_EQ(v.warpgroups, 1);
      EXPECT_EQ(v.block_m(), 64);
      EXPECT_EQ(v.block_n, head_dim == 128 ? 64 : 128);
      EXPECT_FALSE(v.ping_pong);
    }
  knobs.pairs = 1;
  EXPECT_EQ(choose_forward_variant(call(128, JF_MASK_NONE), knobs).pairs, 1);
}

// A rule that picks the two single-warpgroup pairs: set(a, x) for each x in `picks` gives them (one
// warpgroup a tile, 64-key blocks at D = 128), each x in `keeps` the one-pair default, and the
// one-pair knob wins over a picking value; at both head dims, under each of `masks`.
template <class Set>
void expect_pairs_rule(std::initializer_list<jf_mask> masks, int32_t batch, int64_t rows, Set set,
                       std::initializer_list<int32_t> picks, std::initializer_list<int32_t> keeps,
                       const char* what) {
  const kernels::fwd::ForwardKnobs no_knobs;
  for (int head_dim : {64, 128})
    for (jf_mask mask : masks) {
      SCOPED_TRACE(testing::Message() << "D=" << head_dim << " mask=" << mask);
      jf_fwd_args a = call(head_dim, mask, batch, rows);
      for (int32_t x : picks) {
        set(a, x);
        const ForwardVariant v = choose_forward_variant(a, no_knobs);
        EXPECT_EQ(v.pairs, 2) << what << " " << x;
        EXPECT_EQ(v.warpgroups, 1) << what << " " << x;
        EXPECT_EQ(v.block_n, head_dim == 128 ? 64 : 128) << what << " " << x;
      }
      for (int32_t x : keeps) {
        set(a, x);
        EXPECT_EQ(choose_forward_variant(a, no_knobs).pairs, 1) << what << " " << x;
      }
      kernels::fwd::ForwardKnobs one_pair;
      one_pair.pairs = 1;
      set(a, *picks.begin());
      EXPECT_EQ(choose_forward_variant(a, one_pair).pairs, 1) << what << " " << *picks.begin();
    }
}

// A max_seqlen hint of at most 256 (every sequence short) picks the two-pair variant at both
// head dims and masks; a longer or unknown (0) one keeps the default; a knob still wins.
TEST(ForwardVariants, ShortMaxSeqlenHintPicksPairs) {
  expect_pairs_rule(
      {JF_MASK_NONE, JF_MASK_CAUSAL}, 2048, 2048 * 136,
      [](jf_fwd_args& a, int32_t hint) { a.launch.max_seqlen_hint = hint; },
      {100, 1, 136, kernels::fwd::kPairsMaxSeqlen}, {0, kernels::fwd::kPairsMaxSeqlen + 1, 16384}, "hint");
}

// A pooled call whose query set has at most 64 rows takes the two single-warpgroup pairs (two
// sequences a CTA, each its own keys), whatever the hint; a larger set keeps the default; a knob
// still wins.
TEST(ForwardVariants, SmallPooledQuerySetPicksPairs) {
  expect_pairs_rule(
      {JF_MASK_NONE, JF_MASK_WINDOW}, 256, 256 * 16,
      [](jf_fwd_args& a, int32_t rows) { a.problem.pooled_q_rows = rows; },
      {16, 1, kernels::fwd::kPooledPairsMaxRows}, {0, kernels::fwd::kPooledPairsMaxRows + 1, 200}, "Lq");
}

// D = 256 has one kernel (32-key blocks, two warpgroups, one pair: what fits the shared memory
// and registers): neither the max_seqlen hint nor the shape knobs may select another, for which
// no D = 256 kernel exists. The schedule knob still applies.
TEST(ForwardVariants, HeadDim256HasOneShape) {
  kernels::fwd::ForwardKnobs every_knob;
  every_knob.schedule = kernels::fwd::Schedule::kZigzag;
  every_knob.ping_pong = 1;
  every_knob.block_n = 64;
  every_knob.warpgroups = 3;
  every_knob.pairs = 2;
  for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL})
    for (int32_t hint : {0, 100, 256, 5000})
      for (const kernels::fwd::ForwardKnobs& knobs : {kernels::fwd::ForwardKnobs{}, every_knob}) {
        jf_fwd_args a = call(256, mask);
        a.launch.max_seqlen_hint = hint;
        const ForwardVariant v = choose_forward_variant(a, knobs);
        EXPECT_EQ(v.block_n, 32);
        EXPECT_EQ(v.warpgroups, 2);
        EXPECT_EQ(v.block_m(), 128);
        EXPECT_EQ(v.pairs, 1);
        EXPECT_FALSE(v.ping_pong);
        EXPECT_EQ(v.schedule, knobs.schedule);
      }
}

}  // namespace
}  // namespace jagflash
