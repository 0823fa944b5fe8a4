// GPU tests of pooled attention (jf_problem.pooled_q_rows), label "gpu": the oracle's
// pooled forward and backward against the CPU float64 reference run through the C API on the same
// host copies; outputs poisoned (NaN bytes) so an unwritten element or a write past a view is
// caught; dk/dv (and dq, whose oracle sum runs in sequence order) bitwise repeatable; a bad
// kv_offsets batch writes nothing. JF_BACKEND_HOPPER either serves pooled calls (then it is held
// to the same checks) or refuses them with JF_ERR_UNSUPPORTED saying the oracle runs them.
// GpuPooled.SmallCaseForSanitizers is the case to run under compute-sanitizer memcheck/racecheck.
#include "hopper_served.hpp"
#include "testing/device_buffer.hpp"
#include "testing/gpu_batch.hpp"
#include "testing/host_batch.hpp"

#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace jagflash {
namespace {

using testing::cuda_check;
using testing::DeviceBuffer;

constexpr double kLseTol = 1e-3;
constexpr unsigned char kPoison = 0xff;  // every byte: NaN in bf16, fp16 and fp32

struct PooledSpec {
  int lq = 16;
  std::vector<int32_t> len_kv;
  int heads = 4, heads_kv = 2, head_dim = 64;
  jf_dtype dtype = JF_BF16;
  jf_mask mask = JF_MASK_NONE;
  int window_left = -1, window_right = -1;
  uint64_t seed = 1;
  int row_pad = 8;  // after every row of every tensor: poisoned on the outputs, checked untouched
};

std::string describe(const PooledSpec& s) {
  std::string lengths;
  for (int32_t l : s.len_kv) lengths += (lengths.empty() ? "" : ",") + std::to_string(l);
  return "Lq=" + std::to_string(s.lq) + " kv={" + lengths + "} H=" + std::to_string(s.heads) + "/" +
         std::to_string(s.heads_kv) + " D=" + std::to_string(s.head_dim) + " " + dtype_name(s.dtype) +
         " mask=" + std::to_string(s.mask) + "(" + std::to_string(s.window_left) + "," +
         std::to_string(s.window_right) + ") seed=" + std::to_string(s.seed);
}

// Host tensors (the reference's inputs and outputs) and their device twins with the same layout.
struct PooledRun {
  PooledSpec spec;
  int32_t batch = 0;
  int64_t rows = 0;  // B * Lq
  std::vector<int32_t> kv_offsets;
  test::HostTensor q, k, v, dout;    // inputs
  test::HostTensor out, dq, dk, dv;  // the reference's outputs
  std::vector<float> lse;            // the reference's lse [H, B*Lq]
  DeviceBuffer d_kv_offsets, d_q, d_k, d_v, d_dout, d_out, d_dq, d_dk, d_dv, d_lse, d_ws_fwd, d_ws_bwd;

  explicit PooledRun(const PooledSpec& s) : spec(s) {
    batch = static_cast<int32_t>(s.len_kv.size());
    rows = int64_t{batch} * s.lq;
    kv_offsets = test::offsets_from_lengths(s.len_kv);
    const int64_t total_kv = kv_offsets.back();
    std::mt19937_64 rng(s.seed);
    q = test::make_tensor(s.dtype, s.lq, s.heads, s.head_dim, s.row_pad);
    k = test::make_tensor(s.dtype, total_kv, s.heads_kv, s.head_dim, s.row_pad);
    v = test::make_tensor(s.dtype, total_kv, s.heads_kv, s.head_dim, s.row_pad);
    dout = test::make_tensor(s.dtype, rows, s.heads, s.head_dim, s.row_pad);
    for (test::HostTensor* t : {&q, &k, &v, &dout}) t->fill_random(rng);
    out = test::make_tensor(s.dtype, rows, s.heads, s.head_dim, s.row_pad);
    dq = test::make_tensor(s.dtype, s.lq, s.heads, s.head_dim, s.row_pad);
    dk = test::make_tensor(s.dtype, total_kv, s.heads_kv, s.head_dim, s.row_pad);
    dv = test::make_tensor(s.dtype, total_kv, s.heads_kv, s.head_dim, s.row_pad);
    lse.assign(static_cast<size_t>(s.heads * rows), 0.f);

    d_kv_offsets = DeviceBuffer::from_host(kv_offsets);
    for (auto [dev, host] : {std::pair<DeviceBuffer*, const test::HostTensor*>{&d_q, &q},
                             {&d_k, &k},
                             {&d_v, &v},
                             {&d_dout, &dout}}) {
      *dev = DeviceBuffer::from_host(host->bytes);
    }
    d_out = DeviceBuffer(out.bytes.size());
    d_dq = DeviceBuffer(dq.bytes.size());
    d_dk = DeviceBuffer(dk.bytes.size());
    d_dv = DeviceBuffer(dv.bytes.size());
    d_lse = DeviceBuffer(lse.size() * sizeof(float));
    poison_device_outputs();
  }

  void poison_device_outputs() {
    for (DeviceBuffer* b : {&d_out, &d_dq, &d_dk, &d_dv, &d_lse})
      if (b->bytes() > 0) cuda_check(cudaMemset(b->get(), kPoison, b->bytes()), "poison");
  }

  jf_problem problem(jf_device device) const {
    jf_problem p{};
    p.dtype = spec.dtype;
    p.device = device;
    p.batch_size = batch;
    p.q_offsets = nullptr;
    p.pooled_q_rows = spec.lq;
    p.mask = spec.mask;
    p.window_left = spec.window_left;
    p.window_right = spec.window_right;
    const bool gpu = device == JF_DEVICE_CUDA;
    auto view = [&](const test::HostTensor& h, const DeviceBuffer& d) {
      jf_tensor t = const_cast<test::HostTensor&>(h).view();
      if (gpu) t.data = d.get();
      return t;
    };
    p.kv_offsets = gpu ? d_kv_offsets.as<int32_t>() : kv_offsets.data();
    p.q = view(q, d_q);
    p.k = view(k, d_k);
    p.v = view(v, d_v);
    return p;
  }

  jf_tensor gpu_view(const test::HostTensor& like, const DeviceBuffer& d) const {
    jf_tensor t = const_cast<test::HostTensor&>(like).view();
    t.data = d.get();
    return t;
  }

  jf_fwd_args gpu_forward_args(jf_backend backend) {
    jf_fwd_args a{};
    a.problem = problem(JF_DEVICE_CUDA);
    a.out = gpu_view(out, d_out);
    a.lse = d_lse.as<float>();
    a.launch.backend = backend;
    size_t bytes = 0;
    if (jagflash_fwd_workspace_size(&a, &bytes) == JF_OK && d_ws_fwd.bytes() < bytes)
      d_ws_fwd = DeviceBuffer(bytes);
    a.launch.workspace = d_ws_fwd.get();
    a.launch.workspace_bytes = d_ws_fwd.bytes();
    return a;
  }

  jf_bwd_args gpu_backward_args(jf_backend backend) {
    jf_bwd_args a{};
    a.problem = problem(JF_DEVICE_CUDA);
    a.out = gpu_view(out, d_out);
    a.dout = gpu_view(dout, d_dout);
    a.lse = d_lse.as<float>();
    a.dq = gpu_view(dq, d_dq);
    a.dk = gpu_view(dk, d_dk);
    a.dv = gpu_view(dv, d_dv);
    a.launch.backend = backend;
    size_t bytes = 0;
    if (jagflash_bwd_workspace_size(&a, &bytes) == JF_OK && d_ws_bwd.bytes() < bytes)
      d_ws_bwd = DeviceBuffer(bytes);
    a.launch.workspace = d_ws_bwd.get();
    a.launch.workspace_bytes = d_ws_bwd.bytes();
    return a;
  }

  // The CPU reference on the host copies (out, lse, dq, dk, dv of this object).
  void run_reference() {
    jf_fwd_args f{};
    f.problem = problem(JF_DEVICE_CPU);
    f.out = out.view();
    f.lse = lse.data();
    ASSERT_EQ(jagflash_fwd(&f), JF_OK) << jagflash_last_error();
    jf_bwd_args b{};
    b.problem = f.problem;
    b.out = out.view();
    b.dout = dout.view();
    b.lse = lse.data();
    b.dq = dq.view();
    b.dk = dk.view();
    b.dv = dv.view();
    ASSERT_EQ(jagflash_bwd(&b), JF_OK) << jagflash_last_error();
  }
};

// A device tensor downloaded into a host tensor of the same layout.
test::HostTensor download(const DeviceBuffer& d, const test::HostTensor& like) {
  test::HostTensor t = like;
  d.to_host(t.bytes.data());
  return t;
}

// Every byte outside the view still holds the poison.
bool padding_untouched(const test::HostTensor& t) {
  std::vector<bool> in_view(static_cast<size_t>(t.element_count()), false);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int h = 0; h < t.heads; ++h)
      for (int d = 0; d < t.head_dim; ++d) in_view[static_cast<size_t>(t.offset(r, h, d))] = true;
  const size_t elem = t.bytes.size() / std::max<size_t>(1, in_view.size());
  for (size_t i = 0; i < in_view.size(); ++i)
    if (!in_view[i])
      for (size_t b = 0; b < elem; ++b)
        if (t.bytes[i * elem + b] != kPoison) return false;
  return true;
}

bool all_poison(const DeviceBuffer& d) {
  std::vector<unsigned char> host(d.bytes());
  d.to_host(host.data());
  for (unsigned char x : host)
    if (x != kPoison) return false;
  return true;
}

// Whether `backend` serves both directions of this pooled problem (jagflash_query_backend).
bool serves(const PooledRun& run, jf_backend backend) {
  jf_launch l{};
  l.backend = backend;
  const jf_problem p = run.problem(JF_DEVICE_CUDA);
  for (jf_direction dir : {JF_DIRECTION_FORWARD, JF_DIRECTION_BACKWARD}) {
    jf_backend served = JF_BACKEND_AUTO;
    if (jagflash_query_backend(&p, &l, dir, &served) != JF_OK) return false;
    if (backend != JF_BACKEND_AUTO && served != backend) return false;
  }
  return true;
}

// `backend` (ORACLE, HOPPER or AUTO) against the reference.
void run_and_check(const PooledSpec& s, jf_backend backend = JF_BACKEND_ORACLE) {
  SCOPED_TRACE(describe(s) + " backend " + jagflash_backend_name(backend));
  PooledRun run(s);
  run.run_reference();
  ASSERT_TRUE(serves(run, backend)) << jagflash_last_error();
  const jf_fwd_args fa = run.gpu_forward_args(backend);
  const jf_bwd_args ba = run.gpu_backward_args(backend);
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  const test::HostTensor out = download(run.d_out, run.out), dq = download(run.d_dq, run.dq),
                         dk = download(run.d_dk, run.dk), dv = download(run.d_dv, run.dv);
  std::vector<float> lse(run.lse.size());
  run.d_lse.to_host(lse.data());
  const double fwd_tol = testing::forward_tolerance(s.dtype), bwd_tol = testing::backward_tolerance(s.dtype);
  if (run.rows > 0) {
    EXPECT_LE(test::rel_error(out, run.out), fwd_tol) << "out";
  }
  EXPECT_LE(test::rel_error(dq, run.dq), bwd_tol) << "dq";
  if (run.k.rows > 0) {
    EXPECT_LE(test::rel_error(dk, run.dk), bwd_tol) << "dk";
    EXPECT_LE(test::rel_error(dv, run.dv), bwd_tol) << "dv";
  }
  int64_t bad_lse = 0;
  for (size_t i = 0; i < lse.size(); ++i) {
    const float g = lse[i], w = run.lse[i];
    const bool ok = std::isinf(w) ? g == w : std::abs(g - w) <= kLseTol;
    if (!ok && bad_lse++ < 3) ADD_FAILURE() << "lse[" << i << "]: got " << g << " want " << w;
  }
  EXPECT_EQ(bad_lse, 0);
  // No NaN left in a view (an unwritten element), none written into the padding.
  for (const auto& [t, what] : {std::pair<const test::HostTensor*, const char*>{&out, "out"},
                                {&dq, "dq"},
                                {&dk, "dk"},
                                {&dv, "dv"}}) {
    EXPECT_TRUE(padding_untouched(*t)) << what << ": padding written";
    for (int64_t r = 0; r < t->rows; ++r)
      for (int h = 0; h < t->heads; ++h)
        for (int d = 0; d < t->head_dim; ++d)
          if (!std::isfinite(t->get(r, h, d))) {
            ADD_FAILURE() << what << " (" << r << "," << h << "," << d << ") not finite";
            return;
          }
  }
}

TEST(GpuPooled, OracleMatchesReferenceAcrossLqLengthsHeadsDtypes) {
  // Lengths 0 and 1, primes, tile edges; B = 9.
  const std::vector<int32_t> lengths = {0, 1, 37, 64, 0, 129, 2, 211, 17};
  struct Heads {
    int h, h_kv;
  };
  uint64_t seed = 1700;
  for (jf_dtype dtype : {JF_BF16, JF_FP16})
    for (int d : {64, 128})
      for (int lq : {1, 16, 64, 128, 200})
        for (Heads heads : {Heads{4, 4}, Heads{4, 1}, Heads{8, 2}}) {
          PooledSpec s;
          s.lq = lq;
          s.len_kv = lengths;
          s.heads = heads.h;
          s.heads_kv = heads.h_kv;
          s.head_dim = d;
          s.dtype = dtype;
          s.seed = ++seed;
          run_and_check(s);
        }
}

TEST(GpuPooled, OracleMatchesReferenceUnderMasks) {
  struct MaskCase {
    jf_mask mask;
    int left, right;
  };
  uint64_t seed = 1800;
  for (const MaskCase m : {MaskCase{JF_MASK_WINDOW, 16, 0}, MaskCase{JF_MASK_WINDOW, -1, 7},
                           MaskCase{JF_MASK_WINDOW, 5, 9}, MaskCase{JF_MASK_CAUSAL, -1, -1}})
    for (int lq : {1, 64, 200}) {
      PooledSpec s;
      s.lq = lq;
      s.len_kv = std::vector<int32_t>{3, 0, 131, 1, 64};
      s.heads = 4;
      s.heads_kv = 2;
      s.head_dim = 128;
      s.mask = m.mask;
      s.window_left = m.left;
      s.window_right = m.right;
      s.seed = ++seed;
      run_and_check(s);
    }
}

TEST(GpuPooled, EmptyBatchAndAllEmptySequences) {
  for (const std::vector<int32_t>& lengths : {std::vector<int32_t>{}, std::vector<int32_t>{0, 0, 0}}) {
    PooledSpec s;
    s.lq = 16;
    s.len_kv = lengths;
    s.seed = 1900 + lengths.size();
    run_and_check(s);
  }
}

// A small case for compute-sanitizer (memcheck, racecheck), on the oracle and (where it serves
// pooled calls) the Hopper kernels: scripts/gpu-check.sh SANITIZE=1 or
//   compute-sanitizer --tool memcheck build/tests/jagflash_gpu_tests --gtest_filter=GpuPooled.Small*
TEST(GpuPooled, SmallCaseForSanitizers) {
  PooledSpec s;
  s.lq = 5;
  s.len_kv = std::vector<int32_t>{7, 0, 1, 33};
  s.heads = 2;
  s.heads_kv = 1;
  s.head_dim = 64;
  s.seed = 1950;
  for (jf_backend backend : {JF_BACKEND_ORACLE, JF_BACKEND_HOPPER}) {
    PooledRun probe(s);
    if (serves(probe, backend)) run_and_check(s, backend);
  }
}

// dk and dv are bitwise repeatable in both launch.deterministic modes, and so is dq in deterministic
// mode; the oracle's dq in either mode (each dq row is one warp's fixed-order sum over the
// sequences). The oracle, and the Hopper kernels where they serve pooled calls.
TEST(GpuPooled, RepeatedBackwardIsBitwiseIdentical) {
  PooledSpec s;
  s.lq = 64;
  for (int b = 0; b < 40; ++b) s.len_kv.push_back((b * 53) % 257);
  s.heads = 8;
  s.heads_kv = 2;
  s.head_dim = 128;
  s.seed = 1960;
  PooledRun run(s);
  for (jf_backend backend : {JF_BACKEND_ORACLE, JF_BACKEND_HOPPER}) {
    if (!serves(run, backend)) continue;
    SCOPED_TRACE(jagflash_backend_name(backend));
    const jf_fwd_args fa = run.gpu_forward_args(backend);
    ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
    for (int deterministic : {0, 1}) {
      std::vector<unsigned char> first_dq(run.d_dq.bytes()), first_dk(run.d_dk.bytes()),
          first_dv(run.d_dv.bytes());
      std::vector<unsigned char> dq(first_dq.size()), dk(first_dk.size()), dv(first_dv.size());
      for (int rep = 0; rep < 10; ++rep) {
        jf_bwd_args ba = run.gpu_backward_args(backend);
        ba.launch.deterministic = deterministic;
        ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
        run.d_dq.to_host(rep == 0 ? first_dq.data() : dq.data());
        run.d_dk.to_host(rep == 0 ? first_dk.data() : dk.data());
        run.d_dv.to_host(rep == 0 ? first_dv.data() : dv.data());
        if (rep == 0) continue;
        ASSERT_EQ(0, std::memcmp(first_dk.data(), dk.data(), dk.size())) << "dk, run " << rep;
        ASSERT_EQ(0, std::memcmp(first_dv.data(), dv.data(), dv.size())) << "dv, run " << rep;
        if (deterministic != 0 || backend == JF_BACKEND_ORACLE) {
          ASSERT_EQ(0, std::memcmp(first_dq.data(), dq.data(), dq.size()))
              << "dq, run " << rep << " deterministic " << deterministic;
        }
      }
    }
  }
}

// Bad kv_offsets: the host check fails the call naming problem.kv_offsets; the device check runs
// the call (JF_OK), every kernel exits without writing, and the workspace's flag reports it.
TEST(GpuPooled, BadKvOffsetsWriteNothing) {
  PooledSpec s;
  s.lq = 16;
  s.len_kv = std::vector<int32_t>{4, 9, 2};
  s.seed = 1970;
  PooledRun run(s);
  const std::vector<int32_t> bad = {0, 9, 4, 15};  // decreasing, total right
  cuda_check(cudaMemcpy(run.d_kv_offsets.get(), bad.data(), bad.size() * 4, cudaMemcpyHostToDevice),
             "bad offsets");
  jf_fwd_args fa = run.gpu_forward_args(JF_BACKEND_AUTO);
  jf_bwd_args ba = run.gpu_backward_args(JF_BACKEND_AUTO);
  EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("problem.kv_offsets[2]"), std::string::npos)
      << jagflash_last_error();
  EXPECT_EQ(jagflash_bwd(&ba), JF_ERR_INVALID_ARGUMENT);
  fa.launch.offsets_check = ba.launch.offsets_check = JF_CHECK_OFFSETS_DEVICE;
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  EXPECT_EQ(jagflash_read_device_error(fa.launch.workspace, nullptr), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("problem.kv_offsets"), std::string::npos)
      << jagflash_last_error();
  EXPECT_EQ(std::string(jagflash_last_error()).find("problem.q_offsets"), std::string::npos)
      << "pooled calls have no q_offsets to report: " << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  EXPECT_EQ(jagflash_read_device_error(ba.launch.workspace, nullptr), JF_ERR_INVALID_ARGUMENT);
  for (const auto& [buffer, what] : {std::pair<const DeviceBuffer*, const char*>{&run.d_out, "out"},
                                     {&run.d_lse, "lse"},
                                     {&run.d_dq, "dq"},
                                     {&run.d_dk, "dk"},
                                     {&run.d_dv, "dv"}})
    EXPECT_TRUE(all_poison(*buffer)) << what << " was written despite invalid kv_offsets";
  // Good offsets with the device check: the flag reads clean and the outputs are written.
  cuda_check(cudaMemcpy(run.d_kv_offsets.get(), run.kv_offsets.data(), run.kv_offsets.size() * 4,
                        cudaMemcpyHostToDevice),
             "offsets");
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  EXPECT_EQ(jagflash_read_device_error(fa.launch.workspace, nullptr), JF_OK) << jagflash_last_error();
  EXPECT_FALSE(all_poison(run.d_out));
}

// JF_BACKEND_HOPPER on pooled problems: where this build's Hopper kernels serve them (query_backend
// says so), the same checks as the oracle's on a few shapes; where they do not, every entry point
// refuses with JF_ERR_UNSUPPORTED saying pooled attention runs on the oracle, writing nothing.
TEST(GpuPooled, HopperBackendServesOrRefusesPooledProblems) {
  PooledSpec probe;
  probe.len_kv = std::vector<int32_t>{5, 8};
  probe.seed = 1980;
  // Without the probe's unpooled kernels too the refusal below would be another one's.
  JF_SKIP_UNLESS_HOPPER_SERVES(testing::HopperCall({probe.dtype, probe.head_dim}), /*with_backward=*/true);
  PooledRun run(probe);
  if (serves(run, JF_BACKEND_HOPPER)) {
    testing::HopperCases cases;
    uint64_t seed = 1990;
    for (jf_dtype dtype : {JF_BF16, JF_FP16})
      for (int d : {64, 80, 96, 128})  // 80 padded on the 96 kernel
        for (int lq : {1, 16, 64, 128, 200}) {
          PooledSpec s;
          s.lq = lq;
          s.len_kv = std::vector<int32_t>{0, 1, 37, 64, 0, 129, 2, 211, 17};
          s.heads = 8;
          s.heads_kv = 2;
          s.head_dim = d;
          s.dtype = dtype;
          s.seed = ++seed;
          if (!cases.serve({dtype, d}, /*with_backward=*/true)) continue;
          run_and_check(s, JF_BACKEND_HOPPER);
        }
    JF_REPORT_UNSERVED(cases);
    return;
  }
  const jf_fwd_args fa = run.gpu_forward_args(JF_BACKEND_HOPPER);
  const jf_bwd_args ba = run.gpu_backward_args(JF_BACKEND_HOPPER);
  auto expect_refused = [](jf_status status, const char* what) {
    EXPECT_EQ(status, JF_ERR_UNSUPPORTED) << what;
    const std::string msg = jagflash_last_error();
    EXPECT_NE(msg.find("launch.backend"), std::string::npos) << msg;
    EXPECT_NE(msg.find("runs on the oracle in this build"), std::string::npos) << msg;
  };
  jf_backend served = JF_BACKEND_AUTO;
  expect_refused(jagflash_query_backend(&fa.problem, &fa.launch, JF_DIRECTION_FORWARD, &served), "query fwd");
  expect_refused(jagflash_query_backend(&ba.problem, &ba.launch, JF_DIRECTION_BACKWARD, &served),
                 "query bwd");
  size_t bytes = 0;
  expect_refused(jagflash_fwd_workspace_size(&fa, &bytes), "fwd workspace");
  expect_refused(jagflash_bwd_workspace_size(&ba, &bytes), "bwd workspace");
  expect_refused(jagflash_fwd(&fa), "fwd");
  expect_refused(jagflash_bwd(&ba), "bwd");
  EXPECT_TRUE(all_poison(run.d_out));
  // AUTO then runs the oracle.
  ASSERT_TRUE(serves(run, JF_BACKEND_ORACLE));
  jf_launch l{};
  const jf_problem p = run.problem(JF_DEVICE_CUDA);
  ASSERT_EQ(jagflash_query_backend(&p, &l, JF_DIRECTION_FORWARD, &served), JF_OK) << jagflash_last_error();
  EXPECT_EQ(served, JF_BACKEND_ORACLE);
}

// Many sequences of one query head a CTA: the Hopper backward sums a CTA's dQ partials of one head
// in its open stage over consecutive tiles (Lq <= 64, one head a tile, not deterministic), and
// with JAGFLASH_BWD_POOLED_SUM=0 keeps each sequence's rows and sums them in the postprocess: both
// against the reference, with enough tiles (B = 200, about 10 a CTA) that stages are reused.
TEST(GpuPooled, HopperSumsConsecutiveTilesOfAHeadInACta) {
  PooledSpec probe;
  probe.len_kv = std::vector<int32_t>{5, 8};
  probe.heads = probe.heads_kv = 4;
  probe.seed = 2000;
  if (!serves(PooledRun(probe), JF_BACKEND_HOPPER)) GTEST_SKIP() << "this build has no Hopper pooled kernels";
  struct Case {
    int lq, head_dim;
  };
  uint64_t seed = 2001;
  testing::HopperCases cases;
  for (const char* knob : {"1", "0"}) {
    ASSERT_EQ(setenv("JAGFLASH_BWD_POOLED_SUM", knob, 1), 0);
    for (const Case c : {Case{16, 128}, Case{64, 128}, Case{1, 64}, Case{64, 64}}) {
      PooledSpec s;
      s.lq = c.lq;
      for (int b = 0; b < 200; ++b) s.len_kv.push_back(b % 17 == 3 ? 0 : (b * 37) % 300);
      s.heads = s.heads_kv = 4;
      s.head_dim = c.head_dim;
      s.seed = ++seed;
      SCOPED_TRACE(std::string("JAGFLASH_BWD_POOLED_SUM=") + knob);
      if (!cases.serve({s.dtype, s.head_dim}, /*with_backward=*/true)) continue;
      run_and_check(s, JF_BACKEND_HOPPER);
    }
  }
  unsetenv("JAGFLASH_BWD_POOLED_SUM");
  JF_REPORT_UNSERVED(cases);
}

// AUTO (whichever backend it picks) on one mixed case.
TEST(GpuPooled, AutoMatchesReference) {
  PooledSpec s;
  s.lq = 64;
  s.len_kv = std::vector<int32_t>{0, 1, 37, 130, 5};
  s.heads = 8;
  s.heads_kv = 2;
  s.head_dim = 128;
  s.seed = 1995;
  run_and_check(s, JF_BACKEND_AUTO);
}

}  // namespace
}  // namespace jagflash
