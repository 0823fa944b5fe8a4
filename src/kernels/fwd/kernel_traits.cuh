// Types derived from the tile config: shared-memory layouts, TMA atoms, tiled MMAs, shared
// storage and the kernel's device parameters.
#pragma once

#include "core/block_mask.hpp"
#include "core/mask.hpp"
#include "kernels/common/barriers.cuh"
#include "kernels/common/ring.cuh"
#include "kernels/common/score_mod.cuh"
#include "kernels/fwd/tile_config.hpp"
#include "kernels/fwd/variants.hpp"
#include "schedule/plan.hpp"

#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>

#include <cstdint>
#include <type_traits>

namespace jagflash::kernels::fwd {

using namespace cute;
// The pipelines' mbarriers (kernels/common/barriers.cuh, shared with the backward).
using common::ArrivalBarrier;
using common::TxBarrier;

template <class Config>
struct KernelTraits {
  using Element = typename Config::Element;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kHeadDim = Config::kHeadDim;
  static constexpr int kStages = Config::kStages;
  static constexpr int kRowsPerWarpgroup = Config::kRowsPerWarpgroup;
  static constexpr bool kPingPong = Config::kPingPong;
  static constexpr int kPairs = Config::kPairs;
  static constexpr int kQBuffers = Config::kQBuffers;
  static constexpr int kConsumerWarpgroups = Config::kConsumerWarpgroups;
  static constexpr bool kQInRegisters = Config::kQInRegisters;
  using ScoreMod = common::KernelScoreMod<Config::kScoreMod>;
  static constexpr bool kPaddedHeadDim = Config::kPaddedHeadDim;
  static constexpr bool kBlockSparse = Config::kBlockSparse;

  using BlockM = Int<kBlockM>;
  using BlockN = Int<kBlockN>;
  using HeadDim = Int<kHeadDim>;
  using WgRows = Int<kRowsPerWarpgroup>;

  // Q, K, V tiles in shared memory: head dim contiguous, swizzled (the wgmma-native layout,
  // bank-conflict free for both the TMA writes and the tensor-core reads): 128-byte rows of the
  // atom where the head dim is a multiple of 64 elements, 64-byte ones at D = 96 (three atoms).
  using SmemAtom = std::conditional_t<kHeadDim % 64 == 0, decltype(GMMA::Layout_K_SW128_Atom<Element>{}),
                                      decltype(GMMA::Layout_K_SW64_Atom<Element>{})>;
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim>{}));  // one buffer (the TMA box)
  using SmemLayoutQBuffers =
      decltype(tile_to_shape(SmemAtom{}, Shape<BlockM, HeadDim, Int<Config::kQBuffers>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemAtom{}, Shape<BlockN, HeadDim, Int<kStages>>{}));
  using SmemLayoutKVStage = decltype(tile_to_shape(SmemAtom{}, Shape<BlockN, HeadDim>{}));
  // V read as the B operand of O = P V, i.e. as (head dim, keys): the same bytes, transposed view.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_ordered_layout(Shape<HeadDim, BlockN, Int<kStages>>{}, Step<_2, _1, _3>{})));

  // Each consumer warpgroup owns 64 rows of the tile (one wgmma M); the two are laid out along M
  // so partitioning a 128-row tile by consumer thread index hands each its rows. S = Q K^T reads
  // both operands from shared memory (Q from registers with kQInRegisters); O += P V takes P
  // from registers.
  using WgLayout = Layout<Shape<Int<Config::kConsumerWarpgroups>, _1, _1>>;
  using MmaAtomQK = std::conditional_t<
      Config::kQInRegisters,
      decltype(GMMA::rs_op_selector<Element, Element, float, Shape<WgRows, BlockN, HeadDim>>()),
      decltype(GMMA::ss_op_selector<Element, Element, float, Shape<WgRows, BlockN, HeadDim>>())>;
  using TiledMmaQK = decltype(make_tiled_mma(MmaAtomQK{}, WgLayout{}));
  using TiledMmaPV =
      decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<WgRows, HeadDim, BlockN>,
                                                   GMMA::Major::K, GMMA::Major::MN>(),
                              WgLayout{}));

  // Global tensors as TMA sees them: (rows, head dim, heads), row and head strides from the
  // caller, head dim contiguous.
  using GmemShape = Shape<int32_t, HeadDim, int32_t>;
  using GmemStride = Stride<int64_t, _1, int64_t>;
  using GmemLayout = Layout<GmemShape, GmemStride>;
  using TmaQ = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
      SmemLayoutQ{}));
  using TmaKV = decltype(make_tma_copy(
      SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}),
      SmemLayoutKVStage{}));

  // Sizes from the config, which also budgets the shared memory with them.
  static constexpr int kOStagingColumns = Config::kOStagingColumns;  // the head dim or half of it
  static constexpr int kOSmemStride = Config::kOSmemStride;
  static constexpr uint32_t kQBytes = Config::kQBytes;
  static constexpr uint32_t kKBytes = Config::kKVBlockBytes;  // one K (or V) block
};

// What one tile is: decoded from the plan by the scheduler thread, read from the tile ring by the
// producer and the consumers.
struct TileInfo {
  int32_t batch;
  int32_t m_block;
  int32_t head;
  int32_t kv_head;
  int32_t q_start;
  int32_t kv_start;
  int32_t len_q;
  int32_t len_kv;
  IndexRange kv_blocks;  // every KV block the tile visits
  IndexRange unmasked;   // the blocks among them that need no mask (may be empty)
};

template <class Traits>
struct SharedStorage {
  cute::array_aligned<typename Traits::Element, cute::cosize_v<typename Traits::SmemLayoutQBuffers>, 1024> q;
  cute::array_aligned<typename Traits::Element, cute::cosize_v<typename Traits::SmemLayoutKV>, 1024> k;
  cute::array_aligned<typename Traits::Element, cute::cosize_v<typename Traits::SmemLayoutKV>, 1024> v;
  // O of the tile on its way out (epilogue), [kBlockM][kOSmemStride]: kOStagingColumns at a time.
  cute::array_aligned<typename Traits::Element, Traits::kBlockM * Traits::kOSmemStride, 128> o;
  // Q is double-buffered by tile parity (kQBuffers = 2): the producer loads the next tile's Q
  // while the consumers still work on the current one, so a tile starts without waiting for its
  // Q and the two warpgroups may drift apart across tile boundaries.
  uint64_t q_full[2];   // producer -> consumers: Q of the tile landed
  uint64_t q_empty[2];  // consumers -> producer: Q may be overwritten
  // K and V have their own barriers: a K stage frees as soon as S = Q K^T is done, so the next
  // K load starts while the consumers still run the softmax and O += P V of the block.
  uint64_t k_full[Traits::kStages];
  uint64_t k_empty[Traits::kStages];
  uint64_t v_full[Traits::kStages];
  uint64_t v_empty[Traits::kStages];
  // The tiles, taken from the plan and decoded by the scheduler thread (an atomic and a chain
  // of dependent global loads, ~2000 clocks: kept off the producer, which would pay them
  // between one tile's last V and the next tile's Q, exposed at every start of a short tile).
  // A ring of kTileSlots by the CTA's tile ordinal: the scheduler runs up to kTileSlots tiles
  // ahead of the consumers' epilogue, which reads its slot again (the consumers need not keep
  // the tile in registers across the main loop; with three consumer warpgroups that spilled).
  static constexpr uint32_t kTileSlots = 4;
  TileInfo tile[kTileSlots];
  int32_t has_tile[kTileSlots];     // 0: no more work
  uint64_t tile_full[kTileSlots];   // scheduler -> producer: the slot holds the next tile
  uint64_t tile_empty[kTileSlots];  // consumers -> scheduler: the tile's epilogue is done

  // The rings (kernels/common/ring.cuh) over these barriers.
  __device__ __forceinline__ common::Ring<kTileSlots> tile_ring() { return {tile_full, tile_empty}; }
  __device__ __forceinline__ common::Ring<Traits::kQBuffers> q_ring() { return {q_full, q_empty}; }
  __device__ __forceinline__ common::Ring<Traits::kStages> k_ring() { return {k_full, k_empty}; }
  __device__ __forceinline__ common::Ring<Traits::kStages> v_ring() { return {v_full, v_empty}; }
};

// Device parameters: plain values, built once on the host by the launcher.
template <class Traits>
struct Params {
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaKV tma_v;
  int32_t total_q;
  int32_t total_kv;
  int32_t num_heads;
  int32_t num_heads_kv;
  int32_t group;  // query heads per kv head
  // Pooled attention (jf_problem.pooled_q_rows): every sequence's queries are the rows of one
  // shared q [Lq, H, D], loaded from row 0; q_offsets are then b * Lq, the output rows.
  int32_t q_shared;
  typename Traits::Element* out;
  int64_t out_row_stride;
  int64_t out_head_stride;
  float* lse;  // [H, total_q] or null
  const int32_t* q_offsets;
  const int32_t* kv_offsets;
  MaskPolicy mask;
  float scale;
  float scale_log2;
  int32_t* error_flag;  // the kernel sets schedule::kPlanMismatchFlag in it
  // What the plan in the workspace was built for, and what this launch needs (schedule::PlanKey).
  const schedule::PlanKey* plan_key;
  schedule::PlanKey expected_plan_key;
  // The plan (schedule/plan_device): (batch, q block) pairs, heaviest sequence first, a sequence's pairs
  // together.
  const int32_t* sorted_pairs;
  const int32_t* pair_batch;
  const int32_t* pair_block;
  const int32_t* num_pairs;
  int32_t* tile_counter;
  Schedule schedule;
  // Last, so the fields before keep their places in the default kernels' parameter space; read
  // only by a kernel with a modifier (Traits::ScoreMod). With softcap, scale and scale_log2 above
  // are the lse's and the exponent's factors (common::score_mod_launch), cap in place of scale.
  common::ScoreModArgs score_mod;
  // PaddedHeadDim: the caller's head dim in 16-byte chunks (the columns the epilogue stores).
  int32_t head_dim_chunks;
  // BlockSparse: the map (jf_block_mask); read only by a kernel built with that option.
  BlockMask block_mask;
  // How a sequence's heads are grouped in the plan's order (schedule::forward_head_group).
  schedule::HeadOrder head_order;
  // OnlineSoftmax's keep_max (log2 units; < 0: the running max always moves, O always rescaled).
  float keep_max;
  // [H] fp32 or null (jf_problem::learnable_sink): folded into each row's sum by the epilogue.
  const float* learnable_sink;
};

}  // namespace jagflash::kernels::fwd
