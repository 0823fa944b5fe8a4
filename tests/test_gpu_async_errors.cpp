// GPU tests (label "gpu") of what a call costs and reports without syncing: the pointer-location
// queries a call makes (one per distinct allocation, none when the caller vouches), and the
// device offsets check's asynchronous report (nothing written by the bad call, the next call on
// the device fails with the bad call's message and runs nothing, the one after succeeds).
#include "api/validate.hpp"
#include "testing/gpu_batch.hpp"

#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace jagflash {
namespace {

using testing::BatchSpec;
using testing::DeviceBuffer;
using testing::GpuBatch;

constexpr int32_t kHeads = 2;
constexpr int32_t kHeadDim = 64;
constexpr size_t kBf16 = 2;

jf_tensor view(void* data, int64_t rows, int64_t row_stride) {
  return jf_tensor{data, rows, kHeads, kHeadDim, row_stride, kHeadDim};
}

char* at(const DeviceBuffer& b, size_t bytes) { return b.as<char>() + bytes; }

// q, k and v as views of one fused [T, 3, H, D] allocation, as a model's qkv projection gives them;
// the offsets (q's and kv's the same vector) in one allocation; out and lse in one; the gradients
// in one.
struct FusedCall {
  static constexpr int64_t kRows = 8;  // lengths 5, 3
  static constexpr int64_t kRowStride = 3 * kHeads * kHeadDim;
  DeviceBuffer qkv{kRows * kRowStride * kBf16};
  DeviceBuffer dgrads{3 * kRows * kHeads * kHeadDim * kBf16};
  DeviceBuffer offsets = DeviceBuffer::from_host(std::vector<int32_t>{0, 5, 8});
  // out at 0, lse from byte 4096 (its H * T floats).
  DeviceBuffer out_lse{4096 + kHeads * kRows * sizeof(float)};
  DeviceBuffer dout{kRows * kHeads * kHeadDim * kBf16};
  DeviceBuffer workspace;
  jf_problem problem{};

  FusedCall() {
    testing::cuda_check(cudaMemset(qkv.get(), 0, qkv.bytes()), "qkv");
    testing::cuda_check(cudaMemset(dout.get(), 0, dout.bytes()), "dout");
    testing::cuda_check(cudaMemset(out_lse.get(), 0, out_lse.bytes()), "out, lse");
    problem.dtype = JF_BF16;
    problem.device = JF_DEVICE_CUDA;
    problem.batch_size = 2;
    problem.q_offsets = problem.kv_offsets = offsets.as<int32_t>();
    const size_t head_bytes = kHeads * kHeadDim * kBf16;
    problem.q = view(at(qkv, 0), kRows, kRowStride);
    problem.k = view(at(qkv, head_bytes), kRows, kRowStride);
    problem.v = view(at(qkv, 2 * head_bytes), kRows, kRowStride);
    problem.mask = JF_MASK_CAUSAL;
    problem.window_left = problem.window_right = -1;
  }
  jf_fwd_args forward() const {
    jf_fwd_args a{};
    a.problem = problem;
    a.out = view(out_lse.get(), kRows, kHeads * kHeadDim);
    a.lse = reinterpret_cast<float*>(at(out_lse, 4096));
    return a;
  }
  jf_bwd_args backward() const {
    jf_bwd_args a{};
    a.problem = problem;
    a.out = view(out_lse.get(), kRows, kHeads * kHeadDim);
    a.lse = reinterpret_cast<const float*>(at(out_lse, 4096));
    a.dout = view(dout.get(), kRows, kHeads * kHeadDim);
    // dq, dk, dv: dense views one after the other in one allocation.
    const size_t tensor_bytes = kRows * kHeads * kHeadDim * kBf16;
    a.dq = view(at(dgrads, 0), kRows, kHeads * kHeadDim);
    a.dk = view(at(dgrads, tensor_bytes), kRows, kHeads * kHeadDim);
    a.dv = view(at(dgrads, 2 * tensor_bytes), kRows, kHeads * kHeadDim);
    return a;
  }
  template <class Args>
  void attach_workspace(Args& a, size_t bytes) {
    if (workspace.bytes() < bytes) workspace = DeviceBuffer(bytes);
    a.launch.workspace = workspace.get();
    a.launch.workspace_bytes = bytes;
  }
};

uint64_t queries_since(uint64_t before) { return detail::pointer_location_queries() - before; }

TEST(GpuPointerQueries, OnePerDistinctAllocationAndNoneWhenVouched) {
  FusedCall call;
  jf_fwd_args fa = call.forward();
  size_t bytes = 0;
  uint64_t before = detail::pointer_location_queries();
  ASSERT_EQ(jagflash_fwd_workspace_size(&fa, &bytes), JF_OK) << jagflash_last_error();
  EXPECT_EQ(queries_since(before), 3u) << "qkv, offsets, out+lse: one query each";
  call.attach_workspace(fa, bytes);
  before = detail::pointer_location_queries();
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  EXPECT_EQ(queries_since(before), 4u) << "qkv, offsets, out+lse, workspace (22 runtime queries per "
                                          "Python forward before, size query included)";
  fa.launch.caller_checked_pointers = 1;
  before = detail::pointer_location_queries();
  ASSERT_EQ(jagflash_fwd_workspace_size(&fa, &bytes), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  EXPECT_EQ(queries_since(before), 0u);

  jf_bwd_args ba = call.backward();
  ASSERT_EQ(jagflash_bwd_workspace_size(&ba, &bytes), JF_OK) << jagflash_last_error();
  call.attach_workspace(ba, bytes);
  before = detail::pointer_location_queries();
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  EXPECT_EQ(queries_since(before), 6u) << "qkv, offsets, out+lse, dout, dq+dk+dv, workspace";
  ba.launch.caller_checked_pointers = -1;  // any non-zero value vouches
  before = detail::pointer_location_queries();
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  EXPECT_EQ(queries_since(before), 0u);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

TEST(GpuPointerQueries, HostPointersAreStillRefusedWithTheSameMessage) {
  FusedCall call;
  jf_fwd_args fa = call.forward();
  size_t bytes = 0;
  ASSERT_EQ(jagflash_fwd_workspace_size(&fa, &bytes), JF_OK) << jagflash_last_error();
  call.attach_workspace(fa, bytes);
  // A host lse after device tensors (the cache of known ranges must not answer for it).
  std::vector<float> host_lse(kHeads * FusedCall::kRows);
  fa.lse = host_lse.data();
  EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("lse: expected a CUDA device pointer"), std::string::npos)
      << jagflash_last_error();
  // A host pointer inside no allocation at all, for a view whose neighbour is device memory.
  fa = call.forward();
  call.attach_workspace(fa, bytes);
  std::vector<uint16_t> host_v(FusedCall::kRows * FusedCall::kRowStride);
  fa.problem.v.data = host_v.data();
  EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("problem.v.data: expected a CUDA device pointer"),
            std::string::npos)
      << jagflash_last_error();
}

// --- Asynchronous report of the device offsets check --------------------------------------------

std::vector<uint8_t> bytes_of(const DeviceBuffer& b) {
  std::vector<uint8_t> host(b.bytes());
  b.to_host(host.data());
  return host;
}

struct Snapshot {
  std::vector<uint8_t> out, lse, dq, dk, dv;
  explicit Snapshot(const GpuBatch& g)
      : out(bytes_of(g.out)),
        lse(bytes_of(g.lse)),
        dq(bytes_of(g.dq)),
        dk(bytes_of(g.dk)),
        dv(bytes_of(g.dv)) {}
  bool operator==(const Snapshot& o) const {
    return out == o.out && lse == o.lse && dq == o.dq && dk == o.dk && dv == o.dv;
  }
};

GpuBatch async_batch() {
  BatchSpec s;
  s.len_q = {4, 9, 2};
  s.len_kv = {7, 1, 6};
  s.heads = 2;
  s.heads_kv = 1;
  s.head_dim = 64;
  s.mask = JF_MASK_CAUSAL;
  return testing::make_gpu_batch(s);  // outputs poisoned with NaN
}

void set_q_offsets(GpuBatch& g, const std::vector<int32_t>& offsets) {
  testing::cuda_check(
      cudaMemcpy(g.d_q_offsets.get(), offsets.data(), offsets.size() * 4, cudaMemcpyHostToDevice),
      "q offsets");
}

const std::vector<int32_t> kGoodQ = {0, 4, 13, 15};
const std::vector<int32_t> kDecreasingQ = {0, 9, 4, 15};
constexpr const char* kEarlier = "an earlier jagflash call on CUDA device ";
constexpr const char* kDecreasingText = "problem.q_offsets: expected non-decreasing values";

bool message_has(const char* part) {
  return std::string(jagflash_last_error()).find(part) != std::string::npos;
}

// Any earlier test's unreported failure would fail the first call of these tests: start clean.
void drain_latch() {
  (void)jagflash_synchronize(nullptr);
  ASSERT_EQ(jagflash_synchronize(nullptr), JF_OK) << jagflash_last_error();
}

TEST(GpuAsyncOffsetsErrors, ForwardWritesNothingAndTheNextCallReportsIt) {
  drain_latch();
  GpuBatch g = async_batch();
  const Snapshot poisoned(g);
  jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
  fa.launch.offsets_check = ba.launch.offsets_check = JF_CHECK_OFFSETS_DEVICE;

  set_q_offsets(g, kDecreasingQ);
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();  // no sync: it cannot know yet
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(Snapshot(g) == poisoned) << "the bad forward wrote an output";

  // The next call, itself valid, fails with the earlier call's message and runs nothing.
  set_q_offsets(g, kGoodQ);
  EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(message_has(kEarlier)) << jagflash_last_error();
  EXPECT_TRUE(message_has(kDecreasingText)) << jagflash_last_error();
  EXPECT_TRUE(message_has("the call failed a check on the device (nothing was written)"))
      << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(Snapshot(g) == poisoned) << "the call that reported the earlier failure ran";

  // Reported once: the call after runs.
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_read_device_error(fa.launch.workspace, nullptr), JF_OK) << jagflash_last_error();
  EXPECT_FALSE(Snapshot(g).out == poisoned.out) << "the good forward wrote nothing";
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  ASSERT_EQ(jagflash_synchronize(nullptr), JF_OK) << jagflash_last_error();
}

TEST(GpuAsyncOffsetsErrors, BackwardWritesNothingAndAForwardInHostModeReportsIt) {
  drain_latch();
  GpuBatch g = async_batch();
  jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();  // a real lse for the backward
  ba.launch.offsets_check = JF_CHECK_OFFSETS_DEVICE;
  testing::fill_buffer(g.dq.get(), g.dq.bytes() / 2, JF_BF16, NAN);
  testing::fill_buffer(g.dk.get(), g.dk.bytes() / 2, JF_BF16, NAN);
  testing::fill_buffer(g.dv.get(), g.dv.bytes() / 2, JF_BF16, NAN);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Snapshot before(g);

  set_q_offsets(g, kDecreasingQ);
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(Snapshot(g) == before) << "the bad backward wrote a gradient";

  // Any direction and any offsets_check: a host-checked forward (valid) reports it.
  set_q_offsets(g, kGoodQ);
  fa.launch.offsets_check = JF_CHECK_OFFSETS_HOST;
  EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(message_has(kEarlier)) << jagflash_last_error();
  EXPECT_TRUE(message_has(kDecreasingText)) << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(Snapshot(g) == before) << "the call that reported the earlier failure ran";
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_FALSE(Snapshot(g).dq == before.dq) << "the good backward wrote nothing";
}

TEST(GpuAsyncOffsetsErrors, SynchronizeAndReadDeviceErrorReportOnce) {
  drain_latch();
  GpuBatch g = async_batch();
  jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  fa.launch.offsets_check = JF_CHECK_OFFSETS_DEVICE;
  set_q_offsets(g, kDecreasingQ);
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  EXPECT_EQ(jagflash_synchronize(nullptr), JF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(message_has(kEarlier)) << jagflash_last_error();
  EXPECT_TRUE(message_has(kDecreasingText)) << jagflash_last_error();
  EXPECT_EQ(jagflash_synchronize(nullptr), JF_OK) << jagflash_last_error();
  // read_device_error reports the workspace's flag (again, it is still there) and clears the
  // latch, so the next call does not report the same failure a second time.
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  EXPECT_EQ(jagflash_read_device_error(fa.launch.workspace, nullptr), JF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(message_has(kDecreasingText)) << jagflash_last_error();
  EXPECT_FALSE(message_has(kEarlier)) << jagflash_last_error();
  set_q_offsets(g, kGoodQ);
  EXPECT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  EXPECT_EQ(jagflash_synchronize(nullptr), JF_OK) << jagflash_last_error();
}

TEST(GpuAsyncOffsetsErrors, ACapturedCallLatchesOnReplay) {
  drain_latch();
  GpuBatch g = async_batch();
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  fa.launch.stream = stream;
  fa.launch.offsets_check = JF_CHECK_OFFSETS_DEVICE;
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();  // eager first: the latch exists
  ASSERT_EQ(jagflash_synchronize(stream), JF_OK) << jagflash_last_error();
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  set_q_offsets(g, kDecreasingQ);
  testing::poison_outputs(g);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const Snapshot poisoned(g);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_TRUE(Snapshot(g) == poisoned) << "the replay with bad offsets wrote an output";
  set_q_offsets(g, kGoodQ);
  EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(message_has(kEarlier)) << jagflash_last_error();
  EXPECT_TRUE(message_has(kDecreasingText)) << jagflash_last_error();
  EXPECT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace jagflash
