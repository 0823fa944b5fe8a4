// Workspace layout of one call: the library never allocates device memory itself; the caller
// passes one buffer of the queried size and it is carved up here, in one place.
#pragma once

#include "schedule/plan.hpp"

#include <cstddef>
#include <cstdint>

namespace jagflash::detail {

constexpr size_t kWorkspaceAlign = 256;

constexpr size_t align_up(size_t bytes) {
  return (bytes + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

struct WorkspaceLayout {
  // int32 flag written by the device offsets check (JF_CHECK_OFFSETS_DEVICE); always present on
  // the GPU so every kernel can read it.
  size_t error_flag_offset = 0;
  // schedule::PlanKey of the forward's device plan, forward only: before the plan, whose layout
  // depends on the variant, so a call under another variant still finds it.
  size_t plan_key_offset = 0;
  // float [H, total_q]: delta = rowsum(dO * O), backward only (total_q: the rows of out, B * Lq
  // for pooled attention).
  size_t delta_offset = 0;
  size_t total_bytes = 0;

  static WorkspaceLayout forward_gpu() {
    WorkspaceLayout w;
    w.plan_key_offset = align_up(sizeof(int32_t));
    w.total_bytes = w.plan_key_offset + align_up(sizeof(schedule::PlanKey));
    return w;
  }
  // The Hopper backward: lse in log2 units and delta as [H][q_stride] (q_stride: total_q rounded
  // up to 4 rows, plus the kMaxBlockM + 4 rows a Q block's bulk copy may read past the last), the fp32
  // dQ accumulator [H][total_q + kMaxBlockM][D] (one Q block of slack: a block's reduce-add may run
  // past the last row; kMaxBlockM the largest Q block of any kernel, kernels::backward_block_m), the
  // deterministic mode's semaphores [H][total_q] (reserved in either mode), with a split group
  // (group_splits > 1) the fp32 dK and dV partials [group_splits][total_kv][H_kv][D] each, then the
  // plan (from total_bytes on).
  static constexpr int64_t kMaxBlockM = 128;
  size_t lse_log2_offset = 0;
  size_t dq_accum_offset = 0;
  size_t dq_sems_offset = 0;
  int64_t q_stride = 0;
  int64_t dq_rows = 0;
  size_t dk_partial_offset = 0;
  size_t dv_partial_offset = 0;
  int32_t group_splits = 1;  // the backward's query-head group split (kernels::backward_group_splits)
  // Pooled attention on the Hopper kernels: the output rows' offsets b * Lq, int32 [B+1], which
  // the plan and the kernels read as q_offsets; appended to a layout by with_pooled_offsets.
  size_t pooled_offsets_offset = 0;

  static WorkspaceLayout with_pooled_offsets(WorkspaceLayout w, int32_t batch_size) {
    w.pooled_offsets_offset = w.total_bytes;
    w.total_bytes += align_up((static_cast<size_t>(batch_size) + 1) * sizeof(int32_t));
    return w;
  }

  static WorkspaceLayout backward_hopper(int64_t num_heads, int64_t total_q, int64_t head_dim,
                                         int64_t heads_kv = 0, int64_t total_kv = 0,
                                         int32_t group_splits = 1) {
    WorkspaceLayout w;
    w.q_stride = (total_q + 3) / 4 * 4 + kMaxBlockM + 8;
    w.dq_rows = total_q + kMaxBlockM;
    w.plan_key_offset = align_up(sizeof(int32_t));
    w.delta_offset = w.plan_key_offset + align_up(sizeof(schedule::PlanKey));
    const size_t stats = align_up(static_cast<size_t>(num_heads * w.q_stride) * sizeof(float));
    w.lse_log2_offset = w.delta_offset + stats;
    w.dq_accum_offset = w.lse_log2_offset + stats;
    w.dq_sems_offset =
        w.dq_accum_offset + align_up(static_cast<size_t>(num_heads * w.dq_rows * head_dim) * sizeof(float));
    // The semaphores are always reserved: a plan built by a call in one mode must be found by a
    // call in the other (launch.reuse_plan), so the plan's place cannot depend on the mode.
    w.total_bytes = w.dq_sems_offset + align_up(static_cast<size_t>(num_heads * total_q) * sizeof(int32_t));
    w.group_splits = group_splits;
    if (group_splits > 1) {
      const size_t partial =
          align_up(static_cast<size_t>(group_splits * total_kv * heads_kv * head_dim) * sizeof(float));
      w.dk_partial_offset = w.total_bytes;
      w.dv_partial_offset = w.dk_partial_offset + partial;
      w.total_bytes = w.dv_partial_offset + partial;
    }
    return w;
  }
  static WorkspaceLayout backward_gpu(int64_t num_heads, int64_t total_q) {
    WorkspaceLayout w;
    w.delta_offset = align_up(sizeof(int32_t));
    w.total_bytes = w.delta_offset + align_up(static_cast<size_t>(num_heads * total_q) * sizeof(float));
    return w;
  }
};

}  // namespace jagflash::detail
