// The CPU reference with block-sparse maps (jf_problem.block_mask), through the C API, against a
// dense float64 computation written here that knows nothing of core/mask.hpp or
// core/block_mask.hpp: an explicit Lq x Lk visibility matrix per sequence (the window formula and
// the map's byte (i / 128, j / 128) written out), the softmax, and the analytic gradients
// (P, dV = P^T dO, dP = dO V^T, dS = P (dP - delta), dQ = scale dS K, dK = scale dS^T Q).
// Maps: random, document (block diagonal), prefix-LM (the first key blocks seen by all, then
// block-causal), a map row of zeros (rows that see nothing: out = 0, lse = -inf, no gradient), a
// sequence hidden whole; composed with causal and a window; q != kv lengths, lengths 0 and 1,
// several blocks with a cut-short last one, GQA. A map of ones gives the unmasked call's results
// bitwise.
#include "testing/host_batch.hpp"

#include <gtest/gtest.h>
#include <jagflash/jagflash.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace jagflash::test {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kBlock = JF_BLOCK_MASK_BLOCK;

int64_t blocks_of(int64_t len) { return (len + kBlock - 1) / kBlock; }

// Whether query block qb of nq sees key block kb of nk in sequence b (nq x nk: the map's shape).
using MapFn = std::function<bool(int32_t b, int64_t qb, int64_t kb, int64_t nq, int64_t nk)>;

struct Map {
  std::vector<uint8_t> blocks;
  std::vector<int32_t> offsets;
};

Map make_map(const std::vector<int32_t>& len_q, const std::vector<int32_t>& len_kv, const MapFn& fn) {
  Map m;
  m.offsets.push_back(0);
  for (size_t b = 0; b < len_q.size(); ++b) {
    const int64_t nq = blocks_of(len_q[b]), nk = blocks_of(len_kv[b]);
    for (int64_t qb = 0; qb < nq; ++qb)
      for (int64_t kb = 0; kb < nk; ++kb)
        m.blocks.push_back(fn(static_cast<int32_t>(b), qb, kb, nq, nk) ? uint8_t{1} : uint8_t{0});
    m.offsets.push_back(static_cast<int32_t>(m.blocks.size()));
  }
  if (m.blocks.empty()) m.blocks.push_back(0);  // a non-null pointer for a map of no bytes
  return m;
}

struct MaskSpec {
  jf_mask mask = JF_MASK_NONE;
  int left = -1, right = -1;
  std::string name() const {
    return mask == JF_MASK_NONE     ? "none"
           : mask == JF_MASK_CAUSAL ? "causal"
                                    : "window(" + std::to_string(left) + "," + std::to_string(right) + ")";
  }
};

// The mask written out (bottom-right aligned): causal is the window (-1, 0).
bool mask_sees(const MaskSpec& m, int64_t i, int64_t j, int64_t lq, int64_t lk) {
  int64_t left = -1, right = -1;
  if (m.mask == JF_MASK_CAUSAL) right = 0;
  if (m.mask == JF_MASK_WINDOW) {
    left = m.left;
    right = m.right;
  }
  const int64_t diag = i + lk - lq;
  return (left < 0 || j >= diag - left) && (right < 0 || j <= diag + right);
}

// A tensor as float64, packed [rows][heads][head_dim].
std::vector<double> dense(const HostTensor& t) {
  std::vector<double> x(static_cast<size_t>(t.rows * t.heads * t.head_dim));
  size_t n = 0;
  for (int64_t r = 0; r < t.rows; ++r)
    for (int h = 0; h < t.heads; ++h)
      for (int d = 0; d < t.head_dim; ++d) x[n++] = t.get(r, h, d);
  return x;
}

struct Dense {
  std::vector<double> out, lse, dq, dk, dv;  // packed [rows][heads][d]; lse [H][total_q]
};

// Forward and backward of every (sequence, head) with an explicit visibility matrix.
Dense naive(const HostBatch& in, const HostTensor& dout, const MaskSpec& mask, const Map& map) {
  const int H = in.H, H_kv = in.H_kv, D = in.D, group = H / H_kv;
  const int64_t tq = in.total_q(), tk = in.total_kv();
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  Dense r;
  r.out.assign(static_cast<size_t>(tq * H * D), 0.0);
  r.dq.assign(static_cast<size_t>(tq * H * D), 0.0);
  r.dk.assign(static_cast<size_t>(tk * H_kv * D), 0.0);
  r.dv.assign(static_cast<size_t>(tk * H_kv * D), 0.0);
  r.lse.assign(static_cast<size_t>(H * tq), -kInf);
  const std::vector<double> q_f64 = dense(in.q), k_f64 = dense(in.k), v_f64 = dense(in.v),
                            do_f64 = dense(dout);
  for (int32_t b = 0; b < in.batch_size(); ++b) {
    const int64_t q0 = in.q_offsets[b], lq = in.q_offsets[b + 1] - q0;
    const int64_t k0 = in.kv_offsets[b], lk = in.kv_offsets[b + 1] - k0;
    const int64_t nk = blocks_of(lk);
    std::vector<char> vis(static_cast<size_t>(lq * lk));
    for (int64_t i = 0; i < lq; ++i)
      for (int64_t j = 0; j < lk; ++j)
        vis[i * lk + j] =
            mask_sees(mask, i, j, lq, lk) &&
            map.blocks[static_cast<size_t>(map.offsets[b] + (i / kBlock) * nk + j / kBlock)] != 0;
    for (int h = 0; h < H; ++h) {
      const int hk = h / group;
      auto q = [&](int64_t i, int d) { return q_f64[static_cast<size_t>(((q0 + i) * H + h) * D + d)]; };
      auto k = [&](int64_t j, int d) { return k_f64[static_cast<size_t>(((k0 + j) * H_kv + hk) * D + d)]; };
      auto v = [&](int64_t j, int d) { return v_f64[static_cast<size_t>(((k0 + j) * H_kv + hk) * D + d)]; };
      auto d_o = [&](int64_t i, int d) { return do_f64[static_cast<size_t>(((q0 + i) * H + h) * D + d)]; };
      std::vector<double> p(static_cast<size_t>(lq * lk), 0.0);
      for (int64_t i = 0; i < lq; ++i) {
        double m = -kInf;
        for (int64_t j = 0; j < lk; ++j) {
          if (!vis[i * lk + j]) continue;
          double s = 0.0;
          for (int d = 0; d < D; ++d) s += q(i, d) * k(j, d);
          p[i * lk + j] = scale * s;
          m = std::max(m, scale * s);
        }
        if (m == -kInf) continue;  // sees nothing: out 0, lse -inf, no gradient
        double l = 0.0;
        for (int64_t j = 0; j < lk; ++j)
          if (vis[i * lk + j]) l += std::exp(p[i * lk + j] - m);
        for (int64_t j = 0; j < lk; ++j)
          p[i * lk + j] = vis[i * lk + j] ? std::exp(p[i * lk + j] - m) / l : 0.0;
        r.lse[static_cast<size_t>(h * tq + q0 + i)] = m + std::log(l);
        double* o = &r.out[static_cast<size_t>(((q0 + i) * H + h) * D)];
        for (int64_t j = 0; j < lk; ++j)
          for (int d = 0; d < D; ++d) o[d] += p[i * lk + j] * v(j, d);
      }
      for (int64_t i = 0; i < lq; ++i) {
        const double* o = &r.out[static_cast<size_t>(((q0 + i) * H + h) * D)];
        double delta = 0.0;
        for (int d = 0; d < D; ++d) delta += d_o(i, d) * o[d];
        for (int64_t j = 0; j < lk; ++j) {
          const double p_ij = p[i * lk + j];
          if (p_ij == 0.0) continue;
          double dp = 0.0;
          for (int d = 0; d < D; ++d) dp += d_o(i, d) * v(j, d);
          const double ds = p_ij * (dp - delta);
          double* dq = &r.dq[static_cast<size_t>(((q0 + i) * H + h) * D)];
          double* dk = &r.dk[static_cast<size_t>(((k0 + j) * H_kv + hk) * D)];
          double* dv = &r.dv[static_cast<size_t>(((k0 + j) * H_kv + hk) * D)];
          for (int d = 0; d < D; ++d) {
            dq[d] += scale * ds * k(j, d);
            dk[d] += scale * ds * q(i, d);
            dv[d] += p_ij * d_o(i, d);
          }
        }
      }
    }
  }
  return r;
}

double rel_l2(const HostTensor& got, const std::vector<double>& want) {
  const std::vector<double> g = dense(got);
  double diff2 = 0.0, want2 = 0.0;
  for (size_t n = 0; n < g.size(); ++n) {
    const double e = g[n] - want[n];
    diff2 += e * e;
    want2 += want[n] * want[n];
  }
  return std::sqrt(diff2) / std::max(std::sqrt(want2), 1e-30);
}

struct Case {
  std::string name;
  std::vector<int32_t> len_q, len_kv;
  MaskSpec mask;
  MapFn map;
  int H = 4, H_kv = 2;
  jf_dtype dtype = JF_FP32;
  uint64_t seed = 1;
};

// Relative L2 tolerances: fp32 leaves the final roundings (delta from the stored out); bf16 the
// rounding of out to 8 bits, which the backward's delta carries.
double fwd_tolerance(jf_dtype dt) { return dt == JF_FP32 ? 1e-5 : 1e-2; }
double bwd_tolerance(jf_dtype dt) { return dt == JF_FP32 ? 1e-4 : 5e-2; }

struct Results {
  HostTensor out, dq, dk, dv;
  std::vector<float> lse;
};

// The call through the C API (CPU pointers: the reference), forward then backward on its own out
// and lse; map = nullptr: no block mask.
Results run_reference(HostBatch& batch, HostTensor& dout, const MaskSpec& m, const Map* map) {
  const int64_t tq = batch.total_q(), tk = batch.total_kv();
  Results r;
  r.out = make_tensor(batch.dtype, tq, batch.H, batch.D);
  r.dq = make_tensor(batch.dtype, tq, batch.H, batch.D);
  r.dk = make_tensor(batch.dtype, tk, batch.H_kv, batch.D);
  r.dv = make_tensor(batch.dtype, tk, batch.H_kv, batch.D);
  for (HostTensor* t : {&r.out, &r.dq, &r.dk, &r.dv}) t->fill(std::nan(""));  // unwritten shows
  r.lse.assign(static_cast<size_t>(batch.H * tq), std::nanf(""));
  jf_problem p = make_problem(batch, m.mask, m.left, m.right);
  if (map != nullptr) {
    p.block_mask.blocks = map->blocks.data();
    p.block_mask.offsets = map->offsets.data();
    p.block_mask.bytes = static_cast<int64_t>(map->blocks.size());
  }
  const jf_fwd_args fa = forward_args(p, r.out, r.lse.data());
  EXPECT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  const jf_bwd_args ba = backward_args(p, r.out, dout, r.lse.data(), r.dq, r.dk, r.dv);
  EXPECT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  return r;
}

void check(const Case& c) {
  SCOPED_TRACE(c.name + " mask=" + c.mask.name() + " seed=" + std::to_string(c.seed));
  const std::vector<int32_t> len_kv = c.len_kv.empty() ? c.len_q : c.len_kv;
  HostBatch batch = make_random_batch(c.len_q, len_kv, c.H, c.H_kv, 16, c.dtype, c.seed);
  HostTensor dout = make_tensor(c.dtype, batch.total_q(), c.H, 16);
  std::mt19937_64 rng(c.seed + 1000);
  dout.fill_random(rng);
  const Map map = make_map(c.len_q, len_kv, c.map);
  const Results got = run_reference(batch, dout, c.mask, &map);
  const Dense want = naive(batch, dout, c.mask, map);

  EXPECT_LE(rel_l2(got.out, want.out), fwd_tolerance(c.dtype)) << "out";
  EXPECT_LE(rel_l2(got.dq, want.dq), bwd_tolerance(c.dtype)) << "dq";
  EXPECT_LE(rel_l2(got.dk, want.dk), bwd_tolerance(c.dtype)) << "dk";
  EXPECT_LE(rel_l2(got.dv, want.dv), bwd_tolerance(c.dtype)) << "dv";
  // lse: -inf exactly where nothing is visible, close elsewhere; rows that see nothing get exact
  // zeros in out and dq, keys no query sees exact zeros in dk and dv.
  const int64_t tq = batch.total_q();
  for (int h = 0; h < c.H; ++h)
    for (int64_t i = 0; i < tq; ++i) {
      const double w = want.lse[static_cast<size_t>(h * tq + i)];
      const double g = got.lse[static_cast<size_t>(h * tq + i)];
      if (w == -kInf) {
        ASSERT_EQ(g, -kInf) << "lse row " << i << " head " << h;
        for (int d = 0; d < batch.D; ++d) {
          ASSERT_EQ(got.out.get(i, h, d), 0.0) << "out row " << i;
          ASSERT_EQ(got.dq.get(i, h, d), 0.0) << "dq row " << i;
        }
      } else {
        ASSERT_NEAR(g, w, c.dtype == JF_FP32 ? 1e-5 : 2e-2) << "lse row " << i << " head " << h;
      }
    }
  size_t n = 0;
  for (int64_t j = 0; j < batch.total_kv(); ++j)
    for (int hk = 0; hk < c.H_kv; ++hk)
      for (int d = 0; d < batch.D; ++d, ++n)
        if (want.dk[n] == 0.0 && want.dv[n] == 0.0) {
          ASSERT_EQ(got.dk.get(j, hk, d), 0.0) << "dk key " << j;
          ASSERT_EQ(got.dv.get(j, hk, d), 0.0) << "dv key " << j;
        }
}

const std::vector<MaskSpec>& masks() {
  static const std::vector<MaskSpec> m = {
      {JF_MASK_NONE, -1, -1}, {JF_MASK_CAUSAL, -1, -1}, {JF_MASK_WINDOW, 150, 7}, {JF_MASK_WINDOW, 40, 40}};
  return m;
}

// Awkward lengths: 0 and 1, one block exactly, a cut-short last block, several blocks, q != kv.
const std::vector<int32_t> kLenQ = {1, 0, 129, 300, 128, 2, 200, 0};
const std::vector<int32_t> kLenKv = {1, 3, 260, 300, 127, 0, 385, 0};

TEST(ReferenceBlockMask, RandomMaps) {
  uint64_t seed = 1;
  for (const MaskSpec& m : masks())
    for (double density : {0.3, 0.7}) {
      auto rng = std::make_shared<std::mt19937_64>(seed * 77);
      Case c{"random " + std::to_string(density), kLenQ, kLenKv, m,
             [rng, density](int32_t, int64_t, int64_t, int64_t, int64_t) {
               return std::uniform_real_distribution<double>(0.0, 1.0)(*rng) < density;
             }};
      c.seed = seed++;
      check(c);
    }
}

// Documents: each sequence cut into documents of a few blocks; a query block sees the key blocks
// of its own document (block-diagonal, as a packed-document mask on block edges).
TEST(ReferenceBlockMask, DocumentMasks) {
  uint64_t seed = 20;
  auto doc = [](int64_t block) {
    return block < 1 ? 0 : block < 3 ? 1 : 2;
  };  // documents of 1, 2, ... blocks
  for (const MaskSpec& m : masks()) {
    Case c{"document",
           {384, 512, 200, 1},
           {384, 512, 200, 1},
           m,
           [doc](int32_t, int64_t qb, int64_t kb, int64_t, int64_t) { return doc(qb) == doc(kb); }};
    c.seed = seed++;
    check(c);
  }
}

// Prefix-LM: the first two key blocks seen by every query block, then block-causal.
TEST(ReferenceBlockMask, PrefixLmMasks) {
  uint64_t seed = 30;
  for (const MaskSpec& m : masks()) {
    Case c{"prefix-lm",
           {640, 300, 129},
           {640, 300, 260},
           m,
           [](int32_t, int64_t qb, int64_t kb, int64_t, int64_t) { return kb < 2 || kb <= qb; }};
    c.seed = seed++;
    check(c);
  }
}

// A map row of zeros: query block 1 of every sequence sees nothing (out 0, lse -inf, no
// gradient); and sequence 1 is hidden whole (its keys get dk = dv = 0).
TEST(ReferenceBlockMask, EmptyRowsAndHiddenSequences) {
  uint64_t seed = 40;
  for (const MaskSpec& m : masks()) {
    Case c{"row of zeros, sequence 1 hidden",
           {300, 200, 257},
           {256, 300, 129},
           m,
           [](int32_t b, int64_t qb, int64_t, int64_t, int64_t) { return b != 1 && qb != 1; }};
    c.seed = seed++;
    check(c);
  }
}

// GQA (8 query heads over 2 kv heads, and MQA) and bf16.
TEST(ReferenceBlockMask, GqaAndBf16) {
  uint64_t seed = 50;
  for (int h_kv : {2, 1})
    for (jf_dtype dt : {JF_FP32, JF_BF16}) {
      Case c{"gqa",
             {300, 1, 130},
             {260, 5, 400},
             {JF_MASK_CAUSAL, -1, -1},
             [](int32_t b, int64_t qb, int64_t kb, int64_t, int64_t) { return (qb + kb + b) % 3 != 1; }};
      c.H = 8;
      c.H_kv = h_kv;
      c.dtype = dt;
      c.seed = seed++;
      check(c);
    }
}

// A map of ones removes nothing: the results are the unmasked call's, bitwise.
TEST(ReferenceBlockMask, MapOfOnesIsNoMapBitwise) {
  for (const MaskSpec& m : masks()) {
    SCOPED_TRACE(m.name());
    HostBatch batch = make_random_batch(kLenQ, kLenKv, 4, 2, 16, JF_BF16, 60);
    HostTensor dout = make_tensor(JF_BF16, batch.total_q(), 4, 16);
    std::mt19937_64 rng(61);
    dout.fill_random(rng);
    const Map ones =
        make_map(kLenQ, kLenKv, [](int32_t, int64_t, int64_t, int64_t, int64_t) { return true; });
    const Results with = run_reference(batch, dout, m, &ones);
    const Results without = run_reference(batch, dout, m, nullptr);
    EXPECT_EQ(with.out.bytes, without.out.bytes);
    EXPECT_EQ(std::memcmp(with.lse.data(), without.lse.data(), with.lse.size() * sizeof(float)), 0);
    EXPECT_EQ(with.dq.bytes, without.dq.bytes);
    EXPECT_EQ(with.dk.bytes, without.dk.bytes);
    EXPECT_EQ(with.dv.bytes, without.dv.bytes);
  }
}

}  // namespace
}  // namespace jagflash::test
