// Types derived from the backward's tile config: shared-memory layouts, TMA atoms, tiled MMAs,
// shared storage and the kernel's device parameters.
#pragma once

// cute/tensor.hpp first: cute/atom/copy_atom.hpp does not compile without it before.
#include <cute/tensor.hpp>

#include "core/block_mask.hpp"
#include "core/mask.hpp"
#include "kernels/bwd/tile_config_bwd.hpp"
#include "kernels/common/barriers.cuh"
#include "kernels/common/gmma_64x48.cuh"
#include "kernels/common/ring.cuh"
#include "kernels/common/schedule.hpp"
#include "kernels/common/score_mod.cuh"
#include "schedule/plan.hpp"

#include <cuda.h>
#include <cutlass/numeric_types.h>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

#include <cstdint>
#include <type_traits>

namespace jagflash::kernels::bwd {

using namespace cute;
using common::ArrivalBarrier;
using common::TxBarrier;

using common::Schedule;  // how CTAs get their tiles (the forward's choices)

template <class Config>
struct KernelTraits {
  using Element = typename Config::Element;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kStages = Config::kStages;
  static constexpr int kDqStages = Config::kDqStages;
  static constexpr int kDsBuffers = Config::kDsBuffers;
  static constexpr int kProducerRegisters = Config::kProducerRegisters;
  using ScoreMod = common::KernelScoreMod<Config::kScoreMod>;
  static constexpr bool kPaddedHeadDim = Config::kPaddedHeadDim;
  static constexpr bool kBlockSparse = Config::kBlockSparse;
  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;
  using WgKeys = Int<Config::kKeysPerWarpgroup>;

  // Q, dO, K, V: head dim contiguous, 128-byte swizzle (the wgmma-native K-major layout); at
  // D = 192 the wide kernel's warpgroups take 96 columns each of dO^T, Q^T and K^T, which cut a
  // 128-byte atom (64 columns) in two: there 64-byte atoms (32 columns), as the D = 96 forward.
  // At D = 96 (3 x 32 columns) Q and dO in 64-byte atoms too, and K, V in 32-byte ones (16
  // columns): dQ = dS K gives each warpgroup 48 columns of K^T, and an MN-major operand's
  // instruction cannot start inside an atom and run past its end (warpgroup 1 starts at 48).
  static constexpr bool kDim96 = !Config::kWide && kHeadDim % 64 != 0;
  static constexpr bool kAtoms64 = (Config::kWide ? kHeadDim / 2 : kHeadDim) % 64 != 0;
  using SmemAtomQ = std::conditional_t<kAtoms64, decltype(GMMA::Layout_K_SW64_Atom<Element>{}),
                                       decltype(GMMA::Layout_K_SW128_Atom<Element>{})>;
  using SmemAtomK = std::conditional_t<kDim96, decltype(GMMA::Layout_K_SW32_Atom<Element>{}), SmemAtomQ>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQ{}, Shape<BlockM, HeadDim, Int<kStages>>{}));
  using SmemLayoutQStage = decltype(tile_to_shape(SmemAtomQ{}, Shape<BlockM, HeadDim>{}));  // the TMA box
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomK{}, Shape<BlockN, HeadDim>{}));
  // The same bytes read as (head dim, rows): the MN-major B operands of dV += P^T dO,
  // dK += dS^T Q (dO and Q transposed) and dQ = dS K (K transposed).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<HeadDim, BlockM, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutKt =
      decltype(composition(SmemLayoutK{}, make_ordered_layout(Shape<HeadDim, BlockN>{}, Step<_2, _1>{})));
  // dS as the A operand of dQ = dS K: (rows, keys) with the rows contiguous (MN-major), so a
  // consumer thread's dS^T accumulator pairs (adjacent rows) are adjacent in memory.
  using SmemAtomMN = decltype(GMMA::Layout_MN_SW128_Atom<Element>{});
  using SmemLayoutDs =
      decltype(tile_to_shape(SmemAtomMN{}, Shape<BlockM, BlockN, Int<Config::kDsBuffers>>{}));
  // The same bytes as (keys, rows, buffer), the rows contiguous: K-major A operands of the wide
  // kernel's dV += P^T dO and dK += dS^T Q.
  using SmemLayoutDst = decltype(composition(
      SmemLayoutDs{},
      make_ordered_layout(Shape<BlockN, BlockM, Int<Config::kDsBuffers>>{}, Step<_2, _1, _3>{})));

  // S^T = K Q^T and dP^T = V dO^T: the warpgroups stacked along M (keys), 64 keys x 64 rows each.
  using WgAlongM = Layout<Shape<_2, _1, _1>>;
  using TiledMmaSdPSplit = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<WgKeys, BlockM, HeadDim>>(), WgAlongM{}));
  // dV += P^T dO and dK += dS^T Q: A from registers (P^T, dS^T), B = dO^T, Q^T (MN-major).
  using TiledMmaDkvSplit =
      decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<WgKeys, HeadDim, BlockM>,
                                                   GMMA::Major::K, GMMA::Major::MN>(),
                              WgAlongM{}));
  // dQ = dS K: the Q block's rows x D over all 128 keys. 64 rows: the two warpgroups split the head
  // dim (at D = 96 48 columns each: common/gmma_64x48.cuh, a shape CuTe's selector leaves out);
  // 128 rows (Config::kDqRowsSplit): they split the rows, 64 x D each.
  static constexpr bool kDqRowsSplit = Config::kDqRowsSplit;
  static_assert(!kDqRowsSplit || kBlockM == 128, "a warpgroup's 64 rows of dQ");
  static constexpr int kDqWgCols = kDqRowsSplit ? kHeadDim : kHeadDim / 2;  // a warpgroup's dQ columns
  using DqSplitOp = std::conditional_t<
      kDqWgCols == 48, common::Gmma64x48x16SS<Element, GMMA::Major::MN, GMMA::Major::MN>,
      decltype(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kDqWgCols>, BlockN>,
                                    GMMA::Major::MN, GMMA::Major::MN>())>;
  using TiledMmaDqSplit = decltype(make_tiled_mma(
      DqSplitOp{}, std::conditional_t<kDqRowsSplit, Layout<Shape<_2, _1, _1>>, Layout<Shape<_1, _2, _1>>>{}));

  // The wide tile (Config::kWide, mainloop_bwd_wide.cuh): S^T and dP^T of all 64 keys with the
  // warpgroups along N (each 32 of the 64 query rows), P^T and dS^T through shared memory; dV and
  // dK with the warpgroups along N too (each one half of the head dim, A all of P^T, dS^T from
  // shared memory); dQ in kDqParts parts of 2 x kDqPartCols columns, each warpgroup kDqPartCols
  // of a part (64 at D = 256, so that dQ takes 32 registers a thread as in the 128 kernel; at 192
  // one part of 96).
  static constexpr bool kWide = Config::kWide;
  static constexpr int kStepRows = kWide ? kBlockM / 2 : kBlockM;  // query rows of a warpgroup's S^T
  static constexpr int kDqPartCols = kHeadDim == 256 ? 64 : kHeadDim / 2;
  static constexpr int kDqParts = kHeadDim / (2 * kDqPartCols);
  using TiledMmaSdPWide = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<WgKeys, Int<kStepRows>, HeadDim>>(),
      Layout<Shape<_1, _2, _1>>{}));
  using TiledMmaDkvWide = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<WgKeys, Int<kHeadDim / 2>, BlockM>, GMMA::Major::K,
                           GMMA::Major::MN>(),
      Layout<Shape<_1, _2, _1>>{}));
  using TiledMmaDqWide = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<BlockM, Int<kDqPartCols>, BlockN>, GMMA::Major::MN,
                           GMMA::Major::MN>(),
      Layout<Shape<_1, _2, _1>>{}));
  using TiledMmaSdP = std::conditional_t<kWide, TiledMmaSdPWide, TiledMmaSdPSplit>;
  using TiledMmaDkv = std::conditional_t<kWide, TiledMmaDkvWide, TiledMmaDkvSplit>;
  using TiledMmaDq = std::conditional_t<kWide, TiledMmaDqWide, TiledMmaDqSplit>;

  // Global tensors as TMA sees them: (rows, head dim, heads), strides from the caller.
  using GmemLayout = Layout<Shape<int32_t, HeadDim, int32_t>, Stride<int64_t, _1, int64_t>>;
  using TmaQ = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
      SmemLayoutQStage{}));
  using TmaK = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
      SmemLayoutK{}));
  // dQ partials in fp32, two stages, 128-byte swizzled (8 rows x 32 floats an atom): a warp's
  // accumulator stores (8 rows x 32 bytes) hit every bank twice, where a plain row-major stage
  // put the 8 rows on the same 8 banks. A stage is D / 32 boxes of (kBlockM rows x 32 floats),
  // kDqBoxBytes each; the dQ writer's TMA reduce-adds take (kDqRowGroup rows x 32 floats) boxes
  // of them (the tensor map dq_map unswizzles on the way to the accumulator [H x dq_rows][D]), only
  // the row groups that hold rows of the sequence.
  using SmemLayoutDq = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<float>{},
                                              Shape<BlockM, HeadDim, Int<Config::kDqStages>>{}));
  static constexpr int kDqBoxCols = 32;
  static constexpr int kDqRowGroup = 16;
  static constexpr uint32_t kDqBoxBytes = kBlockM * kDqBoxCols * sizeof(float);
  static constexpr uint32_t kDqStageBytes = kBlockM * kHeadDim * sizeof(float);

  // lse (log2 units) and delta of a Q block: [heads][q_stride] fp32 in the workspace, brought by
  // a 1D TMA load (tensor map over the whole array, box kStatRows) of kStatRows rows from the
  // 16-byte aligned row at or before the block's first row: the consumers read from (first row %
  // 4) on. A stage takes kStatStride floats (128-byte aligned, as a TMA destination must be).
  // (A plain bulk copy did the same work; compute-sanitizer's racecheck does not model its
  // completion on the mbarrier and reported every read of it: bench/micro/racecheck_bulk_copy.cu.)
  static constexpr int kStatRows = kBlockM + 4;
  static constexpr int kStatStride = (kStatRows + 31) / 32 * 32;
  static constexpr uint32_t kQBytes = Config::kQBytes;
  static constexpr uint32_t kKBytes = Config::kKBytes;
  static constexpr uint32_t kStatBytes = kStatRows * sizeof(float);
};

// One tile: decoded from the plan by the loading thread, read from the tile ring by the consumers.
struct TileInfo {
  int32_t batch;
  int32_t n_block;  // the tile's KV block in its sequence
  int32_t kv_head;
  int32_t q_start;
  int32_t kv_start;
  int32_t len_q;
  int32_t len_kv;
  int32_t m_lo;  // the Q blocks that see the KV block: [m_lo, m_hi], for each head of the group
  int32_t m_hi;
  // The Q block the tile starts at: m_lo, or (rotated_q_order) m_lo + n_block mod the count, so
  // the concurrent tiles of one (sequence, head) start at different Q blocks and their dQ
  // reduce-adds go to different rows; the loops visit [m_first, m_hi], then [m_lo, m_first).
  int32_t m_first;
  int32_t head_lo;  // the query heads of the tile: [head_lo, head_end), the whole group or a split of it
  int32_t head_end;
  int32_t split;  // which split of the group (0 when the group is not split)
  // The Q blocks whose every row sees every key of the tile (MaskPolicy::
  // unmasked_q_blocks_of_kv_block): their steps take no mask arithmetic at all.
  int32_t m_full_lo;
  int32_t m_full_hi;
};

// Where a dQ stage goes: written by the consumers with the stage, read by the dQ writer.
struct DqTarget {
  int64_t row;       // first accumulator row: head x dq_rows + q_start + 64 m
  int32_t sem;       // deterministic mode: the semaphore of (head, Q block), else unused
  int32_t sem_turn;  // its value when this KV block's turn comes
  int32_t stop;      // 1: no more stages (the consumers are done)
  int32_t rows;      // the Q block's rows inside its sequence (1..kBlockM): the rows reduce-added
};

template <class Traits>
struct SharedStorage {
  using Element = typename Traits::Element;
  cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutK>, 1024> k;
  cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutK>, 1024> v;
  cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutQ>, 1024> q;
  cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutQ>, 1024> dout;
  cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutDs>, 1024> ds;
  cute::array_aligned<float, cute::cosize_v<typename Traits::SmemLayoutDq>, 1024> dq;  // dQ stages
  cute::array_aligned<float, Traits::kStatStride * Traits::kStages, 128> lse;
  cute::array_aligned<float, Traits::kStatStride * Traits::kStages, 128> delta;
  DqTarget dq_target[Traits::kDqStages];
  // The plan lists a sequence's KV blocks last to first (built by the deterministic mode): there a
  // Q block's KV blocks add from the highest down, and the L2-grouped decode finds a sequence's
  // first position from it.
  int32_t dq_turns_descending;
  static constexpr uint32_t kTileSlots = 2;
  TileInfo tile[kTileSlots];
  int32_t has_tile[kTileSlots];
  uint64_t tile_full[kTileSlots];    // loader -> consumers: the slot holds the next tile
  uint64_t tile_empty[kTileSlots];   // consumers -> loader: the tile is done
  uint64_t k_full;                   // K of the tile landed
  uint64_t k_empty;                  // the consumers are done with K (the tile's last dQ GEMM)
  uint64_t v_full;                   // V of the tile landed
  uint64_t v_empty;                  // the consumers are done with V (the tile's last dP GEMM)
  uint64_t q_full[Traits::kStages];  // Q and lse of a Q block
  uint64_t q_empty[Traits::kStages];
  uint64_t do_full[Traits::kStages];  // dO and delta
  uint64_t do_empty[Traits::kStages];
  uint64_t dq_full[Traits::kDqStages];   // consumers -> dQ writer: a stage of dQ partials is written
  uint64_t dq_empty[Traits::kDqStages];  // dQ writer -> consumers: the bulk reduce has read the stage

  // The rings (kernels/common/ring.cuh) over these barriers; K and V are rings of one.
  __device__ __forceinline__ common::Ring<kTileSlots> tile_ring() { return {tile_full, tile_empty}; }
  __device__ __forceinline__ common::Ring<1> k_ring() { return {&k_full, &k_empty}; }
  __device__ __forceinline__ common::Ring<1> v_ring() { return {&v_full, &v_empty}; }
  __device__ __forceinline__ common::Ring<Traits::kStages> q_ring() { return {q_full, q_empty}; }
  __device__ __forceinline__ common::Ring<Traits::kStages> do_ring() { return {do_full, do_empty}; }
  __device__ __forceinline__ common::Ring<Traits::kDqStages> dq_ring() { return {dq_full, dq_empty}; }
};

template <class Traits>
struct Params {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaQ tma_do;
  typename Traits::TmaK tma_k;
  typename Traits::TmaK tma_v;
  const float* lse_log2;  // [heads][q_stride]
  const float* delta;     // [heads][q_stride]
  CUtensorMap lse_map;    // 1D over lse_log2 / delta (heads x q_stride floats), box kStatRows
  CUtensorMap delta_map;
  int64_t q_stride;
  int32_t total_q;
  int32_t total_kv;
  int32_t num_heads;
  int32_t num_heads_kv;
  int32_t group;
  // Pooled attention: Q is one shared [Lq, H, D] set loaded from row 0 for every sequence; dO, O,
  // the stats and the dQ accumulator count the output rows (q_offsets b * Lq).
  int32_t q_shared;
  // Pooled attention with one Q block a sequence and one query head a tile (Lq <= kBlockM, not
  // deterministic): every sequence's dQ goes to the same accumulator rows h x dq_rows + [0, Lq),
  // the tiles come head by head (scheduler_bwd.cuh), and a CTA sums the dQ partials of the
  // consecutive tiles of one head in its open dQ stage, handing it to the dQ writer (one
  // reduce-add) only when the head changes or the CTA is done.
  int32_t pooled_dq_sum;
  // A group split over group_splits tiles (few tiles for the SMs: MQA/GQA on a few long
  // sequences): each tile writes its dK (times the scale) and dV in fp32 to its split's slot of
  // dk_partial / dv_partial [group_splits][total_kv][heads_kv][D], summed by the dK/dV
  // postprocess. 1: the tile holds the whole group and stores dK, dV itself (null partials).
  int32_t group_splits;
  float* dk_partial;
  float* dv_partial;
  typename Traits::Element* dk;
  typename Traits::Element* dv;
  int64_t dk_row_stride, dk_head_stride, dv_row_stride, dv_head_stride;
  CUtensorMap
      dq_map;  // 2D over the accumulator [heads x dq_rows][D] fp32, box (kDqRowGroup, 32), 128-byte swizzle
  int32_t dq_total_rows;  // heads x dq_rows
  int64_t dq_rows;
  int32_t* dq_sems;  // deterministic mode: [heads][total_q], else null
  const int32_t* q_offsets;
  const int32_t* kv_offsets;
  MaskPolicy mask;
  float scale;
  float scale_log2;
  int32_t* error_flag;
  const schedule::PlanKey* plan_key;
  schedule::PlanKey expected_plan_key;
  const int32_t* sorted_pairs;
  const int32_t* pair_batch;
  const int32_t* pair_block;
  const int32_t* num_pairs;
  int32_t* tile_counter;
  Schedule schedule;
  // The tiles' order inside a sequence (scheduler_bwd.cuh), ignored by pooled_dq_sum: 0 for the
  // KV heads innermost (the whole group of heads per KV block); else the KV heads (x splits) in groups of at
  // most this many rows of Q x heads, so that a group's Q, dO and fp32 dQ stay in L2 while its KV blocks run,
  // heads innermost inside a group.
  int32_t l2_group_rows;
  int32_t rotated_q_order;  // 1: each tile starts at TileInfo::m_first (not the deterministic mode)
  // Last, so the fields before keep their places in the default kernels' parameter space; read
  // only by a kernel with a modifier (Traits::ScoreMod). With softcap, scale_log2 above is
  // cap x log2 e (common::score_mod_launch); scale stays the softmax scale dK and dQ take.
  common::ScoreModArgs score_mod;
  // kPaddedHeadDim: the caller's head dim in 16-byte chunks (the columns dk, dv take).
  int32_t head_dim_chunks;
  // kBlockSparse: the map (jf_block_mask); read only by a kernel built with it.
  BlockMask block_mask;
  // kPaddedHeadDim: v's head dim in 16-byte chunks (the columns dv takes; below q's with a v head
  // dim of its own, whose missing columns of V and dO arrive as zeros).
  int32_t v_head_dim_chunks;
};

}  // namespace jagflash::kernels::bwd
