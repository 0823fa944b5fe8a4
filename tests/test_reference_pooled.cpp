// Pooled attention (jf_problem.pooled_q_rows) on the CPU, through the C API, against an
// independent float64 computation: the query set repeated once per sequence and run through the
// ordinary reference (itself checked against a dense naive computation in test_reference.cpp) in
// fp32 storage, whose dq rows are then summed over the sequences in float64. The repeated
// backward is given the pooled call's out and lse (the values of its dtype), from which the
// backward takes delta and P.
//  - out, lse, dk, dv: the same float64 math on the same values, so fp32 is bitwise equal and
//    bf16/fp16 within the output's rounding;
//  - dq: within the final rounding plus 2^-24 of the sum of |row| over sequences (each repeated row
//    carries one fp32 rounding);
//  - sequences of length 0 give out = 0, lse = -inf and no gradient; padding of the outputs is never
//    written; B = 0 writes dq = 0; repeated runs are bitwise identical.
#include "testing/host_batch.hpp"

#include <gtest/gtest.h>
#include <jagflash/jagflash.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace jagflash::test {
namespace {

constexpr double kSentinel = 777.0;
constexpr float kInf = std::numeric_limits<float>::infinity();

// fp16 subnormals are 2^-24 apart; 1e-12 absorbs float64 summation order.
double abs_slack(jf_dtype dtype) { return (dtype == JF_FP16 ? std::ldexp(1.0, -24) : 0.0) + 1e-12; }

// The same values in fp32 storage (bf16 and fp16 convert to fp32 exactly), packed.
HostTensor as_fp32(const HostTensor& t) {
  HostTensor f = make_tensor(JF_FP32, t.rows, t.heads, t.head_dim);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int h = 0; h < t.heads; ++h)
      for (int d = 0; d < t.head_dim; ++d) f.set(r, h, d, t.get(r, h, d));
  return f;
}

struct PooledCase {
  int lq;
  std::vector<int32_t> len_kv;
  int H, H_kv, D;
  jf_dtype dtype;
  jf_mask mask;
  int window_left, window_right;
  uint64_t seed;
  std::string name;
  float softcap = 0.0f;  // > 0: JF_SCORE_MOD_SOFTCAP
  bool alibi = false;    // JF_SCORE_MOD_ALIBI with slopes_of(H)
  bool sinks = false;    // learnable sinks sinks_of(H), and their gradient
};

// One ALiBi slope per query head, large enough to matter at these lengths.
std::vector<float> slopes_of(int H) {
  std::vector<float> slopes(static_cast<size_t>(H));
  for (int h = 0; h < H; ++h) slopes[static_cast<size_t>(h)] = 0.5f / static_cast<float>(h + 1);
  return slopes;
}

// One sink logit per query head, from below the scores to above them.
std::vector<float> sinks_of(int H) {
  std::vector<float> sinks(static_cast<size_t>(H));
  for (int h = 0; h < H; ++h) sinks[static_cast<size_t>(h)] = -2.0f + 1.5f * static_cast<float>(h);
  return sinks;
}

// The case's score modifier and sinks on a problem; the slopes and the sinks must outlive it.
void set_score_mod(jf_problem& p, const PooledCase& c, const std::vector<float>& slopes,
                   const std::vector<float>& sinks) {
  if (c.sinks) p.learnable_sink = sinks.data();
  if (c.softcap > 0.0f) {
    p.score_mod = JF_SCORE_MOD_SOFTCAP;
    p.softcap = c.softcap;
  } else if (c.alibi) {
    p.score_mod = JF_SCORE_MOD_ALIBI;
    p.alibi_slopes = slopes.data();
  }
}

void PrintTo(const PooledCase& c, std::ostream* os) { *os << c.name; }

// Everything a pooled forward + backward call needs, outputs padded and poisoned with the
// sentinel, and the call's arguments.
struct PooledCall {
  PooledCase c;
  std::vector<int32_t> kv_offsets;
  HostTensor q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse;
  std::vector<float> slopes, sinks, dsink;
  jf_fwd_args fwd{};
  jf_bwd_args bwd{};

  explicit PooledCall(const PooledCase& pc, int out_pad = 8)
      : c(pc),
        slopes(slopes_of(pc.H)),
        sinks(sinks_of(pc.H)),
        dsink(static_cast<size_t>(pc.H), static_cast<float>(kSentinel)) {
    const int32_t B = static_cast<int32_t>(c.len_kv.size());
    kv_offsets = offsets_from_lengths(c.len_kv);
    const int64_t total_kv = kv_offsets.back(), rows = int64_t{B} * c.lq;
    std::mt19937_64 rng(c.seed);
    q = make_tensor(c.dtype, c.lq, c.H, c.D, 8);
    k = make_tensor(c.dtype, total_kv, c.H_kv, c.D, 8);
    v = make_tensor(c.dtype, total_kv, c.H_kv, c.D);
    dout = make_tensor(c.dtype, rows, c.H, c.D, 4);
    for (HostTensor* t : {&q, &k, &v, &dout}) t->fill_random(rng);
    out = make_tensor(c.dtype, rows, c.H, c.D, out_pad);
    dq = make_tensor(c.dtype, c.lq, c.H, c.D, out_pad);
    dk = make_tensor(c.dtype, total_kv, c.H_kv, c.D, out_pad);
    dv = make_tensor(c.dtype, total_kv, c.H_kv, c.D, out_pad);
    for (HostTensor* t : {&out, &dq, &dk, &dv}) t->fill(kSentinel);
    lse.assign(static_cast<size_t>(c.H * rows), static_cast<float>(kSentinel));

    fwd = forward_args(
        make_problem(c.dtype, nullptr, kv_offsets, q, k, v, c.mask, c.window_left, c.window_right, c.lq), out,
        lse.data());
    set_score_mod(fwd.problem, c, slopes, sinks);
    bwd = backward_args(fwd.problem, out, dout, lse.data(), dq, dk, dv);
    if (c.sinks) bwd.dlearnable_sink = dsink.data();
  }
};

// The independent computation: q repeated per sequence, fp32, through the ordinary reference; its
// backward reads the pooled call's out (as fp32) and lse, so pc's forward must have run.
struct Repeated {
  HostTensor out, dq_rows, dk, dv;  // dq_rows [B*Lq, H, D]: one row per (sequence, query)
  std::vector<float> lse, dsink;
};

Repeated run_repeated(const PooledCall& pc) {
  const PooledCase& c = pc.c;
  const int32_t B = static_cast<int32_t>(c.len_kv.size());
  const int64_t rows = int64_t{B} * c.lq;
  HostTensor q_rep = make_tensor(JF_FP32, rows, c.H, c.D);
  for (int32_t b = 0; b < B; ++b)
    for (int i = 0; i < c.lq; ++i)
      for (int h = 0; h < c.H; ++h)
        for (int d = 0; d < c.D; ++d) q_rep.set(int64_t{b} * c.lq + i, h, d, pc.q.get(i, h, d));
  HostTensor k = as_fp32(pc.k), v = as_fp32(pc.v), dout = as_fp32(pc.dout), out = as_fp32(pc.out);
  std::vector<float> lse = pc.lse;
  std::vector<int32_t> q_offsets(static_cast<size_t>(B) + 1);
  for (int32_t b = 0; b <= B; ++b) q_offsets[static_cast<size_t>(b)] = b * c.lq;
  std::vector<int32_t> kv_offsets = pc.kv_offsets;

  Repeated r{make_tensor(JF_FP32, rows, c.H, c.D),
             make_tensor(JF_FP32, rows, c.H, c.D),
             make_tensor(JF_FP32, k.rows, c.H_kv, c.D),
             make_tensor(JF_FP32, k.rows, c.H_kv, c.D),
             std::vector<float>(static_cast<size_t>(c.H * rows)),
             std::vector<float>(static_cast<size_t>(c.H))};
  jf_fwd_args fwd = forward_args(
      make_problem(JF_FP32, q_offsets.data(), kv_offsets, q_rep, k, v, c.mask, c.window_left, c.window_right),
      r.out, r.lse.data());
  set_score_mod(fwd.problem, c, pc.slopes, pc.sinks);
  EXPECT_EQ(jagflash_fwd(&fwd), JF_OK) << jagflash_last_error();
  jf_bwd_args bwd = backward_args(fwd.problem, out, dout, lse.data(), r.dq_rows, r.dk, r.dv);
  if (c.sinks) bwd.dlearnable_sink = r.dsink.data();
  EXPECT_EQ(jagflash_bwd(&bwd), JF_OK) << jagflash_last_error();
  return r;
}

// |got - want| <= (u + 2^-24)(1 + 1e-6) |want| + slack, elementwise over the views.
void expect_rounded(const HostTensor& got, const HostTensor& want, const char* what) {
  ASSERT_EQ(got.rows, want.rows) << what;
  const double u = (unit_roundoff(got.dtype) + std::ldexp(1.0, -24)) * (1.0 + 1e-6);
  int64_t bad = 0;
  for (int64_t r = 0; r < got.rows; ++r)
    for (int h = 0; h < got.heads; ++h)
      for (int d = 0; d < got.head_dim; ++d) {
        const double g = got.get(r, h, d), w = want.get(r, h, d);
        if (!(std::abs(g - w) <= u * std::abs(w) + abs_slack(got.dtype)) && bad++ < 3)
          ADD_FAILURE() << what << " (" << r << "," << h << "," << d << "): got " << g << " want " << w;
      }
  EXPECT_EQ(bad, 0) << what << ": elements outside the rounding bound";
}

// Padding (outside the view) keeps the sentinel.
void expect_padding_untouched(const HostTensor& t, const char* what) {
  std::vector<bool> in_view(static_cast<size_t>(t.element_count()), false);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int h = 0; h < t.heads; ++h)
      for (int d = 0; d < t.head_dim; ++d) in_view[static_cast<size_t>(t.offset(r, h, d))] = true;
  HostTensor probe = make_tensor(t.dtype, 1, 1, 1);
  probe.fill(kSentinel);
  const double sentinel = probe.get(0, 0, 0);
  for (int64_t i = 0; i < t.element_count(); ++i) {
    if (!in_view[static_cast<size_t>(i)]) {
      ASSERT_EQ(t.get_flat(i), sentinel) << what << " padding element " << i;
    }
  }
}

void check_pooled(const PooledCase& c) {
  SCOPED_TRACE("case " + c.name + " seed " + std::to_string(c.seed));
  PooledCall call(c);
  ASSERT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&call.bwd), JF_OK) << jagflash_last_error();
  const Repeated want = run_repeated(call);
  const int32_t B = static_cast<int32_t>(c.len_kv.size());
  const int64_t rows = int64_t{B} * c.lq;

  expect_rounded(call.out, want.out, "out");
  EXPECT_EQ(call.lse, want.lse) << "lse: the same float64 values rounded to float";
  expect_rounded(call.dk, want.dk, "dk");
  expect_rounded(call.dv, want.dv, "dv");
  // d sink: the same rows summed in the same order, from the same values.
  if (c.sinks) {
    EXPECT_EQ(call.dsink, want.dsink) << "d learnable_sink";
  }

  // dq = the sum over the sequences of the repeated rows, in float64; the bound adds 2^-24 of
  // the sum of their magnitudes (each repeated row was rounded to fp32 once).
  std::vector<double> sum(static_cast<size_t>(c.lq * c.H * c.D), 0.0), mag(sum.size(), 0.0);
  for (int32_t b = 0; b < B; ++b)
    for (int i = 0; i < c.lq; ++i)
      for (int h = 0; h < c.H; ++h)
        for (int d = 0; d < c.D; ++d) {
          const double x = want.dq_rows.get(int64_t{b} * c.lq + i, h, d);
          const size_t at = (static_cast<size_t>(i) * c.H + h) * c.D + d;
          sum[at] += x;
          mag[at] += std::abs(x);
        }
  const double u = (unit_roundoff(c.dtype) + std::ldexp(1.0, -24)) * (1.0 + 1e-6);
  int64_t bad = 0;
  double dq_max = 0.0;
  for (int i = 0; i < c.lq; ++i)
    for (int h = 0; h < c.H; ++h)
      for (int d = 0; d < c.D; ++d) {
        const size_t at = (static_cast<size_t>(i) * c.H + h) * c.D + d;
        const double g = call.dq.get(i, h, d), w = sum[at];
        dq_max = std::max(dq_max, std::abs(g));
        const double bound =
            u * std::abs(w) + std::ldexp(1.0, -24) * mag[at] * (1.0 + 1e-6) + abs_slack(c.dtype);
        if (!(std::abs(g - w) <= bound) && bad++ < 3)
          ADD_FAILURE() << "dq (" << i << "," << h << "," << d << "): got " << g << " want " << w;
      }
  EXPECT_EQ(bad, 0) << "dq: elements outside the bound";
  if (rows > 0 && c.mask == JF_MASK_NONE) {
    bool any_keys = false;
    for (int32_t l : c.len_kv) any_keys = any_keys || l > 1;
    if (any_keys) {
      EXPECT_GT(dq_max, 0.0) << "dq is all zero";
    }
  }

  // Sequences of length 0: out = 0 and lse = -inf (with sinks, the head's sink) on all their rows.
  for (int32_t b = 0; b < B; ++b) {
    if (c.len_kv[static_cast<size_t>(b)] != 0) continue;
    for (int i = 0; i < c.lq; ++i)
      for (int h = 0; h < c.H; ++h) {
        const int64_t row = int64_t{b} * c.lq + i;
        ASSERT_EQ(call.lse[static_cast<size_t>(h * rows + row)],
                  c.sinks ? call.sinks[static_cast<size_t>(h)] : -kInf)
            << "lse of empty sequence " << b;
        for (int d = 0; d < c.D; ++d)
          ASSERT_EQ(call.out.get(row, h, d), 0.0) << "out of empty sequence " << b;
      }
  }
  for (const auto& [t, what] : {std::pair<const HostTensor*, const char*>{&call.out, "out"},
                                {&call.dq, "dq"},
                                {&call.dk, "dk"},
                                {&call.dv, "dv"}})
    expect_padding_untouched(*t, what);
}

struct MaskCase {
  const char* name;
  jf_mask mask;
  int left, right;
};
const MaskCase kMasks[] = {{"none", JF_MASK_NONE, -1, -1},      {"causal", JF_MASK_CAUSAL, -1, -1},
                           {"win3_0", JF_MASK_WINDOW, 3, 0},    {"win16_16", JF_MASK_WINDOW, 16, 16},
                           {"winInf_7", JF_MASK_WINDOW, -1, 7}, {"win7_Inf", JF_MASK_WINDOW, 7, -1},
                           {"win0_0", JF_MASK_WINDOW, 0, 0}};

struct HeadCase {
  const char* name;
  int H, H_kv;
};
const HeadCase kHeads[] = {{"mha", 4, 4}, {"gqa", 4, 2}, {"mqa", 4, 1}};

// Lengths with 0 and 1, primes and tile edges, shorter and longer than every Lq.
const std::vector<int32_t> kLenKv = {0, 1, 37, 64, 0, 129, 2, 211, 17};

std::vector<PooledCase> pooled_cases() {
  std::vector<PooledCase> cases;
  const jf_dtype dtypes[] = {JF_FP32, JF_BF16, JF_FP16};
  uint64_t seed = 17000;
  size_t n = 0;
  for (int lq : {1, 16, 64, 128, 200})
    for (const MaskCase& m : kMasks)
      for (const HeadCase& h : kHeads) {
        PooledCase c{lq, kLenKv, h.H, h.H_kv, 64, dtypes[n++ % 3], m.mask, m.left, m.right, seed++, ""};
        c.name = "lq" + std::to_string(lq) + "_" + m.name + "_" + h.name + "_" + dtype_name(c.dtype);
        cases.push_back(c);
      }
  // Head dim 128, and every dtype on the none mask and a key-side window at Lq = 16.
  for (jf_dtype dt : dtypes) {
    PooledCase c{16, {5, 0, 130, 1}, 2, 1, 128, dt, JF_MASK_NONE, -1, -1, seed++, ""};
    c.name = std::string("d128_none_") + dtype_name(dt);
    cases.push_back(c);
    PooledCase w{16, {5, 0, 130, 1}, 2, 1, 128, dt, JF_MASK_WINDOW, 8, 0, seed++, ""};
    w.name = std::string("d128_win8_0_") + dtype_name(dt);
    cases.push_back(w);
  }
  // Score modifiers: softcap and ALiBi (bottom-right aligned per sequence, Lq against its length).
  for (int lq : {1, 16, 64})
    for (const MaskCase& m : {kMasks[0], kMasks[1], kMasks[2]}) {
      PooledCase cap{lq, kLenKv, 4, 2, 64, dtypes[n++ % 3], m.mask, m.left, m.right, seed++, "", 0.5f, false};
      cap.name = "softcap_lq" + std::to_string(lq) + "_" + m.name + "_" + dtype_name(cap.dtype);
      cases.push_back(cap);
      PooledCase alibi{lq,      kLenKv, 4,  1,    64,  dtypes[n++ % 3], m.mask, m.left,
                       m.right, seed++, "", 0.0f, true};
      alibi.name = "alibi_lq" + std::to_string(lq) + "_" + m.name + "_" + dtype_name(alibi.dtype);
      cases.push_back(alibi);
    }
  // Learnable sinks, alone and with a softcap, under a mask and a window.
  for (int lq : {1, 16, 64})
    for (const MaskCase& m : {kMasks[0], kMasks[1], kMasks[2]}) {
      PooledCase sink{lq,     kLenKv,  4,      2,  64,   dtypes[n++ % 3], m.mask,
                      m.left, m.right, seed++, "", 0.0f, false,           true};
      sink.name = "sinks_lq" + std::to_string(lq) + "_" + m.name + "_" + dtype_name(sink.dtype);
      cases.push_back(sink);
      PooledCase capped = sink;
      capped.softcap = 2.0f;
      capped.seed = seed++;
      capped.name = "sinks_softcap_lq" + std::to_string(lq) + "_" + m.name + "_" + dtype_name(sink.dtype);
      cases.push_back(capped);
    }
  // One sequence; only empty sequences.
  cases.push_back({64, {97}, 4, 2, 64, JF_BF16, JF_MASK_NONE, -1, -1, seed++, "one_sequence"});
  cases.push_back({16, {0, 0, 0}, 4, 4, 64, JF_FP32, JF_MASK_NONE, -1, -1, seed++, "all_empty"});
  return cases;
}

class ReferencePooled : public ::testing::TestWithParam<PooledCase> {};

TEST_P(ReferencePooled, MatchesRepeatedQueriesThroughTheOrdinaryReference) { check_pooled(GetParam()); }

INSTANTIATE_TEST_SUITE_P(LqMasksHeadsDtypes, ReferencePooled, ::testing::ValuesIn(pooled_cases()),
                         [](const ::testing::TestParamInfo<PooledCase>& info) { return info.param.name; });

// B = 0: nothing to attend over; the forward writes nothing, the backward writes dq = 0.
TEST(ReferencePooledEdges, EmptyBatchWritesZeroDq) {
  PooledCall call({16, {}, 4, 2, 64, JF_BF16, JF_MASK_NONE, -1, -1, 17500, "empty"});
  ASSERT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&call.bwd), JF_OK) << jagflash_last_error();
  for (int i = 0; i < 16; ++i)
    for (int h = 0; h < 4; ++h)
      for (int d = 0; d < 64; ++d) ASSERT_EQ(call.dq.get(i, h, d), 0.0);
  expect_padding_untouched(call.dq, "dq");
}

// The float64 reference threads its (sequence, kv head) and per-head dq tasks: a batch large
// enough for several threads gives bit-identical out, lse, dq, dk, dv on every run.
TEST(ReferencePooledEdges, RepeatedRunsAreBitIdentical) {
  std::vector<int32_t> lengths;
  for (int b = 0; b < 24; ++b) lengths.push_back((b * 37) % 200);
  const PooledCase c{64, lengths, 8, 2, 64, JF_BF16, JF_MASK_NONE, -1, -1, 17600, "repeat"};
  PooledCall first(c), second(c);
  for (PooledCall* call : {&first, &second}) {
    ASSERT_EQ(jagflash_fwd(&call->fwd), JF_OK) << jagflash_last_error();
    ASSERT_EQ(jagflash_bwd(&call->bwd), JF_OK) << jagflash_last_error();
  }
  EXPECT_EQ(first.out.bytes, second.out.bytes);
  EXPECT_EQ(first.lse, second.lse);
  EXPECT_EQ(first.dq.bytes, second.dq.bytes);
  EXPECT_EQ(first.dk.bytes, second.dk.bytes);
  EXPECT_EQ(first.dv.bytes, second.dv.bytes);
}

// The sum over sequences is a real sum: two identical sequences give exactly twice one
// sequence's dq (the float64 sum of two equal contributions is exact, and so is rounding 2x).
TEST(ReferencePooledEdges, DqOfTwoIdenticalSequencesIsTwiceOne) {
  PooledCall one({16, {40}, 2, 2, 64, JF_FP32, JF_MASK_NONE, -1, -1, 17700, "one"});
  PooledCall two({16, {40, 40}, 2, 2, 64, JF_FP32, JF_MASK_NONE, -1, -1, 17700, "two"});
  // The same q, k, v, dout in both sequences of `two`.
  for (int64_t r = 0; r < 40; ++r)
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < 64; ++d) {
        two.k.set(r, h, d, one.k.get(r, h, d));
        two.k.set(r + 40, h, d, one.k.get(r, h, d));
        two.v.set(r, h, d, one.v.get(r, h, d));
        two.v.set(r + 40, h, d, one.v.get(r, h, d));
      }
  for (int i = 0; i < 16; ++i)
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < 64; ++d) {
        two.q.set(i, h, d, one.q.get(i, h, d));
        two.dout.set(i, h, d, one.dout.get(i, h, d));
        two.dout.set(i + 16, h, d, one.dout.get(i, h, d));
      }
  for (PooledCall* call : {&one, &two}) {
    ASSERT_EQ(jagflash_fwd(&call->fwd), JF_OK) << jagflash_last_error();
    ASSERT_EQ(jagflash_bwd(&call->bwd), JF_OK) << jagflash_last_error();
  }
  // fp32: 2x is exact in float64 and rounding commutes with it, so the sums agree bitwise.
  for (int i = 0; i < 16; ++i)
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < 64; ++d) ASSERT_EQ(two.dq.get(i, h, d), 2.0 * one.dq.get(i, h, d));
}

}  // namespace
}  // namespace jagflash::test
