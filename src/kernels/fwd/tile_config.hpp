// Tile shapes of the Hopper forward kernel, chosen in one place.
#pragma once

#include <jagflash/jagflash.h>

#include <cutlass/numeric_types.h>
#include <cute/tensor.hpp>

namespace jagflash::kernels::fwd {

// kConsumerWarpgroups x 64 query rows per tile (kBlockM): each consumer warpgroup owns 64 rows
//   (the M of one wgmma) and every K/V stage feeds all of them. Two at D = 128; three at D = 64
//   are an option, where the GEMMs of one block are half as long and the softmax (as long as at
//   D = 128) needs more GEMM time from the other warpgroups to hide behind.
// kBlockN keys per block: 128 by default (S 64 x 128 fp32 and O 64 x D fp32 fit the consumer
//   registers with P in bf16); 64 wastes less of short sequences' last block. D = 256 takes 32:
//   O alone is 128 fp32 registers a thread, and one Q buffer (64 KB), the O staging tile (66 KB)
//   and three K/V stages of 32 keys (96 KB) fill the shared memory.
// kStages K/V stages: as many as fit (up to 4) next to two Q buffers and the O staging tile in
//   the 227 KB a CTA may use: 2 at D = 128 with 128-key blocks (231.7 KB of 232448 bytes).
// kPingPong: the two consumer warpgroups take turns issuing their GEMMs (named barriers), so
//   one's softmax runs while the other's GEMMs use the tensor cores.
// kPairs: independent (producer, consumers) pairs in one CTA. With 2, each consumer warpgroup
//   works alone on its own 64-row tiles with its own producer thread, Q buffer and K/V ring
//   (half the shared memory each): tiles of short sequences waste fewer rows, and the two
//   warpgroups never wait for each other, so one's softmax and epilogue overlap the other's GEMMs.
// kQInRegisters: each consumer warpgroup copies its 64 rows of Q from shared memory into
//   registers once per tile (ldmatrix) and S = Q K^T takes A from there, so the S GEMMs read only
//   K from shared memory, and the Q buffer is released to the producer at the tile's start.
//   Costs 32 registers a thread at D = 128 (16 at D = 64). Faster at D = 64 with two warpgroups
//   under causal, slower at D = 128 and on short sequences (their S GEMMs are not short of
//   shared-memory bandwidth), and no room in the three-warpgroup D = 64 tile (ptxas serialises
//   the wgmmas and spills); the figures: bench/NOTES.md.
//
// The choices are named option tags after the dtype and head dim, in any order, each left out
// keeping its default (no positional list of flags):
//   TileConfig<Element, 64, Warpgroups<3>>
//   TileConfig<Element, 128, BlockN<64>, Warpgroups<1>, Pairs<2>>
// ScoreModifier<kind>: the score modifier the kernel applies (kernels/common/score_mod.cuh);
//   none by default, which compiles to the kernel without one.
// PaddedHeadDim: the caller's head dim is smaller than kHeadDim (a multiple of 8 below it): the
//   TMA's box is kHeadDim wide over a tensor of the caller's width, so the missing columns of
//   Q, K, V arrive as zeros (its out-of-bounds fill; nothing is copied) and add nothing to S or O,
//   and the epilogue stores only the caller's columns (Params::head_dim_chunks).
// BlockSparse: a block-sparse map (jf_block_mask) says which KV blocks each query block visits;
//   the producer and the consumers walk the visible ones only (KvBlockWalk, mainloop_fwd.cuh).
//   The map's blocks (BlockMask::kBlock tokens a side) must be whole multiples of the tile's.
struct PingPong {};
struct QInRegisters {};
template <int kKeys>
struct BlockN {};
template <int kCount>
struct Warpgroups {};
template <int kCount>
struct Pairs {};
template <jf_score_mod kKind>
struct ScoreModifier {};
struct PaddedHeadDim {};
struct BlockSparse {};

namespace detail {
// Folds the option tags over the defaults: each level overrides (hides) one member of the rest.
template <class... Options>
struct TileOptions;
template <>
struct TileOptions<> {
  static constexpr bool kPingPong = false;
  static constexpr bool kQInRegisters = false;
  static constexpr int kBlockN = 128;
  static constexpr int kWarpgroups = 2;
  static constexpr int kPairs = 1;
  static constexpr jf_score_mod kScoreMod = JF_SCORE_MOD_NONE;
  static constexpr bool kPaddedHeadDim = false;
  static constexpr bool kBlockSparse = false;
};
template <class... Rest>
struct TileOptions<PingPong, Rest...> : TileOptions<Rest...> {
  static constexpr bool kPingPong = true;
};
template <class... Rest>
struct TileOptions<QInRegisters, Rest...> : TileOptions<Rest...> {
  static constexpr bool kQInRegisters = true;
};
template <int kKeys, class... Rest>
struct TileOptions<BlockN<kKeys>, Rest...> : TileOptions<Rest...> {
  static constexpr int kBlockN = kKeys;
};
template <int kCount, class... Rest>
struct TileOptions<Warpgroups<kCount>, Rest...> : TileOptions<Rest...> {
  static constexpr int kWarpgroups = kCount;
};
template <int kCount, class... Rest>
struct TileOptions<Pairs<kCount>, Rest...> : TileOptions<Rest...> {
  static constexpr int kPairs = kCount;
};
template <jf_score_mod kKind, class... Rest>
struct TileOptions<ScoreModifier<kKind>, Rest...> : TileOptions<Rest...> {
  static constexpr jf_score_mod kScoreMod = kKind;
};
template <class... Rest>
struct TileOptions<PaddedHeadDim, Rest...> : TileOptions<Rest...> {
  static constexpr bool kPaddedHeadDim = true;
};
template <class... Rest>
struct TileOptions<BlockSparse, Rest...> : TileOptions<Rest...> {
  static constexpr bool kBlockSparse = true;
};
}  // namespace detail

template <class Element_, int kHeadDim_, class... Options>
struct TileConfig {
  using Chosen = detail::TileOptions<Options...>;
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kPingPong = Chosen::kPingPong;
  static constexpr int kConsumerWarpgroups = Chosen::kWarpgroups;  // per tile (and pair)
  static constexpr int kPairs = Chosen::kPairs;
  static constexpr bool kQInRegisters = Chosen::kQInRegisters;
  static constexpr jf_score_mod kScoreMod = Chosen::kScoreMod;
  static constexpr bool kPaddedHeadDim = Chosen::kPaddedHeadDim;
  static constexpr bool kBlockSparse = Chosen::kBlockSparse;
  static constexpr int kAllConsumerWarpgroups = kPairs * kConsumerWarpgroups;
  static constexpr int kRowsPerWarpgroup = 64;
  static constexpr int kBlockM = kRowsPerWarpgroup * kConsumerWarpgroups;
  static constexpr int kBlockN = Chosen::kBlockN;
  static constexpr int kThreads = 128 * (1 + kAllConsumerWarpgroups);  // producer warpgroup + consumers

  static constexpr int kSmemLimit = 227 * 1024;
  static constexpr int kPairSmemLimit = kSmemLimit / kPairs;
  static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));        // one Q buffer
  static constexpr int kKVBlockBytes = kBlockN * kHeadDim * int(sizeof(Element));  // one K (or V) block
  // O staging rows are padded by 16 bytes: the accumulator writes of a warp (8 rows x 4 threads)
  // then hit 32 different banks.
  static constexpr int staging_bytes(int columns) {
    return kBlockM * (columns + 16 / int(sizeof(Element))) * int(sizeof(Element));
  }
  static constexpr int kStageBytes = 2 * kKVBlockBytes;  // K and V
  static constexpr int fit_stages_with(int q_buffers, int o_columns) {
    return (kPairSmemLimit - q_buffers * kQBytes - staging_bytes(o_columns) - 1024) / kStageBytes;
  }
  // The O staging tile holds the whole head dim, or half of it where the whole would leave fewer
  // than two K/V stages next to one Q buffer (176-key blocks at D = 128: 2 x 88 KB of K/V, 32 KB
  // of Q, and 18 KB of half-width staging fill the 227 KB; whole-width staging, 34 KB, does not
  // fit). The epilogue then stages and stores each warpgroup's rows in two rounds of half the
  // columns (epilogue_fwd.cuh); each warpgroup keeps its own rows, so no warpgroup waits for another.
  static constexpr int kOStagingColumns = fit_stages_with(1, kHeadDim) >= 2 ? kHeadDim : kHeadDim / 2;
  static constexpr int kOSmemStride = kOStagingColumns + 16 / int(sizeof(Element));
  static constexpr int kOStagingBytes = staging_bytes(kOStagingColumns);
  static constexpr int fit_stages(int q_buffers) { return fit_stages_with(q_buffers, kOStagingColumns); }
  // Two Q buffers: the next tile's Q loads while the current one runs. Past D = 128 a second
  // buffer does not fit next to two K/V stages. With two pairs, two each where they leave as
  // many stages as one (D = 64: two stages of 128 keys, D = 96: three of 64); at D = 128 they
  // would leave a single stage of 64 keys, so one, and the other pair hides the wait.
  // 160- and 176-key blocks at D = 128 (FA3 takes 176 there without a mask: fewer blocks a row,
  // so less of each block's fixed work, the max, the rescale, the barriers, a key) leave two stages
  // with one Q buffer: 2 x 80 KB + 32 KB + 34 KB (O staging) + 1 KB of the 227 KB at 160, and
  // 2 x 88 KB + 32 KB + 18 KB (half-width O staging) + 1 KB at 176.
  static constexpr int kQBuffers = kHeadDim > 128 || kBlockN > 128  ? 1
                                   : kPairs == 1                    ? 2
                                   : fit_stages(2) >= fit_stages(1) ? 2
                                                                    : 1;
  static constexpr int kFitStages = fit_stages(kQBuffers);
  static constexpr int kStages = kFitStages > 4 ? 4 : kFitStages;

  // Registers after setmaxnreg: producer x 128 + consumers x 128 x warpgroups <= 64K per SM.
  // With two consumer warpgroups the producer warpgroup keeps 56 (its scheduler thread decodes
  // tiles with 64-bit mask arithmetic; 24 and 40 spilled) and the consumers get 224; with three,
  // 32 and 160: the scheduler thread then spills ~128 bytes to local memory (once per tile, off
  // the critical path), and 152 for the consumers, which would free registers for it, makes
  // the consumers spill instead.
  static constexpr int kProducerRegisters = kAllConsumerWarpgroups == 2 ? 56 : 32;
  static constexpr int kConsumerRegisters = kAllConsumerWarpgroups == 2 ? 224 : 160;

  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "the Hopper forward serves head dims 64, 96, 128, 192, 256");
  static_assert(kBlockN == 64 || kBlockN == 128 || (kBlockN == 32 && kHeadDim == 256) ||
                    ((kBlockN == 160 || kBlockN == 176) && kHeadDim == 128 && kPairs == 1),
                "key blocks of 64 or 128 (32 at D = 256; 160 or 176 at D = 128 with one pair)");
  static_assert(kOStagingColumns == kHeadDim ||
                    (kOStagingColumns * 2 == kHeadDim && kOStagingColumns % 16 == 0),
                "O staged whole or in two halves of whole 16-byte chunks");
  static_assert(kHeadDim < 256 || (kPairs == 1 && kConsumerWarpgroups == 2),
                "D = 256: one pair, two warpgroups");
  static_assert(kAllConsumerWarpgroups == 2 || kAllConsumerWarpgroups == 3,
                "two or three consumer warpgroups");
  static_assert(kPairs == 1 || (kPairs == 2 && kConsumerWarpgroups == 1 && !kPingPong),
                "two pairs of one consumer warpgroup each, or one pair");
  static_assert(!kPingPong || kConsumerWarpgroups == 2, "ping-pong takes turns between two warpgroups");
  static_assert(kStages >= 2, "at least two K/V stages");
  static_assert(!kBlockSparse || (JF_BLOCK_MASK_BLOCK % kBlockM == 0 && JF_BLOCK_MASK_BLOCK % kBlockN == 0),
                "a block-sparse map's blocks hold whole tiles");
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * 128 * kAllConsumerWarpgroups <= 65536,
                "register file");
};

}  // namespace jagflash::kernels::fwd
