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
  // float [H, total_q]: delta = rowsum(dO * O), backward only.
  size_t delta_offset = 0;
  size_t total_bytes = 0;

  static WorkspaceLayout forward_gpu() {
    WorkspaceLayout w;
    w.plan_key_offset = align_up(sizeof(int32_t));
    w.total_bytes = w.plan_key_offset + align_up(sizeof(schedule::PlanKey));
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
