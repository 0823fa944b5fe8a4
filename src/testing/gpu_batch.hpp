// A random jagged batch on the GPU with every buffer a forward + backward call needs, and the
// host-side pieces to check a sample of it against the CPU reference. Used by the CLI and the
// GPU tests.
#pragma once

#include "testing/device_buffer.hpp"
#include "testing/host_batch.hpp"

#include <jagflash/jagflash.h>

#include <cstdint>
#include <vector>

namespace jagflash::testing {

struct BatchSpec {
  std::vector<int32_t> len_q;
  std::vector<int32_t> len_kv;  // same as len_q when empty
  int heads = 16;
  int heads_kv = 16;
  int head_dim = 128;
  int v_head_dim = 0;  // v's (and out, dout, dv's) head dim: 0 = head_dim
  jf_dtype dtype = JF_BF16;
  jf_mask mask = JF_MASK_NONE;
  int window_left = -1;
  int window_right = -1;
  uint64_t seed = 1;
  float input_range = 1.f;      // inputs drawn from U(-input_range, input_range)
  int row_pad = 0;              // extra elements after each row, to exercise row strides
  int32_t max_seqlen_hint = 0;  // jf_launch.max_seqlen_hint of both directions' calls
  // The score modifier (jf_problem's fields): softcap > 0 with JF_SCORE_MOD_SOFTCAP, one slope a
  // query head with JF_SCORE_MOD_ALIBI (copied to the device by make_gpu_batch).
  jf_score_mod score_mod = JF_SCORE_MOD_NONE;
  float softcap = 0.f;
  std::vector<float> alibi_slopes;
  // Learnable sinks (jf_problem::learnable_sink), one logit a query head, when not empty (copied
  // to the device by make_gpu_batch); the backward then returns their gradient in d_dsink.
  std::vector<float> learnable_sink;
  // A block-sparse map (jf_block_mask) when block_mask is set: block_offsets [B+1] and the maps'
  // bytes (copied to the device by make_gpu_batch).
  bool block_mask = false;
  std::vector<uint8_t> blocks;
  std::vector<int32_t> block_offsets;
};

struct GpuBatch {
  BatchSpec spec;
  std::vector<int32_t> q_offsets, kv_offsets;  // host copies
  DeviceBuffer d_q_offsets, d_kv_offsets;
  DeviceBuffer q, k, v, out, lse, dout, dq, dk, dv, workspace;
  DeviceBuffer d_alibi_slopes;             // spec.alibi_slopes on the device (empty without ALiBi)
  DeviceBuffer d_sink, d_dsink;            // spec.learnable_sink and its gradient (empty without sinks)
  DeviceBuffer d_blocks, d_block_offsets;  // spec's block mask on the device (empty without one)
  jf_tensor q_view{}, k_view{}, v_view{}, out_view{}, dout_view{}, dq_view{}, dk_view{}, dv_view{};

  int64_t total_q() const { return q_offsets.back(); }
  int64_t total_kv() const { return kv_offsets.back(); }
  jf_problem problem() const;
  jf_fwd_args forward_args(jf_backend backend) const;
  jf_bwd_args backward_args(jf_backend backend) const;
  // Visible (query, key) pairs summed over sequences (the mask and the block mask), times heads:
  // useful-FLOP counts.
  double forward_flops() const;
};

// Allocates and fills q, k, v, dout with random values; outputs poisoned with NaN.
GpuBatch make_gpu_batch(const BatchSpec& spec);

// Sets out, lse, dq, dk, dv (padding included) to NaN so unwritten elements are caught.
void poison_outputs(GpuBatch& batch);

struct SampleCheck {
  double out_rel = 0, lse_max_abs = 0, dq_rel = 0, dk_rel = 0, dv_rel = 0;
  // With sinks and a sample of every sequence: the largest |d sink - reference| over the heads,
  // relative to the largest sum of its terms' magnitudes, sum_i exp(s_h - lse_i) |delta_i| (d sink
  // is a sum of signed terms, each moved by the rounding of out: relative to |d sink| itself a
  // cancelling sum would fail any tolerance); else 0.
  double dsink_rel = 0;
  bool lse_inf_match = true;  // -inf exactly where the reference has -inf
  bool finite = true;         // no NaN left (an unwritten output) in the sampled rows
};

// Runs the CPU reference on the sequences `seqs` of the batch and compares the GPU results
// (already in the batch's out/lse/dq/dk/dv) on those sequences. `with_backward` also compares
// dq, dk, dv.
SampleCheck check_sample_against_reference(const GpuBatch& batch, const std::vector<int32_t>& seqs,
                                           bool with_backward);

// Tolerances by dtype: bf16 carries 8 bits of mantissa, fp16 11, fp32 24.
double forward_tolerance(jf_dtype dtype);
double backward_tolerance(jf_dtype dtype);

}  // namespace jagflash::testing

namespace jagflash::testing {

// ||a - b|| / ||b|| over the view's elements of two device tensors of the same layout
// (NaN when either holds a NaN in the view).
double device_rel_error(const void* a, const void* b, const jf_tensor& view, jf_dtype dtype);

}  // namespace jagflash::testing
