// GPU tests (label "gpu"): the GPU path against the CPU float64 reference on awkward jagged
// batches and on the five benchmark distributions scaled down; poisoned outputs, row padding,
// device-side offsets checks, CUDA-graph capture with new offsets, and repeatability.
#include "gen/distributions.hpp"
#include "testing/gpu_batch.hpp"

#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
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
  for (int d : {128, 256})
    for (const MaskCase& m : {kMasks[0], kMasks[1]}) {
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
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("JF_CHECK_OFFSETS_DEVICE"), std::string::npos);
  fa.launch.offsets_check = ba.launch.offsets_check = JF_CHECK_OFFSETS_DEVICE;
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
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

}  // namespace
}  // namespace jagflash
