// The C API and the C++ wrapper over it: version, errors as status + message, workspace
// queries, and a forward/backward through the C entry points on CPU pointers.
#include <jagflash/jagflash.h>
#include <jagflash/jagflash.hpp>

#include "hopper_served.hpp"
#include "reference/reference.hpp"
#include "testing/host_batch.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace jagflash {
namespace {

TEST(CApi, Version) {
  EXPECT_STREQ(jagflash_version(), "0.1.0");
  EXPECT_EQ(jagflash_version_number(),
            JAGFLASH_VERSION_MAJOR * 10000 + JAGFLASH_VERSION_MINOR * 100 + JAGFLASH_VERSION_PATCH);
  EXPECT_EQ(jagflash::version(), "0.1.0");
}

TEST(CApi, NullArgumentsAreErrorsWithMessages) {
  EXPECT_EQ(jagflash_fwd(nullptr), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("args"), std::string::npos);
  EXPECT_EQ(jagflash_bwd(nullptr), JF_ERR_INVALID_ARGUMENT);
  jf_fwd_args a{};
  EXPECT_EQ(jagflash_fwd_workspace_size(&a, nullptr), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("bytes"), std::string::npos);
  EXPECT_EQ(jagflash_read_device_error(nullptr, nullptr), JF_ERR_INVALID_ARGUMENT);
  // A host workspace holds no device flag: an argument error naming it, not a CUDA error.
  std::vector<unsigned char> host_workspace(4096, 0);
  EXPECT_EQ(jagflash_read_device_error(host_workspace.data(), nullptr), JF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(jagflash_last_error()).rfind("workspace: expected device memory", 0), 0u)
      << jagflash_last_error();
}

// Nothing failed before (and without a GPU nothing can have): JF_OK, an empty message.
TEST(CApi, SynchronizeWithNothingToReport) {
  EXPECT_EQ(jagflash_synchronize(nullptr), JF_OK) << jagflash_last_error();
  EXPECT_STREQ(jagflash_last_error(), "");
  EXPECT_NO_THROW(jagflash::synchronize());
}

struct CpuCall {
  test::HostBatch batch;
  test::HostTensor out, dout, dq, dk, dv;
  std::vector<float> lse;
  jf_fwd_args fwd{};
  jf_bwd_args bwd{};

  explicit CpuCall(uint64_t seed) {
    batch = test::make_random_batch({5, 0, 17, 1}, {9, 3, 17, 0}, 4, 2, 64, JF_BF16, seed);
    const int64_t tq = batch.total_q(), tk = batch.total_kv();
    out = test::make_tensor(JF_BF16, tq, 4, 64);
    dout = test::make_tensor(JF_BF16, tq, 4, 64);
    dq = test::make_tensor(JF_BF16, tq, 4, 64);
    dk = test::make_tensor(JF_BF16, tk, 2, 64);
    dv = test::make_tensor(JF_BF16, tk, 2, 64);
    std::mt19937_64 rng(seed + 1);
    dout.fill_random(rng);
    lse.assign(static_cast<size_t>(4 * tq), 0.f);
    fwd = test::forward_args(test::make_problem(batch, JF_MASK_CAUSAL, -1, -1), out, lse.data());
    bwd = test::backward_args(fwd.problem, out, dout, lse.data(), dq, dk, dv);
  }
};

TEST(CApi, CpuForwardBackwardMatchReferenceAndClearError) {
  CpuCall call(11);
  size_t bytes = 123;
  ASSERT_EQ(jagflash_fwd_workspace_size(&call.fwd, &bytes), JF_OK) << jagflash_last_error();
  EXPECT_EQ(bytes, 0u);  // the CPU path needs no workspace
  ASSERT_EQ(jagflash_bwd_workspace_size(&call.bwd, &bytes), JF_OK) << jagflash_last_error();
  EXPECT_EQ(bytes, 0u);
  ASSERT_EQ(jagflash_fwd(nullptr), JF_ERR_INVALID_ARGUMENT);  // leaves a message ...
  ASSERT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();
  EXPECT_STREQ(jagflash_last_error(), "");  // ... which success clears
  ASSERT_EQ(jagflash_bwd(&call.bwd), JF_OK) << jagflash_last_error();

  // The same arguments straight into the reference give the same bytes.
  CpuCall direct(11);
  reference::forward(direct.fwd);
  reference::backward(direct.bwd);
  EXPECT_EQ(call.out.bytes, direct.out.bytes);
  EXPECT_EQ(call.lse, direct.lse);
  EXPECT_EQ(call.dq.bytes, direct.dq.bytes);
  EXPECT_EQ(call.dk.bytes, direct.dk.bytes);
  EXPECT_EQ(call.dv.bytes, direct.dv.bytes);
  // Causal, sequence 2 (Lq = Lk = 17): the first row sees only key 0, so out = v[key 0].
  const int64_t row = call.batch.q_offsets[2], key = call.batch.kv_offsets[2];
  for (int d = 0; d < 64; ++d) EXPECT_EQ(call.out.get(row, 0, d), call.batch.v.get(key, 0, d));
}

// jagflash_query_kernel on the CPU: the reference, at q's head dim (v's narrower or not); it fails
// as jagflash_query_backend does, naming a NULL kernel_head_dim, and writes nothing then. (Which
// Hopper kernel serves a GPU call: tests/test_gpu_backend.cpp.)
TEST(CApi, KernelQueryOnTheCpu) {
  CpuCall call(3);
  for (jf_direction d : {JF_DIRECTION_FORWARD, JF_DIRECTION_BACKWARD})
    for (int32_t head_dim : {8, 80, 192, 256}) {
      jf_problem p = call.fwd.problem;
      p.q.head_dim = p.k.head_dim = head_dim;
      p.v.head_dim = 8;
      p.q.head_stride = p.k.head_stride = p.v.head_stride = head_dim;
      p.q.row_stride = 4 * head_dim;
      p.k.row_stride = p.v.row_stride = 2 * head_dim;
      jf_launch l{};
      jf_backend served = JF_BACKEND_HOPPER;
      int32_t kernel = -1;
      ASSERT_EQ(jagflash_query_kernel(&p, &l, d, &served, &kernel), JF_OK) << jagflash_last_error();
      EXPECT_EQ(served, JF_BACKEND_REFERENCE);
      EXPECT_EQ(kernel, head_dim);
    }
  jf_launch l{};
  jf_backend served = JF_BACKEND_AUTO;
  int32_t kernel = -1;
  EXPECT_EQ(jagflash_query_kernel(&call.fwd.problem, &l, JF_DIRECTION_FORWARD, &served, nullptr),
            JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("kernel_head_dim"), std::string::npos);
  jf_problem bad = call.fwd.problem;
  bad.q.head_dim = 100;
  EXPECT_EQ(jagflash_query_kernel(&bad, &l, JF_DIRECTION_BACKWARD, &served, &kernel), JF_ERR_UNSUPPORTED);
  EXPECT_EQ(served, JF_BACKEND_AUTO);
  EXPECT_EQ(kernel, -1);
}

// jagflash_query_backend on the CPU: the reference serves every CPU call, in both directions and
// for every dtype / head dim (v's too, at or below q's); the query checks the problem and the launch as the
// calls do, and a failed query leaves *served alone. (The GPU half is tests/test_gpu_backend.cpp.)
TEST(CApi, BackendQueryOnTheCpu) {
  CpuCall call(3);
  for (jf_direction d : {JF_DIRECTION_FORWARD, JF_DIRECTION_BACKWARD})
    for (jf_dtype dtype : {JF_BF16, JF_FP16, JF_FP32})
      for (int32_t head_dim : {8, 64, 72, 96, 128, 200, 256})
        for (int32_t v_head_dim : {head_dim, 8}) {
          jf_problem p = call.fwd.problem;
          p.dtype = dtype;  // the views' strides stay valid: only shapes are checked, nothing is read
          p.q.head_dim = p.k.head_dim = head_dim;
          p.v.head_dim = v_head_dim;
          p.q.head_stride = p.k.head_stride = p.v.head_stride = head_dim;
          p.q.row_stride = 4 * head_dim;
          p.k.row_stride = p.v.row_stride = 2 * head_dim;
          jf_launch l{};
          jf_backend served = JF_BACKEND_HOPPER;
          ASSERT_EQ(jagflash_query_backend(&p, &l, d, &served), JF_OK) << jagflash_last_error();
          EXPECT_EQ(served, JF_BACKEND_REFERENCE);
          l.backend = JF_BACKEND_REFERENCE;
          served = JF_BACKEND_AUTO;
          ASSERT_EQ(jagflash_query_backend(&p, &l, d, &served), JF_OK) << jagflash_last_error();
          EXPECT_EQ(served, JF_BACKEND_REFERENCE);
        }
  // The call the query described runs (and clears the error a failed query left).
  jf_backend served = JF_BACKEND_AUTO;
  jf_launch l{};
  l.backend = JF_BACKEND_ORACLE;  // a GPU backend for CPU pointers: refused as jagflash_fwd refuses it
  EXPECT_EQ(jagflash_query_backend(&call.fwd.problem, &l, JF_DIRECTION_FORWARD, &served),
            JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("launch.backend"), std::string::npos)
      << jagflash_last_error();
  EXPECT_EQ(served, JF_BACKEND_AUTO);
  call.fwd.launch.backend = JF_BACKEND_ORACLE;
  EXPECT_EQ(jagflash_fwd(&call.fwd), JF_ERR_INVALID_ARGUMENT);
  call.fwd.launch.backend = JF_BACKEND_AUTO;
  ASSERT_EQ(jagflash_fwd(&call.fwd), JF_OK) << jagflash_last_error();

  jf_problem bad = call.fwd.problem;
  bad.q.head_dim = 100;
  jf_launch auto_launch{};
  EXPECT_EQ(jagflash_query_backend(&bad, &auto_launch, JF_DIRECTION_BACKWARD, &served), JF_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(jagflash_last_error()).find("problem.q.head_dim"), std::string::npos);
  EXPECT_EQ(served, JF_BACKEND_AUTO);

  // NULL pointers and a direction outside the enum (a C caller may pass any int) are named.
  EXPECT_EQ(jagflash_query_backend(nullptr, &auto_launch, JF_DIRECTION_FORWARD, &served),
            JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("problem"), std::string::npos);
  EXPECT_EQ(jagflash_query_backend(&call.fwd.problem, nullptr, JF_DIRECTION_FORWARD, &served),
            JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("launch"), std::string::npos);
  EXPECT_EQ(jagflash_query_backend(&call.fwd.problem, &auto_launch, JF_DIRECTION_FORWARD, nullptr),
            JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("served"), std::string::npos);
  jf_direction odd{};
  const int seven = 7;
  std::memcpy(&odd, &seven, sizeof odd);
  EXPECT_EQ(jagflash_query_backend(&call.fwd.problem, &auto_launch, odd, &served), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error())
                .find("direction: expected JF_DIRECTION_FORWARD or "
                      "JF_DIRECTION_BACKWARD, got 7"),
            std::string::npos)
      << jagflash_last_error();
  EXPECT_EQ(served, JF_BACKEND_AUTO);
}

// jagflash_hopper_kernel: the registry's answer (the one the GPU tests ask through hopper_served.hpp),
// asked of no device; 0 throughout in a build without the Hopper kernels.
TEST(CApi, HopperKernelIsTheRegistrysAnswer) {
  for (jf_direction d : {JF_DIRECTION_FORWARD, JF_DIRECTION_BACKWARD})
    for (jf_dtype dtype : {JF_BF16, JF_FP16, JF_FP32})
      for (int head_dim : {8, 64, 80, 128, 160, 192, 256, 264})
        for (int v_head_dim : {0, 64})
          for (jf_score_mod mod :
               {JF_SCORE_MOD_NONE, JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI, JF_SCORE_MOD_RELATIVE_BIAS})
            for (int sparse : {0, 1}) {
              int32_t got = -1;
              ASSERT_EQ(jagflash_hopper_kernel(d, dtype, head_dim, v_head_dim, mod, sparse, &got), JF_OK)
                  << jagflash_last_error();
              const testing::HopperCall call{dtype, head_dim, v_head_dim, mod, sparse != 0};
              EXPECT_EQ(got, testing::registry_kernel_head_dim(d, call)) << testing::describe(call);
            }
  int32_t got = -1;
  const int seven = 7;
  jf_direction odd_direction{};
  std::memcpy(&odd_direction, &seven, sizeof odd_direction);
  EXPECT_EQ(jagflash_hopper_kernel(odd_direction, JF_BF16, 128, 0, JF_SCORE_MOD_NONE, 0, &got),
            JF_ERR_INVALID_ARGUMENT);
  jf_dtype odd_dtype{};
  std::memcpy(&odd_dtype, &seven, sizeof odd_dtype);
  EXPECT_EQ(jagflash_hopper_kernel(JF_DIRECTION_FORWARD, odd_dtype, 128, 0, JF_SCORE_MOD_NONE, 0, &got),
            JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("dtype: expected JF_BF16, JF_FP16 or JF_FP32, got 7"),
            std::string::npos)
      << jagflash_last_error();
  jf_score_mod odd_mod{};
  std::memcpy(&odd_mod, &seven, sizeof odd_mod);
  EXPECT_EQ(jagflash_hopper_kernel(JF_DIRECTION_FORWARD, JF_BF16, 128, 0, odd_mod, 0, &got),
            JF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(jagflash_hopper_kernel(JF_DIRECTION_FORWARD, JF_BF16, 128, 0, JF_SCORE_MOD_NONE, 0, nullptr),
            JF_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(got, -1);  // nothing written on a failure
}

TEST(CApi, BackendNames) {
  EXPECT_STREQ(jagflash_backend_name(JF_BACKEND_AUTO), "auto");
  EXPECT_STREQ(jagflash_backend_name(JF_BACKEND_REFERENCE), "reference");
  EXPECT_STREQ(jagflash_backend_name(JF_BACKEND_ORACLE), "oracle");
  EXPECT_STREQ(jagflash_backend_name(JF_BACKEND_HOPPER), "hopper");
  jf_backend odd{};
  const int nine = 9;
  std::memcpy(&odd, &nine, sizeof odd);
  EXPECT_STREQ(jagflash_backend_name(odd), "unknown");
}

TEST(CppApi, QueryBackend) {
  CpuCall call(5);
  jf_launch l{};
  EXPECT_EQ(jagflash::query_backend(call.bwd.problem, l, JF_DIRECTION_BACKWARD), JF_BACKEND_REFERENCE);
  l.backend = JF_BACKEND_HOPPER;
  try {
    jagflash::query_backend(call.fwd.problem, l, JF_DIRECTION_FORWARD);
    ADD_FAILURE() << "JF_BACKEND_HOPPER on CPU pointers was accepted";
  } catch (const jagflash::Error& e) {
    EXPECT_EQ(e.status(), JF_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("launch.backend"), std::string::npos) << e.what();
  }
}

TEST(CppApi, ThrowsErrorWithStatusAndMessage) {
  CpuCall call(3);
  call.fwd.problem.q.head_dim = 100;
  try {
    jagflash::forward(call.fwd);
    FAIL() << "expected jagflash::Error";
  } catch (const jagflash::Error& e) {
    EXPECT_EQ(e.status(), JF_ERR_UNSUPPORTED);
    EXPECT_NE(std::string(e.what()).find("head_dim"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("100"), std::string::npos) << e.what();
  }
  EXPECT_EQ(jagflash::forward_workspace_size(CpuCall(3).fwd), 0u);
}

// DeepSeek's head dims (q, k 192; v 128) through the wrapper's helpers on CPU pointers: out, dout
// and dv [.., 128], the same bytes as the reference called directly; on CUDA the head dims pass
// validation (the Hopper forward serves them, on a GPU).
TEST(CppApi, VHeadDimOfItsOwnThroughTheWrapper) {
  constexpr int kD = 192, kDv = 128, kH = 4, kHkv = 2;
  const std::vector<int32_t> q_offsets = {0, 5, 5, 22}, kv_offsets = {0, 9, 12, 29};
  const int64_t tq = q_offsets.back(), tk = kv_offsets.back();
  std::mt19937_64 rng(41);
  test::HostTensor q = test::make_tensor(JF_BF16, tq, kH, kD), k = test::make_tensor(JF_BF16, tk, kHkv, kD);
  test::HostTensor v = test::make_tensor(JF_BF16, tk, kHkv, kDv),
                   dout = test::make_tensor(JF_BF16, tq, kH, kDv);
  for (test::HostTensor* t : {&q, &k, &v, &dout}) t->fill_random(rng);
  struct Outputs {
    test::HostTensor out, dq, dk, dv;
    std::vector<float> lse;
  };
  auto outputs = [&] {
    return Outputs{test::make_tensor(JF_BF16, tq, kH, kDv), test::make_tensor(JF_BF16, tq, kH, kD),
                   test::make_tensor(JF_BF16, tk, kHkv, kD), test::make_tensor(JF_BF16, tk, kHkv, kDv),
                   std::vector<float>(static_cast<size_t>(kH * tq))};
  };
  auto args = [&](Outputs& o, jf_fwd_args& fwd, jf_bwd_args& bwd) {
    jf_problem p = jagflash::make_problem(JF_BF16, JF_DEVICE_CPU, 3, q_offsets.data(), kv_offsets.data(),
                                          jagflash::tensor_view(q.bytes.data(), tq, kH, kD),
                                          jagflash::tensor_view(k.bytes.data(), tk, kHkv, kD),
                                          jagflash::tensor_view(v.bytes.data(), tk, kHkv, kDv));
    jagflash::set_causal(p);
    fwd = jf_fwd_args{};
    fwd.problem = p;
    fwd.out = jagflash::tensor_view(o.out.bytes.data(), tq, kH, kDv);
    fwd.lse = o.lse.data();
    bwd = jf_bwd_args{};
    bwd.problem = p;
    bwd.out = fwd.out;
    bwd.dout = jagflash::tensor_view(dout.bytes.data(), tq, kH, kDv);
    bwd.lse = o.lse.data();
    bwd.dq = jagflash::tensor_view(o.dq.bytes.data(), tq, kH, kD);
    bwd.dk = jagflash::tensor_view(o.dk.bytes.data(), tk, kHkv, kD);
    bwd.dv = jagflash::tensor_view(o.dv.bytes.data(), tk, kHkv, kDv);
  };
  Outputs api = outputs(), direct = outputs();
  jf_fwd_args fwd{}, direct_fwd{};
  jf_bwd_args bwd{}, direct_bwd{};
  args(api, fwd, bwd);
  args(direct, direct_fwd, direct_bwd);
  EXPECT_EQ(jagflash::query_backend(fwd.problem, fwd.launch, JF_DIRECTION_FORWARD), JF_BACKEND_REFERENCE);
  EXPECT_EQ(jagflash::forward_workspace_size(fwd), 0u);
  EXPECT_EQ(jagflash::backward_workspace_size(bwd), 0u);
  jagflash::forward(fwd);
  jagflash::backward(bwd);
  reference::forward(direct_fwd);
  reference::backward(direct_bwd);
  EXPECT_EQ(api.out.bytes, direct.out.bytes);
  EXPECT_EQ(api.lse, direct.lse);
  EXPECT_EQ(api.dq.bytes, direct.dq.bytes);
  EXPECT_EQ(api.dk.bytes, direct.dk.bytes);
  EXPECT_EQ(api.dv.bytes, direct.dv.bytes);
  // Causal, sequence 2 (Lq = Lk = 17): its first row sees only its first key, so out = v there.
  for (int d = 0; d < kDv; ++d) EXPECT_EQ(api.out.get(5, 1, d), v.get(12, 0, d));

  // On CUDA a v head dim of its own passes validation (which call serves it, the Hopper forward's
  // padded kernels, is the dispatcher's to say, on a GPU: test_gpu_head_dims.cpp): without a GPU the
  // wrapper throws for the missing device, never for the head dim.
  for (const auto& [d, dv] : {std::pair<int, int>{kD, kDv}, std::pair<int, int>{128, 64}}) {
    jf_problem p = fwd.problem;
    p.device = JF_DEVICE_CUDA;
    p.q.head_dim = p.k.head_dim = d;
    p.v.head_dim = dv;
    if (jagflash_cuda_device_count() > 0) continue;  // a GPU machine: GpuHeadDims.NarrowerVForward
    try {
      jagflash::query_backend(p, jf_launch{}, JF_DIRECTION_FORWARD);
      ADD_FAILURE() << d << "/" << dv << " on CUDA without a GPU was accepted";
    } catch (const jagflash::Error& e) {
      EXPECT_EQ(std::string(e.what()).find("head_dim"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).rfind("problem.device: expected ", 0), 0u) << e.what();
    }
  }
}

// set_softcap / set_alibi through the wrapper: the same bytes as the reference called directly on
// the same problem, the modifier changes the result, one kind clears the other's field, and on
// CUDA the modifier passes validation (the call fails on its host pointers, not on the modifier).
TEST(CppApi, ScoreModifiersThroughTheWrapper) {
  constexpr int kH = 4, kHkv = 2, kD = 64;
  const std::vector<int32_t> q_offsets = {0, 5, 5, 22}, kv_offsets = {0, 7, 9, 26};
  const int64_t tq = q_offsets.back(), tk = kv_offsets.back();
  std::mt19937_64 rng(43);
  test::HostTensor q = test::make_tensor(JF_FP32, tq, kH, kD), k = test::make_tensor(JF_FP32, tk, kHkv, kD);
  test::HostTensor v = test::make_tensor(JF_FP32, tk, kHkv, kD);
  for (test::HostTensor* t : {&q, &k, &v}) t->fill_random(rng);
  const std::vector<float> slopes = {0.5f, 0.25f, 1.0f, 2.0f};
  auto run = [&](jf_problem p, bool through_wrapper) {
    test::HostTensor out = test::make_tensor(JF_FP32, tq, kH, kD);
    jf_fwd_args fwd{};
    fwd.problem = p;
    fwd.out = jagflash::tensor_view(out.bytes.data(), tq, kH, kD);
    if (through_wrapper)
      jagflash::forward(fwd);
    else
      reference::forward(fwd);
    return out.bytes;
  };
  const jf_problem plain = jagflash::make_problem(
      JF_FP32, JF_DEVICE_CPU, 3, q_offsets.data(), kv_offsets.data(),
      jagflash::tensor_view(q.bytes.data(), tq, kH, kD), jagflash::tensor_view(k.bytes.data(), tk, kHkv, kD),
      jagflash::tensor_view(v.bytes.data(), tk, kHkv, kD));
  jf_problem capped = plain, biased = plain;
  jagflash::set_alibi(capped, slopes.data());
  jagflash::set_softcap(capped, 0.5f);
  EXPECT_EQ(capped.score_mod, JF_SCORE_MOD_SOFTCAP);
  EXPECT_EQ(capped.alibi_slopes, nullptr);
  jagflash::set_softcap(biased, 0.5f);
  jagflash::set_alibi(biased, slopes.data());
  EXPECT_EQ(biased.score_mod, JF_SCORE_MOD_ALIBI);
  EXPECT_EQ(biased.softcap, 0.0f);
  const auto plain_out = run(plain, true);
  for (const jf_problem* p : {&capped, &biased}) {
    const auto got = run(*p, true);
    EXPECT_EQ(got, run(*p, false));
    EXPECT_NE(got, plain_out);
    jf_problem on_cuda = *p;
    on_cuda.device = JF_DEVICE_CUDA;
    try {  // served on CUDA too: refused here for the host pointers (or no GPU), not the modifier
      jagflash::query_backend(on_cuda, jf_launch{}, JF_DIRECTION_FORWARD);
      ADD_FAILURE() << "a CUDA problem over host memory was accepted";
    } catch (const jagflash::Error& e) {
      EXPECT_EQ(e.status(), JF_ERR_INVALID_ARGUMENT);
      EXPECT_EQ(std::string(e.what()).find("score_mod"), std::string::npos) << e.what();
    }
  }
}

TEST(CppApi, HelpersBuildValidViews) {
  const jf_tensor t = jagflash::tensor_view(nullptr, 10, 4, 64);
  EXPECT_EQ(t.head_stride, 64);
  EXPECT_EQ(t.row_stride, 256);
  const jf_tensor s = jagflash::tensor_view(nullptr, 10, 4, 64, 3 * 256);  // a slice of fused QKV
  EXPECT_EQ(s.row_stride, 768);
  jf_problem p = jagflash::make_problem(JF_BF16, JF_DEVICE_CPU, 0, nullptr, nullptr, t, t, t);
  jagflash::set_window(p, 8, 0);
  EXPECT_EQ(p.mask, JF_MASK_WINDOW);
  EXPECT_EQ(p.window_left, 8);
  jagflash::set_causal(p);
  EXPECT_EQ(p.mask, JF_MASK_CAUSAL);
  EXPECT_EQ(p.window_left, -1);
  const std::vector<int32_t> lengths = jagflash::generate_lengths("onegiant", 1);
  ASSERT_EQ(lengths.size(), 256u);
  EXPECT_EQ(lengths[0], 16384);
  EXPECT_THROW(jagflash::generate_lengths("nosuch", 1), jagflash::Error);
}

}  // namespace
}  // namespace jagflash
