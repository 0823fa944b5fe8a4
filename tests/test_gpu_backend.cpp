// GPU tests (label "gpu") of the backend reporting and of the portable path: jagflash_query_backend
// names what each call runs on this GPU, the call agrees, and the oracle's device code is the
// image this build promises. In a JAGFLASH_PTX_ONLY build (no SASS in the library) every test of
// this binary runs the oracle from its compute_80 PTX, compiled by the driver: on an H200 that is
// the path an A100, L40 or B200 runs (scripts/gpu-check-ptx.sh).
#include "api/offsets_check_device.hpp"
#include "hopper_served.hpp"
#include "testing/gpu_batch.hpp"

#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <string>

#ifndef JAGFLASH_TEST_PTX_ONLY
#error "tests/CMakeLists.txt defines JAGFLASH_TEST_PTX_ONLY and JAGFLASH_TEST_PORTABLE_PTX"
#endif

namespace jagflash {
namespace {

using testing::BatchSpec;
using testing::GpuBatch;

int compute_capability() {
  int device = 0, major = 0, minor = 0;
  EXPECT_EQ(cudaGetDevice(&device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), cudaSuccess);
  EXPECT_EQ(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), cudaSuccess);
  return major * 10 + minor;
}

BatchSpec small_spec(jf_dtype dtype, int head_dim) {
  BatchSpec s;
  s.len_q = {5, 0, 70, 33};
  s.len_kv = {9, 4, 70, 1};
  s.heads = 4;
  s.heads_kv = 2;
  s.head_dim = head_dim;
  s.dtype = dtype;
  s.mask = JF_MASK_CAUSAL;
  s.seed = 11 + head_dim + dtype;
  return s;
}

jf_backend query(const GpuBatch& g, jf_backend requested, jf_direction direction) {
  jf_problem p = g.problem();
  jf_launch l{};
  l.backend = requested;
  jf_backend served = JF_BACKEND_AUTO;
  EXPECT_EQ(jagflash_query_backend(&p, &l, direction, &served), JF_OK) << jagflash_last_error();
  return served;
}

// What the README's table promises for AUTO on this GPU and build: the Hopper kernels on a compute
// capability 9.0 GPU where this build instantiates them (a full build: bf16 and fp16 at 64, 128
// and 256, both directions: cmake/hopper_kernels.cmake), else the oracle.
jf_backend expected_auto(jf_dtype dtype, int head_dim, jf_direction direction) {
  const bool hopper_gpu = compute_capability() == 90 && !JAGFLASH_TEST_PTX_ONLY;
  return hopper_gpu && testing::registry_serves(direction, {dtype, head_dim}) ? JF_BACKEND_HOPPER
                                                                              : JF_BACKEND_ORACLE;
}

// The oracle's image on this device: in a PTX-only build (or on any GPU but compute capability
// 9.0) it was compiled from the compute_80 PTX; with sm_90a SASS in the library an H200 runs that.
TEST(GpuBackend, OracleRunsFromTheImageThisBuildPromises) {
  cudaFuncAttributes attributes{};
  ASSERT_EQ(detail::portable_image(&attributes), cudaSuccess);
  const int cc = compute_capability();
  std::printf("oracle image on compute capability %d: ptxVersion %d, binaryVersion %d\n", cc,
              attributes.ptxVersion, attributes.binaryVersion);
  EXPECT_EQ(attributes.binaryVersion, cc);
  if (JAGFLASH_TEST_PTX_ONLY || cc != 90)
    EXPECT_EQ(attributes.ptxVersion, JAGFLASH_TEST_PORTABLE_PTX)
        << "expected the driver to compile the portable PTX";
  else
    EXPECT_EQ(attributes.ptxVersion, 90) << "expected the sm_90a SASS on compute capability 9.0";
}

TEST(GpuBackend, QueryNamesWhatServesEachCallAndTheCallsAgree) {
  testing::HopperCases cases;
  for (jf_dtype dtype : {JF_BF16, JF_FP16, JF_FP32})
    for (int head_dim : {64, 128, 256}) {
      if (!cases.oracle_has(dtype, head_dim)) continue;  // AUTO's fallback: the call would be refused
      SCOPED_TRACE(std::string("dtype=") + std::to_string(dtype) + " D=" + std::to_string(head_dim));
      GpuBatch g = testing::make_gpu_batch(small_spec(dtype, head_dim));
      for (jf_direction d : {JF_DIRECTION_FORWARD, JF_DIRECTION_BACKWARD}) {
        const jf_backend want = expected_auto(dtype, head_dim, d);
        EXPECT_EQ(query(g, JF_BACKEND_AUTO, d), want) << jagflash_backend_name(want) << " expected";
        EXPECT_EQ(query(g, JF_BACKEND_ORACLE, d), JF_BACKEND_ORACLE);
        jf_problem p = g.problem();
        jf_launch l{};
        l.backend = JF_BACKEND_HOPPER;
        jf_backend served = JF_BACKEND_AUTO;
        const jf_status st = jagflash_query_backend(&p, &l, d, &served);
        if (want == JF_BACKEND_HOPPER) {
          EXPECT_EQ(st, JF_OK) << jagflash_last_error();
          EXPECT_EQ(served, JF_BACKEND_HOPPER);
        } else {
          EXPECT_EQ(st, JF_ERR_UNSUPPORTED);
          EXPECT_NE(std::string(jagflash_last_error()).find("launch.backend"), std::string::npos)
              << jagflash_last_error();
          EXPECT_EQ(served, JF_BACKEND_AUTO) << "a failed query wrote *served";
        }
      }
      // The call the query described runs and matches the CPU reference (in a PTX-only build:
      // the JIT-compiled oracle, every dtype and head dim).
      const jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
      const jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
      ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
      ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const testing::SampleCheck c = testing::check_sample_against_reference(g, {0, 1, 2, 3}, true);
      EXPECT_TRUE(c.finite);
      EXPECT_LE(c.out_rel, testing::forward_tolerance(dtype));
      EXPECT_LE(c.dq_rel, testing::backward_tolerance(dtype));
      EXPECT_LE(c.dk_rel, testing::backward_tolerance(dtype));
      EXPECT_LE(c.dv_rel, testing::backward_tolerance(dtype));
    }
  JF_REPORT_UNSERVED(cases);
}

// jagflash_query_kernel: the head dim of the kernel that serves a call (on an sm_90 GPU the
// narrowest Hopper kernel at or above it per direction; elsewhere the oracle at q's own).
TEST(GpuBackend, KernelQueryNamesTheKernelThatServes) {
  const bool hopper_gpu = compute_capability() == 90 && !JAGFLASH_TEST_PTX_ONLY;
  testing::HopperCases built_cases;
  struct Case {
    int d, dv;
    jf_direction dir;
    int hopper_kernel;
  } cases[] = {
      {64, 64, JF_DIRECTION_FORWARD, 64},     {80, 80, JF_DIRECTION_FORWARD, 96},
      {80, 80, JF_DIRECTION_BACKWARD, 96},    {96, 96, JF_DIRECTION_BACKWARD, 96},
      {112, 112, JF_DIRECTION_BACKWARD, 128}, {160, 160, JF_DIRECTION_FORWARD, 192},
      {160, 160, JF_DIRECTION_BACKWARD, 192}, {192, 192, JF_DIRECTION_BACKWARD, 192},
      {192, 128, JF_DIRECTION_BACKWARD, 192}, {200, 200, JF_DIRECTION_BACKWARD, 256},
      {256, 256, JF_DIRECTION_BACKWARD, 256}, {256, 256, JF_DIRECTION_FORWARD, 256},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("D=" + std::to_string(c.d) + " Dv=" + std::to_string(c.dv) +
                 " dir=" + std::to_string(c.dir));
    BatchSpec s = small_spec(JF_BF16, c.d);
    s.v_head_dim = c.dv;
    GpuBatch g = testing::make_gpu_batch(s);
    jf_problem p = g.problem();
    jf_launch l{};
    jf_backend served = JF_BACKEND_AUTO;
    int32_t kernel = 0;
    const jf_status st = jagflash_query_kernel(&p, &l, c.dir, &served, &kernel);
    if (!hopper_gpu) {  // the oracle: 64/128/256 with v's the same only
      if (st == JF_OK) {
        EXPECT_EQ(served, JF_BACKEND_ORACLE);
        EXPECT_EQ(kernel, c.d);
      }
      continue;
    }
    // A trimmed build may serve the case with another kernel than a full one (no 96 or 192), or none.
    const testing::HopperCall call{JF_BF16, c.d, c.dv};
    const int built = testing::registry_kernel_head_dim(c.dir, call);
    if (built != c.hopper_kernel) {
      built_cases.skip(testing::describe(call) + (c.dir == JF_DIRECTION_FORWARD ? " forward" : " backward") +
                       ": a full build runs the " + std::to_string(c.hopper_kernel) + " kernel, this one " +
                       (built == 0 ? std::string("none") : "the " + std::to_string(built)));
      continue;
    }
    built_cases.serve_in(c.dir, call);  // counted as run
    ASSERT_EQ(st, JF_OK) << jagflash_last_error();
    EXPECT_EQ(served, JF_BACKEND_HOPPER);
    EXPECT_EQ(kernel, c.hopper_kernel);
  }
  JF_REPORT_UNSERVED(built_cases);
}

}  // namespace
}  // namespace jagflash
