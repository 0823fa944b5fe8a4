// GPU tests (label "gpu"): the GPU path against the CPU float64 reference on awkward jagged
// batches and on the five benchmark distributions scaled down; poisoned outputs, row padding,
// device-side offsets checks, CUDA-graph capture with new offsets, and repeatability. The score
// modifiers (softcap, ALiBi) through the oracle's entry, ordinary and pooled, forward and backward.
#include "api/offsets_check_device.hpp"
#include "gen/distributions.hpp"
#include "hopper_served.hpp"
#include "oracle/oracle.hpp"
#include "testing/device_buffer.hpp"
#include "testing/gpu_batch.hpp"
#include "testing/host_batch.hpp"

#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace jagflash {
namespace {

using testing::BatchSpec;
using testing::GpuBatch;

constexpr double kLseTol = 1e-3;

std::vector<int32_t> all_sequences(const BatchSpec& s) {
  std::vector<int32_t> seqs(s.len_q.size());
  for (size_t b = 0; b < seqs.size(); ++b) seqs[b] = static_cast<int32_t>(b);
  return seqs;
}

void run_and_check(const BatchSpec& spec, jf_backend backend, const std::string& label) {
  SCOPED_TRACE(label + " seed=" + std::to_string(spec.seed));
  GpuBatch g = testing::make_gpu_batch(spec);
  const jf_fwd_args fa = g.forward_args(backend);
  const jf_bwd_args ba = g.backward_args(backend);
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const testing::SampleCheck c = testing::check_sample_against_reference(g, all_sequences(g.spec), true);
  EXPECT_TRUE(c.finite) << "an output element was left unwritten (NaN poison survived) or is NaN";
  EXPECT_TRUE(c.lse_inf_match);
  EXPECT_LE(c.out_rel, testing::forward_tolerance(spec.dtype));
  EXPECT_LE(c.lse_max_abs, kLseTol);
  EXPECT_LE(c.dq_rel, testing::backward_tolerance(spec.dtype));
  EXPECT_LE(c.dk_rel, testing::backward_tolerance(spec.dtype));
  EXPECT_LE(c.dv_rel, testing::backward_tolerance(spec.dtype));
}

struct MaskCase {
  const char* name;
  jf_mask mask;
  int left, right;
};
const MaskCase kMasks[] = {{"none", JF_MASK_NONE, -1, -1},
                           {"causal", JF_MASK_CAUSAL, -1, -1},
                           {"window(16,0)", JF_MASK_WINDOW, 16, 0},
                           {"window(5,9)", JF_MASK_WINDOW, 5, 9},
                           {"window(-1,3)", JF_MASK_WINDOW, -1, 3}};

TEST(GpuOracle, AwkwardLengthsEveryMaskDtypeAndHeadLayout) {
  const std::vector<int32_t> len_q = {0, 1, 2, 63, 64, 65, 127, 129, 17, 131, 5, 0};
  const std::vector<int32_t> len_kv = {3, 1, 0, 64, 65, 63, 129, 127, 17, 97, 200, 0};  // q != kv
  struct Heads {
    int h, h_kv;
  };
  uint64_t seed = 100;
  for (jf_dtype dtype : {JF_BF16, JF_FP16, JF_FP32})
    for (Heads heads : {Heads{4, 4}, Heads{4, 2}, Heads{4, 1}})
      for (const MaskCase& m : kMasks) {
        BatchSpec s;
        s.len_q.assign(len_q.begin(), len_q.end());
        s.len_kv.assign(len_kv.begin(), len_kv.end());
        s.heads = heads.h;
        s.heads_kv = heads.h_kv;
        s.head_dim = 64;
        s.dtype = dtype;
        s.mask = m.mask;
        s.window_left = m.left;
        s.window_right = m.right;
        s.seed = ++seed;
        s.row_pad = 8;
        run_and_check(s, JF_BACKEND_AUTO,
                      std::string(m.name) + " dtype=" + std::to_string(dtype) +
                          " H=" + std::to_string(heads.h) + " H_kv=" + std::to_string(heads.h_kv));
      }
}

TEST(GpuOracle, HeadDims128And256) {
  testing::HopperCases cases;
  for (int d : {128, 256})
    for (const MaskCase& m : {kMasks[0], kMasks[1]}) {
      if (!cases.oracle_has(JF_BF16, d)) continue;
      BatchSpec s;
      s.len_q = {1, 77, 130, 0, 31};
      s.len_kv = {9, 77, 64, 12, 31};
      s.heads = 2;
      s.heads_kv = 1;
      s.head_dim = d;
      s.mask = m.mask;
      s.seed = 7 + d;
      run_and_check(s, JF_BACKEND_ORACLE, std::string(m.name) + " D=" + std::to_string(d));
    }
  JF_REPORT_UNSERVED(cases);
}

TEST(GpuOracle, FiveDistributionsScaledDown) {
  // Lengths divided by 8 and at most 64 sequences keep the float64 reference fast; H = 4.
  for (const std::string& name : gen::distribution_names())
    for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL}) {
      std::vector<int32_t> lengths = gen::generate_lengths(name, gen::kDefaultSeed);
      for (int32_t& l : lengths) l = std::max(1, l / 8);
      if (lengths.size() > 64) lengths.resize(64);
      BatchSpec s;
      s.len_q.assign(lengths.begin(), lengths.end());
      s.heads = 4;
      s.heads_kv = 4;
      s.head_dim = 128;
      s.mask = mask;
      s.seed = 31;
      run_and_check(s, JF_BACKEND_AUTO, name + (mask == JF_MASK_CAUSAL ? " causal" : " none"));
    }
}

// Row padding is caller memory between rows: it must keep its poison.
TEST(GpuOracle, PaddingBetweenRowsIsNeverWritten) {
  BatchSpec s;
  s.len_q = {3, 70, 0, 129};
  s.len_kv = {5, 70, 4, 100};
  s.heads = 2;
  s.heads_kv = 2;
  s.head_dim = 64;
  s.row_pad = 16;
  s.mask = JF_MASK_CAUSAL;
  GpuBatch g = testing::make_gpu_batch(s);
  const jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  const jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (const auto* pair : {&g.out, &g.dq, &g.dk, &g.dv}) {
    std::vector<uint16_t> host(pair->bytes() / 2);
    pair->to_host(host.data());
    const int64_t row_stride = int64_t(s.heads) * s.head_dim + s.row_pad;
    for (size_t i = 0; i < host.size(); ++i) {
      const bool padding = int64_t(i) % row_stride >= int64_t(s.heads) * s.head_dim;
      const bool is_nan = (host[i] & 0x7f80) == 0x7f80 && (host[i] & 0x7f) != 0;  // bf16 NaN
      EXPECT_EQ(padding, is_nan) << "element " << i;
      if (padding != is_nan) break;
    }
  }
}

TEST(GpuOracle, InvalidDeviceOffsetsWriteNothing) {
  BatchSpec s;
  s.len_q = {4, 9, 2};
  s.heads = 2;
  s.heads_kv = 2;
  s.head_dim = 64;
  GpuBatch g = testing::make_gpu_batch(s);
  const std::vector<int32_t> bad = {0, 9, 4, 15};  // decreasing, total right
  testing::cuda_check(cudaMemcpy(g.d_q_offsets.get(), bad.data(), bad.size() * 4, cudaMemcpyHostToDevice),
                      "bad offsets");
  // Host check: the call fails before anything runs.
  jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("problem.q_offsets[2]"), std::string::npos)
      << jagflash_last_error();
  // Device check: the call is queued, every kernel exits early, the flag reports it.
  fa.launch.offsets_check = JF_CHECK_OFFSETS_DEVICE;
  jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
  ba.launch.offsets_check = JF_CHECK_OFFSETS_DEVICE;
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  EXPECT_EQ(jagflash_read_device_error(fa.launch.workspace, nullptr), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("non-decreasing"), std::string::npos)
      << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  EXPECT_EQ(jagflash_read_device_error(ba.launch.workspace, nullptr), JF_ERR_INVALID_ARGUMENT);
  std::vector<uint16_t> out(g.out.bytes() / 2), dq(g.dq.bytes() / 2);
  g.out.to_host(out.data());
  g.dq.to_host(dq.data());
  for (uint16_t x : out) ASSERT_EQ(x & 0x7f80, 0x7f80) << "out was written despite invalid offsets";
  for (uint16_t x : dq) ASSERT_EQ(x & 0x7f80, 0x7f80) << "dq was written despite invalid offsets";
  // Valid offsets with the device check: the flag reads clean.
  const std::vector<int32_t> good = {0, 4, 13, 15};
  testing::cuda_check(cudaMemcpy(g.d_q_offsets.get(), good.data(), good.size() * 4, cudaMemcpyHostToDevice),
                      "offsets");
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK);
  EXPECT_EQ(jagflash_read_device_error(fa.launch.workspace, nullptr), JF_OK) << jagflash_last_error();
}

// Captured once, replayed with new offsets of the same batch size: the graph reads the offsets
// from device memory, so the replay must serve the new batch.
TEST(GpuOracle, CudaGraphReplayWithNewOffsets) {
  BatchSpec s;
  s.len_q = {40, 7, 90, 0};  // 137 tokens
  s.heads = 2;
  s.heads_kv = 1;
  s.head_dim = 128;
  s.mask = JF_MASK_CAUSAL;
  GpuBatch g = testing::make_gpu_batch(s);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
  fa.launch.stream = ba.launch.stream = stream;
  // The host check would sync inside the capture: it must be refused with a clear message.
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  {
    // A failed assertion below leaves the capture ended (else every later test's allocation
    // failed with "operation not permitted when stream is capturing").
    struct EndCapture {
      cudaStream_t stream;
      cudaGraph_t* graph;
      ~EndCapture() {
        if (*graph == nullptr && cudaStreamEndCapture(stream, graph) != cudaSuccess) cudaGetLastError();
      }
    } end_capture{stream, &graph};
    EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(jagflash_last_error()).find("JF_CHECK_OFFSETS_DEVICE"), std::string::npos);
    fa.launch.offsets_check = ba.launch.offsets_check = JF_CHECK_OFFSETS_DEVICE;
    ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
    ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  }
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (const std::vector<int32_t>& lengths :
       {std::vector<int32_t>{40, 7, 90, 0}, std::vector<int32_t>{1, 0, 100, 36}}) {
    const std::vector<int32_t> offsets = test::offsets_from_lengths(lengths);
    testing::cuda_check(
        cudaMemcpy(g.d_q_offsets.get(), offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice),
        "q offsets");
    testing::cuda_check(
        cudaMemcpy(g.d_kv_offsets.get(), offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice),
        "kv offsets");
    g.q_offsets.assign(offsets.begin(), offsets.end());
    g.kv_offsets.assign(offsets.begin(), offsets.end());
    g.spec.len_q.assign(lengths.begin(), lengths.end());
    g.spec.len_kv.assign(lengths.begin(), lengths.end());
    testing::poison_outputs(g);
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    EXPECT_EQ(jagflash_read_device_error(fa.launch.workspace, stream), JF_OK) << jagflash_last_error();
    const testing::SampleCheck c = testing::check_sample_against_reference(g, all_sequences(g.spec), true);
    EXPECT_TRUE(c.finite);
    EXPECT_LE(c.out_rel, testing::forward_tolerance(s.dtype));
    EXPECT_LE(c.dq_rel, testing::backward_tolerance(s.dtype));
    EXPECT_LE(c.dk_rel, testing::backward_tolerance(s.dtype));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

TEST(GpuOracle, RepeatedRunsAreBitwiseIdentical) {
  BatchSpec s;
  s.len_q = gen::generate_lengths("short", 3);
  s.len_q.resize(200);
  s.heads = 4;
  s.heads_kv = 2;
  s.head_dim = 128;
  s.mask = JF_MASK_CAUSAL;
  GpuBatch g = testing::make_gpu_batch(s);
  const jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  const jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
  std::vector<unsigned char> first_out(g.out.bytes()), first_dk(g.dk.bytes()), out(g.out.bytes()),
      dk(g.dk.bytes());
  for (int run = 0; run < 20; ++run) {
    ASSERT_EQ(jagflash_fwd(&fa), JF_OK);
    ASSERT_EQ(jagflash_bwd(&ba), JF_OK);
    g.out.to_host(run == 0 ? first_out.data() : out.data());
    g.dk.to_host(run == 0 ? first_dk.data() : dk.data());
    if (run > 0) {
      ASSERT_EQ(0, std::memcmp(first_out.data(), out.data(), out.size())) << "run " << run;
      ASSERT_EQ(0, std::memcmp(first_dk.data(), dk.data(), dk.size())) << "run " << run;
    }
  }
}

// ---- Score modifiers through the oracle -------------------------------------------------------
// These call the oracle's entry (oracle::find) as dispatch does, with a workspace of their own, so
// they test the oracle whichever backend the C API routes a call with a modifier to (and also
// where it refuses one); the CPU float64 reference runs through the C API on the same host copies.

struct ModSpec {
  std::vector<int32_t> len_q;  // ordinary attention, one length per sequence; unused when pooled
  int pooled_lq = 0;           // > 0: pooled attention, one query set of this many rows
  std::vector<int32_t> len_kv;
  int heads = 4, heads_kv = 2, head_dim = 64;
  jf_dtype dtype = JF_BF16;
  jf_mask mask = JF_MASK_NONE;
  int window_left = -1, window_right = -1;
  jf_score_mod score_mod = JF_SCORE_MOD_NONE;
  float softcap = 0.f;
  // Inputs are drawn from U(-r, r): s = q.k / sqrt(D) then has a standard deviation of about
  // r^2 / 3, so r sets how far into tanh's bend a softcap reaches.
  double input_range = 1.0;
  uint64_t seed = 1;
  int row_pad = 8;
};

std::string describe(const ModSpec& s) {
  auto list = [](const std::vector<int32_t>& v) {
    std::string out;
    for (int32_t x : v) out += (out.empty() ? "" : ",") + std::to_string(x);
    return "{" + out + "}";
  };
  const std::string mod = s.score_mod == JF_SCORE_MOD_SOFTCAP ? "softcap=" + std::to_string(s.softcap)
                          : s.score_mod == JF_SCORE_MOD_ALIBI ? std::string("alibi")
                                                              : std::string("none");
  return mod + " " + (s.pooled_lq > 0 ? "Lq=" + std::to_string(s.pooled_lq) : "q=" + list(s.len_q)) +
         " kv=" + list(s.len_kv) + " H=" + std::to_string(s.heads) + "/" + std::to_string(s.heads_kv) +
         " D=" + std::to_string(s.head_dim) + " " + dtype_name(s.dtype) + " mask=" + std::to_string(s.mask) +
         "(" + std::to_string(s.window_left) + "," + std::to_string(s.window_right) +
         ") r=" + std::to_string(s.input_range) + " seed=" + std::to_string(s.seed);
}

// BLOOM's slopes, 2^(-8 (h + 1) / H): distinct per head, so a head mixed up with its kv head or a
// neighbour shows, and from 1/4 (a bias of -50 at distance 200) down to 2^-8 (a mild one).
std::vector<float> alibi_slopes(int heads) {
  std::vector<float> slopes(static_cast<size_t>(heads));
  for (int h = 0; h < heads; ++h)
    slopes[static_cast<size_t>(h)] = std::exp2(-8.f * float(h + 1) / float(heads));
  return slopes;
}

struct ModOutputs {
  test::HostTensor out, dq, dk, dv;
  std::vector<float> lse;  // [H, output rows]
};

// Host inputs and their device twins (same layouts), the CPU reference and the oracle over them.
struct ModRun {
  ModSpec spec;
  int32_t batch = 0;
  int64_t out_rows = 0;
  std::vector<int32_t> q_offsets, kv_offsets;
  std::vector<float> slopes;
  test::HostTensor q, k, v, dout;
  testing::DeviceBuffer d_q_offsets, d_kv_offsets, d_slopes, d_q, d_k, d_v, d_dout;
  testing::DeviceBuffer d_out, d_lse, d_dq, d_dk, d_dv, d_flag, d_delta;

  explicit ModRun(const ModSpec& s) : spec(s) {
    const bool pooled = s.pooled_lq > 0;
    batch = static_cast<int32_t>(s.len_kv.size());
    kv_offsets = test::offsets_from_lengths(s.len_kv);
    if (!pooled) q_offsets = test::offsets_from_lengths(s.len_q);
    const int64_t q_rows = pooled ? s.pooled_lq : q_offsets.back();
    out_rows = pooled ? int64_t{batch} * s.pooled_lq : q_rows;
    const int64_t kv_rows = kv_offsets.back();
    q = test::make_tensor(s.dtype, q_rows, s.heads, s.head_dim, s.row_pad);
    k = test::make_tensor(s.dtype, kv_rows, s.heads_kv, s.head_dim, s.row_pad);
    v = test::make_tensor(s.dtype, kv_rows, s.heads_kv, s.head_dim, s.row_pad);
    dout = test::make_tensor(s.dtype, out_rows, s.heads, s.head_dim, s.row_pad);
    std::mt19937_64 rng(s.seed);
    for (test::HostTensor* t : {&q, &k, &v, &dout}) t->fill_random(rng, -s.input_range, s.input_range);
    if (s.score_mod == JF_SCORE_MOD_ALIBI) slopes = alibi_slopes(s.heads);

    if (!pooled) d_q_offsets = testing::DeviceBuffer::from_host(q_offsets);
    d_kv_offsets = testing::DeviceBuffer::from_host(kv_offsets);
    d_slopes = testing::DeviceBuffer::from_host(slopes);
    d_q = testing::DeviceBuffer::from_host(q.bytes);
    d_k = testing::DeviceBuffer::from_host(k.bytes);
    d_v = testing::DeviceBuffer::from_host(v.bytes);
    d_dout = testing::DeviceBuffer::from_host(dout.bytes);
    d_out = testing::DeviceBuffer(dout.bytes.size());
    d_dq = testing::DeviceBuffer(q.bytes.size());
    d_dk = testing::DeviceBuffer(k.bytes.size());
    d_dv = testing::DeviceBuffer(v.bytes.size());
    // At least one element each: a batch with no output rows still gets valid pointers.
    const size_t lse_bytes = static_cast<size_t>(std::max<int64_t>(1, s.heads * out_rows)) * sizeof(float);
    d_lse = testing::DeviceBuffer(lse_bytes);
    d_delta = testing::DeviceBuffer(lse_bytes);
    d_flag = testing::DeviceBuffer(sizeof(int32_t));
    // Every byte 0xff: NaN in bf16, fp16 and fp32, so an unwritten element fails the comparison.
    for (testing::DeviceBuffer* b : {&d_out, &d_lse, &d_dq, &d_dk, &d_dv})
      if (b->bytes() > 0) testing::cuda_check(cudaMemset(b->get(), 0xff, b->bytes()), "poison");
  }

  // The problem over the host copies (CPU) or the device twins (CUDA); without_mod drops the
  // modifier (for the check that the modifier changes the result at all).
  jf_problem problem(jf_device device, bool without_mod = false) const {
    const bool gpu = device == JF_DEVICE_CUDA;
    auto view = [&](const test::HostTensor& h, const testing::DeviceBuffer& d) {
      jf_tensor t = const_cast<test::HostTensor&>(h).view();
      if (gpu) t.data = d.get();
      return t;
    };
    jf_problem p{};
    p.dtype = spec.dtype;
    p.device = device;
    p.batch_size = batch;
    p.pooled_q_rows = spec.pooled_lq;
    p.q_offsets = spec.pooled_lq > 0 ? nullptr : gpu ? d_q_offsets.as<int32_t>() : q_offsets.data();
    p.kv_offsets = gpu ? d_kv_offsets.as<int32_t>() : kv_offsets.data();
    p.q = view(q, d_q);
    p.k = view(k, d_k);
    p.v = view(v, d_v);
    p.mask = spec.mask;
    p.window_left = spec.window_left;
    p.window_right = spec.window_right;
    if (!without_mod) {
      p.score_mod = spec.score_mod;
      p.softcap = spec.softcap;
      if (spec.score_mod == JF_SCORE_MOD_ALIBI) p.alibi_slopes = gpu ? d_slopes.as<float>() : slopes.data();
    }
    return p;
  }

  // Zeroed outputs in the inputs' layouts: out like dout, dq like q, dk like k, dv like v.
  ModOutputs empty_outputs() const {
    auto like = [](const test::HostTensor& t) {
      return test::make_tensor(t.dtype, t.rows, t.heads, t.head_dim,
                               static_cast<int>(t.row_stride - int64_t(t.heads) * t.head_dim));
    };
    return {like(dout), like(q), like(k), like(v),
            std::vector<float>(static_cast<size_t>(spec.heads * out_rows))};
  }

  ModOutputs reference(bool without_mod = false) const {
    ModOutputs r = empty_outputs();
    jf_fwd_args f{};
    f.problem = problem(JF_DEVICE_CPU, without_mod);
    f.out = r.out.view();
    f.lse = r.lse.data();
    EXPECT_EQ(jagflash_fwd(&f), JF_OK) << jagflash_last_error();
    jf_bwd_args b{};
    b.problem = f.problem;
    b.out = r.out.view();
    b.dout = const_cast<test::HostTensor&>(dout).view();
    b.lse = r.lse.data();
    b.dq = r.dq.view();
    b.dk = r.dk.view();
    b.dv = r.dv.view();
    EXPECT_EQ(jagflash_bwd(&b), JF_OK) << jagflash_last_error();
    return r;
  }

  jf_tensor device_view(const test::HostTensor& like, const testing::DeviceBuffer& d) const {
    jf_tensor t = const_cast<test::HostTensor&>(like).view();
    t.data = d.get();
    return t;
  }

  // Forward, then backward on the oracle's own out and lse, on the default stream; the flag
  // zeroed first as dispatch does (no device check: the offsets are the test's own).
  void run_oracle() {
    const oracle::Entry* entry = oracle::find(spec.dtype, spec.head_dim);
    ASSERT_NE(entry, nullptr) << "this build instantiates " << oracle::instantiated();
    const jf_problem p = problem(JF_DEVICE_CUDA);
    auto* flag = d_flag.as<int32_t>();
    ASSERT_EQ(
        detail::launch_offsets_check(p.q_offsets, p.kv_offsets, p.block_mask.offsets, p.block_mask.bytes,
                                     p.batch_size, p.q.rows, p.k.rows, flag, /*check=*/false, nullptr),
        cudaSuccess);
    jf_fwd_args f{};
    f.problem = p;
    f.out = device_view(dout, d_out);
    f.lse = d_lse.as<float>();
    ASSERT_EQ(entry->forward(f, oracle::Workspace{flag, nullptr}, nullptr), cudaSuccess);
    jf_bwd_args b{};
    b.problem = p;
    b.out = f.out;
    b.dout = device_view(dout, d_dout);
    b.lse = f.lse;
    b.dq = device_view(q, d_dq);
    b.dk = device_view(k, d_dk);
    b.dv = device_view(v, d_dv);
    ASSERT_EQ(entry->backward(b, oracle::Workspace{flag, d_delta.as<float>()}, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  }

  ModOutputs download() const {
    ModOutputs o = empty_outputs();
    d_out.to_host(o.out.bytes.data());
    d_dq.to_host(o.dq.bytes.data());
    d_dk.to_host(o.dk.bytes.data());
    d_dv.to_host(o.dv.bytes.data());
    if (!o.lse.empty())
      testing::cuda_check(
          cudaMemcpy(o.lse.data(), d_lse.get(), o.lse.size() * sizeof(float), cudaMemcpyDeviceToHost), "lse");
    return o;
  }
};

// Finite lse entries: the largest |a - b|, NaN when either holds a NaN; inf_match false where one is
// -inf and the other is not.
struct LseDiff {
  double max_abs = 0;
  bool inf_match = true;
};
LseDiff lse_diff(const std::vector<float>& a, const std::vector<float>& b) {
  LseDiff d;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      d.inf_match = d.inf_match && a[i] == b[i];
      continue;
    }
    const double e = std::abs(double(a[i]) - b[i]);
    if (!(e <= d.max_abs)) d.max_abs = e;  // NaN propagates
  }
  return d;
}

// The oracle against the reference: out and lse, dq, dk and dv (an unwritten element is NaN and
// fails its comparison); and the case's modifier moves the reference's lse by far more than the
// lse tolerance (out may move by less than a bf16 tolerance: a softcap of 30 bends only the
// largest scores), so that an oracle ignoring the modifier fails here.
void check_modifier(const ModSpec& spec) {
  SCOPED_TRACE(describe(spec));
  ModRun run(spec);
  ASSERT_NO_FATAL_FAILURE(run.run_oracle());
  const ModOutputs gpu = run.download();
  const ModOutputs ref = run.reference();
  const double fwd_tol = testing::forward_tolerance(spec.dtype),
               bwd_tol = testing::backward_tolerance(spec.dtype);
  EXPECT_LE(test::rel_error(gpu.out, ref.out), fwd_tol);
  const LseDiff lse = lse_diff(gpu.lse, ref.lse);
  EXPECT_TRUE(lse.inf_match) << "lse is -inf exactly where no key is visible";
  EXPECT_LE(lse.max_abs, kLseTol);
  EXPECT_LE(test::rel_error(gpu.dq, ref.dq), bwd_tol);
  EXPECT_LE(test::rel_error(gpu.dk, ref.dk), bwd_tol);
  EXPECT_LE(test::rel_error(gpu.dv, ref.dv), bwd_tol);
  const ModOutputs plain = run.reference(/*without_mod=*/true);
  EXPECT_GT(lse_diff(plain.lse, ref.lse).max_abs, 10 * kLseTol)
      << "the case cannot tell the modifier from none";
}

struct ModCase {
  const char* name;
  jf_score_mod kind;
  float softcap;
  double input_range;  // large enough that the softcap bends the scores
};
const ModCase kMods[] = {{"softcap 5", JF_SCORE_MOD_SOFTCAP, 5.f, 2.0},
                         {"softcap 30", JF_SCORE_MOD_SOFTCAP, 30.f, 3.0},
                         {"alibi", JF_SCORE_MOD_ALIBI, 0.f, 1.0}};

TEST(GpuOracleScoreMod, AwkwardLengthsMasksDtypesAndGqa) {
  // Lengths 0 and 1, q != kv both ways (bottom-right alignment of the masks and of ALiBi), rows
  // that see no key under causal (lq > lk).
  const std::vector<int32_t> len_q = {0, 1, 1, 2, 17, 64, 129, 5, 40, 0};
  const std::vector<int32_t> len_kv = {3, 0, 1, 2, 17, 65, 127, 200, 9, 0};
  struct Heads {
    int h, h_kv;
  };
  const MaskCase masks[] = {kMasks[0], kMasks[1], kMasks[2], kMasks[3]};
  uint64_t seed = 500;
  for (jf_dtype dtype : {JF_BF16, JF_FP16, JF_FP32})
    for (const ModCase& mod : kMods)
      for (Heads heads : {Heads{4, 4}, Heads{6, 2}})
        for (const MaskCase& m : masks) {
          ModSpec s;
          s.len_q = len_q;
          s.len_kv = len_kv;
          s.heads = heads.h;
          s.heads_kv = heads.h_kv;
          s.dtype = dtype;
          s.mask = m.mask;
          s.window_left = m.left;
          s.window_right = m.right;
          s.score_mod = mod.kind;
          s.softcap = mod.softcap;
          s.input_range = mod.input_range;
          s.seed = ++seed;
          check_modifier(s);
        }
}

TEST(GpuOracleScoreMod, HeadDims128And256) {
  testing::HopperCases cases;
  for (int d : {128, 256})
    for (const ModCase& mod : kMods)
      for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL}) {
        if (!cases.oracle_has(JF_BF16, d)) continue;
        ModSpec s;
        s.len_q = {1, 77, 130, 0, 31};
        s.len_kv = {9, 77, 64, 12, 31};
        s.heads = 4;
        s.heads_kv = 1;
        s.head_dim = d;
        s.mask = mask;
        s.score_mod = mod.kind;
        s.softcap = mod.softcap;
        // s has a standard deviation of about r^2 / 3 at any D: the same ranges as at D = 64.
        s.input_range = mod.input_range;
        s.seed = 900 + d + mask;
        check_modifier(s);
      }
  JF_REPORT_UNSERVED(cases);
}

// Pooled attention: one query set against every sequence (the oracle's pooled dq kernel sums the
// sequences' contributions; ALiBi's alignment uses Lq and each sequence's own Lk).
TEST(GpuOracleScoreMod, Pooled) {
  uint64_t seed = 700;
  for (jf_dtype dtype : {JF_BF16, JF_FP16})
    for (const ModCase& mod : kMods)
      for (const MaskCase& m : {kMasks[0], kMasks[1], kMasks[3]}) {
        ModSpec s;
        s.pooled_lq = 13;
        s.len_kv = {0, 1, 13, 40, 7, 100};
        s.heads = 4;
        s.heads_kv = 2;
        s.dtype = dtype;
        s.mask = m.mask;
        s.window_left = m.left;
        s.window_right = m.right;
        s.score_mod = mod.kind;
        s.softcap = mod.softcap;
        s.input_range = mod.input_range;
        s.seed = ++seed;
        check_modifier(s);
      }
}

TEST(GpuOracleScoreMod, RepeatedRunsAreBitwiseIdentical) {
  for (const ModCase& mod : kMods) {
    ModSpec s;
    s.len_q = {70, 1, 129, 33};
    s.len_kv = {64, 5, 129, 90};
    s.heads = 4;
    s.heads_kv = 2;
    s.mask = JF_MASK_CAUSAL;
    s.score_mod = mod.kind;
    s.softcap = mod.softcap;
    s.input_range = mod.input_range;
    s.seed = 42;
    SCOPED_TRACE(describe(s));
    ModRun run(s);
    ASSERT_NO_FATAL_FAILURE(run.run_oracle());
    const ModOutputs first = run.download();
    for (int repeat = 0; repeat < 5; ++repeat) {
      ASSERT_NO_FATAL_FAILURE(run.run_oracle());
      const ModOutputs again = run.download();
      EXPECT_EQ(first.out.bytes, again.out.bytes) << "repeat " << repeat;
      EXPECT_EQ(first.lse, again.lse) << "repeat " << repeat;
      EXPECT_EQ(first.dq.bytes, again.dq.bytes) << "repeat " << repeat;
      EXPECT_EQ(first.dk.bytes, again.dk.bytes) << "repeat " << repeat;
      EXPECT_EQ(first.dv.bytes, again.dv.bytes) << "repeat " << repeat;
    }
  }
}

}  // namespace
}  // namespace jagflash
