// The kernels' plan built on the GPU: (batch, block) pairs in schedule::
// sort_sequences_heaviest_first's order (heaviest sequence first, a sequence's pairs together),
// read by the persistent kernel through an atomic tile counter (tile = pair x heads + head). The
// forward's pairs are (sequence, q block); the backward builds the same plan with the two sides
// swapped, its pairs (sequence, KV block). Built
// from device offsets by small kernels and a CUB radix sort: no host sync, capturable in a CUDA
// graph, and reusable by later calls with the same offsets (the plan lives in the workspace).
#pragma once

#include "core/block_mask.hpp"
#include "core/mask.hpp"
#include "schedule/plan.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace jagflash::schedule {

// Where each array of the plan lives inside the caller's workspace.
struct DevicePlanLayout {
  int64_t max_pairs = 0;  // sum over b of ceil(Lq_b / tile_m) <= total_q / tile_m + B
  size_t pair_offset = 0, num_pairs = 0, tile_counter = 0, pair_batch = 0, pair_block = 0;
  size_t keys_in = 0, keys_out = 0, vals_in = 0, vals_out = 0, sort_temp = 0;
  size_t map_weights = 0;  // [B] uint32 with a block mask (its visible blocks), else unused
  size_t sort_temp_bytes = 0;
  int batch_bits = 1;     // low key bits: the batch index from the end
  int sort_end_bit = 64;  // the bits above: the sequence weight + 1, up to the heaviest possible
  size_t total_bytes = 0;

  // Offsets from `base` (a 256-byte aligned offset inside the workspace).
  // block_mask: the plan weighs sequences by a block-sparse map's visible blocks (room for them).
  static DevicePlanLayout make(size_t base, int32_t batch_size, int64_t total_q, int64_t total_kv, int tile_m,
                               int tile_n, bool block_mask = false);
};

struct DevicePlan {
  const int32_t* sorted_pairs;  // pair indices in plan order
  const int32_t* pair_batch;
  const int32_t* pair_block;
  const int32_t* num_pairs;
  int32_t* tile_counter;
};

DevicePlan device_plan_at(void* workspace, const DevicePlanLayout& layout);

// How the plan is built. Both give the same plan, array for array.
//  kLarge: a pair-count scan, a fill kernel, CUB's device radix sort and a counter reset (four or
//    more launches; any size).
//  kSmall: one kernel of one CTA doing all of it in shared memory, for plans of at most
//    kSmallPlanMaxPairs pairs (the shapes' bound, DevicePlanLayout::max_pairs): the small batches
//    whose call cost is launches, not work.
//  kAuto: kSmall where it fits, else kLarge.
enum class PlanBuilder { kAuto, kSmall, kLarge };
constexpr int64_t kSmallPlanMaxPairs = 2048;

// Builds the plan and stores `key` at `stored_key` (skipped entirely when *error_flag is set by
// the offsets check, and the stored key is then cleared: no later call may reuse the plan).
// A sequence's blocks come last to first (the forward: under causal its last q blocks are the
// costliest), or with first_block_first first to last (the backward, whose "q blocks" are KV
// blocks: under causal its first KV blocks are seen by the most queries). kSmall on a layout
// whose max_pairs exceeds kSmallPlanMaxPairs returns cudaErrorInvalidValue.
// SequenceMap: with a block-sparse map (BlockMask, present) a sequence weighs its visible map
// blocks instead of its q blocks x kv blocks, so the heaviest-first order follows the work the
// kernels do. The plan's pairs are then map rows (the forward: tile_m == BlockMask::kBlock) or,
// with by_column (the backward, whose pairs are KV blocks), map columns (tile_m == kBlock too);
// another tile_m returns cudaErrorInvalidValue. The layout must have been made with block_mask.
struct SequenceMap {
  BlockMask block_mask{};
  bool by_column = false;
};
cudaError_t build_device_plan(const int32_t* q_offsets, const int32_t* kv_offsets, int32_t batch_size,
                              int tile_m, int tile_n, const int32_t* error_flag, PlanKey* stored_key,
                              PlanKey key, void* workspace, const DevicePlanLayout& layout,
                              cudaStream_t stream, bool first_block_first = false,
                              PlanBuilder builder = PlanBuilder::kAuto, SequenceMap map = {});

// offsets[b] = b * rows_per_sequence for b <= batch_size: pooled attention's output rows (every
// sequence has the shared query set's rows), read by the plan and the kernels as q_offsets.
cudaError_t fill_uniform_offsets(int32_t* offsets, int32_t batch_size, int32_t rows_per_sequence,
                                 cudaStream_t stream);

// Resets the tile counter: each launch of the persistent kernel starts from the first tile.
cudaError_t reset_tile_counter(void* workspace, const DevicePlanLayout& layout, cudaStream_t stream);

}  // namespace jagflash::schedule
