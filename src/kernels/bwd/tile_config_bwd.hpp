// Tile shapes of the Hopper backward kernel, chosen in one place.
#pragma once

#include <jagflash/jagflash.h>

#include <cutlass/numeric_types.h>

namespace jagflash::kernels::bwd {

// A CTA owns one tile: kBlockN = 128 keys of one KV head (K and V stay in shared memory) and
// loops over the Q blocks of kBlockM = 64 query rows that see them, for every query head of the
// KV head's group. Two consumer warpgroups own 64 keys each: with the swapped products
// S^T = K Q^T and dP^T = V dO^T (64 keys x 64 rows per warpgroup), P^T and dS^T are already the
// register A operands of dV += P^T dO and dK += dS^T Q, and dK, dV (64 x D fp32 each) stay in
// registers across the whole loop. dQ = dS K needs every key of the tile: dS goes through shared
// memory and the two warpgroups split dQ's head dim.
// Q with its lse and dO with its delta come through a kStages ring; dS is double-buffered (a
// warpgroup may write the next block's dS while the other still reads this one in its dQ GEMM);
// dQ's fp32 partials go through kDqStages shared-memory stages to the dQ writer's bulk reduce-add.
// kScoreMod: the score modifier the kernel applies (kernels/common/score_mod.cuh); none compiles
// to the kernel without one. kPaddedHeadDim: the caller's head dim is below kHeadDim (a multiple of
// 8): Q, K, V, dO arrive zero-filled past it (the TMA's out-of-bounds fill), the fp32 dQ
// accumulator and partials keep kHeadDim columns, and only the caller's are read from O, dO and
// written to dq, dk, dv (Params::head_dim_chunks). kBlockSparse: a block-sparse map
// (jf_block_mask) says which Q blocks see the tile's KV block; the loader and the consumers skip
// the others (common::QBlockFilter).
template <class Element_, int kHeadDim_, jf_score_mod kScoreMod_ = JF_SCORE_MOD_NONE,
          bool kPaddedHeadDim_ = false, bool kBlockSparse_ = false>
struct TileConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr jf_score_mod kScoreMod = kScoreMod_;
  static constexpr bool kPaddedHeadDim = kPaddedHeadDim_;
  static constexpr bool kBlockSparse = kBlockSparse_;
  // The wide kernels (head dims 192 and 256; mainloop_bwd_wide.cuh): 64 x D fp32 of dK and of dV no
  // longer fit one warpgroup's registers, and 128 keys of K and V not beside a Q/dO stage and a
  // dQ stage in shared memory. A tile holds 64 keys; each warpgroup computes S^T and dP^T of all
  // of them for its 32 of the Q block's 64 rows, and owns one half of the head dim of dK, dV and
  // dQ, whose GEMMs read all of P^T and dS^T from shared memory (both warpgroups' rows).
  static constexpr bool kWide = kHeadDim > 128;
  // At D = 64 without a modifier or a map a step takes 128 query rows (kBlockM, the same rule as
  // kernels::backward_block_m): the step's fixed work (barrier, waits, stats, the dQ hand-over) is
  // spread over twice the FLOPs, and S^T, dP^T (64 keys x 128 rows a warpgroup) are the wgmma's
  // wider N. dK, dV hold 32 registers each there, so the 64 + 64 of S^T and dP^T fit beside
  // them; dQ = dS K then splits its rows between the warpgroups (kDqRowsSplit: 64 rows x D each)
  // instead of its head dim. A modifier's or a map's work per score did not fit beside them
  // (softcap, relative bias: 14-15 spill instructions in the step): those keep 64 rows.
  static constexpr int kBlockM = kHeadDim == 64 && kScoreMod == JF_SCORE_MOD_NONE && !kBlockSparse ? 128 : 64;
  static constexpr bool kDqRowsSplit = kBlockM == 128;
  static constexpr int kBlockN = kWide ? 64 : 128;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kKeysPerWarpgroup = kWide ? kBlockN : kBlockN / kConsumerWarpgroups;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);
  // Shared memory of the wide tile at D = 256: K 32 + V 32 + one Q and one dO stage 64 + the P/dS
  // buffers 32 (two of dS, two of P, 8 KB each; at a tile's end each warpgroup's dK/dV staging,
  // 16 KB) + one fp32 dQ stage
  // 64 = 224 KB of the 227; at 192 two Q/dO stages fit (24 + 24 + 96 + 32 + 48), its operands in
  // 64-byte swizzle atoms (kernel_traits_bwd.cuh: a warpgroup's 96 columns are whole atoms).
  static constexpr int kStages = kHeadDim == 256 ? 1 : 2;
  static constexpr int kDsBuffers = kWide ? 4 : 2;
  static constexpr int kDqStages = kWide ? 1 : 2;

  static constexpr int kSmemLimit = 227 * 1024;
  static constexpr int kQBytes = kBlockM * kHeadDim * int(sizeof(Element));
  static constexpr int kKBytes = kBlockN * kHeadDim * int(sizeof(Element));

  // setmaxnreg: the producer warpgroup (one loading thread, one dQ-writer thread) keeps 24, the
  // consumers get 240: 24 x 128 + 240 x 256 = 168 x 384, the pool the CTA starts with (the
  // launch bound's 168 registers a thread). A request past the pool never completes. At D = 64
  // the consumers' dK/dV accumulators are half as large: 72 / 216 ends the loader's spills (476
  // bytes of stores at 24, 0 at 72; the consumers stay free of local memory, check_sass); at
  // D = 128, 32 / 232 makes ptxas serialise the consumers' wgmmas and spill them. At D = 96
  // (96 registers of dK/dV a thread) 56 / 224 ends the loader's spills (316 bytes at 24; 40 / 232
  // leaves 92), the consumers free of local memory either way.
  static constexpr int kProducerRegisters = kHeadDim == 64 ? 24 : kHeadDim == 96 ? 56 : 24;
  static constexpr int kConsumerRegisters = kHeadDim == 64 ? 240 : kHeadDim == 96 ? 224 : 240;

  static_assert(kHeadDim == 64 || kHeadDim == 96 || kHeadDim == 128 || kHeadDim == 192 || kHeadDim == 256,
                "the Hopper backward serves head dims 64, 96, 128, 192 and 256");
  static_assert(!kBlockSparse || (JF_BLOCK_MASK_BLOCK % kBlockM == 0 && JF_BLOCK_MASK_BLOCK % kBlockN == 0),
                "a block-sparse map's blocks hold whole tiles");
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * 128 * kConsumerWarpgroups <= 168 * kThreads,
                "the CTA's register pool");
};

}  // namespace jagflash::kernels::bwd
