// Host side of the Hopper backward: preprocess, the plan over KV blocks, TMA descriptors, the
// persistent kernel, postprocess.
#pragma once

#include "core/bench_knobs.hpp"
#include "kernels/bwd/bwd_kernel.cuh"
#include "kernels/bwd/prepost_bwd.cuh"
#include "kernels/common/launch_common.cuh"
#include "kernels/hopper_backward.hpp"

#include <cmath>
#include <cstdlib>
#include <cstring>

namespace jagflash::kernels::bwd {

// Benchmark knob, read at every launch (as the forward's, variants.hpp, so that one process can
// time its values side by side): JAGFLASH_BWD_SCHEDULE = dynamic (default) | zigzag | grid.
inline Schedule schedule_knob() {
  const char* v = bench_knob("JAGFLASH_BWD_SCHEDULE");
  if (v != nullptr && std::strcmp(v, "zigzag") == 0) return Schedule::kZigzag;
  if (v != nullptr && std::strcmp(v, "grid") == 0) return Schedule::kGrid;
  return Schedule::kDynamic;
}

// The order of a sequence's tiles (Params::l2_group_rows in both modes, rotated_q_order outside
// the deterministic mode; pooled_dq_sum keeps its own). Benchmark knobs, read at every launch so
// that one process can time them side by side: JAGFLASH_BWD_L2_GROUP_MB = the L2 budget of a
// group of heads in MB (0: the KV heads innermost), JAGFLASH_BWD_ROTATE = 1 starts each tile at
// Q block m_lo + n_block mod count. The rotation is off by default: the adds into one Q block do
// not contend enough to pay for the tiles of a head no longer sharing each Q block's L2 lines
// (bench/NOTES.md, "The backward's defaults: the figures behind them").
struct TileOrder {
  int64_t l2_group_bytes;
  int32_t rotate;
};
// A (sequence, query head)'s bytes in flight per Q row while its KV blocks run: Q and dO (2 bytes
// an element, bf16/fp16) and the fp32 dQ accumulator row.
template <int kHeadDim>
constexpr int64_t kL2BytesPerQRow = int64_t(kHeadDim) * (2 + 2 + 4);
// About half of an H200's L2 (the rest holds K, V and the stats).
constexpr int64_t kDefaultL2GroupBytes = int64_t(24) << 20;
inline TileOrder tile_order_knob() {
  TileOrder o{kDefaultL2GroupBytes, 0};
  if (const char* v = bench_knob("JAGFLASH_BWD_L2_GROUP_MB")) {
    char* end = nullptr;
    const long mb = std::strtol(v, &end, 10);
    if (end != v && *end == '\0' && mb >= 0 && mb <= 4096) o.l2_group_bytes = int64_t(mb) << 20;
  }
  if (const char* v = bench_knob("JAGFLASH_BWD_ROTATE")) o.rotate = std::strcmp(v, "1") == 0;
  return o;
}

using common::gmem_tensor;
using common::sm_count;

// A 1D tensor map over `count` fp32 values from `base`, box `box`: the stats' TMA loads.
inline cudaError_t stats_tensor_map(CUtensorMap* map, const float* base, uint64_t count, uint32_t box) {
  const cuuint64_t dims[1] = {count};
  const cuuint64_t strides[1] = {count * sizeof(float)};  // rank 1: none is read
  const cuuint32_t box_dims[1] = {box};
  const cuuint32_t element_strides[1] = {1};
  const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 1, const_cast<float*>(base), dims, strides, box_dims,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
      CU_TENSOR_MAP_L2_PROMOTION_NONE, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// A 2D tensor map over the fp32 dQ accumulator [rows][head_dim], box (box_rows, box_cols) with
// the 128-byte swizzle of the dQ stages: the dQ writer's reduce-adds.
inline cudaError_t dq_tensor_map(CUtensorMap* map, float* base, uint64_t rows, int head_dim,
                                 uint32_t box_cols, uint32_t box_rows) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(head_dim), rows};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(head_dim) * sizeof(float)};
  const cuuint32_t box_dims[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
      map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, base, dims, strides, box_dims, element_strides,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

// kMod: the score modifier; kPadded: the caller's head dim is below kHeadDim; kSparse: a
// block-sparse map (one instantiation per (dtype, head dim, variant), each in its own translation
// unit).
template <class Element, int kHeadDim, jf_score_mod kMod = JF_SCORE_MOD_NONE, bool kPadded = false,
          bool kSparse = false>
cudaError_t run_backward(const jf_bwd_args& a, const HopperBackwardLaunch& launch, cudaStream_t stream) {
  static_assert(int(kPadded) + int(kMod != JF_SCORE_MOD_NONE) + int(kSparse) <= 1,
                "one option at a time: a modifier, a padded head dim or a block-sparse map");
  using Config = TileConfig<Element, kHeadDim, kMod, kPadded, kSparse>;
  using Traits = KernelTraits<Config>;
  // The workspace (api/workspace.hpp) has one Q block of slack after the last row, and the
  // dispatcher sizes the plan for this tile shape.
  static_assert(Config::kBlockM == backward_block_m(kHeadDim, kMod, kSparse) &&
                    Config::kBlockN == backward_block_n(kHeadDim),
                "tile shape");
  const jf_problem& pb = a.problem;
  const int32_t heads = pb.q.heads;
  // 1/sqrt of the caller's head dim (kHeadDim's but with kPadded).
  const float scale = pb.scale != 0.f ? pb.scale : 1.f / std::sqrt(static_cast<float>(pb.q.head_dim));
  const int32_t head_dim_chunks = pb.q.head_dim * static_cast<int32_t>(sizeof(Element)) / 16;
  // v, out, dout and dv: v's head dim, at most q's (kPadded when below the kernel's).
  const int32_t v_head_dim_chunks = pb.v.head_dim * static_cast<int32_t>(sizeof(Element)) / 16;

  // Pooled attention summed inside the CTAs (Params::pooled_dq_sum): one Q block a sequence, one
  // query head a tile, and the deterministic mode's fixed order not asked for.
  const int32_t group = pb.k.heads > 0 ? heads / pb.k.heads : 1;
  // JAGFLASH_BWD_POOLED_SUM=0 (benchmark knob, read by the pooled calls it could apply to)
  // keeps the per-sequence rows.
  auto sum_knob_off = [] {
    const char* v = bench_knob("JAGFLASH_BWD_POOLED_SUM");
    return v != nullptr && std::strcmp(v, "0") == 0;
  };
  // Not in the wide kernel (its dQ goes to its stage in parts).
  const bool pooled_dq_sum = !Config::kWide && pb.pooled_q_rows > 0 && pb.pooled_q_rows <= Config::kBlockM &&
                             launch.dq_sems == nullptr && group == launch.group_splits && !sum_knob_off();
  // The accumulator starts at zero (with pooled_dq_sum only its first Q block of rows a head is
  // used); the semaphores too (deterministic mode).
  const size_t head_pitch = static_cast<size_t>(launch.dq_rows) * kHeadDim * sizeof(float);
  cudaError_t err =
      pooled_dq_sum
          ? cudaMemset2DAsync(launch.dq_accum, head_pitch, 0,
                              static_cast<size_t>(Config::kBlockM) * kHeadDim * sizeof(float), heads, stream)
          : cudaMemsetAsync(launch.dq_accum, 0, static_cast<size_t>(heads) * head_pitch, stream);
  if (err != cudaSuccess) return err;
  if (launch.dq_sems != nullptr) {
    err =
        cudaMemsetAsync(launch.dq_sems, 0, static_cast<size_t>(heads) * pb.q.rows * sizeof(int32_t), stream);
    if (err != cudaSuccess) return err;
  }
  {
    PreprocessParams pp{};
    pp.out = a.out.data;
    pp.dout = a.dout.data;
    pp.out_row_stride = a.out.row_stride;
    pp.out_head_stride = a.out.head_stride;
    pp.dout_row_stride = a.dout.row_stride;
    pp.dout_head_stride = a.dout.head_stride;
    pp.lse = a.lse;
    pp.lse_log2 = launch.lse_log2;
    pp.delta = launch.delta;
    pp.total_q = pb.q.rows;
    pp.q_stride = launch.q_stride;
    pp.num_heads = heads;
    pp.error_flag = launch.error_flag;
    pp.head_dim_chunks = v_head_dim_chunks;  // delta = rowsum(dO O) over v's head dim
    using Shape = PreprocessShape<kHeadDim>;
    preprocess_kernel<Element, kHeadDim, kPadded>
        <<<Shape::grid(launch.q_stride, heads), Shape::kThreads, 0, stream>>>(pp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }

  if (pb.k.rows > 0) {
    const MaskPolicy mask = MaskPolicy::from(pb.mask, pb.window_left, pb.window_right);
    // The plan lists (sequence, KV block) pairs: the forward's plan builder with the two sides
    // swapped (KV blocks of kBlockN keys as its "q blocks", Q blocks of 64 rows as its "kv blocks").
    const schedule::PlanKey key =
        schedule::plan_key({Config::kBlockN, Config::kBlockM}, pb.batch_size, pb.k.rows, pb.q.rows);
    // KV blocks first to last: under causal the first KV blocks are seen by the most Q blocks and
    // start first. The deterministic mode adds a Q block's partials in the plan's order of its
    // KV blocks, and under causal KV block n first meets Q blocks the lower blocks reach only
    // later, so first to last it waits (bench/NOTES.md); last to first with the turns
    // from the highest KV block down, every block's first Q blocks are its own turn first.
    const bool first_block_first = launch.dq_sems == nullptr;
    // With a block-sparse map the sequences weigh their visible blocks (the plan's pairs are the
    // map's columns).
    schedule::SequenceMap map{};
    if constexpr (kSparse) map = {BlockMask::from(pb), /*by_column=*/true};
    err = launch.build_plan ? schedule::build_device_plan(
                                  pb.kv_offsets, pb.q_offsets, pb.batch_size, Config::kBlockN,
                                  Config::kBlockM, launch.error_flag, launch.plan_key,
                                  schedule::with_block_order(key, first_block_first), launch.workspace,
                                  launch.plan, stream, first_block_first, schedule::PlanBuilder::kAuto, map)
                            : schedule::reset_tile_counter(launch.workspace, launch.plan, stream);
    if (err != cudaSuccess) return err;

    Params<Traits> p{};
    // Pooled: the problem counts the output rows (q.rows = B * Lq, q_offsets b * Lq); the tensor q
    // itself holds Lq rows, which bound its loads.
    jf_tensor q_rows = pb.q;
    if (pb.pooled_q_rows > 0) q_rows.rows = pb.pooled_q_rows;
    p.q_shared = pb.pooled_q_rows > 0;
    p.pooled_dq_sum = pooled_dq_sum;
    p.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor<Traits>(q_rows, pb.k),
                            typename Traits::SmemLayoutQStage{});
    p.tma_do = make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor<Traits>(a.dout, pb.k),
                             typename Traits::SmemLayoutQStage{});
    p.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor<Traits>(pb.k, pb.k), typename Traits::SmemLayoutK{});
    p.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gmem_tensor<Traits>(pb.v, pb.k), typename Traits::SmemLayoutK{});
    p.lse_log2 = launch.lse_log2;
    p.delta = launch.delta;
    const uint64_t stat_count = static_cast<uint64_t>(heads) * launch.q_stride;
    if ((err = stats_tensor_map(&p.lse_map, launch.lse_log2, stat_count, Traits::kStatRows)) != cudaSuccess ||
        (err = stats_tensor_map(&p.delta_map, launch.delta, stat_count, Traits::kStatRows)) != cudaSuccess)
      return err;
    p.q_stride = launch.q_stride;
    p.total_q = static_cast<int32_t>(pb.q.rows > 0 ? pb.q.rows : pb.k.rows);  // the TMA's row count
    p.total_kv = static_cast<int32_t>(pb.k.rows);
    p.num_heads = heads;
    p.num_heads_kv = pb.k.heads;
    p.group = heads / pb.k.heads;
    p.group_splits = launch.group_splits;
    p.dk_partial = launch.group_splits > 1 ? launch.dk_partial : nullptr;
    p.dv_partial = launch.group_splits > 1 ? launch.dv_partial : nullptr;
    p.dk = static_cast<Element*>(a.dk.data);
    p.dv = static_cast<Element*>(a.dv.data);
    p.dk_row_stride = a.dk.row_stride;
    p.dk_head_stride = a.dk.head_stride;
    p.dv_row_stride = a.dv.row_stride;
    p.dv_head_stride = a.dv.head_stride;
    p.dq_total_rows = static_cast<int32_t>(heads * launch.dq_rows);
    if ((err = dq_tensor_map(&p.dq_map, launch.dq_accum, static_cast<uint64_t>(p.dq_total_rows), kHeadDim,
                             Traits::kDqBoxCols, Traits::kDqRowGroup)) != cudaSuccess)
      return err;
    p.dq_rows = launch.dq_rows;
    p.dq_sems = launch.dq_sems;
    p.q_offsets = pb.q_offsets;
    p.kv_offsets = pb.kv_offsets;
    p.mask = mask;
    p.head_dim_chunks = head_dim_chunks;
    p.v_head_dim_chunks = v_head_dim_chunks;
    p.scale = scale;
    p.scale_log2 = scale * 1.4426950408889634f;
    if constexpr (kMod != JF_SCORE_MOD_NONE) {
      const common::ScoreModLaunch mod = common::score_mod_launch(pb, scale);
      p.score_mod = mod.args;
      p.scale_log2 = mod.exp_factor;
    }
    if constexpr (kSparse) p.block_mask = BlockMask::from(pb);
    p.error_flag = launch.error_flag;
    p.plan_key = launch.plan_key;
    p.expected_plan_key = key;
    const schedule::DevicePlan plan = schedule::device_plan_at(launch.workspace, launch.plan);
    p.sorted_pairs = plan.sorted_pairs;
    p.pair_batch = plan.pair_batch;
    p.pair_block = plan.pair_block;
    p.num_pairs = plan.num_pairs;
    p.tile_counter = plan.tile_counter;
    p.schedule = schedule_knob();
    // pooled_dq_sum's head-by-head order keeps the plain order; the deterministic mode takes the
    // L2 groups (its turns follow the plan's block order inside a group) but not the rotation.
    if (!pooled_dq_sum) {
      const TileOrder order = tile_order_knob();
      p.l2_group_rows = order.l2_group_bytes > 0
                            ? static_cast<int32_t>(order.l2_group_bytes / kL2BytesPerQRow<kHeadDim>)
                            : 0;
      p.rotated_q_order = launch.dq_sems == nullptr ? order.rotate : 0;
    }

    constexpr size_t kSmemBytes = sizeof(SharedStorage<Traits>);
    static_assert(kSmemBytes <= Config::kSmemLimit, "shared storage exceeds what a CTA may use");
    err = common::allow_dynamic_smem<backward_kernel<Config>>(kSmemBytes);
    if (err != cudaSuccess) return err;
    const int64_t max_tiles = launch.plan.max_pairs * pb.k.heads * launch.group_splits;
    const int64_t grid =
        p.schedule == Schedule::kGrid ? max_tiles : (max_tiles < sm_count() ? max_tiles : sm_count());
    backward_kernel<Config><<<static_cast<unsigned>(grid), Config::kThreads, kSmemBytes, stream>>>(p);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;

    if (p.dk_partial != nullptr) {
      DkvPostprocessParams dp{};
      dp.dk_partial = launch.dk_partial;
      dp.dv_partial = launch.dv_partial;
      dp.splits = launch.group_splits;
      dp.total_kv = pb.k.rows;
      dp.num_heads_kv = pb.k.heads;
      dp.dk = a.dk.data;
      dp.dv = a.dv.data;
      dp.dk_row_stride = a.dk.row_stride;
      dp.dk_head_stride = a.dk.head_stride;
      dp.dv_row_stride = a.dv.row_stride;
      dp.dv_head_stride = a.dv.head_stride;
      dp.error_flag = launch.error_flag;
      dp.head_dim_chunks = head_dim_chunks;
      dp.v_head_dim_chunks = v_head_dim_chunks;
      using Shape = PreprocessShape<kHeadDim>;
      dkv_postprocess_kernel<Element, kHeadDim, kPadded>
          <<<Shape::grid(pb.k.rows, pb.k.heads), Shape::kThreads, 0, stream>>>(dp);
      if ((err = cudaGetLastError()) != cudaSuccess) return err;
    }
  }

  if (pb.q.rows > 0) {
    PostprocessParams pp{};
    pp.dq_accum = launch.dq_accum;
    pp.dq_rows = launch.dq_rows;
    pp.dq = a.dq.data;
    pp.dq_row_stride = a.dq.row_stride;
    pp.dq_head_stride = a.dq.head_stride;
    // Pooled: dq [Lq] is the sum of the B sequences' accumulator rows b * Lq + i, or with
    // pooled_dq_sum already summed in rows i.
    const bool pooled = pb.pooled_q_rows > 0;
    pp.total_q = pooled ? pb.pooled_q_rows : pb.q.rows;
    pp.sum_count = pooled && !pooled_dq_sum ? pb.batch_size : 1;
    pp.sum_stride = pooled ? pb.pooled_q_rows : 0;
    pp.num_heads = heads;
    pp.scale = scale;
    pp.error_flag = launch.error_flag;
    pp.head_dim_chunks = head_dim_chunks;
    using Shape = PreprocessShape<kHeadDim>;
    postprocess_kernel<Element, kHeadDim, kPadded>
        <<<Shape::grid(pp.total_q, heads), Shape::kThreads, 0, stream>>>(pp);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace jagflash::kernels::bwd
