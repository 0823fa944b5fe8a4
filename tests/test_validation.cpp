// Every validation error: the status, a message naming the argument with what was expected and
// what was given, and outputs left exactly as they were.
#include <jagflash/jagflash.h>

#include "api/error.hpp"
#include "api/validate.hpp"
#include "testing/host_batch.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace jagflash {
namespace {

constexpr double kSentinel = 7.0;  // exactly representable in every dtype

struct Call {
  test::HostBatch batch;
  test::HostTensor out, dout, dq, dk, dv;
  std::vector<float> lse;
  // A buffer a case may point arguments into (checked untouched like the outputs).
  std::vector<int32_t> scratch, scratch_before;
  jf_fwd_args fwd{};
  jf_bwd_args bwd{};

  // q and k at head dim d, v (and out, dout, dv) at dv_dim.
  explicit Call(int d = 64, int dv_dim = 64) {
    batch = test::make_random_batch({3, 0, 5}, {4, 2, 5}, 4, 2, d, JF_BF16, 5);
    const int64_t tq = batch.total_q(), tk = batch.total_kv();
    if (dv_dim != d) {
      batch.v = test::make_tensor(JF_BF16, tk, 2, dv_dim);
      std::mt19937_64 v_rng(6);
      batch.v.fill_random(v_rng);
    }
    out = test::make_tensor(JF_BF16, tq, 4, dv_dim);
    dout = test::make_tensor(JF_BF16, tq, 4, dv_dim);
    dq = test::make_tensor(JF_BF16, tq, 4, d);
    dk = test::make_tensor(JF_BF16, tk, 2, d);
    dv = test::make_tensor(JF_BF16, tk, 2, dv_dim);
    for (test::HostTensor* t : {&out, &dq, &dk, &dv}) t->fill(kSentinel);
    std::mt19937_64 rng(9);
    dout.fill_random(rng);
    lse.assign(static_cast<size_t>(4 * tq), static_cast<float>(kSentinel));
    fwd = test::forward_args(test::make_problem(batch, JF_MASK_NONE, -1, -1), out, lse.data());
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
  std::function<void(Call&)> break_it;  // applied to both the forward and the backward args
  jf_status status;
  std::vector<std::string> message_parts;
};

void apply_to_problem(Call& c, const std::function<void(jf_problem&)>& f) {
  f(c.fwd.problem);
  f(c.bwd.problem);
}

std::vector<Case> problem_cases() {
  auto p = [](std::function<void(jf_problem&)> f) { return [f](Call& c) { apply_to_problem(c, f); }; };
  static std::vector<int32_t> bad_first = {1, 3, 3, 8};
  static std::vector<int32_t> decreasing = {0, 3, 2, 8};
  static std::vector<int32_t> wrong_total = {0, 3, 3, 9};
  static std::vector<float> alibi_slopes(4, 0.25f);
  static std::vector<float> nan_slopes = {0.25f, 0.5f, std::numeric_limits<float>::quiet_NaN(), 1.0f};
  static std::vector<float> inf_sinks = {0.25f, std::numeric_limits<float>::infinity(), 0.5f, 1.0f};
  static std::vector<float> sinks(5, 0.5f);
  static std::vector<float> inf_table = [] {
    std::vector<float> table(4 * 3, 0.5f);
    table[1 * 3 + 2] = -std::numeric_limits<float>::infinity();
    return table;
  }();
  return {
      {"dtype",
       p([](jf_problem& q) { q.dtype = static_cast<jf_dtype>(7); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.dtype", "expected", "got 7"}},
      {"device",
       p([](jf_problem& q) { q.device = static_cast<jf_device>(5); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.device", "got 5"}},
      {"mask",
       p([](jf_problem& q) { q.mask = static_cast<jf_mask>(9); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.mask", "got 9"}},
      {"score_mod kind",
       p([](jf_problem& q) { q.score_mod = static_cast<jf_score_mod>(99); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.score_mod", "one of JF_SCORE_MOD_NONE, JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI", "got 99"}},
      {"score_mod kind negative",
       p([](jf_problem& q) { q.score_mod = static_cast<jf_score_mod>(-1); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.score_mod", "got -1"}},
      {"score_mod table set without a kind that reads it",
       p([](jf_problem& q) { q.score_mod_table = alibi_slopes.data(); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.score_mod_table", "NULL with JF_SCORE_MOD_NONE"}},
      {"score_mod table width set without a kind that reads it",
       p([](jf_problem& q) {
         q.score_mod = JF_SCORE_MOD_ALIBI;
         q.alibi_slopes = alibi_slopes.data();
         q.score_mod_table_width = 3;
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.score_mod_table_width", "0 with JF_SCORE_MOD_ALIBI", "got 3"}},
      {"softcap zero",
       p([](jf_problem& q) { q.score_mod = JF_SCORE_MOD_SOFTCAP; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.softcap", "a finite number > 0 with JF_SCORE_MOD_SOFTCAP", "got 0"}},
      {"softcap negative",
       p([](jf_problem& q) {
         q.score_mod = JF_SCORE_MOD_SOFTCAP;
         q.softcap = -30.0f;
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.softcap", "> 0", "got -30"}},
      {"softcap infinite",
       p([](jf_problem& q) {
         q.score_mod = JF_SCORE_MOD_SOFTCAP;
         q.softcap = std::numeric_limits<float>::infinity();
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.softcap", "finite", "got inf"}},
      {"softcap nan",
       p([](jf_problem& q) {
         q.score_mod = JF_SCORE_MOD_SOFTCAP;
         q.softcap = std::numeric_limits<float>::quiet_NaN();
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.softcap", "finite", "got nan"}},
      {"softcap set without the kind",
       p([](jf_problem& q) { q.softcap = 30.0f; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.softcap", "0 with JF_SCORE_MOD_NONE", "got 30"}},
      {"softcap set with alibi",
       p([](jf_problem& q) {
         q.score_mod = JF_SCORE_MOD_ALIBI;
         q.alibi_slopes = alibi_slopes.data();
         q.softcap = 30.0f;
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.softcap", "0 with JF_SCORE_MOD_ALIBI", "got 30"}},
      {"alibi slopes null",
       p([](jf_problem& q) { q.score_mod = JF_SCORE_MOD_ALIBI; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.alibi_slopes", "a non-null pointer to H float32", "got NULL"}},
      {"alibi slopes misaligned",
       p([](jf_problem& q) {
         q.score_mod = JF_SCORE_MOD_ALIBI;
         q.alibi_slopes =
             reinterpret_cast<const float*>(reinterpret_cast<const char*>(alibi_slopes.data()) + 1);
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.alibi_slopes", "4-byte alignment"}},
      {"alibi slopes set without the kind",
       p([](jf_problem& q) { q.alibi_slopes = alibi_slopes.data(); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.alibi_slopes", "NULL with JF_SCORE_MOD_NONE"}},
      {"alibi slopes set with softcap",
       p([](jf_problem& q) {
         q.score_mod = JF_SCORE_MOD_SOFTCAP;
         q.softcap = 30.0f;
         q.alibi_slopes = alibi_slopes.data();
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.alibi_slopes", "NULL with JF_SCORE_MOD_SOFTCAP"}},
      {"values: alibi slope NaN (read on the CPU)",
       p([](jf_problem& q) {
         q.score_mod = JF_SCORE_MOD_ALIBI;
         q.alibi_slopes = nan_slopes.data();
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.alibi_slopes[2]: expected a finite number, got nan"}},
      {"values: learnable sink infinite (read on the CPU)",
       p([](jf_problem& q) { q.learnable_sink = inf_sinks.data(); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.learnable_sink[1]: expected a finite number, got inf"}},
      {"learnable sink misaligned",
       p([](jf_problem& q) {
         q.learnable_sink = reinterpret_cast<const float*>(reinterpret_cast<const char*>(sinks.data()) + 2);
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.learnable_sink", "4-byte alignment"}},
      {"values: score_mod_table entry infinite (read on the CPU)",
       p([](jf_problem& q) {
         q.score_mod = JF_SCORE_MOD_RELATIVE_BIAS;
         q.score_mod_table = inf_table.data();
         q.score_mod_table_width = 3;
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.score_mod_table[1][2]: expected a finite number, got -inf"}},
      {"batch",
       p([](jf_problem& q) { q.batch_size = -1; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.batch_size", ">= 0", "got -1"}},
      {"q_offsets null",
       p([](jf_problem& q) { q.q_offsets = nullptr; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q_offsets", "NULL"}},
      {"kv_offsets null",
       p([](jf_problem& q) { q.kv_offsets = nullptr; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.kv_offsets", "NULL"}},
      {"head dim not a multiple of 8",
       p([](jf_problem& q) { q.q.head_dim = q.k.head_dim = q.v.head_dim = 36; }),
       JF_ERR_UNSUPPORTED,
       {"problem.q.head_dim", "a multiple of 8 from 8 to 256", "got 36"}},
      {"head dim above 256",
       p([](jf_problem& q) { q.q.head_dim = q.k.head_dim = q.v.head_dim = 264; }),
       JF_ERR_UNSUPPORTED,
       {"problem.q.head_dim", "a multiple of 8 from 8 to 256", "got 264"}},
      {"head dim 0",
       p([](jf_problem& q) { q.q.head_dim = q.k.head_dim = q.v.head_dim = 0; }),
       JF_ERR_UNSUPPORTED,
       {"problem.q.head_dim", "got 0"}},
      {"v head dim above q's",
       p([](jf_problem& q) { q.v.head_dim = 72; }),
       JF_ERR_UNSUPPORTED,
       {"problem.v.head_dim", "a multiple of 8 from 8 to q's head dim (64)", "got 72"}},
      {"v head dim not a multiple of 8",
       p([](jf_problem& q) { q.v.head_dim = 60; }),
       JF_ERR_UNSUPPORTED,
       {"problem.v.head_dim", "got 60"}},
      {"v head dim of its own: out keeps q's",
       p([](jf_problem& q) { q.v.head_dim = 32; }),
       JF_ERR_INVALID_ARGUMENT,
       {"out.head_dim", "expected 32", "got 64"}},
      {"k head dim",
       p([](jf_problem& q) { q.k.head_dim = 128; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.k.head_dim", "expected 64", "got 128"}},
      {"gqa divisor",
       p([](jf_problem& q) { q.k.heads = q.v.heads = 3; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.k.heads", "divisor", "got 3"}},
      {"v heads",
       p([](jf_problem& q) { q.v.heads = 1; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.v.heads", "expected 2", "got 1"}},
      {"v rows",
       p([](jf_problem& q) { q.v.rows -= 1; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.v.rows", "expected 11", "got 10"}},
      {"head stride",
       p([](jf_problem& q) { q.q.head_stride = 32; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q.head_stride", ">= head_dim", "got 32"}},
      {"row stride",
       p([](jf_problem& q) { q.k.row_stride = 64; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.k.row_stride", "got 64"}},
      // Found by the C API fuzzer (tests/fuzz): the span of such a view overflowed int64 in the
      // overlap check (undefined behaviour), and the call went on to read far outside k.
      {"row stride past int64",
       p([](jf_problem& q) { q.k.row_stride = int64_t{1} << 62; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.k.row_stride", "fits in memory", "got 4611686018427387904"}},
      {"head stride past int64",
       p([](jf_problem& q) { q.q.head_stride = int64_t{1} << 62; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q.row_stride", "more than int64 holds"}},
      {"misaligned q_offsets",
       p([](jf_problem& q) {
         alignas(int32_t) static unsigned char bytes[24] = {};
         q.q_offsets = reinterpret_cast<const int32_t*>(bytes + 2);
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q_offsets", "4-byte alignment"}},
      {"null data",
       p([](jf_problem& q) { q.v.data = nullptr; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.v.data", "NULL"}},
      {"misaligned",
       p([](jf_problem& q) { q.q.data = static_cast<char*>(q.q.data) + 1; }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q.data", "alignment"}},
      {"offsets first",
       p([](jf_problem& q) { q.q_offsets = bad_first.data(); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q_offsets[0]", "expected 0", "got 1"}},
      {"offsets decreasing",
       p([](jf_problem& q) { q.q_offsets = decreasing.data(); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q_offsets[2]", "non-decreasing", "got 2"}},
      {"offsets total",
       p([](jf_problem& q) { q.q_offsets = wrong_total.data(); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q_offsets[B=3]", "token count 8", "got 9"}},
      {"kv offsets total",
       p([](jf_problem& q) { q.kv_offsets = wrong_total.data(); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.kv_offsets[B=3]", "token count 11", "got 9"}},
      {"window left",
       p([](jf_problem& q) {
         q.mask = JF_MASK_WINDOW;
         q.window_left = -2;
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.window_left", ">= -1", "got -2"}},
      {"window right",
       p([](jf_problem& q) {
         q.mask = JF_MASK_WINDOW;
         q.window_right = -5;
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.window_right", "got -5"}},
      {"causal with window",
       p([](jf_problem& q) {
         q.mask = JF_MASK_CAUSAL;
         q.window_left = 4;
       }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.window_left", "JF_MASK_WINDOW", "got 4"}},
      {"scale",
       p([](jf_problem& q) { q.scale = std::numeric_limits<float>::quiet_NaN(); }),
       JF_ERR_INVALID_ARGUMENT,
       {"problem.scale", "finite"}},
      {"cuda device without gpu or with host pointers",
       p([](jf_problem& q) { q.device = JF_DEVICE_CUDA; }),
       JF_ERR_INVALID_ARGUMENT,
       {"expected"}},
      {"backend",
       [](Call& c) {
         // Two stores: a chained assignment would load the out-of-range value back (undefined).
         c.fwd.launch.backend = static_cast<jf_backend>(8);
         c.bwd.launch.backend = static_cast<jf_backend>(8);
       },
       JF_ERR_INVALID_ARGUMENT,
       {"launch.backend", "got 8"}},
      {"oracle on cpu",
       [](Call& c) { c.fwd.launch.backend = c.bwd.launch.backend = JF_BACKEND_ORACLE; },
       JF_ERR_INVALID_ARGUMENT,
       {"launch.backend", "JF_DEVICE_CUDA"}},
      {"negative max_seqlen_hint",
       [](Call& c) { c.fwd.launch.max_seqlen_hint = c.bwd.launch.max_seqlen_hint = -5; },
       JF_ERR_INVALID_ARGUMENT,
       {"launch.max_seqlen_hint", ">= 0", "got -5"}},
      {"offsets check",
       [](Call& c) {
         c.fwd.launch.offsets_check = static_cast<jf_offsets_check>(4);
         c.bwd.launch.offsets_check = static_cast<jf_offsets_check>(4);
       },
       JF_ERR_INVALID_ARGUMENT,
       {"launch.offsets_check", "got 4"}},
  };
}

void expect_error(jf_status got, const Case& c, const Call& call) {
  EXPECT_EQ(got, c.status) << c.name;
  const std::string msg = jagflash_last_error();
  for (const std::string& part : c.message_parts)
    EXPECT_NE(msg.find(part), std::string::npos)
        << c.name << ": message '" << msg << "' lacks '" << part << "'";
  EXPECT_TRUE(call.outputs_untouched()) << c.name;
}

TEST(Validation, ValidCallSucceeds) {
  Call call;
  ASSERT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&call.bwd), JF_OK) << jagflash_last_error();
  EXPECT_FALSE(call.outputs_untouched());
}

TEST(Validation, ForwardErrors) {
  for (const Case& c : problem_cases()) {
    Call call;
    c.break_it(call);
    expect_error(jagflash_fwd(&call.fwd), c, call);
    size_t bytes = 0;
    // Shape errors are reported by the size query too (offsets are not read there).
    const std::string name = c.name;
    // ... nor the modifier's values, read (on the CPU) with the offsets.
    const bool offsets_case =
        name.rfind("offsets", 0) == 0 || name.rfind("kv offsets", 0) == 0 || name.rfind("values:", 0) == 0;
    if (!offsets_case) {
      EXPECT_NE(jagflash_fwd_workspace_size(&call.fwd, &bytes), JF_OK) << c.name;
    }
  }
}

TEST(Validation, BackwardErrors) {
  for (const Case& c : problem_cases()) {
    Call call;
    c.break_it(call);
    expect_error(jagflash_bwd(&call.bwd), c, call);
  }
}

TEST(Validation, OutputArgumentErrors) {
  const std::vector<Case> fwd_cases = {
      {"out rows",
       [](Call& c) { c.fwd.out.rows = 7; },
       JF_ERR_INVALID_ARGUMENT,
       {"out.rows", "expected 8", "got 7"}},
      {"out heads",
       [](Call& c) { c.fwd.out.heads = 2; },
       JF_ERR_INVALID_ARGUMENT,
       {"out.heads", "expected 4", "got 2"}},
      {"out aliases q",
       [](Call& c) { c.fwd.out.data = c.fwd.problem.q.data; },
       JF_ERR_INVALID_ARGUMENT,
       {"out", "disjoint", "q"}},
      {"lse aliases k",
       [](Call& c) { c.fwd.lse = static_cast<float*>(c.fwd.problem.k.data); },
       JF_ERR_INVALID_ARGUMENT,
       {"lse", "disjoint", "k"}},
      // Found by the fuzzer: accepted, the reference then stored floats through a misaligned
      // pointer, and wrote lse over the offsets it was still reading (and past them).
      {"lse misaligned",
       [](Call& c) { c.fwd.lse = reinterpret_cast<float*>(reinterpret_cast<char*>(c.lse.data()) + 2); },
       JF_ERR_INVALID_ARGUMENT,
       {"lse", "4-byte alignment"}},
      {"lse over q_offsets",
       [](Call& c) {
         // q_offsets at the start of a buffer as long as lse, lse over the whole buffer: no other
         // input can lie inside lse's span (see "dq over kv_offsets" below).
         c.scratch.assign(c.lse.size() + c.batch.q_offsets.size(), 0x5a5a5a5a);
         std::copy(c.batch.q_offsets.begin(), c.batch.q_offsets.end(), c.scratch.begin());
         c.scratch_before = c.scratch;
         c.fwd.problem.q_offsets = c.scratch.data();
         c.fwd.lse = reinterpret_cast<float*>(c.scratch.data());
       },
       JF_ERR_INVALID_ARGUMENT,
       {"lse", "disjoint", "problem.q_offsets"}},
  };
  for (const Case& c : fwd_cases) {
    Call call;
    c.break_it(call);
    expect_error(jagflash_fwd(&call.fwd), c, call);
  }
  const std::vector<Case> bwd_cases = {
      {"lse null",
       [](Call& c) { c.bwd.lse = nullptr; },
       JF_ERR_INVALID_ARGUMENT,
       {"lse", "non-null", "NULL"}},
      {"dk rows",
       [](Call& c) { c.bwd.dk.rows = 3; },
       JF_ERR_INVALID_ARGUMENT,
       {"dk.rows", "expected 11", "got 3"}},
      {"dv heads",
       [](Call& c) { c.bwd.dv.heads = 4; },
       JF_ERR_INVALID_ARGUMENT,
       {"dv.heads", "expected 2", "got 4"}},
      {"dout head dim",
       [](Call& c) { c.bwd.dout.head_dim = 128; },
       JF_ERR_INVALID_ARGUMENT,
       {"dout.head_dim", "got 128"}},
      {"dq aliases dout",
       [](Call& c) { c.bwd.dq.data = c.bwd.dout.data; },
       JF_ERR_INVALID_ARGUMENT,
       {"dq", "disjoint", "dout"}},
      {"dk aliases dv",
       [](Call& c) { c.bwd.dk.data = c.bwd.dv.data; },
       JF_ERR_INVALID_ARGUMENT,
       {"dk", "disjoint", "dv"}},
      {"lse misaligned",
       [](Call& c) {
         c.bwd.lse = reinterpret_cast<const float*>(reinterpret_cast<const char*>(c.lse.data()) + 1);
       },
       JF_ERR_INVALID_ARGUMENT,
       {"lse", "4-byte alignment"}},
      {"dq over kv_offsets",
       [](Call& c) {
         // kv_offsets at the start of a buffer as long as dq's view, dq over the whole buffer: no
         // other input can lie inside dq's span (over the batch's own kv_offsets vector, the heap
         // sometimes put q_offsets there too, and the message named that first).
         const size_t dq_ints = static_cast<size_t>(c.dq.element_count()) * 2 / sizeof(int32_t);
         c.scratch.assign(dq_ints + c.batch.kv_offsets.size(), 0x5a5a5a5a);
         std::copy(c.batch.kv_offsets.begin(), c.batch.kv_offsets.end(), c.scratch.begin());
         c.scratch_before = c.scratch;
         c.bwd.problem.kv_offsets = c.scratch.data();
         c.bwd.dq.data = c.scratch.data();
       },
       JF_ERR_INVALID_ARGUMENT,
       {"dq", "disjoint", "problem.kv_offsets"}},
  };
  for (const Case& c : bwd_cases) {
    Call call;
    c.break_it(call);
    expect_error(jagflash_bwd(&call.bwd), c, call);
  }
}

// The sinks' gradient: asked for only with sinks, aligned, and no output or input beneath it.
TEST(Validation, SinkGradientArgument) {
  static std::vector<float> sinks(4, 0.5f), dsinks(5, 0.f);
  const std::vector<Case> cases = {
      {"dlearnable_sink without sinks",
       [](Call& c) { c.bwd.dlearnable_sink = dsinks.data(); },
       JF_ERR_INVALID_ARGUMENT,
       {"dlearnable_sink", "NULL without problem.learnable_sink"}},
      {"dlearnable_sink misaligned",
       [](Call& c) {
         c.bwd.problem.learnable_sink = sinks.data();
         c.bwd.dlearnable_sink = reinterpret_cast<float*>(reinterpret_cast<char*>(dsinks.data()) + 1);
       },
       JF_ERR_INVALID_ARGUMENT,
       {"dlearnable_sink", "4-byte alignment"}},
      {"dlearnable_sink over the sinks",
       [](Call& c) {
         c.bwd.problem.learnable_sink = sinks.data();
         c.bwd.dlearnable_sink = sinks.data();
       },
       JF_ERR_INVALID_ARGUMENT,
       {"dlearnable_sink", "memory disjoint from the input problem.learnable_sink"}},
      {"dlearnable_sink over lse",
       [](Call& c) {
         c.bwd.problem.learnable_sink = sinks.data();
         c.bwd.dlearnable_sink = const_cast<float*>(c.bwd.lse);
       },
       JF_ERR_INVALID_ARGUMENT,
       {"dlearnable_sink", "memory disjoint from the input lse"}},
  };
  for (const Case& c : cases) {
    Call call;
    c.break_it(call);
    expect_error(jagflash_bwd(&call.bwd), c, call);
  }
}

// 16-byte aligned (the workspace's requirement) and inside the bytes p points to.
void* inside(const void* p) {
  return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(p) + 15) / 16 * 16);
}

// Found by the C API fuzzer (tests/fuzz): the workspace was in no overlap check, so a GPU call
// whose workspace lay over an input or an output was accepted, and its scratch (the plan, the
// backward's accumulators, the error flag) was then written over the caller's tensors. A CPU
// call needs no workspace, so validation is called as a GPU call's would be, with the size its
// query returns; the pointers are host pointers, which validation of a CPU problem accepts.
TEST(Validation, WorkspaceMustBeDisjointFromEveryInputAndOutput) {
  constexpr size_t kNeeded = 64;
  alignas(16) static int32_t q_offsets_copy[4] = {0, 3, 3, 8};  // the batch's q offsets (3, 0, 5)
  struct Target {
    const char* name;  // as the message names it
    std::function<void*(Call&)> at;
  };
  const std::vector<Target> fwd_targets = {
      {"the input q", [](Call& c) { return inside(c.fwd.problem.q.data); }},
      {"the input v", [](Call& c) { return inside(c.fwd.problem.v.data); }},
      {"the output out", [](Call& c) { return inside(c.fwd.out.data); }},
      {"the output lse", [](Call& c) { return inside(c.fwd.lse); }},
      {"the input problem.q_offsets", [&](Call& c) {
         c.fwd.problem.q_offsets = q_offsets_copy;
         return static_cast<void*>(q_offsets_copy);
       }}};
  for (const Target& t : fwd_targets) {
    Call call;
    call.fwd.launch.workspace = t.at(call);
    call.fwd.launch.workspace_bytes = kNeeded;
    try {
      detail::validate_forward(call.fwd, kNeeded, /*require_workspace=*/true);
      ADD_FAILURE() << "forward: a workspace over " << t.name << " was accepted";
    } catch (const detail::ApiError& e) {
      EXPECT_EQ(e.status(), JF_ERR_INVALID_ARGUMENT);
      const std::string msg = e.what();
      for (const std::string& part :
           {std::string("launch.workspace: expected memory disjoint from ") + t.name,
            std::string("first 64 bytes"), std::string("got an overlapping range")})
        EXPECT_NE(msg.find(part), std::string::npos) << "message '" << msg << "' lacks '" << part << "'";
    }
    EXPECT_TRUE(call.outputs_untouched()) << t.name;
  }
  const std::vector<Target> bwd_targets = {
      {"the output dq", [](Call& c) { return inside(c.bwd.dq.data); }},
      {"the output dv", [](Call& c) { return inside(c.bwd.dv.data); }},
      {"the input dout", [](Call& c) { return inside(c.bwd.dout.data); }},
      {"the input out", [](Call& c) { return inside(c.bwd.out.data); }},
      {"the input lse", [](Call& c) { return inside(c.bwd.lse); }},
      {"the input k", [](Call& c) { return inside(c.bwd.problem.k.data); }}};
  for (const Target& t : bwd_targets) {
    Call call;
    call.bwd.launch.workspace = t.at(call);
    call.bwd.launch.workspace_bytes = kNeeded;
    try {
      detail::validate_backward(call.bwd, kNeeded, /*require_workspace=*/true);
      ADD_FAILURE() << "backward: a workspace over " << t.name << " was accepted";
    } catch (const detail::ApiError& e) {
      EXPECT_EQ(e.status(), JF_ERR_INVALID_ARGUMENT);
      const std::string msg = e.what();
      const std::string part = std::string("launch.workspace: expected memory disjoint from ") + t.name;
      EXPECT_NE(msg.find(part), std::string::npos) << "message '" << msg << "' lacks '" << part << "'";
    }
    EXPECT_TRUE(call.outputs_untouched()) << t.name;
  }
  // A workspace of its own passes, in both directions.
  Call call;
  alignas(16) static unsigned char own[kNeeded];
  call.fwd.launch.workspace = call.bwd.launch.workspace = own;
  call.fwd.launch.workspace_bytes = call.bwd.launch.workspace_bytes = kNeeded;
  EXPECT_NO_THROW(detail::validate_forward(call.fwd, kNeeded, true));
  EXPECT_NO_THROW(detail::validate_backward(call.bwd, kNeeded, true));
}

TEST(Validation, EmptyBatchIsLegal) {
  Call call;
  static const int32_t zero[1] = {0};
  for (jf_problem* p : {&call.fwd.problem, &call.bwd.problem}) {
    p->batch_size = 0;
    p->q_offsets = p->kv_offsets = zero;
    p->q.rows = p->k.rows = p->v.rows = 0;
  }
  call.fwd.out.rows = call.bwd.out.rows = call.bwd.dout.rows = call.bwd.dq.rows = 0;
  call.bwd.dk.rows = call.bwd.dv.rows = 0;
  EXPECT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();
  EXPECT_EQ(jagflash_bwd(&call.bwd), JF_OK) << jagflash_last_error();
  EXPECT_TRUE(call.outputs_untouched());
}

// launch.caller_checked_pointers is a flag like reuse_plan and deterministic: any int32 is
// accepted, non-zero skips the pointer-location queries and nothing else.
TEST(Validation, CallerCheckedPointersTakesAnyValueAndSkipsOnlyTheLocationQueries) {
  for (int32_t vouched :
       {0, 1, -1, std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()}) {
    SCOPED_TRACE("caller_checked_pointers = " + std::to_string(vouched));
    Call call;
    call.fwd.launch.caller_checked_pointers = call.bwd.launch.caller_checked_pointers = vouched;
    const uint64_t before = detail::pointer_location_queries();
    ASSERT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();
    ASSERT_EQ(jagflash_bwd(&call.bwd), JF_OK) << jagflash_last_error();
    jf_backend served = JF_BACKEND_AUTO;
    ASSERT_EQ(jagflash_query_backend(&call.fwd.problem, &call.fwd.launch, JF_DIRECTION_FORWARD, &served),
              JF_OK)
        << jagflash_last_error();
    size_t bytes = 0;
    ASSERT_EQ(jagflash_bwd_workspace_size(&call.bwd, &bytes), JF_OK) << jagflash_last_error();
    const uint64_t queries = detail::pointer_location_queries() - before;
    if (vouched != 0)
      EXPECT_EQ(queries, 0u);
    else
      EXPECT_GT(queries, 0u);  // host memory the driver does not know: one query per pointer
  }
}

TEST(Validation, CallerCheckedPointersKeepsTheOtherPointerChecks) {
  const std::vector<Case> cases = {
      {"q null",
       [](Call& c) { c.fwd.problem.q.data = c.bwd.problem.q.data = nullptr; },
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q.data", "non-null", "NULL"}},
      {"q misaligned",
       [](Call& c) {
         void* odd = static_cast<char*>(c.fwd.problem.q.data) + 1;
         c.fwd.problem.q.data = c.bwd.problem.q.data = odd;
       },
       JF_ERR_INVALID_ARGUMENT,
       {"problem.q.data", "2-byte alignment"}},
      // out laid from k's first byte: its span may reach past k's buffer over another the heap put
      // there (a clean-clone CI run saw lse named), so the message names out and the overlap only.
      {"out aliases k",
       [](Call& c) { c.fwd.out.data = c.bwd.dq.data = c.fwd.problem.k.data; },
       JF_ERR_INVALID_ARGUMENT,
       {"disjoint", "overlapping"}},
      {"offsets null",
       [](Call& c) { c.fwd.problem.kv_offsets = c.bwd.problem.kv_offsets = nullptr; },
       JF_ERR_INVALID_ARGUMENT,
       {"problem.kv_offsets", "NULL"}},
  };
  for (const Case& c : cases) {
    Call call;
    call.fwd.launch.caller_checked_pointers = call.bwd.launch.caller_checked_pointers = 1;
    c.break_it(call);
    expect_error(jagflash_fwd(&call.fwd), c, call);
    expect_error(jagflash_bwd(&call.bwd), c, call);
  }
}

// Without a scope every location is a query of its own; inside one, a pointer in an allocation
// the driver already described is answered from it (on the CPU no allocation has a range, so the
// count is the same: the GPU test checks the saving, tests/test_gpu_async_errors.cpp).
TEST(Validation, LocationQueriesAreCounted) {
  std::vector<char> host(64);
  const uint64_t before = detail::pointer_location_queries();
  EXPECT_FALSE(detail::is_device_pointer(host.data()));
  EXPECT_FALSE(detail::is_device_pointer(host.data() + 16));
  EXPECT_EQ(detail::pointer_location_queries() - before, 2u);
}

// Every q/k head dim that is a multiple of 8 from 8 to 256, with v at that head dim or below it,
// is served on the CPU in both directions (by the reference: tests/test_reference.cpp checks the
// values), with out, dout and dv at v's head dim.
TEST(Validation, EveryMultipleOf8AndAVHeadDimOfItsOwnAreServedOnTheCpu) {
  for (int d = 8; d <= 256; d += 8)
    for (int dv : {8, std::max(8, d / 16 * 8), d}) {
      SCOPED_TRACE("D " + std::to_string(d) + " Dv " + std::to_string(dv));
      Call call(d, dv);
      size_t bytes = 1;
      ASSERT_EQ(jagflash_fwd_workspace_size(&call.fwd, &bytes), JF_OK) << jagflash_last_error();
      EXPECT_EQ(bytes, 0u);
      for (jf_direction direction : {JF_DIRECTION_FORWARD, JF_DIRECTION_BACKWARD}) {
        jf_backend served = JF_BACKEND_AUTO;
        ASSERT_EQ(jagflash_query_backend(&call.fwd.problem, &call.fwd.launch, direction, &served), JF_OK)
            << jagflash_last_error();
        EXPECT_EQ(served, JF_BACKEND_REFERENCE);
      }
      ASSERT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();
      ASSERT_EQ(jagflash_bwd(&call.bwd), JF_OK) << jagflash_last_error();
      EXPECT_FALSE(call.outputs_untouched());
    }
}

// With a v head dim of its own (64 / 32): dq and dk keep q's and k's, out, dout and dv take v's.
TEST(Validation, OutputsTakeTheHeadDimOfTheirInput) {
  const std::vector<Case> fwd_cases = {
      {"out at q's head dim",
       [](Call& c) { c.fwd.out.head_dim = 64; },
       JF_ERR_INVALID_ARGUMENT,
       {"out.head_dim", "expected 32", "got 64"}},
  };
  for (const Case& c : fwd_cases) {
    Call call(64, 32);
    c.break_it(call);
    expect_error(jagflash_fwd(&call.fwd), c, call);
  }
  const std::vector<Case> bwd_cases = {
      {"dout at q's head dim",
       [](Call& c) { c.bwd.dout.head_dim = 64; },
       JF_ERR_INVALID_ARGUMENT,
       {"dout.head_dim", "expected 32", "got 64"}},
      {"dv at k's head dim",
       [](Call& c) { c.bwd.dv.head_dim = 64; },
       JF_ERR_INVALID_ARGUMENT,
       {"dv.head_dim", "expected 32", "got 64"}},
      {"dk at v's head dim",
       [](Call& c) { c.bwd.dk.head_dim = 32; },
       JF_ERR_INVALID_ARGUMENT,
       {"dk.head_dim", "expected 64", "got 32"}},
      {"dq at v's head dim",
       [](Call& c) { c.bwd.dq.head_dim = 32; },
       JF_ERR_INVALID_ARGUMENT,
       {"dq.head_dim", "expected 64", "got 32"}},
  };
  for (const Case& c : bwd_cases) {
    Call call(64, 32);
    c.break_it(call);
    expect_error(jagflash_bwd(&call.bwd), c, call);
  }
}

// On CUDA neither a q head dim (a multiple of 8 up to 256) nor a v head dim of its own (Dv < D) is
// refused by validation: which call serves it (the Hopper kernels, padded below 64 / 128 / 256; a
// narrower v on the forward's padded kernels only) is the dispatcher's to say, on a GPU
// (test_gpu_head_dims.cpp). Here, without a GPU or with host pointers, such a call fails on those,
// never naming a head dim, and writes nothing.
TEST(Validation, CudaLeavesHeadDimsToTheDispatcher) {
  const std::vector<std::pair<int, int>> dims = {{8, 8},     {64, 64},   {72, 72},   {96, 96},
                                                 {128, 128}, {192, 192}, {200, 200}, {256, 256},
                                                 {192, 128}, {64, 32},   {256, 128}, {128, 64}};
  for (const auto& [d, dv] : dims) {
    SCOPED_TRACE("D " + std::to_string(d) + " Dv " + std::to_string(dv));
    Call call(d, dv);
    call.fwd.problem.device = call.bwd.problem.device = JF_DEVICE_CUDA;
    EXPECT_EQ(jagflash_fwd(&call.fwd), JF_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(jagflash_last_error()).find("head_dim"), std::string::npos)
        << jagflash_last_error();
    EXPECT_EQ(jagflash_bwd(&call.bwd), JF_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(jagflash_last_error()).find("head_dim"), std::string::npos)
        << jagflash_last_error();
    EXPECT_TRUE(call.outputs_untouched());
  }
}

// Softcap and ALiBi set as the header says pass on CPU pointers, both directions.
TEST(Validation, ScoreModifiersAreServedOnTheCpu) {
  std::vector<float> slopes(4, 0.25f);
  for (jf_score_mod kind : {JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI}) {
    SCOPED_TRACE(kind == JF_SCORE_MOD_SOFTCAP ? "softcap" : "alibi");
    Call call;
    apply_to_problem(call, [&](jf_problem& p) {
      p.score_mod = kind;
      if (kind == JF_SCORE_MOD_SOFTCAP) p.softcap = 30.0f;
      if (kind == JF_SCORE_MOD_ALIBI) p.alibi_slopes = slopes.data();
    });
    jf_backend served = JF_BACKEND_AUTO;
    ASSERT_EQ(jagflash_query_backend(&call.fwd.problem, &call.fwd.launch, JF_DIRECTION_FORWARD, &served),
              JF_OK)
        << jagflash_last_error();
    EXPECT_EQ(served, JF_BACKEND_REFERENCE);
    ASSERT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();
    ASSERT_EQ(jagflash_bwd(&call.bwd), JF_OK) << jagflash_last_error();
    EXPECT_FALSE(call.outputs_untouched());
  }
}

// The slopes are an input: an output over them is refused.
TEST(Validation, OutputsMustBeDisjointFromTheAlibiSlopes) {
  Call call;
  apply_to_problem(call, [&](jf_problem& p) {
    p.score_mod = JF_SCORE_MOD_ALIBI;
    p.alibi_slopes = call.lse.data();
  });
  const Case c{"lse over the slopes",
               nullptr,
               JF_ERR_INVALID_ARGUMENT,
               {"lse", "memory disjoint from the input problem.alibi_slopes"}};
  expect_error(jagflash_fwd(&call.fwd), c, call);
}

// On CUDA the score modifiers are served (the Hopper kernels, the oracle): a CUDA problem with one
// passes the modifier's checks and fails here only on what this test gives it (host pointers, or
// no GPU), never naming score_mod or softcap.
TEST(Validation, CudaTakesTheScoreModifiers) {
  std::vector<float> slopes(4, 0.25f);
  for (jf_score_mod kind : {JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI}) {
    SCOPED_TRACE(kind);
    Call call;
    apply_to_problem(call, [&](jf_problem& p) {
      p.device = JF_DEVICE_CUDA;
      p.score_mod = kind;
      if (kind == JF_SCORE_MOD_SOFTCAP) p.softcap = 30.0f;
      if (kind == JF_SCORE_MOD_ALIBI) p.alibi_slopes = slopes.data();
    });
    EXPECT_EQ(jagflash_fwd(&call.fwd), JF_ERR_INVALID_ARGUMENT);
    const std::string message = jagflash_last_error();
    EXPECT_EQ(message.find("score_mod"), std::string::npos) << message;
    EXPECT_EQ(message.find("softcap"), std::string::npos) << message;
  }
}

// ---- block masks (jf_problem.block_mask) ----------------------------------------------------

// The call's batch (q lengths 3, 0, 5; kv 4, 2, 5) has one 128 x 128 block in sequences 0 and 2 and
// none in sequence 1: map offsets {0, 1, 1, 2}, two bytes.
struct BlockMaskCall : Call {
  std::vector<int32_t> map_offsets = {0, 1, 1, 2};
  std::vector<uint8_t> blocks = {1, 1};

  BlockMaskCall() { set(blocks.data(), map_offsets.data(), static_cast<int64_t>(blocks.size())); }
  void set(const uint8_t* b, const int32_t* offsets, int64_t bytes) {
    apply_to_problem(*this, [&](jf_problem& p) {
      p.block_mask.blocks = b;
      p.block_mask.offsets = offsets;
      p.block_mask.bytes = bytes;
    });
  }
  int64_t blocks_bytes() const { return static_cast<int64_t>(blocks.size()); }
};

void expect_refused(jf_status got, jf_status status, const std::vector<std::string>& parts, const Call& call,
                    const std::string& what) {
  EXPECT_EQ(got, status) << what;
  const std::string msg = jagflash_last_error();
  for (const std::string& part : parts)
    EXPECT_NE(msg.find(part), std::string::npos)
        << what << ": message '" << msg << "' lacks '" << part << "'";
  EXPECT_TRUE(call.outputs_untouched()) << what;
}

// Half a map is never taken for none: both pointers or neither, each named; the size queries
// refuse it too (no offsets are read for it).
TEST(ValidationBlockMask, BothPointersOrNeither) {
  struct Half {
    const char* what;
    bool blocks, offsets;
    const char* named;
  } halves[] = {{"blocks without offsets", true, false, "problem.block_mask.offsets"},
                {"offsets without blocks", false, true, "problem.block_mask.blocks"}};
  for (const Half& h : halves) {
    BlockMaskCall call;
    call.set(h.blocks ? call.blocks.data() : nullptr, h.offsets ? call.map_offsets.data() : nullptr,
             h.blocks ? call.blocks_bytes() : 0);
    const std::vector<std::string> parts = {std::string(h.named) + ": expected a non-null pointer",
                                            "both NULL: no block mask", "got NULL"};
    expect_refused(jagflash_fwd(&call.fwd), JF_ERR_INVALID_ARGUMENT, parts, call, h.what);
    expect_refused(jagflash_bwd(&call.bwd), JF_ERR_INVALID_ARGUMENT, parts, call, h.what);
    size_t bytes = 0;
    EXPECT_EQ(jagflash_fwd_workspace_size(&call.fwd, &bytes), JF_ERR_INVALID_ARGUMENT) << h.what;
    EXPECT_EQ(jagflash_bwd_workspace_size(&call.bwd, &bytes), JF_ERR_INVALID_ARGUMENT) << h.what;
  }
}

TEST(ValidationBlockMask, OffsetsAreReadAsInt32) {
  BlockMaskCall call;
  alignas(int32_t) static unsigned char bytes[24] = {};
  call.set(call.blocks.data(), reinterpret_cast<const int32_t*>(bytes + 2), call.blocks_bytes());
  expect_refused(jagflash_fwd(&call.fwd), JF_ERR_INVALID_ARGUMENT,
                 {"problem.block_mask.offsets", "4-byte alignment (int32)"}, call, "misaligned");
}

// The offsets' values are checked as q_offsets' are (CPU calls on the host, like
// JF_CHECK_OFFSETS_HOST): [0] == 0 and ceil(Lq/128) * ceil(Lk/128) bytes per sequence, the
// message naming the entry, what it should be and why, and what it is.
TEST(ValidationBlockMask, OffsetsValues) {
  struct Bad {
    const char* what;
    std::vector<int32_t> offsets;
    std::vector<std::string> parts;
  } bad[] = {
      {"first not zero", {1, 2, 2, 3}, {"problem.block_mask.offsets[0]: expected 0, got 1"}},
      {"a sequence without blocks given one",
       {0, 1, 2, 3},
       {"problem.block_mask.offsets[2]: expected problem.block_mask.offsets[1] + ceil(Lq/128) * ceil(Lk/128) "
        "= 1 + 0 * 1 = 1 (sequence 1: Lq = 0, Lk = 2), got 2"}},
      {"too few bytes", {0, 0, 0, 1}, {"problem.block_mask.offsets[1]", "= 0 + 1 * 1 = 1", "got 0"}},
      {"negative", {0, 1, 1, -1}, {"problem.block_mask.offsets[3]", "= 1 + 1 * 1 = 2", "got -1"}},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    BlockMaskCall call;
    call.map_offsets = b.offsets;
    call.set(call.blocks.data(), call.map_offsets.data(), call.blocks_bytes());
    for (int backward = 0; backward < 2; ++backward) {
      try {
        if (backward)
          detail::validate_backward(call.bwd, 0, /*require_workspace=*/true);
        else
          detail::validate_forward(call.fwd, 0, /*require_workspace=*/true);
        ADD_FAILURE() << "accepted";
      } catch (const detail::ApiError& e) {
        EXPECT_EQ(e.status(), JF_ERR_INVALID_ARGUMENT);
        for (const std::string& part : b.parts)
          EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what() << " lacks " << part;
      }
    }
    // The size queries read no offsets.
    EXPECT_NO_THROW(detail::validate_forward(call.fwd, 0, /*require_workspace=*/false));
    EXPECT_TRUE(call.outputs_untouched());
  }
  BlockMaskCall good;
  EXPECT_NO_THROW(detail::validate_forward(good.fwd, 0, /*require_workspace=*/true));
  EXPECT_NO_THROW(detail::validate_backward(good.bwd, 0, /*require_workspace=*/true));
  // Sequences longer than a block: 129 queries and 300 keys are 2 x 3 blocks.
  const int32_t q_off[] = {0, 129, 129}, kv_off[] = {0, 300, 301};
  const int32_t map_ok[] = {0, 6, 6}, map_bad[] = {0, 4, 4};
  EXPECT_NO_THROW(detail::validate_host_block_mask_offsets(map_ok, q_off, kv_off, 2, /*bytes=*/6));
  try {
    detail::validate_host_block_mask_offsets(map_bad, q_off, kv_off, 2, /*bytes=*/6);
    ADD_FAILURE() << "accepted";
  } catch (const detail::ApiError& e) {
    EXPECT_NE(std::string(e.what()).find("= 0 + 2 * 3 = 6 (sequence 0: Lq = 129, Lk = 300), got 4"),
              std::string::npos)
        << e.what();
  }
}

// The map and its offsets are inputs: an output over either is refused (the blocks' extent is
// [blocks, blocks + bytes), known without reading the offsets: the size queries refuse it too).
TEST(ValidationBlockMask, OutputsMustBeDisjointFromTheMap) {
  {
    BlockMaskCall call;
    call.set(call.blocks.data(), reinterpret_cast<const int32_t*>(call.lse.data()), call.blocks_bytes());
    expect_refused(jagflash_fwd(&call.fwd), JF_ERR_INVALID_ARGUMENT,
                   {"lse", "memory disjoint from the input problem.block_mask.offsets"}, call,
                   "lse over offsets");
  }
  {
    BlockMaskCall call;
    call.set(static_cast<const uint8_t*>(call.fwd.out.data), call.map_offsets.data(), call.blocks_bytes());
    for (bool require_workspace : {true, false}) {
      try {
        detail::validate_forward(call.fwd, 0, require_workspace);
        ADD_FAILURE() << "accepted";
      } catch (const detail::ApiError& e) {
        EXPECT_NE(std::string(e.what()).find(
                      "out: expected memory disjoint from the input problem.block_mask.blocks"),
                  std::string::npos)
            << e.what();
      }
    }
  }
  {
    // The map's buffer just before lse: disjoint while it ends where lse begins, refused when its
    // last byte (bytes, not offsets[B] = 2) reaches into lse.
    BlockMaskCall call;
    constexpr size_t kLead = 4;  // floats before lse
    call.lse.assign(call.lse.size() + kLead, static_cast<float>(kSentinel));
    call.fwd.lse = call.lse.data() + kLead;
    const auto* map = reinterpret_cast<const uint8_t*>(call.lse.data());
    const auto lead_bytes = static_cast<int64_t>(kLead * sizeof(float));
    call.set(map, call.map_offsets.data(), lead_bytes);
    EXPECT_NO_THROW(detail::validate_forward(call.fwd, 0, /*require_workspace=*/true));
    call.set(map, call.map_offsets.data(), lead_bytes + 1);
    try {
      detail::validate_forward(call.fwd, 0, /*require_workspace=*/true);
      ADD_FAILURE() << "accepted";
    } catch (const detail::ApiError& e) {
      EXPECT_NE(std::string(e.what()).find(
                    "lse: expected memory disjoint from the input problem.block_mask.blocks"),
                std::string::npos)
          << e.what();
    }
  }
}

// bytes, the size of the blocks buffer: 0 without a map (a size given to no buffer is a mistake,
// not ignored) and never negative; both refused by the size queries too (no offsets are read).
TEST(ValidationBlockMask, BytesField) {
  struct Bad {
    const char* what;
    bool map;
    int64_t bytes;
    std::vector<std::string> parts;
  } bad[] = {
      {"bytes without a map",
       false,
       2,
       {"problem.block_mask.bytes: expected 0 with problem.block_mask.blocks NULL (no block mask), got 2"}},
      {"negative bytes",
       true,
       -1,
       {"problem.block_mask.bytes: expected >= 0 (the size of the buffer at problem.block_mask.blocks), got "
        "-1"}},
  };
  for (const Bad& b : bad) {
    BlockMaskCall call;
    call.set(b.map ? call.blocks.data() : nullptr, b.map ? call.map_offsets.data() : nullptr, b.bytes);
    expect_refused(jagflash_fwd(&call.fwd), JF_ERR_INVALID_ARGUMENT, b.parts, call, b.what);
    expect_refused(jagflash_bwd(&call.bwd), JF_ERR_INVALID_ARGUMENT, b.parts, call, b.what);
    size_t bytes = 0;
    EXPECT_EQ(jagflash_fwd_workspace_size(&call.fwd, &bytes), JF_ERR_INVALID_ARGUMENT) << b.what;
    EXPECT_EQ(jagflash_bwd_workspace_size(&call.bwd, &bytes), JF_ERR_INVALID_ARGUMENT) << b.what;
  }
}

// offsets[B] past bytes: the kernels would read past the caller's buffer. Refused where the
// offsets are checked (on the host for CPU calls), both directions, naming the offsets' last
// entry and bytes, nothing written; the size queries read no offsets and accept it. A buffer
// larger than the map is fine.
TEST(ValidationBlockMask, OffsetsPastTheBuffer) {
  for (int64_t bytes : {int64_t{0}, int64_t{1}}) {
    SCOPED_TRACE(bytes);
    BlockMaskCall call;
    call.set(call.blocks.data(), call.map_offsets.data(), bytes);
    const std::vector<std::string> parts = {
        "problem.block_mask.offsets[B=3]: expected <= problem.block_mask.bytes = " + std::to_string(bytes) +
        " (the size of the blocks buffer), got 2"};
    expect_refused(jagflash_fwd(&call.fwd), JF_ERR_INVALID_ARGUMENT, parts, call, "forward");
    expect_refused(jagflash_bwd(&call.bwd), JF_ERR_INVALID_ARGUMENT, parts, call, "backward");
    size_t size = 1;
    EXPECT_EQ(jagflash_fwd_workspace_size(&call.fwd, &size), JF_OK) << jagflash_last_error();
    EXPECT_EQ(jagflash_bwd_workspace_size(&call.bwd, &size), JF_OK) << jagflash_last_error();
  }
  BlockMaskCall roomy;
  roomy.blocks.resize(64, 1);
  roomy.set(roomy.blocks.data(), roomy.map_offsets.data(), roomy.blocks_bytes());
  ASSERT_EQ(jagflash_fwd(&roomy.fwd), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&roomy.bwd), JF_OK) << jagflash_last_error();
  // Direct: the check follows the per-sequence ones.
  const int32_t q_off[] = {0, 129, 129}, kv_off[] = {0, 300, 301};
  const int32_t map_ok[] = {0, 6, 6};
  EXPECT_NO_THROW(detail::validate_host_block_mask_offsets(map_ok, q_off, kv_off, 2, /*bytes=*/7));
  try {
    detail::validate_host_block_mask_offsets(map_ok, q_off, kv_off, 2, /*bytes=*/5);
    ADD_FAILURE() << "accepted";
  } catch (const detail::ApiError& e) {
    EXPECT_NE(
        std::string(e.what()).find(
            "problem.block_mask.offsets[B=2]: expected <= problem.block_mask.bytes = 5 (the size of the "
            "blocks buffer), got 6"),
        std::string::npos)
        << e.what();
  }
}

// A valid map runs on the CPU reference (test_reference_block_mask.cpp checks what it computes).
TEST(ValidationBlockMask, ServedOnTheCpu) {
  BlockMaskCall call;
  jf_backend served = JF_BACKEND_AUTO;
  ASSERT_EQ(jagflash_query_backend(&call.fwd.problem, &call.fwd.launch, JF_DIRECTION_FORWARD, &served), JF_OK)
      << jagflash_last_error();
  EXPECT_EQ(served, JF_BACKEND_REFERENCE);
  size_t bytes = 1;
  ASSERT_EQ(jagflash_fwd_workspace_size(&call.fwd, &bytes), JF_OK) << jagflash_last_error();
  EXPECT_EQ(bytes, 0u);
  ASSERT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&call.bwd), JF_OK) << jagflash_last_error();
  EXPECT_FALSE(call.outputs_untouched());
}

// The same offsets errors through the C API, both directions, nothing written.
TEST(ValidationBlockMask, BadOffsetsRefusedByTheCalls) {
  BlockMaskCall call;
  call.map_offsets = {0, 1, 2, 3};
  call.set(call.blocks.data(), call.map_offsets.data(), call.blocks_bytes());
  const std::vector<std::string> parts = {"problem.block_mask.offsets[2]", "got 2"};
  expect_refused(jagflash_fwd(&call.fwd), JF_ERR_INVALID_ARGUMENT, parts, call, "forward");
  expect_refused(jagflash_bwd(&call.bwd), JF_ERR_INVALID_ARGUMENT, parts, call, "backward");
}

}  // namespace
}  // namespace jagflash
