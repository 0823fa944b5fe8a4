// Host side of the Hopper forward: TMA descriptors, the plan, the launch.
#pragma once

#include "core/bench_knobs.hpp"
#include "kernels/common/launch_common.cuh"
#include "kernels/fwd/fwd_kernel.cuh"
#include "kernels/hopper_forward.hpp"

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <type_traits>

namespace jagflash::kernels::fwd {

using common::gmem_tensor;
using common::sm_count;

// The L2 budget of a group of heads in the plan's order under a mask (schedule::HeadOrder). 32 MB
// of Hopper's 50 MB of L2 (FA3 sizes its head groups by the same figure) is the candidate: a
// group's K and V would stay there while Q, O and the next group's first blocks stream through.
// Off by default (0: every head of a sequence in one group): it has not beaten that order
// (bench/NOTES.md, "The measurements behind the code's defaults").
// Benchmark knob, read at every launch so that one process can time orders side by side:
// JAGFLASH_FWD_L2_GROUP_KB. Without a mask the order stays head by head.
constexpr int64_t kDefaultFwdL2GroupBytes = 0;
inline int64_t fwd_l2_group_bytes_knob() {
  if (const char* v = bench_knob("JAGFLASH_FWD_L2_GROUP_KB")) {
    char* end = nullptr;
    const long kb = std::strtol(v, &end, 10);
    if (end != v && *end == '\0' && kb >= 0 && kb <= (long(1) << 22)) return int64_t(kb) << 10;
  }
  return kDefaultFwdL2GroupBytes;
}

// OnlineSoftmax's keep_max: with a value >= 0 a row keeps its running max while a block's maximum
// passes it by at most that many log2 units, so once a row's max has settled O's rescale is
// skipped (a warp's rows all kept theirs). 8 by default on the D = 128 and D = 256 kernels, where
// it is faster; off on the others: D = 64 is slower with it, probably its issue-bound loop paying
// more for the compare and the vote than the 32 FMUL it saves, and D = 96 and 192 are untimed
// (bench/NOTES.md, "The measurements behind the code's defaults"). The GPU tests and the Python
// suite pass with 8 at every head dim. Benchmark knob, read at every launch:
// JAGFLASH_FWD_KEEP_MAX (negative: the max always moves and O is always rescaled, the softmax
// before), at most 16 (the probabilities reach 2^keep_max, far inside fp16's range).
constexpr float default_keep_max(int kernel_head_dim) {
  return kernel_head_dim == 128 || kernel_head_dim == 256 ? 8.f : -1.f;
}
inline float fwd_keep_max_knob(int kernel_head_dim) {
  if (const char* v = bench_knob("JAGFLASH_FWD_KEEP_MAX")) {
    char* end = nullptr;
    const float x = std::strtof(v, &end);
    if (end != v && *end == '\0' && x <= 16.f) return x < 0.f ? -1.f : x;
  }
  return default_keep_max(kernel_head_dim);
}

// The plan's head order for a call: head by head without a mask, else L2-sized groups of heads.
inline schedule::HeadOrder forward_head_order(const jf_problem& pb, const MaskPolicy& mask,
                                              int element_bytes) {
  if (mask.is_full()) return schedule::kHeadByHead;
  const int64_t row_bytes = int64_t(pb.k.head_dim + pb.v.head_dim) * element_bytes;  // one K and one V row
  const int64_t rows = fwd_l2_group_bytes_knob() / (row_bytes > 0 ? row_bytes : 1);
  const int32_t group = pb.k.heads > 0 ? pb.q.heads / pb.k.heads : 1;
  return {static_cast<int32_t>(rows < INT32_MAX ? rows : INT32_MAX), group};
}

template <class Config>
cudaError_t run_forward_variant(const jf_fwd_args& a, const HopperForwardLaunch& launch, Schedule schedule,
                                cudaStream_t stream) {
  using Element = typename Config::Element;
  using Traits = KernelTraits<Config>;
  const jf_problem& pb = a.problem;
  if (pb.q.rows == 0) return cudaSuccess;
  const MaskPolicy mask = MaskPolicy::from(pb.mask, pb.window_left, pb.window_right);

  const schedule::PlanKey key =
      schedule::plan_key({Config::kBlockM, Config::kBlockN}, pb.batch_size, pb.q.rows, pb.k.rows);
  schedule::SequenceMap map{};
  if constexpr (Config::kBlockSparse) map.block_mask = BlockMask::from(pb);
  cudaError_t err = launch.build_plan
                        ? schedule::build_device_plan(
                              pb.q_offsets, pb.kv_offsets, pb.batch_size, Config::kBlockM, Config::kBlockN,
                              launch.error_flag, launch.plan_key, key, launch.workspace, launch.plan, stream,
                              /*first_block_first=*/false, schedule::PlanBuilder::kAuto, map)
                        : schedule::reset_tile_counter(launch.workspace, launch.plan, stream);
  if (err != cudaSuccess) return err;

  Params<Traits> p{};
  // Pooled: the problem the dispatcher hands over counts the output rows (q.rows = B * Lq, q_offsets
  // b * Lq); the tensor q itself holds Lq rows, which bound its loads.
  jf_tensor q_rows = pb.q;
  if (pb.pooled_q_rows > 0) q_rows.rows = pb.pooled_q_rows;
  p.q_shared = pb.pooled_q_rows > 0;
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor<Traits>(q_rows, pb.q), typename Traits::SmemLayoutQ{});
  p.tma_k =
      make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor<Traits>(pb.k, pb.q), typename Traits::SmemLayoutKVStage{});
  p.tma_v =
      make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor<Traits>(pb.v, pb.q), typename Traits::SmemLayoutKVStage{});
  p.total_q = static_cast<int32_t>(pb.q.rows);
  p.total_kv = static_cast<int32_t>(pb.k.rows > 0 ? pb.k.rows : pb.q.rows);  // the TMA's row count
  p.num_heads = pb.q.heads;
  p.num_heads_kv = pb.k.rows > 0 ? pb.k.heads : pb.q.heads;
  p.group = pb.q.heads / pb.k.heads;
  p.out = static_cast<Element*>(a.out.data);
  p.out_row_stride = a.out.row_stride;
  p.out_head_stride = a.out.head_stride;
  p.lse = a.lse;
  p.learnable_sink = pb.learnable_sink;
  p.q_offsets = pb.q_offsets;
  p.kv_offsets = pb.kv_offsets;
  p.mask = mask;
  // 1/sqrt of the caller's head dim (kHeadDim's but with PaddedHeadDim).
  p.scale = pb.scale != 0.f ? pb.scale : 1.f / std::sqrt(static_cast<float>(pb.q.head_dim));
  p.scale_log2 = p.scale * 1.4426950408889634f;
  // The columns of O the epilogue stores: v's head dim (q's, or narrower: V arrives zero-filled past it).
  p.head_dim_chunks = pb.v.head_dim * static_cast<int32_t>(sizeof(Element)) / 16;
  if constexpr (Config::kScoreMod != JF_SCORE_MOD_NONE) {
    const common::ScoreModLaunch mod = common::score_mod_launch(pb, p.scale);
    p.score_mod = mod.args;
    p.scale = mod.lse_factor;
    p.scale_log2 = mod.exp_factor;
  }
  if constexpr (Config::kBlockSparse) p.block_mask = BlockMask::from(pb);
  p.error_flag = launch.error_flag;
  p.plan_key = launch.plan_key;
  p.expected_plan_key = key;
  const schedule::DevicePlan plan = schedule::device_plan_at(launch.workspace, launch.plan);
  p.sorted_pairs = plan.sorted_pairs;
  p.pair_batch = plan.pair_batch;
  p.pair_block = plan.pair_block;
  p.num_pairs = plan.num_pairs;
  p.tile_counter = plan.tile_counter;
  p.schedule = schedule;
  p.head_order = forward_head_order(pb, mask, static_cast<int>(sizeof(Element)));
  p.keep_max = fwd_keep_max_knob(Config::kHeadDim);

  constexpr size_t kSmemBytes = Config::kPairs * sizeof(SharedStorage<Traits>);
  static_assert(kSmemBytes <= Config::kSmemLimit, "shared storage exceeds what a CTA may use");
  err = common::allow_dynamic_smem<forward_kernel<Config>>(kSmemBytes);
  if (err != cudaSuccess) return err;
  // Persistent: one CTA per SM, fewer when the batch has fewer tiles (an upper bound on the
  // host, which never reads the plan). The plain grid launches a CTA per possible tile (per
  // kPairs tiles with independent pairs).
  const int64_t max_tiles = launch.plan.max_pairs * pb.q.heads;
  const int64_t grid = schedule == Schedule::kGrid ? (max_tiles + Config::kPairs - 1) / Config::kPairs
                                                   : (max_tiles < sm_count() ? max_tiles : sm_count());
  forward_kernel<Config><<<static_cast<unsigned>(grid), Config::kThreads, kSmemBytes, stream>>>(p);
  err = cudaGetLastError();
  print_forward_trace();  // a no-op unless built with -DJAGFLASH_FWD_TRACE
  return err;
}

// The two-pair tile (variants.hpp): one warpgroup and 64 query rows a tile, two independent
// pairs a CTA, at the kernel head dims up to 128 (with PaddedHeadDim, padded below them).
template <class Element, int kHeadDim, class... Options>
using PairsTileConfig = TileConfig<Element, kHeadDim, BlockN<forward_pairs_block_n(kHeadDim)>, Warpgroups<1>,
                                   Pairs<2>, Options...>;

// The instantiations per (dtype, head dim): D = 128 with 128-key blocks (and, in a build with
// benchmark knobs, 64-, 160- and 176-key blocks and ping-pong, also with 176); D = 64 with two (Q in
// registers; ping-pong with knobs) or three consumer warpgroups; D = 64, 96 and 128 with two independent
// single-warpgroup pairs; D = 256 with two warpgroups and 32-key blocks; D = 192 with 64-key blocks; D = 96
// with the default tile.
template <class Element, int kHeadDim>
cudaError_t run_forward(const jf_fwd_args& a, const HopperForwardLaunch& launch, cudaStream_t stream) {
  const ForwardVariant& v = launch.variant;
  if constexpr (kHeadDim == 256) {
    return run_forward_variant<TileConfig<Element, 256, BlockN<32>>>(a, launch, v.schedule, stream);
  } else if constexpr (kHeadDim == 192) {
    // D = 192: the default tile with 64-key blocks (two K/V stages fit; tile_config.hpp).
    return run_forward_variant<TileConfig<Element, 192, BlockN<forward_block_n_past_128(192)>>>(
        a, launch, v.schedule, stream);
  } else {
    if (v.pairs == 2)
      return run_forward_variant<PairsTileConfig<Element, kHeadDim>>(a, launch, v.schedule, stream);
    if constexpr (kHeadDim == 96) {
      // D = 96 (a forward-only head dim): the default tile beside the pairs (no knob tiles).
      return run_forward_variant<TileConfig<Element, 96>>(a, launch, v.schedule, stream);
    } else if constexpr (kHeadDim == 128) {
      // The 64-, 160-, 176-key and ping-pong tiles are chosen by benchmark knobs only (variants.hpp):
      // compiled in a build with them (core/bench_knobs.hpp), where choose_forward_variant can return them.
      if constexpr (kBenchKnobs) {
        if (v.block_n == 64)
          return run_forward_variant<TileConfig<Element, 128, BlockN<64>>>(a, launch, v.schedule, stream);
        if (v.block_n == 160)
          return run_forward_variant<TileConfig<Element, 128, BlockN<160>>>(a, launch, v.schedule, stream);
        if (v.block_n == 176) {
          if (v.ping_pong)
            return run_forward_variant<TileConfig<Element, 128, BlockN<176>, PingPong>>(a, launch, v.schedule,
                                                                                        stream);
          return run_forward_variant<TileConfig<Element, 128, BlockN<176>>>(a, launch, v.schedule, stream);
        }
        if (v.ping_pong)
          return run_forward_variant<TileConfig<Element, 128, PingPong>>(a, launch, v.schedule, stream);
      }
      return run_forward_variant<TileConfig<Element, 128>>(a, launch, v.schedule, stream);
    } else {
      if (v.warpgroups == 3)
        return run_forward_variant<TileConfig<Element, 64, Warpgroups<3>>>(a, launch, v.schedule, stream);
      // Q in registers only where it is faster (bench/NOTES.md): D = 64 with two warpgroups; at
      // D = 128 it is slower, and the three-warpgroup D = 64 tile has no registers for it (ptxas
      // serialises its wgmmas and spills).
      if constexpr (kBenchKnobs) {
        if (v.ping_pong)
          return run_forward_variant<TileConfig<Element, 64, PingPong, QInRegisters>>(a, launch, v.schedule,
                                                                                      stream);
      }
      return run_forward_variant<TileConfig<Element, 64, QInRegisters>>(a, launch, v.schedule, stream);
    }
  }
}

// A call with a score modifier, or with a head dim below kHeadDim (PaddedHeadDim): the default
// tile with that option (two consumer warpgroups, 128-key blocks; 32 at D = 256), whatever the
// knobs but the schedule and, padded up to 128, the two pairs (choose_forward_variant); one
// translation unit per (dtype, head dim, option).
template <class Element, int kHeadDim, class Option>
cudaError_t run_forward_default_tile(const jf_fwd_args& a, const HopperForwardLaunch& launch,
                                     cudaStream_t stream) {
  const ForwardVariant& v = launch.variant;
  if constexpr (kHeadDim <= 128 && std::is_same_v<Option, PaddedHeadDim>) {
    if (v.pairs == 2)
      return run_forward_variant<PairsTileConfig<Element, kHeadDim, PaddedHeadDim>>(a, launch, v.schedule,
                                                                                    stream);
  }
  if constexpr (kHeadDim > 128)
    return run_forward_variant<
        TileConfig<Element, kHeadDim, BlockN<forward_block_n_past_128(kHeadDim)>, Option>>(
        a, launch, v.schedule, stream);
  else
    return run_forward_variant<TileConfig<Element, kHeadDim, Option>>(a, launch, v.schedule, stream);
}

// The entry point's body for one (dtype, kernel head dim, modifier, padded head dim, block-sparse).
template <class Element, int kHeadDim, jf_score_mod kMod, bool kPadded, bool kSparse>
cudaError_t run_forward_for(const jf_fwd_args& a, const HopperForwardLaunch& launch, cudaStream_t stream) {
  static_assert(int(kPadded) + int(kMod != JF_SCORE_MOD_NONE) + int(kSparse) <= 1,
                "one option at a time: a modifier, a padded head dim or a block-sparse map");
  static_assert(!kSparse || kHeadDim <= 128, "block-sparse maps at head dims 64 and 128");
  if constexpr (kSparse)
    return run_forward_default_tile<Element, kHeadDim, BlockSparse>(a, launch, stream);
  else if constexpr (kPadded)
    return run_forward_default_tile<Element, kHeadDim, PaddedHeadDim>(a, launch, stream);
  else if constexpr (kMod == JF_SCORE_MOD_NONE)
    return run_forward<Element, kHeadDim>(a, launch, stream);
  else
    return run_forward_default_tile<Element, kHeadDim, ScoreModifier<kMod>>(a, launch, stream);
}

}  // namespace jagflash::kernels::fwd
