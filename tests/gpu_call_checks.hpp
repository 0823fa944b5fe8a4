// Shared by the GPU tests of the call variants (score modifiers, padded head dims): the awkward
// batch they all run, which backend AUTO picks, one AUTO forward (+ backward) call, the
// comparison of its results with the CPU float64 reference, and the deterministic mode's repeats.
#pragma once

#include "hopper_served.hpp"
#include "testing/gpu_batch.hpp"

#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace jagflash::testing {

// Every sequence ending inside a tile, lengths 0, 1 and 2, q != kv, GQA, row padding; a window
// (40, 7) with JF_MASK_WINDOW.
inline BatchSpec awkward_batch(int head_dim, jf_dtype dtype, jf_mask mask, uint64_t seed) {
  BatchSpec s;
  s.len_q = {1, 63, 65, 200, 0, 2, 130};
  s.len_kv = {2, 64, 63, 257, 5, 0, 130};
  s.heads = 4;
  s.heads_kv = 2;
  s.head_dim = head_dim;
  s.dtype = dtype;
  s.mask = mask;
  if (mask == JF_MASK_WINDOW) {
    s.window_left = 40;
    s.window_right = 7;
  }
  s.row_pad = 8;
  s.seed = seed;
  return s;
}

inline jf_backend served_by(const GpuBatch& g, jf_direction direction) {
  const jf_problem p = g.problem();
  jf_launch l{};
  jf_backend b = JF_BACKEND_AUTO;
  EXPECT_EQ(jagflash_query_backend(&p, &l, direction, &b), JF_OK) << jagflash_last_error();
  return b;
}

// One AUTO forward (and with_backward, backward in the given mode) on g, AUTO expected to pick
// the Hopper kernels; synchronised.
inline void run_on_hopper(GpuBatch& g, bool with_backward, int deterministic = 0) {
  EXPECT_EQ(served_by(g, JF_DIRECTION_FORWARD), JF_BACKEND_HOPPER);
  const jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  if (with_backward) {
    EXPECT_EQ(served_by(g, JF_DIRECTION_BACKWARD), JF_BACKEND_HOPPER);
    jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
    ba.launch.deterministic = deterministic;
    ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// g's results on every sequence against the CPU reference (which evaluates the same modifier).
inline void expect_matches_reference(const GpuBatch& g, bool with_backward) {
  std::vector<int32_t> seqs(g.spec.len_q.size());
  for (size_t b = 0; b < seqs.size(); ++b) seqs[b] = static_cast<int32_t>(b);
  const SampleCheck c = check_sample_against_reference(g, seqs, with_backward);
  const jf_dtype dt = g.spec.dtype;
  EXPECT_TRUE(c.finite) << "an output element is NaN: left unwritten, or poison read";
  EXPECT_TRUE(c.lse_inf_match);
  EXPECT_LE(c.out_rel, forward_tolerance(dt));
  EXPECT_LE(c.lse_max_abs, 2e-2) << "lse";
  if (!with_backward) return;
  EXPECT_LE(c.dq_rel, backward_tolerance(dt)) << "dq";
  EXPECT_LE(c.dk_rel, backward_tolerance(dt)) << "dk";
  EXPECT_LE(c.dv_rel, backward_tolerance(dt)) << "dv";
  EXPECT_LE(c.dsink_rel, backward_tolerance(dt)) << "d learnable_sink";
}

// One case of a variant's test: the spec's forward (and, with_backward, backward in the given
// mode) with AUTO on the Hopper kernels, checked against the CPU reference; a case this build does
// not serve is noted in `cases` and not run. `what` names the case in failures.
inline void run_and_check(HopperCases& cases, const BatchSpec& s, const std::string& what, bool with_backward,
                          int deterministic = 0) {
  if (!cases.serve(HopperCall::of(s), with_backward)) return;
  SCOPED_TRACE(what + " deterministic=" + std::to_string(deterministic));
  GpuBatch g = make_gpu_batch(s);
  run_on_hopper(g, with_backward, deterministic);
  if (::testing::Test::HasFatalFailure()) return;
  expect_matches_reference(g, with_backward);
}

// The deterministic backward on g (its forward run first) `runs` times: dq, dk, dv (and d sink)
// bitwise identical every time.
inline void expect_deterministic_backward_repeats(GpuBatch& g, int runs) {
  const jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
  ba.launch.deterministic = 1;
  std::vector<unsigned char> first[4];
  for (int run = 0; run < runs; ++run) {
    ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    // With sinks their gradient too (an empty buffer otherwise compares trivially).
    const DeviceBuffer* bufs[4] = {&g.dq, &g.dk, &g.dv, &g.d_dsink};
    for (int i = 0; i < 4; ++i) {
      std::vector<unsigned char> h(bufs[i]->bytes());
      bufs[i]->to_host(h.data());
      if (run == 0)
        first[i] = h;
      else
        ASSERT_EQ(std::memcmp(h.data(), first[i].data(), h.size()), 0) << "gradient " << i << " run " << run;
    }
  }
}

}  // namespace jagflash::testing
