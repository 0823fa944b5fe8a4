// Which Hopper forward variant a call gets (host-only: no GPU needed). choose_forward_variant
// reads the q head dim, the mask, the score modifier, the mean sequence length (rows / batch size),
// launch.max_seqlen_hint, problem.pooled_q_rows and the benchmark knobs; these tests vary those and
// nothing else. Its
// answer is both the tile the launcher instantiates (kernels/fwd/fwd_launch.cuh) and the tile the
// dispatcher sizes the call's plan for, so a wrong answer is a plan built for another tile shape.
// Every test passes its knobs explicitly, the environment's (ForwardKnobs::get) play no part, but
// KnobsAreReadAtEveryCall, which tests that reading itself (and unsets what it set).
#include "kernels/fwd/variants.hpp"
#include "kernels/hopper_backward.hpp"
#include "kernels/hopper_forward.hpp"

#include <gtest/gtest.h>

#include <cstdlib>

#include <vector>

#include <initializer_list>

namespace jagflash {
namespace {

using kernels::fwd::choose_forward_variant;
using kernels::fwd::ForwardKnobs;
using kernels::fwd::ForwardVariant;
using kernels::fwd::Schedule;

// A valid CUDA call; the fields the chooser does not read get fixed values (batch 8 of 512
// rows, 16 heads, a 32-key window where the mask has one).
jf_fwd_args call(int head_dim, jf_mask mask) {
  jf_fwd_args a{};
  a.problem.dtype = JF_BF16;
  a.problem.device = JF_DEVICE_CUDA;
  a.problem.batch_size = 8;
  a.problem.q = {nullptr, 4096, 16, head_dim, int64_t(16) * head_dim, head_dim};
  a.problem.k = a.problem.q;
  a.problem.v = a.problem.q;
  a.problem.mask = mask;
  a.problem.window_left = a.problem.window_right = mask == JF_MASK_WINDOW ? 32 : -1;
  return a;
}

// Every knob set to a value that is not the default.
ForwardKnobs every_knob() {
  ForwardKnobs k;
  k.schedule = Schedule::kZigzag;
  k.ping_pong = 1;
  k.block_n = 64;
  k.warpgroups = 3;
  k.pairs = 2;
  return k;
}

void expect_default_tile(const ForwardVariant& v, int head_dim) {
  EXPECT_EQ(v.block_n, head_dim == 256 ? 32 : head_dim == 192 ? 64 : 128);
  EXPECT_EQ(v.warpgroups, 2);
  EXPECT_EQ(v.block_m(), 128);
  EXPECT_EQ(v.pairs, 1);
  EXPECT_FALSE(v.ping_pong);
}

// No knob, no hint, no pooling, no modifier: D = 64 without a mask takes three consumer
// warpgroups (192-row tiles), every other (head dim, mask) the two-warpgroup 128 x 128 tile (96's
// own kernel included).
TEST(ForwardVariants, DefaultsFollowHeadDimAndMask) {
  struct Case {
    int head_dim;
    jf_mask mask;
    int warpgroups;
  };
  const Case cases[] = {
      {128, JF_MASK_NONE, 2},  {128, JF_MASK_CAUSAL, 2}, {128, JF_MASK_WINDOW, 2}, {64, JF_MASK_NONE, 3},
      {64, JF_MASK_CAUSAL, 2}, {64, JF_MASK_WINDOW, 2},  {96, JF_MASK_NONE, 2},    {96, JF_MASK_CAUSAL, 2},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "D=" << c.head_dim << " mask=" << c.mask);
    const ForwardVariant v = choose_forward_variant(call(c.head_dim, c.mask), ForwardKnobs{});
    EXPECT_EQ(v.block_n, 128);
    EXPECT_EQ(v.warpgroups, c.warpgroups);
    EXPECT_EQ(v.block_m(), 64 * c.warpgroups);
    EXPECT_EQ(v.pairs, 1);
    EXPECT_FALSE(v.ping_pong);
    EXPECT_EQ(v.schedule, Schedule::kDynamic);
  }
}

// D = 64 causal takes three warpgroups once both sides' mean sequence reaches
// kCausalThreeWarpgroupsMeanLength rows (a shape: rows / batch size), not below it, not with a
// window, not for an empty batch; pooled, the query set's length counts. The knobs still win.
TEST(ForwardVariants, LongCausalSequencesTakeThreeWarpgroupsAtHeadDim64) {
  const int64_t threshold = kernels::fwd::kCausalThreeWarpgroupsMeanLength;
  auto with_lengths = [](jf_mask mask, int64_t q_rows, int64_t kv_rows, int32_t batch) {
    jf_fwd_args a = call(64, mask);
    a.problem.batch_size = batch;
    a.problem.q.rows = q_rows;
    a.problem.k.rows = a.problem.v.rows = kv_rows;
    return a;
  };
  auto warpgroups = [](const jf_fwd_args& a, ForwardKnobs k = ForwardKnobs{}) {
    return choose_forward_variant(a, k).warpgroups;
  };
  EXPECT_EQ(warpgroups(with_lengths(JF_MASK_CAUSAL, 8 * threshold, 8 * threshold, 8)), 3);
  EXPECT_EQ(warpgroups(with_lengths(JF_MASK_CAUSAL, 8 * threshold - 1, 8 * threshold, 8)), 2);
  EXPECT_EQ(warpgroups(with_lengths(JF_MASK_CAUSAL, 8 * threshold, 8 * threshold - 1, 8)), 2);
  EXPECT_EQ(warpgroups(with_lengths(JF_MASK_CAUSAL, 0, 0, 0)), 2);
  EXPECT_EQ(warpgroups(with_lengths(JF_MASK_WINDOW, 8 * threshold, 8 * threshold, 8)), 2);
  EXPECT_EQ(warpgroups(with_lengths(JF_MASK_NONE, 8, 8, 8)), 3) << "no mask: three at every length";
  const jf_fwd_args long_128 = [&] {
    jf_fwd_args a = with_lengths(JF_MASK_CAUSAL, 8 * threshold, 8 * threshold, 8);
    a.problem.q.head_dim = a.problem.k.head_dim = a.problem.v.head_dim = 128;
    return a;
  }();
  EXPECT_EQ(warpgroups(long_128), 2) << "D = 128 has no three-warpgroup tile";
  ForwardKnobs two;
  two.warpgroups = 2;
  EXPECT_EQ(warpgroups(with_lengths(JF_MASK_CAUSAL, 8 * threshold, 8 * threshold, 8), two), 2);
  // Pooled: a query set of `threshold` rows (q.rows holds the set) against long sequences.
  jf_fwd_args pooled = with_lengths(JF_MASK_CAUSAL, threshold, 8 * threshold, 8);
  pooled.problem.pooled_q_rows = static_cast<int32_t>(threshold);
  EXPECT_EQ(warpgroups(pooled), 3);
  pooled.problem.q.rows = 8 * threshold;  // the dispatcher's view: the output rows
  EXPECT_EQ(warpgroups(pooled), 3);
  pooled.problem.pooled_q_rows = static_cast<int32_t>(threshold / 2);
  EXPECT_EQ(warpgroups(pooled), 2);
}

// The knobs are read from the environment at every call (bench/sweep.py times variants in one
// process), in a build with them; without them the environment plays no part.
TEST(ForwardVariants, KnobsAreReadAtEveryCall) {
  ASSERT_EQ(setenv("JAGFLASH_FWD_BLOCK_N", "64", 1), 0);
  const int with_knob = ForwardKnobs::get().block_n;
  ASSERT_EQ(setenv("JAGFLASH_FWD_BLOCK_N", "176", 1), 0);
  const int changed = ForwardKnobs::get().block_n;
  ASSERT_EQ(unsetenv("JAGFLASH_FWD_BLOCK_N"), 0);
  const int without = ForwardKnobs::get().block_n;
  if (kBenchKnobs) {
    EXPECT_EQ(with_knob, 64);
    EXPECT_EQ(changed, 176);
  } else {
    EXPECT_EQ(with_knob, 0);
    EXPECT_EQ(changed, 0);
  }
  EXPECT_EQ(without, 0);
}

// Each shape knob reaches only the tiles instantiated for it (fwd_launch.cuh): 64-key blocks
// at D = 128, the warpgroup count at D = 64, ping-pong with two consumer warpgroups; elsewhere
// the knob leaves the default. The schedule knob passes through everywhere.
TEST(ForwardVariants, ShapeKnobsReachOnlyTheirTiles) {
  ForwardKnobs block_n_64;
  block_n_64.block_n = 64;
  EXPECT_EQ(choose_forward_variant(call(128, JF_MASK_NONE), block_n_64).block_n, 64);
  EXPECT_EQ(choose_forward_variant(call(128, JF_MASK_CAUSAL), block_n_64).block_n, 64);
  EXPECT_EQ(choose_forward_variant(call(64, JF_MASK_CAUSAL), block_n_64).block_n, 128);
  ForwardKnobs block_n_160;
  block_n_160.block_n = 160;
  EXPECT_EQ(choose_forward_variant(call(128, JF_MASK_NONE), block_n_160).block_n, 160);
  EXPECT_EQ(choose_forward_variant(call(128, JF_MASK_CAUSAL), block_n_160).block_n, 160);
  EXPECT_EQ(choose_forward_variant(call(64, JF_MASK_NONE), block_n_160).block_n, 128);
  ForwardKnobs block_n_176;
  block_n_176.block_n = 176;
  EXPECT_EQ(choose_forward_variant(call(128, JF_MASK_NONE), block_n_176).block_n, 176);
  EXPECT_EQ(choose_forward_variant(call(128, JF_MASK_CAUSAL), block_n_176).block_n, 176);
  EXPECT_EQ(choose_forward_variant(call(64, JF_MASK_NONE), block_n_176).block_n, 128);

  ForwardKnobs three;
  three.warpgroups = 3;
  EXPECT_EQ(choose_forward_variant(call(64, JF_MASK_CAUSAL), three).warpgroups, 3);
  EXPECT_EQ(choose_forward_variant(call(128, JF_MASK_NONE), three).warpgroups, 2);
  ForwardKnobs two;
  two.warpgroups = 2;
  EXPECT_EQ(choose_forward_variant(call(64, JF_MASK_NONE), two).warpgroups, 2);

  ForwardKnobs ping_pong;
  ping_pong.ping_pong = 1;
  EXPECT_TRUE(choose_forward_variant(call(128, JF_MASK_NONE), ping_pong).ping_pong);
  EXPECT_TRUE(choose_forward_variant(call(64, JF_MASK_CAUSAL), ping_pong).ping_pong);
  EXPECT_FALSE(choose_forward_variant(call(64, JF_MASK_NONE), ping_pong).ping_pong)
      << "three consumer warpgroups have no ping-pong kernel";
  ping_pong.warpgroups = 2;
  EXPECT_TRUE(choose_forward_variant(call(64, JF_MASK_NONE), ping_pong).ping_pong);
  ForwardKnobs no_ping_pong;
  no_ping_pong.ping_pong = 0;
  EXPECT_FALSE(choose_forward_variant(call(128, JF_MASK_NONE), no_ping_pong).ping_pong);

  for (Schedule s : {Schedule::kDynamic, Schedule::kZigzag, Schedule::kGrid}) {
    ForwardKnobs k;
    k.schedule = s;
    for (int head_dim : {64, 128, 256})
      EXPECT_EQ(choose_forward_variant(call(head_dim, JF_MASK_CAUSAL), k).schedule, s) << "D=" << head_dim;
  }
}

// Two independent pairs: one warpgroup and 64 rows per tile whatever else is forced, 64-key
// blocks on the 96 and 128 kernels (two 128-key K/V stages per pair would not fit), no ping-pong;
// at the kernels' own head dims and padded below them.
TEST(ForwardVariants, PairsKnobGivesSingleWarpgroupTiles) {
  ForwardKnobs knobs;
  knobs.pairs = 2;
  knobs.ping_pong = 1;
  knobs.warpgroups = 3;
  for (int head_dim : {64, 96, 128, 8, 40, 80, 112})
    for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL}) {
      const ForwardVariant v = choose_forward_variant(call(head_dim, mask), knobs);
      SCOPED_TRACE(testing::Message() << "D=" << head_dim << " mask=" << mask);
      EXPECT_EQ(v.pairs, 2);
      EXPECT_EQ(v.warpgroups, 1);
      EXPECT_EQ(v.block_m(), 64);
      EXPECT_EQ(v.block_n, head_dim <= 64 ? 128 : 64);
      EXPECT_FALSE(v.ping_pong);
    }
  knobs.pairs = 1;
  EXPECT_EQ(choose_forward_variant(call(128, JF_MASK_NONE), knobs).pairs, 1);
}

// A rule that picks the two single-warpgroup pairs: set(a, x) for each x in `picks` gives them (one
// warpgroup a tile, 64-key blocks on the 96 and 128 kernels), each x in `keeps` the one-pair
// default, and the one-pair knob wins over a picking value; at the kernel head dims up to 128 and
// padded ones, under each of `masks`.
template <class Set>
void expect_pairs_rule(std::initializer_list<jf_mask> masks, Set set, std::initializer_list<int32_t> picks,
                       std::initializer_list<int32_t> keeps, const char* what) {
  const ForwardKnobs no_knobs;
  for (int head_dim : {64, 96, 128, 32, 80, 120})
    for (jf_mask mask : masks) {
      SCOPED_TRACE(testing::Message() << "D=" << head_dim << " mask=" << mask);
      jf_fwd_args a = call(head_dim, mask);
      for (int32_t x : picks) {
        set(a, x);
        const ForwardVariant v = choose_forward_variant(a, no_knobs);
        EXPECT_EQ(v.pairs, 2) << what << " " << x;
        EXPECT_EQ(v.warpgroups, 1) << what << " " << x;
        EXPECT_EQ(v.block_n, head_dim <= 64 ? 128 : 64) << what << " " << x;
      }
      for (int32_t x : keeps) {
        set(a, x);
        EXPECT_EQ(choose_forward_variant(a, no_knobs).pairs, 1) << what << " " << x;
      }
      ForwardKnobs one_pair;
      one_pair.pairs = 1;
      set(a, *picks.begin());
      EXPECT_EQ(choose_forward_variant(a, one_pair).pairs, 1) << what << " " << *picks.begin();
    }
}

// A max_seqlen hint of at most 256 (every sequence short) picks the two-pair variant at both
// head dims and masks; a longer or unknown (0) one keeps the default; a knob still wins.
TEST(ForwardVariants, ShortMaxSeqlenHintPicksPairs) {
  expect_pairs_rule(
      {JF_MASK_NONE, JF_MASK_CAUSAL}, [](jf_fwd_args& a, int32_t hint) { a.launch.max_seqlen_hint = hint; },
      {100, 1, 136, kernels::fwd::kPairsMaxSeqlen}, {0, kernels::fwd::kPairsMaxSeqlen + 1, 16384}, "hint");
}

// A pooled call whose query set has at most 64 rows takes the two single-warpgroup pairs (two
// sequences a CTA, each its own keys), whatever the hint; a larger set keeps the default; a knob
// still wins.
TEST(ForwardVariants, SmallPooledQuerySetPicksPairs) {
  expect_pairs_rule(
      {JF_MASK_NONE, JF_MASK_WINDOW}, [](jf_fwd_args& a, int32_t rows) { a.problem.pooled_q_rows = rows; },
      {16, 1, kernels::fwd::kPooledPairsMaxRows}, {0, kernels::fwd::kPooledPairsMaxRows + 1, 200}, "Lq");
}

// D = 256 has one kernel (32-key blocks, two warpgroups, one pair: what fits the shared memory
// and registers): neither the max_seqlen hint, the pooled query set nor the shape knobs may
// select another, for which no D = 256 kernel exists. The schedule knob still applies.
TEST(ForwardVariants, HeadDim256HasOneShape) {
  for (int d : {192, 256})  // 192: its own forward, 64-key blocks
    for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL})
      for (int32_t hint : {0, 100, 256, 5000})
        for (int32_t pooled_rows : {0, 16})
          for (const ForwardKnobs& knobs : {ForwardKnobs{}, every_knob()}) {
            SCOPED_TRACE(testing::Message() << "mask=" << mask << " hint=" << hint << " Lq=" << pooled_rows);
            jf_fwd_args a = call(d, mask);
            a.launch.max_seqlen_hint = hint;
            a.problem.pooled_q_rows = pooled_rows;
            const ForwardVariant v = choose_forward_variant(a, knobs);
            expect_default_tile(v, d);
            EXPECT_EQ(v.schedule, knobs.schedule);
          }
}

// A call with a score modifier runs the one tile its kernels are instantiated for (two consumer
// warpgroups, 128-key blocks, 32 at D = 256; fwd_launch.cuh run_forward_modified), so the
// chooser must name that tile whatever would pick another without the modifier: D = 64 without
// a mask, a short max_seqlen hint, a small pooled query set, every shape knob. Each case is
// checked to pick another tile without the modifier, so the modifier is what decides it.
TEST(ForwardVariants, ScoreModifierTakesTheDefaultTile) {
  struct Case {
    const char* what;
    int head_dim;
    jf_mask mask;
    int32_t hint, pooled_rows;
    ForwardKnobs knobs;
  };
  const Case cases[] = {
      {"D = 64 without a mask", 64, JF_MASK_NONE, 0, 0, ForwardKnobs{}},
      {"a short hint", 128, JF_MASK_CAUSAL, 100, 0, ForwardKnobs{}},
      {"a short hint", 64, JF_MASK_WINDOW, kernels::fwd::kPairsMaxSeqlen, 0, ForwardKnobs{}},
      {"a small pooled query set", 128, JF_MASK_NONE, 0, 16, ForwardKnobs{}},
      {"every knob", 128, JF_MASK_NONE, 0, 0, every_knob()},
      {"every knob", 64, JF_MASK_CAUSAL, 0, 0, every_knob()},
  };
  for (jf_score_mod mod : {JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI})
    for (const Case& c : cases) {
      SCOPED_TRACE(testing::Message()
                   << c.what << ": D=" << c.head_dim << " mask=" << c.mask << " mod=" << mod);
      jf_fwd_args a = call(c.head_dim, c.mask);
      a.launch.max_seqlen_hint = c.hint;
      a.problem.pooled_q_rows = c.pooled_rows;
      const ForwardVariant plain = choose_forward_variant(a, c.knobs);
      EXPECT_TRUE(plain.warpgroups != 2 || plain.block_n != 128 || plain.pairs != 1 || plain.ping_pong)
          << "without the modifier this case already takes the default tile";
      a.problem.score_mod = mod;
      const ForwardVariant v = choose_forward_variant(a, c.knobs);
      expect_default_tile(v, c.head_dim);
      EXPECT_EQ(v.schedule, c.knobs.schedule);
    }
  for (jf_score_mod mod : {JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI}) {
    jf_fwd_args a = call(256, JF_MASK_NONE);
    a.problem.score_mod = mod;
    expect_default_tile(choose_forward_variant(a, every_knob()), 256);
  }
}

// A head dim below its kernel's (a multiple of 8 that is not 64, 96, 128, 192 or 256) runs that
// kernel padded, instantiated for the default tile and, up to 128, the two pairs
// (fwd_launch.cuh run_forward_default_tile): two warpgroups and 128-key blocks up to 128, the 192
// and 256 kernels' 64- and 32-key blocks above. No shape knob reaches it (D = 64's three
// warpgroups, the 64-key blocks, ping-pong); a short hint, a small pooled query set or the pairs
// knob give the pairs up to 128 and the default tile past it.
TEST(ForwardVariants, PaddedHeadDimsTakeTheDefaultTileOrThePairs) {
  struct Input {
    const char* what;
    jf_mask mask;
    int32_t hint, pooled_rows;
    ForwardKnobs knobs;
    bool pairs;  // whether it picks the two pairs up to 128
  };
  ForwardKnobs shape_knobs = every_knob();
  shape_knobs.pairs = 0;
  const Input inputs[] = {
      {"no mask", JF_MASK_NONE, 0, 0, ForwardKnobs{}, false},
      {"every shape knob", JF_MASK_CAUSAL, 0, 0, shape_knobs, false},
      {"a short hint", JF_MASK_CAUSAL, 100, 0, ForwardKnobs{}, true},
      {"a small pooled query set", JF_MASK_WINDOW, 0, 16, ForwardKnobs{}, true},
      {"every knob", JF_MASK_CAUSAL, 0, 0, every_knob(), true},
  };
  for (int head_dim : {8, 32, 40, 72, 88, 104, 112, 136, 184, 248})
    for (const Input& in : inputs) {
      SCOPED_TRACE(testing::Message() << in.what << ": D=" << head_dim);
      // The forward's kernel head dims: 64, 96 (or 128 in a build without it), 128, 192, 256.
      const auto* entry = kernels::find_hopper_forward(JF_BF16, head_dim, JF_SCORE_MOD_NONE);
      const int kernel_d = entry != nullptr ? entry->head_dim : kernels::kernel_head_dim(head_dim);
      jf_fwd_args a = call(head_dim, in.mask);
      a.launch.max_seqlen_hint = in.hint;
      a.problem.pooled_q_rows = in.pooled_rows;
      const ForwardVariant v = choose_forward_variant(a, in.knobs);
      EXPECT_EQ(v.schedule, in.knobs.schedule);
      if (in.pairs && kernel_d <= 128) {
        EXPECT_EQ(v.pairs, 2);
        EXPECT_EQ(v.warpgroups, 1);
        EXPECT_EQ(v.block_n, kernel_d == 64 ? 128 : 64);
        EXPECT_FALSE(v.ping_pong);
      } else {
        expect_default_tile(v, kernel_d);
      }
    }
}

// Which Hopper kernel serves a head dim (the registry's tables, no GPU needed): the forward takes
// the narrowest kernel at or above the head dim that has the call's variant (96's own forward for
// 72-96 without a modifier or a map, padded below 96 or with a narrower v), the backward the next
// of 64, 128, 256 up. A build without the D = 96 forward (JAGFLASH_FORWARD_HEAD_DIMS empty) serves
// 72-96 with the 128 kernel instead; one without Hopper kernels has no entries at all.
// The Hopper dtypes this build has (JAGFLASH_HOPPER_DTYPES: bf16 alone in the CPU-only CI build).
std::vector<jf_dtype> built_hopper_dtypes() {
  std::vector<jf_dtype> built;
  for (jf_dtype dt : {JF_BF16, JF_FP16})
    if (kernels::find_hopper_forward(dt, 128, JF_SCORE_MOD_NONE) != nullptr) built.push_back(dt);
  return built;
}

TEST(HopperKernels, TheNarrowestKernelWithTheVariantServesAHeadDim) {
  if (kernels::find_hopper_forward(JF_BF16, 128, JF_SCORE_MOD_NONE) == nullptr)
    GTEST_SKIP() << "a build without the Hopper kernels (JAGFLASH_PTX_ONLY or no sm_90a)";
  const auto* own96 = kernels::find_hopper_forward(JF_BF16, 96, JF_SCORE_MOD_NONE);
  ASSERT_NE(own96, nullptr);
  const int k96 = own96->head_dim;  // 96 with the forward-only head dim, else 128
  ASSERT_TRUE(k96 == 96 || k96 == 128) << k96;
  EXPECT_EQ(own96->padded, k96 != 96);
  struct Case {
    int d, dv;
    jf_score_mod mod;
    int kernel;  // 0: no Hopper forward
    bool padded;
  };
  const Case cases[] = {
      {64, 0, JF_SCORE_MOD_NONE, 64, false},      {56, 0, JF_SCORE_MOD_NONE, 64, true},
      {72, 0, JF_SCORE_MOD_NONE, k96, true},      {80, 0, JF_SCORE_MOD_NONE, k96, true},
      {96, 64, JF_SCORE_MOD_NONE, k96, true},     {104, 0, JF_SCORE_MOD_NONE, 128, true},
      {128, 0, JF_SCORE_MOD_NONE, 128, false},    {128, 96, JF_SCORE_MOD_NONE, 128, true},
      {192, 128, JF_SCORE_MOD_NONE, 192, true},   {256, 0, JF_SCORE_MOD_NONE, 256, false},
      {160, 0, JF_SCORE_MOD_NONE, 192, true},     {200, 0, JF_SCORE_MOD_NONE, 256, true},
      {128, 0, JF_SCORE_MOD_SOFTCAP, 128, false}, {96, 0, JF_SCORE_MOD_SOFTCAP, 0, false},
      {80, 0, JF_SCORE_MOD_ALIBI, 0, false},      {36, 0, JF_SCORE_MOD_NONE, 0, false},
      {264, 0, JF_SCORE_MOD_NONE, 0, false},
  };
  for (jf_dtype dt : built_hopper_dtypes())
    for (const Case& c : cases) {
      SCOPED_TRACE(testing::Message()
                   << "D=" << c.d << " Dv=" << c.dv << " mod=" << c.mod << " dtype=" << dt);
      const auto* e = kernels::find_hopper_forward(dt, c.d, c.mod, false, c.dv);
      if (c.kernel == 0) {
        EXPECT_EQ(e, nullptr);
        continue;
      }
      ASSERT_NE(e, nullptr);
      EXPECT_EQ(e->head_dim, c.kernel);
      EXPECT_EQ(e->padded, c.padded);
      EXPECT_EQ(e->dtype, dt);
    }
  // A block-sparse map: 64 and 128 only, never the D = 96 forward.
  const auto* sparse80 = kernels::find_hopper_forward(JF_BF16, 80, JF_SCORE_MOD_NONE, true);
  EXPECT_EQ(sparse80, nullptr);
  // The backward's kernel for each head dim from 72 up: the 128-key tiles of 96 (72-88 padded)
  // and 128 (104-120 padded), past 128 the wide kernels (64-key tiles) of 192 (a backward-only
  // head dim; 136-184 padded) and 256 (200-248 padded); not with a score modifier or a
  // block-sparse map past 128 (below).
  for (jf_dtype dt : built_hopper_dtypes())
    for (int d = 72; d <= 256; d += 8) {
      const auto* b = kernels::find_hopper_backward(dt, d, JF_SCORE_MOD_NONE);
      ASSERT_NE(b, nullptr) << d;
      const int want = d <= 96 ? 96 : d <= 128 ? 128 : d <= 192 ? 192 : 256;
      EXPECT_EQ(b->head_dim, want) << d;
      EXPECT_EQ(b->padded, d != want) << d;
      EXPECT_EQ(kernels::backward_block_n(b->head_dim), want > 128 ? 64 : 128) << d;
    }
  // A narrower v runs q's kernel padded (V and dO zero-filled past it): (96, 64), DeepSeek's
  // (192, 128).
  const auto* narrow_v96 = kernels::find_hopper_backward(JF_BF16, 96, JF_SCORE_MOD_NONE, false, 64);
  ASSERT_NE(narrow_v96, nullptr);
  EXPECT_EQ(narrow_v96->head_dim, 96);
  EXPECT_TRUE(narrow_v96->padded);
  const auto* deepseek = kernels::find_hopper_backward(JF_BF16, 192, JF_SCORE_MOD_NONE, false, 128);
  ASSERT_NE(deepseek, nullptr);
  EXPECT_EQ(deepseek->head_dim, 192);
  EXPECT_TRUE(deepseek->padded);
  // The forward's own 192 kernel (no modifier: 192 with softcap is refused on CUDA).
  const auto* forward192 = kernels::find_hopper_forward(JF_BF16, 192, JF_SCORE_MOD_NONE);
  ASSERT_NE(forward192, nullptr);
  EXPECT_EQ(forward192->head_dim, 192);
  EXPECT_EQ(kernels::find_hopper_forward(JF_BF16, 192, JF_SCORE_MOD_SOFTCAP), nullptr);
  EXPECT_TRUE(kernels::find_hopper_backward(JF_BF16, 256, JF_SCORE_MOD_NONE, false, 128)->padded);
  // The wide backward of 256 with softcap and ALiBi (unpadded: no padded modifier kernels), not
  // with the relative bias.
  const auto* softcap256 = kernels::find_hopper_backward(JF_BF16, 256, JF_SCORE_MOD_SOFTCAP);
  ASSERT_NE(softcap256, nullptr);
  EXPECT_EQ(softcap256->head_dim, 256);
  EXPECT_FALSE(softcap256->padded);
  EXPECT_NE(kernels::find_hopper_backward(JF_BF16, 256, JF_SCORE_MOD_ALIBI), nullptr);
  EXPECT_EQ(kernels::find_hopper_backward(JF_BF16, 256, JF_SCORE_MOD_RELATIVE_BIAS), nullptr);
  EXPECT_EQ(kernels::find_hopper_backward(JF_BF16, 256, JF_SCORE_MOD_NONE, true), nullptr);
  EXPECT_EQ(kernels::backward_block_n(128), 128);
  EXPECT_EQ(kernels::backward_block_n(64), 128);
}

}  // namespace
}  // namespace jagflash
