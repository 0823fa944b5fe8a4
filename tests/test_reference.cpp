// The CPU reference against independent float64 computations written here:
//  - forward vs a dense per-sequence softmax(Q K^T) V that masks elementwise with
//    MaskPolicy::visible (the reference iterates key_range instead);
//  - backward vs central finite differences of that dense forward; its contract with the caller
//    (P from the given lse, delta from the given out): key blocks called with the out and lse of
//    all the keys add up to the backward over all of them, and a row with lse = -inf adds nothing;
//  - exact zeros / -inf where nothing is visible, writes confined to the views, determinism;
//  - every head dim (multiples of 8 up to 256) and a v head dim of its own, through the C API;
//  - the score modifiers (tanh softcap, ALiBi) through the C API, against the dense forward with
//    the modifier written out here (NaiveMod, not core/score_mod.hpp) and its finite differences;
//  - learnable sinks, alone and with a softcap, under every mask: the same, finite differences
//    of d sink included, and the rows that see no key (out 0, lse = the sink, no gradient).
#include "reference/reference.hpp"

#include "core/mask.hpp"
#include "testing/host_batch.hpp"

#include <gtest/gtest.h>
#include <jagflash/jagflash.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

namespace jagflash::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// unit_roundoff (testing/host_batch.hpp) of each storage type: the reference rounds double ->
// float -> storage, which adds at most the float roundoff 2^-24 on top.

// Relative L2 tolerance on the forward output: fp32 leaves only the final rounding; bf16 and fp16
// are compared with a naive result computed from the same rounded inputs, so only the output
// rounding separates them.
double out_tolerance(jf_dtype dtype) {
  switch (dtype) {
    case JF_BF16:
      return 1e-2;
    case JF_FP16:
      return 2e-3;
    case JF_FP32:
      return 1e-6;
  }
  return 0.0;
}

// Absolute slack on elementwise bounds: fp16 subnormals are spaced 2^-24 apart, and the two
// float64 computations sum in different orders (~1e-15 on O(1) terms).
double abs_slack(jf_dtype dtype) { return (dtype == JF_FP16 ? std::ldexp(1.0, -24) : 0.0) + 1e-12; }

// A batch in float64, each tensor packed as [rows][heads][D] (v as [rows][heads][Dv]).
struct DenseBatch {
  int H = 0;
  int H_kv = 0;
  int D = 0;
  int Dv = 0;
  std::vector<int32_t> q_offsets;
  std::vector<int32_t> kv_offsets;
  std::vector<double> q, k, v;
};

std::vector<double> to_dense(const HostTensor& t) {
  std::vector<double> dense(static_cast<size_t>(t.rows * t.heads * t.head_dim));
  size_t i = 0;
  for (int64_t r = 0; r < t.rows; ++r)
    for (int h = 0; h < t.heads; ++h)
      for (int d = 0; d < t.head_dim; ++d) dense[i++] = t.get(r, h, d);
  return dense;
}

DenseBatch to_dense(const HostBatch& batch) {
  DenseBatch dense;
  dense.H = batch.H;
  dense.H_kv = batch.H_kv;
  dense.D = batch.D;
  dense.Dv = batch.v.head_dim;
  dense.q_offsets = batch.q_offsets;
  dense.kv_offsets = batch.kv_offsets;
  dense.q = to_dense(batch.q);
  dense.k = to_dense(batch.k);
  dense.v = to_dense(batch.v);
  return dense;
}

struct NaiveResult {
  std::vector<double> out;  // [total_q][H][Dv]
  std::vector<double> lse;  // [H][total_q]
};

// A score modifier written out independently of core/score_mod.hpp: cap > 0 applies
// cap * tanh(s / cap) to the scaled score; non-empty slopes add -slopes[h] * |i + Lk - Lq - j|.
// Non-empty sinks: head h's logit sinks[h] joins every row's softmax with no value.
struct NaiveMod {
  double cap = 0.0;
  std::vector<double> slopes;
  std::vector<double> sinks;
};

// Builds the full Lq x Lk score matrix of every (sequence, head), masks it elementwise, softmaxes
// each row and multiplies by V.
NaiveResult naive_forward(const DenseBatch& in, const MaskPolicy& mask, double scale,
                          const NaiveMod& mod = {}) {
  const int64_t total_q = in.q_offsets.back();
  const int H = in.H, H_kv = in.H_kv, D = in.D, Dv = in.Dv;
  NaiveResult res;
  res.out.assign(static_cast<size_t>(total_q * H * Dv), 0.0);
  res.lse.assign(static_cast<size_t>(H * total_q), -kInf);
  for (size_t b = 0; b + 1 < in.q_offsets.size(); ++b) {
    const int64_t q0 = in.q_offsets[b], lq = in.q_offsets[b + 1] - q0;
    const int64_t k0 = in.kv_offsets[b], lk = in.kv_offsets[b + 1] - k0;
    std::vector<double> s(static_cast<size_t>(lq * lk));
    for (int h = 0; h < H; ++h) {
      const int hk = h / (H / H_kv);
      for (int64_t i = 0; i < lq; ++i)
        for (int64_t j = 0; j < lk; ++j) {
          double acc = 0.0;
          for (int d = 0; d < D; ++d)
            acc += in.q[((q0 + i) * H + h) * D + d] * in.k[((k0 + j) * H_kv + hk) * D + d];
          double score = scale * acc;
          if (mod.cap > 0.0) score = mod.cap * std::tanh(score / mod.cap);
          if (!mod.slopes.empty())
            score -= mod.slopes[static_cast<size_t>(h)] * static_cast<double>(std::abs(i + lk - lq - j));
          s[i * lk + j] = mask.visible(i, j, lq, lk) ? score : -kInf;
        }
      const double sink = mod.sinks.empty() ? -kInf : mod.sinks[static_cast<size_t>(h)];
      for (int64_t i = 0; i < lq; ++i) {
        double m = sink;
        for (int64_t j = 0; j < lk; ++j) m = std::max(m, s[i * lk + j]);
        if (m == -kInf) continue;
        double l = std::exp(sink - m);
        for (int64_t j = 0; j < lk; ++j) {
          s[i * lk + j] = std::exp(s[i * lk + j] - m);
          l += s[i * lk + j];
        }
        double* o = &res.out[((q0 + i) * H + h) * Dv];
        for (int64_t j = 0; j < lk; ++j)
          for (int d = 0; d < Dv; ++d) o[d] += s[i * lk + j] / l * in.v[((k0 + j) * H_kv + hk) * Dv + d];
        res.lse[h * total_q + q0 + i] = m + std::log(l);
      }
    }
  }
  return res;
}

struct MaskCase {
  const char* name;
  jf_mask mask;
  int window_left;
  int window_right;
};

const std::vector<MaskCase>& all_masks() {
  static const std::vector<MaskCase> masks = {
      {"none", JF_MASK_NONE, -1, -1},       {"causal", JF_MASK_CAUSAL, -1, 0},
      {"win3_0", JF_MASK_WINDOW, 3, 0},     {"win0_5", JF_MASK_WINDOW, 0, 5},
      {"win16_16", JF_MASK_WINDOW, 16, 16}, {"winInf_7", JF_MASK_WINDOW, -1, 7},
      {"win7_Inf", JF_MASK_WINDOW, 7, -1},
  };
  return masks;
}

struct HeadCase {
  const char* name;
  int H;
  int H_kv;
};

const std::vector<HeadCase>& all_heads() {
  static const std::vector<HeadCase> heads = {{"mha", 4, 4}, {"gqa", 4, 2}, {"mqa", 4, 1}};
  return heads;
}

MaskPolicy policy_of(const MaskCase& m) { return MaskPolicy::from(m.mask, m.window_left, m.window_right); }

double scale_of(float scale, int D) {
  return scale != 0.0f ? scale : 1.0 / std::sqrt(static_cast<double>(D));
}

struct ForwardResult {
  HostTensor out;
  std::vector<float> lse;
};

constexpr double kSentinel = 777.0;

ForwardResult run_forward(HostBatch& batch, const MaskCase& m, float scale, int out_pad) {
  ForwardResult res{make_tensor(batch.dtype, batch.total_q(), batch.H, batch.D, out_pad), {}};
  res.out.fill(kSentinel);
  res.lse.assign(static_cast<size_t>(batch.H * batch.total_q()), static_cast<float>(kSentinel));
  jf_fwd_args args{};
  args.problem = make_problem(batch, m.mask, m.window_left, m.window_right, scale);
  args.out = res.out.view();
  args.lse = res.lse.data();
  reference::forward(args);
  return res;
}

struct Grads {
  HostTensor dq, dk, dv;
};

Grads run_backward(HostBatch& batch, const MaskCase& m, float scale, HostTensor& out, std::vector<float>& lse,
                   HostTensor& dout, int grad_pad) {
  Grads g{make_tensor(batch.dtype, batch.total_q(), batch.H, batch.D, grad_pad),
          make_tensor(batch.dtype, batch.total_kv(), batch.H_kv, batch.D, grad_pad),
          make_tensor(batch.dtype, batch.total_kv(), batch.H_kv, batch.D, grad_pad)};
  g.dq.fill(kSentinel);
  g.dk.fill(kSentinel);
  g.dv.fill(kSentinel);
  jf_bwd_args args{};
  args.problem = make_problem(batch, m.mask, m.window_left, m.window_right, scale);
  args.out = out.view();
  args.dout = dout.view();
  args.lse = lse.data();
  args.dq = g.dq.view();
  args.dk = g.dk.view();
  args.dv = g.dv.view();
  reference::backward(args);
  return g;
}

// Elementwise: |got - want| <= (u + 2^-24) |want| + slack, the most the final double -> float ->
// dtype rounding may move a value (the factor covers the second-order term of double rounding),
// plus extra_rel when want carries a rounding of its own; and a relative L2 bound per dtype.
void expect_tensor_near(const HostTensor& got, const std::vector<double>& want, double rel_l2_tol,
                        const char* what, double extra_rel = 0.0) {
  const double u = (unit_roundoff(got.dtype) + std::ldexp(1.0, -24)) * (1.0 + 1e-6) + extra_rel;
  double diff2 = 0.0, want2 = 0.0;
  int64_t bad = 0;
  size_t i = 0;
  for (int64_t r = 0; r < got.rows; ++r)
    for (int h = 0; h < got.heads; ++h)
      for (int d = 0; d < got.head_dim; ++d, ++i) {
        const double g = got.get(r, h, d), w = want[i];
        diff2 += (g - w) * (g - w);
        want2 += w * w;
        if (!(std::abs(g - w) <= u * std::abs(w) + abs_slack(got.dtype))) {
          if (bad++ < 3)
            ADD_FAILURE() << what << " (" << r << "," << h << "," << d << "): got " << g << " want " << w;
        }
      }
  EXPECT_EQ(bad, 0) << what << ": elements outside the rounding bound";
  const double rel = std::sqrt(diff2) / std::max(std::sqrt(want2), 1e-30);
  EXPECT_LE(rel, rel_l2_tol) << what << ": relative L2 error";
}

// lse and out where no key is visible must be exactly -inf and 0; elsewhere lse is finite and
// within the float rounding of the naive value. `has_empty_rows`: the batch's rows that see no key
// have lse = -inf (false with sinks, whose lse there is the sink's).
void expect_forward_matches(const ForwardResult& got, const NaiveResult& want, jf_dtype dtype,
                            bool has_empty_rows = true) {
  expect_tensor_near(got.out, want.out, out_tolerance(dtype), "out");
  const int64_t total_q = got.out.rows;
  int64_t empty_rows = 0, bad = 0;
  for (int h = 0; h < got.out.heads; ++h)
    for (int64_t r = 0; r < total_q; ++r) {
      const double g = got.lse[h * total_q + r], w = want.lse[h * total_q + r];
      if (w == -kInf) {
        ++empty_rows;
        EXPECT_EQ(g, -kInf) << "lse of empty row " << r << " head " << h;
        for (int d = 0; d < got.out.head_dim; ++d)
          EXPECT_EQ(got.out.get(r, h, d), 0.0) << "out of empty row " << r << " head " << h;
      } else if (!(std::abs(g - w) <= std::ldexp(1.0, -23) * std::abs(w) + 1e-12)) {
        if (bad++ < 3) ADD_FAILURE() << "lse row " << r << " head " << h << ": got " << g << " want " << w;
      }
    }
  EXPECT_EQ(bad, 0) << "lse elements outside the float rounding bound";
  // Every batch here has a sequence with Lq > 0 and Lk = 0, so the empty-row branch is exercised.
  if (has_empty_rows) {
    EXPECT_GT(empty_rows, 0);
  }
}

// ---------------------------------------------------------------------------------------------
// a) forward vs the dense naive computation

// Awkward lengths: 0, 1, tile edges 63/64/65/127/129, primes; q != kv both ways, Lk = 0 with
// Lq > 0, Lq = 0 with Lk > 0.
const std::vector<int32_t> kLenQ = {0, 1, 2, 63, 64, 65, 127, 129, 17, 31, 97, 131, 5, 0, 64, 1};
const std::vector<int32_t> kLenKv = {0, 1, 3, 64, 63, 131, 127, 17, 129, 0, 97, 31, 0, 7, 65, 2};

struct ForwardCase {
  std::string name;
  MaskCase mask;
  HeadCase heads;
  jf_dtype dtype;
  int D;
  int in_pad;
  int out_pad;
  float scale;
  uint64_t seed;
};

std::ostream& operator<<(std::ostream& os, const ForwardCase& c) { return os << c.name; }

std::vector<ForwardCase> forward_cases() {
  std::vector<ForwardCase> cases;
  const jf_dtype dtypes[] = {JF_FP32, JF_BF16, JF_FP16};
  uint64_t seed = 1000;
  for (size_t mi = 0; mi < all_masks().size(); ++mi)
    for (size_t hi = 0; hi < all_heads().size(); ++hi)
      for (size_t di = 0; di < 3; ++di) {
        ForwardCase c;
        c.mask = all_masks()[mi];
        c.heads = all_heads()[hi];
        c.dtype = dtypes[di];
        c.D = 64;
        // Cycle through the four (input, output) padding combinations.
        c.in_pad = ((mi + hi + di) % 2) * 8;
        c.out_pad = ((mi + hi) % 2) * 8;
        c.scale = (di == 0 && hi == 1) ? 0.3f : 0.0f;
        c.seed = seed++;
        cases.push_back(c);
      }
  {
    ForwardCase c{"", all_masks()[1], all_heads()[1], JF_BF16, 128, 8, 8, 0.0f, seed++};
    cases.push_back(c);
    ForwardCase w{"", all_masks()[4], all_heads()[2], JF_FP32, 128, 0, 8, 0.0f, seed++};
    cases.push_back(w);
  }
  for (ForwardCase& c : cases)
    c.name = std::string(c.mask.name) + "_" + c.heads.name + "_" + dtype_name(c.dtype) + "_d" +
             std::to_string(c.D) + "_pad" + std::to_string(c.in_pad) + "_" + std::to_string(c.out_pad) +
             (c.scale != 0.0f ? "_scaled" : "");
  return cases;
}

class ReferenceForward : public ::testing::TestWithParam<ForwardCase> {};

TEST_P(ReferenceForward, MatchesDenseNaive) {
  const ForwardCase& c = GetParam();
  SCOPED_TRACE("case " + c.name + " seed " + std::to_string(c.seed));
  HostBatch batch = make_random_batch(kLenQ, kLenKv, c.heads.H, c.heads.H_kv, c.D, c.dtype, c.seed, c.in_pad);
  const ForwardResult got = run_forward(batch, c.mask, c.scale, c.out_pad);
  const NaiveResult want = naive_forward(to_dense(batch), policy_of(c.mask), scale_of(c.scale, c.D));
  expect_forward_matches(got, want, c.dtype);
}

INSTANTIATE_TEST_SUITE_P(AllMasksHeadsDtypes, ReferenceForward, ::testing::ValuesIn(forward_cases()),
                         [](const ::testing::TestParamInfo<ForwardCase>& info) { return info.param.name; });

TEST(ReferenceForwardScale, ZeroMeansInverseSqrtHeadDim) {
  const uint64_t seed = 2000;
  SCOPED_TRACE("seed " + std::to_string(seed));
  HostBatch batch = make_random_batch({17, 5}, {31, 5}, 2, 2, 64, JF_FP32, seed);
  const MaskCase none = all_masks()[0];
  const ForwardResult implicit = run_forward(batch, none, 0.0f, 0);
  const ForwardResult explicit_scale = run_forward(batch, none, 0.125f, 0);
  const ForwardResult other = run_forward(batch, none, 0.5f, 0);
  EXPECT_EQ(implicit.out.bytes, explicit_scale.out.bytes);
  EXPECT_EQ(implicit.lse, explicit_scale.lse);
  EXPECT_NE(implicit.out.bytes, other.out.bytes);
}

TEST(ReferenceForwardLse, NullLseWritesTheSameOut) {
  const uint64_t seed = 2001;
  SCOPED_TRACE("seed " + std::to_string(seed));
  HostBatch batch = make_random_batch({33, 0, 8}, {20, 4, 0}, 4, 2, 64, JF_BF16, seed);
  const MaskCase causal = all_masks()[1];
  const ForwardResult with_lse = run_forward(batch, causal, 0.0f, 0);
  HostTensor out = make_tensor(JF_BF16, batch.total_q(), 4, 64);
  out.fill(kSentinel);
  jf_fwd_args args{};
  args.problem = make_problem(batch, causal.mask, causal.window_left, causal.window_right);
  args.out = out.view();
  args.lse = nullptr;
  reference::forward(args);
  EXPECT_EQ(out.bytes, with_lse.out.bytes);
}

// ---------------------------------------------------------------------------------------------
// b) backward vs central finite differences of the dense naive forward

const std::vector<int32_t> kFdLenQ = {3, 0, 5, 1, 9, 20, 4, 6};
const std::vector<int32_t> kFdLenKv = {4, 2, 0, 1, 7, 20, 9, 6};

struct BackwardCase {
  std::string name;
  MaskCase mask;
  HeadCase heads;
  uint64_t seed;
};

std::ostream& operator<<(std::ostream& os, const BackwardCase& c) { return os << c.name; }

std::vector<BackwardCase> backward_cases() {
  std::vector<BackwardCase> cases;
  uint64_t seed = 3000;
  for (const MaskCase& m : all_masks())
    for (const HeadCase& h : all_heads()) cases.push_back({std::string(m.name) + "_" + h.name, m, h, seed++});
  return cases;
}

double loss_of(const DenseBatch& in, const MaskPolicy& mask, double scale, const std::vector<double>& dout,
               const NaiveMod& mod = {}) {
  const NaiveResult r = naive_forward(in, mask, scale, mod);
  double loss = 0.0;
  for (size_t i = 0; i < dout.size(); ++i) loss += r.out[i] * dout[i];
  return loss;
}

double max_abs(const HostTensor& t) {
  double m = 0.0;
  for (int64_t r = 0; r < t.rows; ++r)
    for (int h = 0; h < t.heads; ++h)
      for (int d = 0; d < t.head_dim; ++d) m = std::max(m, std::abs(t.get(r, h, d)));
  return m;
}

class ReferenceBackward : public ::testing::TestWithParam<BackwardCase> {};

TEST_P(ReferenceBackward, MatchesFiniteDifferences) {
  const BackwardCase& c = GetParam();
  SCOPED_TRACE("case " + c.name + " seed " + std::to_string(c.seed));
  constexpr int kD = 64;
  constexpr int kSamples = 20;
  constexpr double kStep = 1e-4;
  constexpr double kTol = 1e-4;
  HostBatch batch = make_random_batch(kFdLenQ, kFdLenKv, c.heads.H, c.heads.H_kv, kD, JF_FP32, c.seed, 3);
  HostTensor dout = make_tensor(JF_FP32, batch.total_q(), c.heads.H, kD, 5);
  std::mt19937_64 rng(c.seed ^ 0x5eedULL);
  dout.fill_random(rng);
  ForwardResult fwd = run_forward(batch, c.mask, 0.0f, 0);
  const Grads g = run_backward(batch, c.mask, 0.0f, fwd.out, fwd.lse, dout, 7);

  const MaskPolicy mask = policy_of(c.mask);
  const double scale = scale_of(0.0f, kD);
  const DenseBatch base = to_dense(batch);
  const std::vector<double> dout_dense = to_dense(dout);

  struct Target {
    const char* name;
    std::vector<double> DenseBatch::*field;
    const HostTensor* grad;
    int heads;
  };
  const Target targets[] = {{"dq", &DenseBatch::q, &g.dq, c.heads.H},
                            {"dk", &DenseBatch::k, &g.dk, c.heads.H_kv},
                            {"dv", &DenseBatch::v, &g.dv, c.heads.H_kv}};
  for (const Target& t : targets) {
    const double grad_max = max_abs(*t.grad);
    EXPECT_GT(grad_max, 0.0) << t.name << " is all zero";
    std::uniform_int_distribution<size_t> pick(0, (base.*(t.field)).size() - 1);
    for (int s = 0; s < kSamples; ++s) {
      const size_t idx = pick(rng);
      DenseBatch x = base;
      (x.*(t.field))[idx] += kStep;
      const double plus = loss_of(x, mask, scale, dout_dense);
      (x.*(t.field))[idx] -= 2 * kStep;
      const double minus = loss_of(x, mask, scale, dout_dense);
      const double fd = (plus - minus) / (2 * kStep);
      const int64_t r = static_cast<int64_t>(idx / (t.heads * kD));
      const int h = static_cast<int>(idx / kD % t.heads);
      const int d = static_cast<int>(idx % kD);
      EXPECT_NEAR(t.grad->get(r, h, d), fd, kTol * grad_max)
          << t.name << " (" << r << "," << h << "," << d << ")";
    }
  }

  // Exact zeros: query rows that see no key, keys that no query sees (visibility does not depend
  // on the head). The FD batch holds Lq > 0 with Lk = 0 and Lq = 0 with Lk > 0, so both occur.
  int64_t blind_rows = 0, unseen_keys = 0;
  for (size_t b = 0; b < kFdLenQ.size(); ++b) {
    const int64_t lq = kFdLenQ[b], lk = kFdLenKv[b];
    const int64_t q0 = batch.q_offsets[b], k0 = batch.kv_offsets[b];
    for (int64_t i = 0; i < lq; ++i) {
      bool sees = false;
      for (int64_t j = 0; j < lk; ++j) sees = sees || mask.visible(i, j, lq, lk);
      if (sees) continue;
      ++blind_rows;
      for (int h = 0; h < c.heads.H; ++h)
        for (int d = 0; d < kD; ++d) ASSERT_EQ(g.dq.get(q0 + i, h, d), 0.0) << "dq row " << q0 + i;
    }
    for (int64_t j = 0; j < lk; ++j) {
      bool seen = false;
      for (int64_t i = 0; i < lq; ++i) seen = seen || mask.visible(i, j, lq, lk);
      if (seen) continue;
      ++unseen_keys;
      for (int h = 0; h < c.heads.H_kv; ++h)
        for (int d = 0; d < kD; ++d) {
          ASSERT_EQ(g.dk.get(k0 + j, h, d), 0.0) << "dk row " << k0 + j;
          ASSERT_EQ(g.dv.get(k0 + j, h, d), 0.0) << "dv row " << k0 + j;
        }
    }
  }
  EXPECT_GT(blind_rows, 0);
  EXPECT_GT(unseen_keys, 0);
}

INSTANTIATE_TEST_SUITE_P(AllMasksHeads, ReferenceBackward, ::testing::ValuesIn(backward_cases()),
                         [](const ::testing::TestParamInfo<BackwardCase>& info) { return info.param.name; });

// bf16/fp16 backward against the fp32 backward of the same (rounded) inputs, both given the half
// forward's out and lse (the backward takes delta from the out it is given, so an fp32 out would
// change delta by out's rounding): the math is float64 in both, so only the rounding of the
// gradients separates them.
TEST(ReferenceBackwardDtypes, HalfPrecisionMatchesFp32OfSameInputs) {
  const std::vector<int32_t> len_q = {65, 0, 17, 129, 3};
  const std::vector<int32_t> len_kv = {31, 5, 0, 127, 64};
  uint64_t seed = 4000;
  for (jf_dtype dtype : {JF_BF16, JF_FP16})
    for (const MaskCase& m : {all_masks()[1], all_masks()[4], all_masks()[6]}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + " " + m.name + " seed " + std::to_string(seed));
      HostBatch half = make_random_batch(len_q, len_kv, 4, 2, 64, dtype, seed, 8);
      HostTensor dout_half = make_tensor(dtype, half.total_q(), 4, 64);
      std::mt19937_64 rng(seed++);
      dout_half.fill_random(rng);

      HostBatch full = half;
      full.dtype = JF_FP32;
      HostTensor dout_full = make_tensor(JF_FP32, half.total_q(), 4, 64);
      for (HostTensor* t : {&full.q, &full.k, &full.v}) {
        const HostTensor src = *t;
        *t = make_tensor(JF_FP32, src.rows, src.heads, src.head_dim, 8);
        for (int64_t r = 0; r < src.rows; ++r)
          for (int h = 0; h < src.heads; ++h)
            for (int d = 0; d < src.head_dim; ++d) t->set(r, h, d, src.get(r, h, d));
      }
      for (int64_t r = 0; r < dout_half.rows; ++r)
        for (int h = 0; h < 4; ++h)
          for (int d = 0; d < 64; ++d) dout_full.set(r, h, d, dout_half.get(r, h, d));

      ForwardResult fwd_half = run_forward(half, m, 0.0f, 0);
      HostTensor out_full = make_tensor(JF_FP32, half.total_q(), 4, 64);
      for (int64_t r = 0; r < out_full.rows; ++r)
        for (int h = 0; h < 4; ++h)
          for (int d = 0; d < 64; ++d) out_full.set(r, h, d, fwd_half.out.get(r, h, d));
      const Grads got = run_backward(half, m, 0.0f, fwd_half.out, fwd_half.lse, dout_half, 0);
      const Grads want = run_backward(full, m, 0.0f, out_full, fwd_half.lse, dout_full, 0);
      const double tol = out_tolerance(dtype);
      // want carries its own float rounding, hence the extra 2^-23 in the bound.
      const double want_rounding = std::ldexp(1.0, -23);
      expect_tensor_near(got.dq, to_dense(want.dq), tol, "dq", want_rounding);
      expect_tensor_near(got.dk, to_dense(want.dk), tol, "dk", want_rounding);
      expect_tensor_near(got.dv, to_dense(want.dv), tol, "dv", want_rounding);
      EXPECT_GT(max_abs(want.dk), 0.0);
    }
}

// ---------------------------------------------------------------------------------------------
// The backward's contract with its caller: P = exp(score - lse) and delta = rowsum(dO * O) from
// the lse and out it is given, as the GPU backwards take them. Context parallelism (ring
// attention) relies on it: it calls the backward once per K/V block with the out and lse of
// attention over every block, and sums the blocks' dq and puts their dk, dv side by side.

// The keys [first[b], first[b] + count[b]) of every sequence b of `whole`, as a batch of its own
// (the same q and q_offsets; k and v rows packed, with row padding).
HostBatch key_block(const HostBatch& whole, const std::vector<int32_t>& first,
                    const std::vector<int32_t>& count) {
  HostBatch block = whole;
  block.kv_offsets = offsets_from_lengths(count);
  for (HostTensor* t : {&block.k, &block.v}) {
    const HostTensor& src = t == &block.k ? whole.k : whole.v;
    *t = make_tensor(whole.dtype, block.total_kv(), src.heads, src.head_dim, 3);
    for (size_t b = 0; b < count.size(); ++b)
      for (int32_t j = 0; j < count[b]; ++j)
        for (int h = 0; h < src.heads; ++h)
          for (int d = 0; d < src.head_dim; ++d)
            t->set(block.kv_offsets[b] + j, h, d, src.get(whole.kv_offsets[b] + first[b] + j, h, d));
  }
  return block;
}

struct ContractCase {
  std::string name;
  jf_dtype dtype;
  float softcap;  // > 0: JF_SCORE_MOD_SOFTCAP (its score does not depend on where the key sits)
  uint64_t seed;
};

std::ostream& operator<<(std::ostream& os, const ContractCase& c) { return os << c.name; }

class ReferenceBackwardContract : public ::testing::TestWithParam<ContractCase> {};

// Two key blocks per sequence (one of them empty in some), each called with the out and lse of
// attention over all the keys: dk and dv are the whole call's bitwise (every key's terms are the
// same float64 products summed in the same order); dq, the sum of the blocks' rounded dq, is the
// whole's within the roundings of the three. The control: each block with its own out and lse
// (what a backward that ignored the given ones would see) is far off.
TEST_P(ReferenceBackwardContract, KeyBlocksWithTheMergedOutAndLseAddUpToAllKeys) {
  const ContractCase& c = GetParam();
  SCOPED_TRACE("case " + c.name + " seed " + std::to_string(c.seed));
  constexpr int kH = 4, kHkv = 2, kD = 64;
  const std::vector<int32_t> len_q = {37, 1, 0, 64, 5, 20, 9, 3};
  const std::vector<int32_t> len_kv = {48, 17, 3, 0, 1, 129, 2, 31};
  const std::vector<int32_t> split = {17, 0, 3, 0, 1, 64, 1, 30};  // block 0's keys per sequence
  std::vector<int32_t> rest(len_kv.size()), zeros(len_kv.size(), 0);
  for (size_t b = 0; b < len_kv.size(); ++b) rest[b] = len_kv[b] - split[b];
  HostBatch whole = make_random_batch(len_q, len_kv, kH, kHkv, kD, c.dtype, c.seed, 8);
  HostBatch blocks[2] = {key_block(whole, zeros, split), key_block(whole, split, rest)};
  auto problem_of = [&](HostBatch& batch) {
    jf_problem p = make_problem(batch, JF_MASK_NONE, -1, -1);
    if (c.softcap > 0.0f) {
      p.score_mod = JF_SCORE_MOD_SOFTCAP;
      p.softcap = c.softcap;
    }
    return p;
  };
  auto forward = [&](HostBatch& batch, HostTensor& out, std::vector<float>& lse) {
    out = make_tensor(c.dtype, batch.total_q(), kH, kD, 5);
    lse.assign(static_cast<size_t>(kH * batch.total_q()), static_cast<float>(kSentinel));
    reference::forward(forward_args(problem_of(batch), out, lse.data()));
  };
  auto backward = [&](HostBatch& batch, HostTensor& out, std::vector<float>& lse, HostTensor& dout) {
    Grads g{make_tensor(c.dtype, batch.total_q(), kH, kD, 7),
            make_tensor(c.dtype, batch.total_kv(), kHkv, kD, 7),
            make_tensor(c.dtype, batch.total_kv(), kHkv, kD, 7)};
    reference::backward(backward_args(problem_of(batch), out, dout, lse.data(), g.dq, g.dk, g.dv));
    return g;
  };

  HostTensor out, dout = make_tensor(c.dtype, whole.total_q(), kH, kD, 2);
  std::vector<float> lse;
  std::mt19937_64 rng(c.seed ^ 0xc0ffeeULL);
  dout.fill_random(rng);
  forward(whole, out, lse);
  const Grads want = backward(whole, out, lse, dout);
  const Grads part[2] = {backward(blocks[0], out, lse, dout), backward(blocks[1], out, lse, dout)};

  // dk, dv: block k's key j of sequence b is the whole's key kv_offsets[b] + first + j.
  for (int k = 0; k < 2; ++k)
    for (size_t b = 0; b < len_kv.size(); ++b) {
      const int32_t first = k == 0 ? 0 : split[b];
      for (int32_t j = 0; j < blocks[k].kv_offsets[b + 1] - blocks[k].kv_offsets[b]; ++j)
        for (int h = 0; h < kHkv; ++h)
          for (int d = 0; d < kD; ++d) {
            const int64_t row = blocks[k].kv_offsets[b] + j, whole_row = whole.kv_offsets[b] + first + j;
            ASSERT_EQ(part[k].dk.get(row, h, d), want.dk.get(whole_row, h, d))
                << "dk of block " << k << " row " << row << " head " << h << " dim " << d;
            ASSERT_EQ(part[k].dv.get(row, h, d), want.dv.get(whole_row, h, d))
                << "dv of block " << k << " row " << row << " head " << h << " dim " << d;
          }
    }
  EXPECT_GT(max_abs(want.dk), 0.0);

  // dq: each of the three is its float64 sum rounded once to the dtype, so the blocks' sum is
  // within u (|dq_0| + |dq_1| + |dq|) of the whole's, u the dtype's roundoff plus the float's.
  const double u = (unit_roundoff(c.dtype) + std::ldexp(1.0, -24)) * (1.0 + 1e-6);
  int64_t bad = 0;
  for (int64_t r = 0; r < whole.total_q(); ++r)
    for (int h = 0; h < kH; ++h)
      for (int d = 0; d < kD; ++d) {
        const double a = part[0].dq.get(r, h, d), b = part[1].dq.get(r, h, d), w = want.dq.get(r, h, d);
        if (!(std::abs(a + b - w) <= u * (std::abs(a) + std::abs(b) + std::abs(w)) + abs_slack(c.dtype)) &&
            bad++ < 3)
          ADD_FAILURE() << "dq (" << r << "," << h << "," << d << "): blocks " << a << " + " << b << " want "
                        << w;
      }
  EXPECT_EQ(bad, 0) << "dq: elements outside the rounding bound";
  EXPECT_GT(max_abs(want.dq), 0.0);

  // The control: every block with the out and lse of its own forward.
  HostTensor dq_control = make_tensor(JF_FP32, whole.total_q(), kH, kD);
  for (HostBatch& block : blocks) {
    HostTensor own_out;
    std::vector<float> own_lse;
    forward(block, own_out, own_lse);
    const Grads g = backward(block, own_out, own_lse, dout);
    for (int64_t r = 0; r < whole.total_q(); ++r)
      for (int h = 0; h < kH; ++h)
        for (int d = 0; d < kD; ++d) dq_control.set(r, h, d, dq_control.get(r, h, d) + g.dq.get(r, h, d));
  }
  EXPECT_GT(rel_error(dq_control, want.dq), 0.1) << "the blocks' own out and lse would give the same dq";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ReferenceBackwardContract,
                         ::testing::Values(ContractCase{"fp32", JF_FP32, 0.0f, 4100},
                                           ContractCase{"bf16", JF_BF16, 0.0f, 4101},
                                           ContractCase{"fp16_softcap2", JF_FP16, 2.0f, 4102}),
                         [](const ::testing::TestParamInfo<ContractCase>& info) { return info.param.name; });

// A row whose given lse is -inf sees no key: P = 0, so dq = 0 on it and it adds nothing to dk and
// dv, exactly as if its dout were 0 (then every term it adds is an exact 0).
TEST(ReferenceBackwardGivenLse, RowsWithLseMinusInfContributeNothing) {
  const uint64_t seed = 4200;
  SCOPED_TRACE("seed " + std::to_string(seed));
  constexpr int kH = 4, kHkv = 2, kD = 64;
  HostBatch batch = make_random_batch({9, 1, 20}, {12, 5, 17}, kH, kHkv, kD, JF_FP32, seed, 3);
  const MaskCase m = all_masks()[4];
  ForwardResult fwd = run_forward(batch, m, 0.0f, 0);
  HostTensor dout = make_tensor(JF_FP32, batch.total_q(), kH, kD);
  std::mt19937_64 rng(seed);
  dout.fill_random(rng);
  // Rows 0, 9 (the second sequence's only row) and 25, on heads 1 and 3.
  std::vector<float> lse = fwd.lse;
  HostTensor dout_zeroed = dout;
  const int64_t total_q = batch.total_q();
  for (int64_t r : {0, 9, 25})
    for (int h : {1, 3}) {
      lse[static_cast<size_t>(h * total_q + r)] = -std::numeric_limits<float>::infinity();
      for (int d = 0; d < kD; ++d) dout_zeroed.set(r, h, d, 0.0);
    }
  const Grads got = run_backward(batch, m, 0.0f, fwd.out, lse, dout, 0);
  const Grads want = run_backward(batch, m, 0.0f, fwd.out, fwd.lse, dout_zeroed, 0);
  for (int64_t r = 0; r < total_q; ++r)
    for (int h = 0; h < kH; ++h)
      for (int d = 0; d < kD; ++d) ASSERT_EQ(got.dq.get(r, h, d), want.dq.get(r, h, d)) << "dq row " << r;
  for (int h : {1, 3})
    for (int d = 0; d < kD; ++d) ASSERT_EQ(got.dq.get(9, h, d), 0.0);
  EXPECT_EQ(got.dk.bytes, want.dk.bytes);
  EXPECT_EQ(got.dv.bytes, want.dv.bytes);
  EXPECT_GT(max_abs(got.dk), 0.0);
}

// ---------------------------------------------------------------------------------------------
// c) writes stay inside the views; inputs are not modified

// Whether each flat element of t's buffer belongs to the view.
std::vector<bool> view_elements(const HostTensor& t) {
  std::vector<bool> in_view(static_cast<size_t>(t.element_count()), false);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int h = 0; h < t.heads; ++h)
      for (int d = 0; d < t.head_dim; ++d) in_view[static_cast<size_t>(t.offset(r, h, d))] = true;
  return in_view;
}

// Padding keeps the sentinel; every view element was overwritten with a finite value.
void expect_written_only_in_view(const HostTensor& t, const char* what) {
  const std::vector<bool> in_view = view_elements(t);
  HostTensor probe = make_tensor(t.dtype, 1, 1, 1);
  probe.fill(kSentinel);
  const double sentinel = probe.get(0, 0, 0);  // kSentinel as the dtype stores it
  int64_t padding = 0;
  for (int64_t i = 0; i < t.element_count(); ++i) {
    const double x = t.get_flat(i);
    if (in_view[static_cast<size_t>(i)]) {
      ASSERT_TRUE(std::isfinite(x) && std::abs(x) < 100.0) << what << " element " << i << " = " << x;
    } else {
      ++padding;
      ASSERT_EQ(x, sentinel) << what << " padding element " << i << " was overwritten";
    }
  }
  EXPECT_GT(padding, 0) << what << " has no padding: the check would be vacuous";
}

TEST(ReferenceViews, WritesOnlyInsideStrides) {
  const std::vector<int32_t> len_q = {9, 5, 0, 17};
  const std::vector<int32_t> len_kv = {12, 0, 4, 17};
  uint64_t seed = 5000;
  for (jf_dtype dtype : {JF_FP32, JF_BF16, JF_FP16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)) + " seed " + std::to_string(seed));
    constexpr int kH = 4, kHkv = 2, kD = 64;
    HostBatch batch = make_random_batch(len_q, len_kv, kH, kHkv, kD, dtype, seed, 8);
    // Inputs with gaps between heads too, so a reader that ignores head_stride would see them.
    for (HostTensor* t : {&batch.q, &batch.k, &batch.v}) {
      const HostTensor src = *t;
      *t = make_tensor(dtype, src.rows, src.heads, src.head_dim, 8, 4);
      t->fill(kSentinel);
      for (int64_t r = 0; r < src.rows; ++r)
        for (int h = 0; h < src.heads; ++h)
          for (int d = 0; d < src.head_dim; ++d) t->set(r, h, d, src.get(r, h, d));
    }
    const HostBatch inputs_before = batch;
    const MaskCase m = all_masks()[2];

    HostTensor out = make_tensor(dtype, batch.total_q(), kH, kD, 8, 3);
    out.fill(kSentinel);
    std::vector<float> lse(static_cast<size_t>(kH * batch.total_q()), static_cast<float>(kSentinel));
    jf_fwd_args fwd =
        forward_args(make_problem(batch, m.mask, m.window_left, m.window_right), out, lse.data());
    reference::forward(fwd);
    expect_written_only_in_view(out, "out");
    for (float x : lse) EXPECT_NE(x, static_cast<float>(kSentinel)) << "lse entry not written";
    // Values too: a reader that strays into the poisoned input padding would be caught here.
    expect_forward_matches(ForwardResult{out, lse},
                           naive_forward(to_dense(batch), policy_of(m), scale_of(0.0f, kD)), dtype);

    HostTensor dout = make_tensor(dtype, batch.total_q(), kH, kD, 6, 2);
    dout.fill(kSentinel);
    std::mt19937_64 rng(seed++);
    dout.fill_random(rng);
    const HostTensor dout_before = dout;
    HostTensor dq = make_tensor(dtype, batch.total_q(), kH, kD, 8, 3);
    HostTensor dk = make_tensor(dtype, batch.total_kv(), kHkv, kD, 8, 3);
    HostTensor dv = make_tensor(dtype, batch.total_kv(), kHkv, kD, 5, 1);
    for (HostTensor* t : {&dq, &dk, &dv}) t->fill(kSentinel);
    jf_bwd_args bwd = backward_args(fwd.problem, out, dout, lse.data(), dq, dk, dv);
    reference::backward(bwd);
    expect_written_only_in_view(dq, "dq");
    expect_written_only_in_view(dk, "dk");
    expect_written_only_in_view(dv, "dv");

    EXPECT_EQ(batch.q.bytes, inputs_before.q.bytes);
    EXPECT_EQ(batch.k.bytes, inputs_before.k.bytes);
    EXPECT_EQ(batch.v.bytes, inputs_before.v.bytes);
    EXPECT_EQ(dout.bytes, dout_before.bytes);
  }
}

// ---------------------------------------------------------------------------------------------
// Determinism: a batch large enough for the reference to use several threads gives bit-identical
// results on every run.

TEST(ReferenceDeterminism, RepeatedRunsAreBitIdentical) {
  const uint64_t seed = 6000;
  SCOPED_TRACE("seed " + std::to_string(seed));
  HostBatch batch =
      make_random_batch({300, 257, 512, 1, 0, 129}, {300, 511, 257, 0, 3, 129}, 4, 2, 64, JF_BF16, seed);
  const MaskCase m = all_masks()[1];
  HostTensor dout = make_tensor(JF_BF16, batch.total_q(), 4, 64);
  std::mt19937_64 rng(seed);
  dout.fill_random(rng);
  ForwardResult first = run_forward(batch, m, 0.0f, 0);
  ForwardResult second = run_forward(batch, m, 0.0f, 0);
  EXPECT_EQ(first.out.bytes, second.out.bytes);
  EXPECT_EQ(first.lse, second.lse);
  const Grads g1 = run_backward(batch, m, 0.0f, first.out, first.lse, dout, 0);
  const Grads g2 = run_backward(batch, m, 0.0f, first.out, first.lse, dout, 0);
  EXPECT_EQ(g1.dq.bytes, g2.dq.bytes);
  EXPECT_EQ(g1.dk.bytes, g2.dk.bytes);
  EXPECT_EQ(g1.dv.bytes, g2.dv.bytes);
}

// ---------------------------------------------------------------------------------------------
// d) Every head dim, and a v head dim of its own, through the C API (validation, dispatch, then
// the reference): q and k at D, v, out, dout and dv at Dv <= D, the default scale 1/sqrt(D).

struct HeadDimCase {
  int D;
  int Dv;
};

const std::vector<HeadDimCase> kHeadDimCases = {{8, 8}, {72, 72}, {96, 96}, {200, 200}, {192, 128}, {64, 32}};

std::string head_dim_name(const HeadDimCase& c) {
  return "d" + std::to_string(c.D) + (c.Dv != c.D ? "_v" + std::to_string(c.Dv) : "");
}

// make_random_batch with v [total_kv, H_kv, Dv] (its own random values).
HostBatch make_batch_with_dv(const std::vector<int32_t>& len_q, const std::vector<int32_t>& len_kv, int H,
                             int H_kv, const HeadDimCase& dims, jf_dtype dtype, uint64_t seed, int row_pad) {
  HostBatch batch = make_random_batch(len_q, len_kv, H, H_kv, dims.D, dtype, seed, row_pad);
  batch.v = make_tensor(dtype, batch.total_kv(), H_kv, dims.Dv, row_pad + 1);
  std::mt19937_64 rng(seed ^ 0x76ULL);
  batch.v.fill_random(rng);
  return batch;
}

// The problem as the C API takes it: JF_MASK_CAUSAL with the window fields -1 (all_masks() gives
// causal as the window (-1, 0), which the reference alone reads the same).
jf_problem api_problem(HostBatch& batch, const MaskCase& m, float scale = 0.0f) {
  const bool causal = m.mask == JF_MASK_CAUSAL;
  return make_problem(batch, m.mask, causal ? -1 : m.window_left, causal ? -1 : m.window_right, scale);
}

// jagflash_fwd on the CPU; out [total_q, H, Dv] padded by out_pad, poisoned before the call.
// `problem` replaces api_problem(batch, m, scale) when given (a score modifier set on it).
ForwardResult api_forward(HostBatch& batch, const MaskCase& m, float scale, int out_pad,
                          const jf_problem* problem = nullptr) {
  ForwardResult res{make_tensor(batch.dtype, batch.total_q(), batch.H, batch.v.head_dim, out_pad), {}};
  res.out.fill(kSentinel);
  res.lse.assign(static_cast<size_t>(batch.H * batch.total_q()), static_cast<float>(kSentinel));
  jf_fwd_args args =
      forward_args(problem != nullptr ? *problem : api_problem(batch, m, scale), res.out, res.lse.data());
  jf_backend served = JF_BACKEND_AUTO;
  EXPECT_EQ(jagflash_query_backend(&args.problem, &args.launch, JF_DIRECTION_FORWARD, &served), JF_OK)
      << jagflash_last_error();
  EXPECT_EQ(served, JF_BACKEND_REFERENCE);
  EXPECT_EQ(jagflash_fwd(&args), JF_OK) << jagflash_last_error();
  return res;
}

struct HeadDimForwardCase {
  std::string name;
  HeadDimCase dims;
  MaskCase mask;
  HeadCase heads;
  jf_dtype dtype;
  uint64_t seed;
};

std::ostream& operator<<(std::ostream& os, const HeadDimForwardCase& c) { return os << c.name; }

std::vector<HeadDimForwardCase> head_dim_forward_cases() {
  std::vector<HeadDimForwardCase> cases;
  const jf_dtype dtypes[] = {JF_FP32, JF_BF16, JF_FP16};
  uint64_t seed = 7000;
  size_t i = 0;
  for (const HeadDimCase& dims : kHeadDimCases)
    for (const MaskCase& m : all_masks()) {
      const HeadCase& h = all_heads()[i % all_heads().size()];
      const jf_dtype dtype = dtypes[i / all_heads().size() % 3];
      cases.push_back({head_dim_name(dims) + "_" + m.name + "_" + h.name + "_" + dtype_name(dtype), dims, m,
                       h, dtype, seed++});
      ++i;
    }
  return cases;
}

class ReferenceHeadDimsForward : public ::testing::TestWithParam<HeadDimForwardCase> {};

TEST_P(ReferenceHeadDimsForward, MatchesDenseNaiveThroughTheCApi) {
  const HeadDimForwardCase& c = GetParam();
  SCOPED_TRACE("case " + c.name + " seed " + std::to_string(c.seed));
  HostBatch batch = make_batch_with_dv(kLenQ, kLenKv, c.heads.H, c.heads.H_kv, c.dims, c.dtype, c.seed, 8);
  const ForwardResult got = api_forward(batch, c.mask, 0.0f, 8);
  ASSERT_EQ(got.out.head_dim, c.dims.Dv);
  expect_written_only_in_view(got.out, "out");
  // The default scale is 1/sqrt(D) of q's head dim, not v's.
  const NaiveResult want = naive_forward(to_dense(batch), policy_of(c.mask), scale_of(0.0f, c.dims.D));
  expect_forward_matches(got, want, c.dtype);
}

INSTANTIATE_TEST_SUITE_P(HeadDims, ReferenceHeadDimsForward, ::testing::ValuesIn(head_dim_forward_cases()),
                         [](const ::testing::TestParamInfo<HeadDimForwardCase>& info) {
                           return info.param.name;
                         });

// Every multiple of 8 from 8 to 256, with v at D and at 8, on a small batch.
TEST(ReferenceHeadDims, EveryMultipleOf8IsServedOnTheCpu) {
  uint64_t seed = 7500;
  for (int D = 8; D <= 256; D += 8)
    for (int Dv : {D, 8}) {
      SCOPED_TRACE("D " + std::to_string(D) + " Dv " + std::to_string(Dv) + " seed " + std::to_string(seed));
      HostBatch batch = make_batch_with_dv({5, 0, 3}, {4, 2, 0}, 2, 1, {D, Dv}, JF_FP32, seed++, 0);
      const MaskCase causal = all_masks()[1];
      const ForwardResult got = api_forward(batch, causal, 0.0f, 0);
      expect_forward_matches(got, naive_forward(to_dense(batch), policy_of(causal), scale_of(0.0f, D)),
                             JF_FP32);
    }
}

struct HeadDimBackwardCase {
  std::string name;
  HeadDimCase dims;
  MaskCase mask;
  HeadCase heads;
  uint64_t seed;
};

std::ostream& operator<<(std::ostream& os, const HeadDimBackwardCase& c) { return os << c.name; }

std::vector<HeadDimBackwardCase> head_dim_backward_cases() {
  std::vector<HeadDimBackwardCase> cases;
  uint64_t seed = 8000;
  size_t i = 0;
  for (const HeadDimCase& dims : kHeadDimCases)
    for (const MaskCase& m : all_masks()) {
      const HeadCase& h = all_heads()[i++ % all_heads().size()];
      cases.push_back({head_dim_name(dims) + "_" + m.name + "_" + h.name, dims, m, h, seed++});
    }
  return cases;
}

class ReferenceHeadDimsBackward : public ::testing::TestWithParam<HeadDimBackwardCase> {};

// jagflash_bwd (fp32) against central finite differences of the dense naive forward: dq and dk
// [.., D], dv [.., Dv] from dout [.., Dv]; writes confined to the padded views.
TEST_P(ReferenceHeadDimsBackward, MatchesFiniteDifferencesThroughTheCApi) {
  const HeadDimBackwardCase& c = GetParam();
  SCOPED_TRACE("case " + c.name + " seed " + std::to_string(c.seed));
  constexpr int kSamples = 20;
  constexpr double kStep = 1e-4;
  constexpr double kTol = 1e-4;
  const int D = c.dims.D, Dv = c.dims.Dv, H = c.heads.H, H_kv = c.heads.H_kv;
  HostBatch batch = make_batch_with_dv(kFdLenQ, kFdLenKv, H, H_kv, c.dims, JF_FP32, c.seed, 3);
  HostTensor dout = make_tensor(JF_FP32, batch.total_q(), H, Dv, 5);
  std::mt19937_64 rng(c.seed ^ 0x5eedULL);
  dout.fill_random(rng);
  ForwardResult fwd = api_forward(batch, c.mask, 0.0f, 0);
  Grads g{make_tensor(JF_FP32, batch.total_q(), H, D, 7), make_tensor(JF_FP32, batch.total_kv(), H_kv, D, 7),
          make_tensor(JF_FP32, batch.total_kv(), H_kv, Dv, 7)};
  for (HostTensor* t : {&g.dq, &g.dk, &g.dv}) t->fill(kSentinel);
  jf_bwd_args args =
      backward_args(api_problem(batch, c.mask), fwd.out, dout, fwd.lse.data(), g.dq, g.dk, g.dv);
  jf_backend served = JF_BACKEND_AUTO;
  ASSERT_EQ(jagflash_query_backend(&args.problem, &args.launch, JF_DIRECTION_BACKWARD, &served), JF_OK)
      << jagflash_last_error();
  EXPECT_EQ(served, JF_BACKEND_REFERENCE);
  ASSERT_EQ(jagflash_bwd(&args), JF_OK) << jagflash_last_error();
  expect_written_only_in_view(g.dq, "dq");
  expect_written_only_in_view(g.dk, "dk");
  expect_written_only_in_view(g.dv, "dv");

  const MaskPolicy mask = policy_of(c.mask);
  const double scale = scale_of(0.0f, D);
  const DenseBatch base = to_dense(batch);
  const std::vector<double> dout_dense = to_dense(dout);
  struct Target {
    const char* name;
    std::vector<double> DenseBatch::*field;
    const HostTensor* grad;
    int heads;
    int width;
  };
  const Target targets[] = {{"dq", &DenseBatch::q, &g.dq, H, D},
                            {"dk", &DenseBatch::k, &g.dk, H_kv, D},
                            {"dv", &DenseBatch::v, &g.dv, H_kv, Dv}};
  for (const Target& t : targets) {
    const double grad_max = max_abs(*t.grad);
    EXPECT_GT(grad_max, 0.0) << t.name << " is all zero";
    std::uniform_int_distribution<size_t> pick(0, (base.*(t.field)).size() - 1);
    for (int s = 0; s < kSamples; ++s) {
      const size_t idx = pick(rng);
      DenseBatch x = base;
      (x.*(t.field))[idx] += kStep;
      const double plus = loss_of(x, mask, scale, dout_dense);
      (x.*(t.field))[idx] -= 2 * kStep;
      const double minus = loss_of(x, mask, scale, dout_dense);
      const double fd = (plus - minus) / (2 * kStep);
      const int64_t r = static_cast<int64_t>(idx / (t.heads * t.width));
      const int h = static_cast<int>(idx / t.width % t.heads);
      const int d = static_cast<int>(idx % t.width);
      EXPECT_NEAR(t.grad->get(r, h, d), fd, kTol * grad_max)
          << t.name << " (" << r << "," << h << "," << d << ")";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(HeadDims, ReferenceHeadDimsBackward, ::testing::ValuesIn(head_dim_backward_cases()),
                         [](const ::testing::TestParamInfo<HeadDimBackwardCase>& info) {
                           return info.param.name;
                         });

// Score modifiers through the C API: softcap at several caps (small ones saturate the tanh) and
// ALiBi with per-head slopes, each under every mask, with MHA/GQA/MQA and q != kv lengths.
struct ScoreModCase {
  std::string name;
  double cap;  // > 0: softcap
  bool alibi;  // slopes 2^(-8 h / H) as BLOOM's, times 4 so the bias matters at these lengths
  MaskCase mask;
  HeadCase heads;
  jf_dtype dtype;
  uint64_t seed;
};

std::ostream& operator<<(std::ostream& os, const ScoreModCase& c) { return os << c.name; }

std::vector<float> alibi_slopes_of(int H) {
  std::vector<float> slopes(static_cast<size_t>(H));
  for (int h = 0; h < H; ++h) slopes[static_cast<size_t>(h)] = 4.0f * std::exp2(-8.0f * (h + 1) / H);
  return slopes;
}

std::vector<ScoreModCase> score_mod_cases(bool with_dtypes) {
  std::vector<ScoreModCase> cases;
  const jf_dtype dtypes[] = {JF_FP32, JF_BF16, JF_FP16};
  uint64_t seed = with_dtypes ? 9000 : 9500;
  size_t i = 0;
  struct Mod {
    const char* name;
    double cap;
    bool alibi;
  };
  const Mod mods[] = {
      {"softcap0p5", 0.5, false}, {"softcap2", 2.0, false}, {"softcap30", 30.0, false}, {"alibi", 0.0, true}};
  for (const Mod& mod : mods)
    for (const MaskCase& m : all_masks()) {
      const HeadCase& h = all_heads()[i % all_heads().size()];
      const jf_dtype dtype = with_dtypes ? dtypes[i / all_heads().size() % 3] : JF_FP32;
      std::string name = std::string(mod.name) + "_" + m.name + "_" + h.name;
      if (with_dtypes) name += std::string("_") + dtype_name(dtype);
      cases.push_back({name, mod.cap, mod.alibi, m, h, dtype, seed++});
      ++i;
    }
  return cases;
}

struct ScoreModProblem {
  jf_problem problem;
  std::vector<float> slopes;  // the problem points here (ALiBi)
  NaiveMod naive;
};

void set_score_mod(ScoreModProblem& sm, const ScoreModCase& c, int H) {
  if (c.alibi) {
    sm.slopes = alibi_slopes_of(H);
    sm.problem.score_mod = JF_SCORE_MOD_ALIBI;
    sm.problem.alibi_slopes = sm.slopes.data();
    sm.naive.slopes.assign(sm.slopes.begin(), sm.slopes.end());
  } else {
    sm.problem.score_mod = JF_SCORE_MOD_SOFTCAP;
    sm.problem.softcap = static_cast<float>(c.cap);
    sm.naive.cap = static_cast<float>(c.cap);
  }
}

class ReferenceScoreModForward : public ::testing::TestWithParam<ScoreModCase> {};

TEST_P(ReferenceScoreModForward, MatchesDenseNaiveThroughTheCApi) {
  const ScoreModCase& c = GetParam();
  SCOPED_TRACE("case " + c.name + " seed " + std::to_string(c.seed));
  constexpr int kD = 32;
  // Inputs scaled up so that the cap and the bias change the result (random inputs are O(1)).
  HostBatch batch = make_random_batch(kLenQ, kLenKv, c.heads.H, c.heads.H_kv, kD, c.dtype, c.seed, 8);
  ScoreModProblem sm{api_problem(batch, c.mask, 2.0f), {}, {}};
  set_score_mod(sm, c, c.heads.H);
  const ForwardResult got = api_forward(batch, c.mask, 2.0f, 8, &sm.problem);
  const NaiveResult want = naive_forward(to_dense(batch), policy_of(c.mask), 2.0, sm.naive);
  expect_forward_matches(got, want, c.dtype);
  // The modifier is not a no-op on this batch.
  const NaiveResult plain = naive_forward(to_dense(batch), policy_of(c.mask), 2.0);
  double differ = 0.0;
  for (size_t k = 0; k < plain.out.size(); ++k)
    differ = std::max(differ, std::abs(plain.out[k] - want.out[k]));
  EXPECT_GT(differ, 1e-4);
}

INSTANTIATE_TEST_SUITE_P(ScoreMods, ReferenceScoreModForward, ::testing::ValuesIn(score_mod_cases(true)),
                         [](const ::testing::TestParamInfo<ScoreModCase>& info) { return info.param.name; });

// dq, dk and dv (fp32, the dense batch's head counts and head dim) against central finite
// differences of loss_of at `samples` random elements each, within tol of each gradient's largest
// magnitude; none all zero.
void expect_grads_match_finite_differences(const Grads& g, const DenseBatch& base, const MaskPolicy& mask,
                                           double scale, const std::vector<double>& dout, const NaiveMod& mod,
                                           int samples, double step, double tol, std::mt19937_64& rng) {
  struct Target {
    const char* name;
    std::vector<double> DenseBatch::*field;
    const HostTensor* grad;
    int heads;
  };
  const Target targets[] = {{"dq", &DenseBatch::q, &g.dq, base.H},
                            {"dk", &DenseBatch::k, &g.dk, base.H_kv},
                            {"dv", &DenseBatch::v, &g.dv, base.H_kv}};
  for (const Target& t : targets) {
    const int width = t.grad->head_dim;
    const double grad_max = max_abs(*t.grad);
    EXPECT_GT(grad_max, 0.0) << t.name << " is all zero";
    std::uniform_int_distribution<size_t> pick(0, (base.*(t.field)).size() - 1);
    for (int s = 0; s < samples; ++s) {
      const size_t idx = pick(rng);
      DenseBatch x = base;
      (x.*(t.field))[idx] += step;
      const double plus = loss_of(x, mask, scale, dout, mod);
      (x.*(t.field))[idx] -= 2 * step;
      const double minus = loss_of(x, mask, scale, dout, mod);
      const double fd = (plus - minus) / (2 * step);
      const int64_t r = static_cast<int64_t>(idx / (t.heads * width));
      const int h = static_cast<int>(idx / width % t.heads);
      const int d = static_cast<int>(idx % width);
      EXPECT_NEAR(t.grad->get(r, h, d), fd, tol * grad_max)
          << t.name << " (" << r << "," << h << "," << d << ")";
    }
  }
}

class ReferenceScoreModBackward : public ::testing::TestWithParam<ScoreModCase> {};

// jagflash_bwd (fp32) with a modifier against central finite differences of the dense naive
// forward with the same modifier: the softcap's 1 - tanh^2 in dS, ALiBi's constant bias.
TEST_P(ReferenceScoreModBackward, MatchesFiniteDifferencesThroughTheCApi) {
  const ScoreModCase& c = GetParam();
  SCOPED_TRACE("case " + c.name + " seed " + std::to_string(c.seed));
  constexpr int kD = 16;
  constexpr int kSamples = 20;
  constexpr double kStep = 1e-4;
  constexpr double kTol = 1e-4;
  constexpr float kScale = 2.0f;
  const int H = c.heads.H, H_kv = c.heads.H_kv;
  HostBatch batch = make_random_batch(kFdLenQ, kFdLenKv, H, H_kv, kD, JF_FP32, c.seed, 3);
  HostTensor dout = make_tensor(JF_FP32, batch.total_q(), H, kD, 5);
  std::mt19937_64 rng(c.seed ^ 0x5eedULL);
  dout.fill_random(rng);
  ScoreModProblem sm{api_problem(batch, c.mask, kScale), {}, {}};
  set_score_mod(sm, c, H);
  ForwardResult fwd = api_forward(batch, c.mask, kScale, 0, &sm.problem);
  Grads g{make_tensor(JF_FP32, batch.total_q(), H, kD, 7),
          make_tensor(JF_FP32, batch.total_kv(), H_kv, kD, 7),
          make_tensor(JF_FP32, batch.total_kv(), H_kv, kD, 7)};
  for (HostTensor* t : {&g.dq, &g.dk, &g.dv}) t->fill(kSentinel);
  jf_bwd_args args = backward_args(sm.problem, fwd.out, dout, fwd.lse.data(), g.dq, g.dk, g.dv);
  ASSERT_EQ(jagflash_bwd(&args), JF_OK) << jagflash_last_error();

  expect_grads_match_finite_differences(g, to_dense(batch), policy_of(c.mask), kScale, to_dense(dout),
                                        sm.naive, kSamples, kStep, kTol, rng);
}

INSTANTIATE_TEST_SUITE_P(ScoreMods, ReferenceScoreModBackward, ::testing::ValuesIn(score_mod_cases(false)),
                         [](const ::testing::TestParamInfo<ScoreModCase>& info) { return info.param.name; });

// Learnable sinks through the C API: alone and with a softcap, under every mask and head layout,
// the batch's length-0 and length-1 sequences and q != kv lengths included.
struct SinkCase {
  std::string name;
  double cap;  // > 0: a softcap as well
  MaskCase mask;
  HeadCase heads;
  jf_dtype dtype;
  uint64_t seed;
};

std::ostream& operator<<(std::ostream& os, const SinkCase& c) { return os << c.name; }

std::vector<SinkCase> sink_cases(bool with_dtypes) {
  std::vector<SinkCase> cases;
  const jf_dtype dtypes[] = {JF_FP32, JF_BF16, JF_FP16};
  uint64_t seed = with_dtypes ? 9700 : 9800;
  size_t i = 0;
  for (const double cap : {0.0, 5.0})
    for (const MaskCase& m : all_masks()) {
      const HeadCase& h = all_heads()[i % all_heads().size()];
      const jf_dtype dtype = with_dtypes ? dtypes[i % 3] : JF_FP32;
      std::string name = std::string(cap > 0 ? "sink_softcap5_" : "sink_") + m.name + "_" + h.name;
      if (with_dtypes) name += std::string("_") + dtype_name(dtype);
      cases.push_back({name, cap, m, h, dtype, seed++});
      ++i;
    }
  return cases;
}

// Sinks around the rows' scores (these inputs give scaled scores of a few units): one far below,
// some level with them, one above, so the sink's share ranges from nothing to most of a row.
struct SinkProblem {
  jf_problem problem;
  std::vector<float> sinks;
  NaiveMod naive;
};

SinkProblem sink_problem(HostBatch& batch, const SinkCase& c, float scale) {
  SinkProblem sp{api_problem(batch, c.mask, scale), {}, {}};
  const float pattern[] = {-8.0f, 0.5f, 2.0f, 6.0f};
  for (int h = 0; h < c.heads.H; ++h) sp.sinks.push_back(pattern[h % 4]);
  sp.problem.learnable_sink = sp.sinks.data();
  sp.naive.sinks.assign(sp.sinks.begin(), sp.sinks.end());
  if (c.cap > 0.0) {
    sp.problem.score_mod = JF_SCORE_MOD_SOFTCAP;
    sp.problem.softcap = static_cast<float>(c.cap);
    sp.naive.cap = static_cast<float>(c.cap);
  }
  return sp;
}

class ReferenceSinkForward : public ::testing::TestWithParam<SinkCase> {};

TEST_P(ReferenceSinkForward, MatchesDenseNaiveThroughTheCApi) {
  const SinkCase& c = GetParam();
  SCOPED_TRACE("case " + c.name + " seed " + std::to_string(c.seed));
  constexpr int kD = 32;
  HostBatch batch = make_random_batch(kLenQ, kLenKv, c.heads.H, c.heads.H_kv, kD, c.dtype, c.seed, 8);
  SinkProblem sp = sink_problem(batch, c, 1.0f);
  const ForwardResult got = api_forward(batch, c.mask, 1.0f, 8, &sp.problem);
  const NaiveResult want = naive_forward(to_dense(batch), policy_of(c.mask), 1.0, sp.naive);
  expect_forward_matches(got, want, c.dtype, /*has_empty_rows=*/false);
  // The sinks change the result, and a row that sees no key has lse = its head's sink.
  NaiveMod no_sink = sp.naive;
  no_sink.sinks.clear();
  const NaiveResult plain = naive_forward(to_dense(batch), policy_of(c.mask), 1.0, no_sink);
  double differ = 0.0;
  for (size_t k = 0; k < plain.out.size(); ++k)
    differ = std::max(differ, std::abs(plain.out[k] - want.out[k]));
  EXPECT_GT(differ, 1e-3);
  int64_t unseen_rows = 0;
  for (int h = 0; h < c.heads.H; ++h)
    for (int64_t r = 0; r < batch.total_q(); ++r)
      if (plain.lse[static_cast<size_t>(h * batch.total_q() + r)] == -kInf) {
        ++unseen_rows;
        EXPECT_EQ(got.lse[static_cast<size_t>(h * batch.total_q() + r)], sp.sinks[static_cast<size_t>(h)]);
        for (int d = 0; d < kD; ++d) EXPECT_EQ(got.out.get(r, h, d), 0.0) << "row " << r << " head " << h;
      }
  EXPECT_GT(unseen_rows, 0);  // the batch's q rows whose sequence has no keys (kLenKv's zeros)
}

INSTANTIATE_TEST_SUITE_P(Sinks, ReferenceSinkForward, ::testing::ValuesIn(sink_cases(true)),
                         [](const ::testing::TestParamInfo<SinkCase>& info) { return info.param.name; });

class ReferenceSinkBackward : public ::testing::TestWithParam<SinkCase> {};

// dq, dk, dv and d sink (fp32) against central finite differences of the dense naive forward
// with the sinks, the gradient buffers poisoned before the call.
TEST_P(ReferenceSinkBackward, MatchesFiniteDifferencesThroughTheCApi) {
  const SinkCase& c = GetParam();
  SCOPED_TRACE("case " + c.name + " seed " + std::to_string(c.seed));
  constexpr int kD = 16;
  constexpr int kSamples = 12;
  constexpr double kStep = 1e-4;
  constexpr double kTol = 1e-4;
  constexpr float kScale = 1.0f;
  const int H = c.heads.H, H_kv = c.heads.H_kv;
  HostBatch batch = make_random_batch(kFdLenQ, kFdLenKv, H, H_kv, kD, JF_FP32, c.seed, 3);
  HostTensor dout = make_tensor(JF_FP32, batch.total_q(), H, kD, 5);
  std::mt19937_64 rng(c.seed ^ 0x5eedULL);
  dout.fill_random(rng);
  SinkProblem sp = sink_problem(batch, c, kScale);
  ForwardResult fwd = api_forward(batch, c.mask, kScale, 0, &sp.problem);
  Grads g{make_tensor(JF_FP32, batch.total_q(), H, kD, 7),
          make_tensor(JF_FP32, batch.total_kv(), H_kv, kD, 7),
          make_tensor(JF_FP32, batch.total_kv(), H_kv, kD, 7)};
  for (HostTensor* t : {&g.dq, &g.dk, &g.dv}) t->fill(kSentinel);
  std::vector<float> dsink(static_cast<size_t>(H), static_cast<float>(kSentinel));
  jf_bwd_args args = backward_args(sp.problem, fwd.out, dout, fwd.lse.data(), g.dq, g.dk, g.dv);
  args.dlearnable_sink = dsink.data();
  ASSERT_EQ(jagflash_bwd(&args), JF_OK) << jagflash_last_error();

  const MaskPolicy mask = policy_of(c.mask);
  const DenseBatch base = to_dense(batch);
  const std::vector<double> dout_dense = to_dense(dout);
  double dsink_max = 0.0;
  for (int h = 0; h < H; ++h) {
    NaiveMod plus = sp.naive, minus = sp.naive;
    plus.sinks[static_cast<size_t>(h)] += kStep;
    minus.sinks[static_cast<size_t>(h)] -= kStep;
    const double fd =
        (loss_of(base, mask, kScale, dout_dense, plus) - loss_of(base, mask, kScale, dout_dense, minus)) /
        (2 * kStep);
    EXPECT_NEAR(dsink[static_cast<size_t>(h)], fd, kTol * std::max(1.0, std::abs(fd)))
        << "d sink of head " << h;
    dsink_max = std::max(dsink_max, std::abs(fd));
  }
  EXPECT_GT(dsink_max, 1e-3);  // the sinks matter to this loss
  expect_grads_match_finite_differences(g, base, mask, kScale, dout_dense, sp.naive, kSamples, kStep, kTol,
                                        rng);
}

INSTANTIATE_TEST_SUITE_P(Sinks, ReferenceSinkBackward, ::testing::ValuesIn(sink_cases(false)),
                         [](const ::testing::TestParamInfo<SinkCase>& info) { return info.param.name; });

}  // namespace
}  // namespace jagflash::test
