// Validation of pooled attention (jf_problem.pooled_q_rows): every rule of the contract
// with its status and message (argument, expected, given), outputs left exactly as they were.
#include <jagflash/jagflash.h>

#include "testing/host_batch.hpp"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace jagflash {
namespace {

constexpr double kSentinel = 7.0;  // exactly representable in every dtype
constexpr int kLq = 16, kH = 4, kHkv = 2, kD = 64;

// B = 3 sequences of kv lengths 4, 0, 7 attended by one query set of kLq rows.
struct PooledCall {
  std::vector<int32_t> kv_offsets = {0, 4, 4, 11};
  test::HostTensor q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse;
  std::vector<int32_t> scratch, scratch_before;  // a case may point arguments into it
  jf_fwd_args fwd{};
  jf_bwd_args bwd{};

  static constexpr int32_t kB = 3;
  static constexpr int64_t kRows = int64_t{kB} * kLq;

  PooledCall() {
    std::mt19937_64 rng(11);
    q = test::make_tensor(JF_BF16, kLq, kH, kD);
    k = test::make_tensor(JF_BF16, 11, kHkv, kD);
    v = test::make_tensor(JF_BF16, 11, kHkv, kD);
    dout = test::make_tensor(JF_BF16, kRows, kH, kD);
    for (test::HostTensor* t : {&q, &k, &v, &dout}) t->fill_random(rng);
    out = test::make_tensor(JF_BF16, kRows, kH, kD);
    dq = test::make_tensor(JF_BF16, kLq, kH, kD);
    dk = test::make_tensor(JF_BF16, 11, kHkv, kD);
    dv = test::make_tensor(JF_BF16, 11, kHkv, kD);
    for (test::HostTensor* t : {&out, &dq, &dk, &dv}) t->fill(kSentinel);
    lse.assign(static_cast<size_t>(kH * kRows), static_cast<float>(kSentinel));
    fwd = test::forward_args(
        test::make_problem(JF_BF16, nullptr, kv_offsets, q, k, v, JF_MASK_NONE, -1, -1, kLq), out,
        lse.data());
    bwd = test::backward_args(fwd.problem, out, dout, lse.data(), dq, dk, dv);
  }

  bool outputs_untouched() const {
    for (const test::HostTensor* t : {&out, &dq, &dk, &dv})
      for (int64_t i = 0; i < t->element_count(); ++i)
        if (t->get_flat(i) != kSentinel) return false;
    for (float x : lse)
      if (x != static_cast<float>(kSentinel)) return false;
    return scratch == scratch_before;
  }
};

struct Case {
  const char* name;
  std::function<void(PooledCall&)> break_it;
  jf_status status;
  std::vector<std::string> message_parts;
};

void expect_error(jf_status got, const Case& c, const PooledCall& call) {
  EXPECT_EQ(got, c.status) << c.name;
  const std::string msg = jagflash_last_error();
  for (const std::string& part : c.message_parts)
    EXPECT_NE(msg.find(part), std::string::npos)
        << c.name << ": message '" << msg << "' lacks '" << part << "'";
  EXPECT_TRUE(call.outputs_untouched()) << c.name;
}

auto both(std::function<void(jf_problem&)> f) {
  return [f](PooledCall& c) {
    f(c.fwd.problem);
    f(c.bwd.problem);
  };
}

// Rules of the problem itself: both directions and the size queries report them.
std::vector<Case> problem_cases() {
  static std::vector<int32_t> q_offsets = {0, 16, 32, 48};
  return {
      {"negative pooled_q_rows",
       both([](jf_problem& p) { p.pooled_q_rows = -3; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.pooled_q_rows", "expected >= 0", "got -3"}},
      {"q_offsets given when pooled",
       both([](jf_problem& p) { p.q_offsets = q_offsets.data(); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q_offsets", "expected NULL when problem.pooled_q_rows > 0", "got a non-null pointer"}},
      {"q rows not Lq",
       both([](jf_problem& p) { p.q.rows = kLq - 1; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q.rows", "expected problem.pooled_q_rows (16)", "got 15"}},
      {"q rows the output rows",
       both([](jf_problem& p) { p.q.rows = PooledCall::kRows; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q.rows", "expected problem.pooled_q_rows (16)", "got 48"}},
      {"output rows past int32",
       both([](jf_problem& p) {
         p.batch_size = 1 << 12;
         p.pooled_q_rows = 1 << 20;
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.pooled_q_rows", "batch_size * pooled_q_rows (the output rows) <= 2^31-1", "4294967296"}},
      {"with a block mask",
       both([](jf_problem& p) {
         static const uint8_t blocks[3] = {1, 1, 1};
         static const int32_t offsets[4] = {0, 1, 1, 2};
         p.block_mask.blocks = blocks;
         p.block_mask.offsets = offsets;
         p.block_mask.bytes = sizeof blocks;
       }),
       JF_ERR_UNSUPPORTED,
       {"problem.block_mask", "expected none (blocks and offsets NULL) with pooled attention",
        "got a block mask"}},
      {"ordinary without q_offsets",
       both([](jf_problem& p) { p.pooled_q_rows = 0; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q_offsets", "a non-null pointer", "NULL"}},
  };
}

std::vector<Case> offsets_cases() {
  static std::vector<int32_t> kv_wrong_total = {0, 4, 4, 12};
  static std::vector<int32_t> kv_decreasing = {0, 4, 3, 11};
  return {
      {"kv offsets total",
       both([](jf_problem& p) { p.kv_offsets = kv_wrong_total.data(); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.kv_offsets[B=3]", "token count 11", "got 12"}},
      {"kv offsets decreasing",
       both([](jf_problem& p) { p.kv_offsets = kv_decreasing.data(); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.kv_offsets[2]", "non-decreasing", "got 3"}},
  };
}

TEST(ValidationPooled, ValidCallSucceedsAndRunsOnTheReference) {
  PooledCall call;
  ASSERT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&call.bwd), JF_OK) << jagflash_last_error();
  EXPECT_FALSE(call.outputs_untouched());
  size_t bytes = 1;
  ASSERT_EQ(jagflash_fwd_workspace_size(&call.fwd, &bytes), JF_OK) << jagflash_last_error();
  EXPECT_EQ(bytes, 0u);
  ASSERT_EQ(jagflash_bwd_workspace_size(&call.bwd, &bytes), JF_OK) << jagflash_last_error();
  EXPECT_EQ(bytes, 0u);
  for (jf_direction dir : {JF_DIRECTION_FORWARD, JF_DIRECTION_BACKWARD}) {
    jf_backend served = JF_BACKEND_AUTO;
    ASSERT_EQ(jagflash_query_backend(&call.fwd.problem, &call.fwd.launch, dir, &served), JF_OK)
        << jagflash_last_error();
    EXPECT_EQ(served, JF_BACKEND_REFERENCE);
  }
}

TEST(ValidationPooled, ProblemErrors) {
  for (const Case& c : problem_cases()) {
    {
      PooledCall call;
      c.break_it(call);
      expect_error(jagflash_fwd(&call.fwd), c, call);
      size_t bytes = 0;
      EXPECT_EQ(jagflash_fwd_workspace_size(&call.fwd, &bytes), c.status) << c.name;
      jf_backend served = JF_BACKEND_AUTO;
      EXPECT_EQ(jagflash_query_backend(&call.fwd.problem, &call.fwd.launch, JF_DIRECTION_FORWARD, &served),
                c.status)
          << c.name;
    }
    PooledCall call;
    c.break_it(call);
    expect_error(jagflash_bwd(&call.bwd), c, call);
    size_t bytes = 0;
    EXPECT_EQ(jagflash_bwd_workspace_size(&call.bwd, &bytes), c.status) << c.name;
  }
}

// Offsets are read by the calls, not by the size queries; only kv_offsets exist when pooled.
TEST(ValidationPooled, KvOffsetsErrors) {
  for (const Case& c : offsets_cases()) {
    PooledCall fwd_call, bwd_call;
    c.break_it(fwd_call);
    c.break_it(bwd_call);
    expect_error(jagflash_fwd(&fwd_call.fwd), c, fwd_call);
    expect_error(jagflash_bwd(&bwd_call.bwd), c, bwd_call);
  }
}

TEST(ValidationPooled, OutputShapesAreTheOutputRows) {
  const std::vector<Case> fwd_cases = {
      {"out rows Lq",
       [](PooledCall& c) { c.fwd.out.rows = kLq; },
       JF_ERR_INVALID_ARGUMENT,
       {"out.rows", "expected 48", "got 16"}},
      // lse is [H, B*Lq]: out laid just past lse's first H*Lq floats overlaps it (a check sizing
      // lse by q.rows would let the forward write lse over out).
      {"out inside lse's [H, B*Lq] span",
       [](PooledCall& c) {
         const size_t lse_floats = static_cast<size_t>(kH * PooledCall::kRows);
         const size_t out_ints = static_cast<size_t>(c.out.element_count()) * 2 / sizeof(int32_t);
         c.scratch.assign(kH * kLq + out_ints, 0x5a5a5a5a);
         c.scratch_before = c.scratch;
         ASSERT_GT(lse_floats, static_cast<size_t>(kH * kLq));
         c.fwd.lse = reinterpret_cast<float*>(c.scratch.data());
         c.fwd.out.data = c.scratch.data() + kH * kLq;
       },
       JF_ERR_INVALID_ARGUMENT,
       {"out", "disjoint from lse"}},
  };
  for (const Case& c : fwd_cases) {
    PooledCall call;
    c.break_it(call);
    expect_error(jagflash_fwd(&call.fwd), c, call);
  }
  const std::vector<Case> bwd_cases = {
      {"out rows Lq",
       [](PooledCall& c) { c.bwd.out.rows = kLq; },
       JF_ERR_INVALID_ARGUMENT,
       {"out.rows", "expected 48", "got 16"}},
      {"dout rows Lq",
       [](PooledCall& c) { c.bwd.dout.rows = kLq; },
       JF_ERR_INVALID_ARGUMENT,
       {"dout.rows", "expected 48", "got 16"}},
      {"dq rows the output rows",
       [](PooledCall& c) { c.bwd.dq.rows = PooledCall::kRows; },
       JF_ERR_INVALID_ARGUMENT,
       {"dq.rows", "expected 16", "got 48"}},
      {"lse null",
       [](PooledCall& c) { c.bwd.lse = nullptr; },
       JF_ERR_INVALID_ARGUMENT,
       {"lse", "the forward's lse [H, B*Lq] (non-null)", "NULL"}},
      // dq over the tail of lse's [H, B*Lq] span (past its first H*Lq floats).
      {"dq over lse's tail",
       [](PooledCall& c) {
         const size_t lse_floats = static_cast<size_t>(kH * PooledCall::kRows);
         const size_t dq_ints = static_cast<size_t>(c.dq.element_count()) * 2 / sizeof(int32_t);
         c.scratch.assign(lse_floats + dq_ints, 0x5a5a5a5a);
         c.scratch_before = c.scratch;
         c.bwd.lse = reinterpret_cast<const float*>(c.scratch.data());
         c.bwd.dq.data = c.scratch.data() + lse_floats - 64;
       },
       JF_ERR_INVALID_ARGUMENT,
       {"dq", "disjoint from the input lse"}},
  };
  for (const Case& c : bwd_cases) {
    PooledCall call;
    c.break_it(call);
    expect_error(jagflash_bwd(&call.bwd), c, call);
  }
}

// A batch of no sequences is legal: out and lse have no rows, dq [Lq, H, D] is written as zeros.
TEST(ValidationPooled, EmptyBatchIsLegal) {
  PooledCall call;
  static const int32_t zero[1] = {0};
  for (jf_problem* p : {&call.fwd.problem, &call.bwd.problem}) {
    p->batch_size = 0;
    p->kv_offsets = zero;
    p->k.rows = p->v.rows = 0;
  }
  call.fwd.out.rows = call.bwd.out.rows = call.bwd.dout.rows = 0;
  call.bwd.dk.rows = call.bwd.dv.rows = 0;
  call.fwd.lse = nullptr;  // no rows: not needed
  call.bwd.lse = nullptr;
  EXPECT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();
  EXPECT_EQ(jagflash_bwd(&call.bwd), JF_OK) << jagflash_last_error();
  for (int64_t r = 0; r < kLq; ++r)
    for (int h = 0; h < kH; ++h)
      for (int d = 0; d < kD; ++d) ASSERT_EQ(call.dq.get(r, h, d), 0.0);
}

}  // namespace
}  // namespace jagflash
