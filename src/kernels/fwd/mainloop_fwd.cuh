// The forward's main loop inside a persistent CTA (once per pair when kPairs = 2, each pair with
// its own shared storage); the tiles come from the scheduler thread (scheduler_fwd.cuh).
//  Producer (one thread of the producer warpgroup): takes the tiles from the ring, publishes
//    each to the consumers with its Q, and issues the TMA loads: Q once per tile, K and V
//    through the kStages ring.
//  Consumers (the pair's warpgroups, 64 rows each): S = Q K^T, mask (only on the peeled blocks),
//    online softmax, O += P V, then the epilogue. A KV block's math between the GEMMs is
//    StepMath's (step_fwd.cuh); here are the waits, the GEMM issues and the releases.
#pragma once

#include "kernels/common/barriers.cuh"
#include "kernels/common/block_sparse.cuh"
#include "kernels/common/ring.cuh"
#include "kernels/common/warpgroup_gemm.cuh"
#include "kernels/fwd/barrier_ids_fwd.hpp"
#include "kernels/fwd/epilogue_fwd.cuh"
#include "kernels/fwd/kernel_traits.cuh"
#include "kernels/fwd/scheduler_fwd.cuh"
#include "kernels/fwd/softmax.cuh"
#include "kernels/fwd/step_fwd.cuh"
#include "kernels/fwd/trace_fwd.cuh"

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>

namespace jagflash::kernels::fwd {

using namespace cute;

using common::warpgroup_gemm;  // kernels/common/warpgroup_gemm.cuh, shared with the backward

// Copies this thread's part of the Q tile in shared memory (one buffer) into the A-operand
// registers of S = Q K^T (kQInRegisters): ldmatrix reads the swizzled tile in the wgmma's
// register layout.
template <class Element, class TiledMma, class TS, class TR>
__device__ __forceinline__ void copy_q_to_registers(TiledMma const& mma, TS const& sQ_buffer, TR& tSrQ,
                                                    int thread) {
  auto q_copy = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma);
  auto thr_q_copy = q_copy.get_thread_slice(thread);
  Tensor tQrQ = thr_q_copy.retile_D(tSrQ);
  copy(q_copy, thr_q_copy.partition_S(sQ_buffer), tQrQ);
}

// The KV blocks a tile visits, from the top of its range down: with BlockSparse the map row of
// its query block decides, else every block of the mask's range.
template <class Traits>
__device__ __forceinline__ common::KvBlockWalk<Traits::kBlockSparse, Traits::kBlockN> kv_block_walk(
    const Params<Traits>& p, const TileInfo& t) {
  common::KvBlockWalk<Traits::kBlockSparse, Traits::kBlockN> walk;
  if constexpr (Traits::kBlockSparse)
    walk.row = p.block_mask.row(t.batch, t.m_block * Traits::kBlockM / BlockMask::kBlock, t.len_kv);
  return walk;
}

template <class Traits>
struct Producer {
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using HeadDim = typename Traits::HeadDim;
  static constexpr int kStages = Traits::kStages;

  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem, int pair) {
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.total_q, HeadDim{}, p.num_heads));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.total_kv, HeadDim{}, p.num_heads_kv));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.total_kv, HeadDim{}, p.num_heads_kv));
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQBuffers{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});

    constexpr uint32_t kSlots = SharedStorage<Traits>::kTileSlots;
    uint32_t q_uses = 0, k_uses = 0, v_uses = 0;
    for (;;) {
      // Tile ordinal q_uses: its slot in the tile ring, its Q buffer (the previous user of the
      // buffer is kQBuffers tiles back).
      constexpr uint32_t kQBuffers = Traits::kQBuffers;
      const uint32_t q_buf = q_uses % kQBuffers, slot = q_uses % kSlots;
      smem.tile_ring().wait(q_uses);
      const bool has_tile = smem.has_tile[slot];
      smem.q_ring().acquire(q_uses);
      if (!has_tile) {
        smem.q_ring().commit(q_buf);  // the consumers read has_tile = 0 and stop
        return;
      }
      const TileInfo t = smem.tile[slot];

      // Rows are addressed from the sequence's first token: loads past its end read the next
      // sequence (masked by the consumers, never stored) or are zero-filled past the tensor. A
      // shared (pooled) query set is every sequence's, from its first row.
      const int32_t q_load_start = p.q_shared ? 0 : t.q_start;
      Tensor gQ = local_tile(domain_offset(make_coord(q_load_start, _0{}), mQ(_, _, t.head)),
                             Shape<BlockM, HeadDim>{}, make_coord(t.m_block, _0{}));
      auto [tQg, tQs] =
          tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      smem.q_ring().commit_tx(q_buf, Traits::kQBytes);
      copy(p.tma_q.with(smem.q_full[q_buf]), tQg, tQs(_, q_buf));

      Tensor gK = local_tile(domain_offset(make_coord(t.kv_start, _0{}), mK(_, _, t.kv_head)),
                             Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));
      Tensor gV = local_tile(domain_offset(make_coord(t.kv_start, _0{}), mV(_, _, t.kv_head)),
                             Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));
      // Not structured bindings: the loaders below capture them (a C++20 feature otherwise).
      auto k_parts =
          tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto v_parts =
          tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      Tensor tKg = get<0>(k_parts);
      Tensor tKs = get<1>(k_parts);
      Tensor tVg = get<0>(v_parts);
      Tensor tVs = get<1>(v_parts);
      // Same order as the consumers: last block first (the masked tail), down to the first.
      // K of a block is issued one block ahead of V (K[n], then V[n+1]): the consumers need K of
      // block n while they still multiply by V of the block before it.
      // One K or V block into the next stage of its ring (uses: that ring's load count).
      // (The ring's arrays are passed as the storage's members: passing smem.k_ring() moved two
      // address instructions of this loop.)
      auto load_block = [&](const auto& tma, const auto& tg, const auto& ts, uint64_t* full, uint64_t* empty,
                            uint32_t& uses, int32_t n) {
        const common::Ring<kStages> ring{full, empty};
        const uint32_t stage = uses % kStages;
        ring.acquire(uses);
        ring.commit_tx(stage, Traits::kKBytes);
        copy(tma.with(full[stage]), tg(_, n), ts(_, stage));
        ++uses;
      };
      auto load_k = [&](int32_t n) { load_block(p.tma_k, tKg, tKs, smem.k_full, smem.k_empty, k_uses, n); };
      auto load_v = [&](int32_t n) { load_block(p.tma_v, tVg, tVs, smem.v_full, smem.v_empty, v_uses, n); };
      const int32_t n_hi = static_cast<int32_t>(t.kv_blocks.hi), n_lo = static_cast<int32_t>(t.kv_blocks.lo);
      if constexpr (!Traits::kBlockSparse) {
        for (int32_t n = n_hi; n >= n_lo; --n) {
          load_k(n);
          if (n < n_hi) load_v(n + 1);
        }
        if (n_lo <= n_hi) load_v(n_lo);
      } else {  // the visible blocks only, in the same order (the consumers walk the same)
        const auto walk = kv_block_walk<Traits>(p, t);
        int32_t previous = n_lo - 1;
        for (int32_t n = walk.at_or_below(n_hi, n_lo); n >= n_lo; n = walk.after(n, n_lo)) {
          load_k(n);
          if (previous >= n_lo) load_v(previous);
          previous = n;
        }
        if (previous >= n_lo) load_v(previous);
      }
      ++q_uses;
    }
  }
};

// Ping-pong between the two consumer warpgroups: each waits for its turn before issuing a
// group of GEMMs and hands the turn to the other right after, so the tensor cores work for one
// warpgroup while the other runs its softmax. Warpgroup 0 goes first. Both warpgroups issue the
// same number of groups per tile, so the turns stay paired across tiles. A no-op without kPingPong.
// Hardware barriers FwdBarrier::kTurn0 and kTurn1 (barrier_ids_fwd.hpp). Each turn is one
// predicated asm block, so
// no branch sits between the GEMMs' issue and their wait (where ptxas is quick to serialize
// every wgmma: C7514/C7518, see the wait in Consumer::run).
template <bool kPingPong>
struct WarpgroupTurns {
  static constexpr uint32_t kThreads = 256;  // both consumer warpgroups
  static constexpr uint32_t kTurn0 = static_cast<uint32_t>(FwdBarrier::kTurn0);
  static constexpr uint32_t kTurn1 = static_cast<uint32_t>(FwdBarrier::kTurn1);
  uint32_t warpgroup;
  __device__ explicit WarpgroupTurns(int wg) : warpgroup(static_cast<uint32_t>(wg)) {
    if constexpr (kPingPong)
      asm volatile("{\n .reg .pred p;\n setp.eq.u32 p, %0, 1;\n @p bar.arrive %2, %1;\n}\n" ::"r"(warpgroup),
                   "n"(kThreads), "n"(kTurn0)
                   : "memory");
  }
  // Warpgroup 0 waits on kTurn0, warpgroup 1 on kTurn1.
  __device__ void wait_turn() const {
    if constexpr (kPingPong)
      asm volatile(
          "{\n .reg .pred p;\n setp.eq.u32 p, %0, 0;\n @p bar.sync %2, %1;\n @!p bar.sync %3, %1;\n}\n" ::"r"(
              warpgroup),
          "n"(kThreads), "n"(kTurn0), "n"(kTurn1)
          : "memory");
  }
  __device__ void pass_turn() const {
    if constexpr (kPingPong)
      asm volatile(
          "{\n .reg .pred p;\n setp.eq.u32 p, %0, 0;\n @p bar.arrive %3, %1;\n @!p bar.arrive %2, %1;\n}\n" ::
              "r"(warpgroup),
          "n"(kThreads), "n"(kTurn0), "n"(kTurn1)
          : "memory");
  }
};

template <class Traits>
struct Consumer {
  using Element = typename Traits::Element;
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using HeadDim = typename Traits::HeadDim;
  static constexpr int kStages = Traits::kStages;
  using Step = StepMath<Traits>;  // one KV block's math between the GEMMs (step_fwd.cuh)

  // thread: index among the pair's consumer threads (its warpgroups' rows follow from it).
  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem, int thread, int pair) {
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    // The GEMMs' shared-memory operands are partitioned by warpgroup only (a wgmma's descriptor is
    // one for its 128 threads): sliced at the warpgroup's first thread, read through a shuffle the
    // compiler knows to be warp-uniform, each k-block's descriptor is built in uniform registers.
    // Sliced at `thread`, the S GEMM's were built in per-thread registers and moved over (R2UR,
    // IMAD a k-block: bench/NOTES.md, "The measurements behind the code's defaults").
    // Not with an elementwise modifier (the relative bias): there the uniform registers it takes
    // left its per-score table reads short and the consumers spilled (2 LDL/STL, check_sass).
    const int slice_thread =
        Traits::ScoreMod::kElementwise ? thread : __shfl_sync(0xffffffffu, thread / 128, 0) * 128;
    auto thr_qk = mma_qk.get_thread_slice(slice_thread);
    auto thr_pv = mma_pv.get_thread_slice(slice_thread);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQBuffers{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
    // Q as S's A operand: smem descriptors (MMA, M, K, buffer), or one buffer's registers.
    constexpr bool kQInRegisters = Traits::kQInRegisters;
    Tensor tSrQ = [&] {
      if constexpr (kQInRegisters)
        return thr_qk.partition_fragment_A(sQ(_, _, 0));
      else
        return thr_qk.partition_fragment_A(sQ);
    }();
    Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, D, keys, stage)

    Tensor tSrS = partition_fragment_C(mma_qk, Shape<BlockM, BlockN>{});
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<BlockM, HeadDim>{});
    Tensor s_rc = make_tensor(tSrS.data(), rowcol_layout(tSrS.layout()));
    Tensor o_rc = make_tensor(tOrO.data(), rowcol_layout(tOrO.layout()));
    const AccumulatorCoords coords(thread);
    constexpr int kRows = decltype(size<0>(s_rc))::value;
    OnlineSoftmax<kRows> softmax;

    // P (the probabilities in the input dtype) doubles as the A operand of O += P V.
    Tensor tOrP = make_tensor_like<Element>(tSrS);
    Tensor tOrP_a = make_tensor(tOrP.data(), acc_as_a_operand_layout(tOrP.layout()));

    const int lane = thread % 32;
    const WarpgroupTurns<Traits::kPingPong> turns(thread / 128);
    uint32_t q_uses = 0, k_uses = 0, v_uses = 0;
    ConsumerTrace trace;  // empty unless built with -DJAGFLASH_FWD_TRACE
    const int trace_thread = thread + pair * 128 * Traits::kConsumerWarpgroups;  // among all consumers
    for (;;) {
      constexpr uint32_t kQBuffers = Traits::kQBuffers;
      const uint32_t q_buf = q_uses % kQBuffers, slot = q_uses % SharedStorage<Traits>::kTileSlots;
      smem.q_ring().wait(q_uses);
      trace.tile_start(trace_thread, q_uses);
      if (!smem.has_tile[slot]) return;
      const TileInfo t = smem.tile[slot];
      if constexpr (kQInRegisters) {
        // Every S GEMM of the previous tile has completed (waited before its softmax).
        warpgroup_fence_operand(tSrQ);
        copy_q_to_registers<Element>(mma_qk, sQ(_, _, q_buf), tSrQ, thread);
        warpgroup_fence_operand(tSrQ);
        // Q is in registers: the producer may load the next tile's Q into this buffer now.
        __syncwarp();
        smem.q_ring().release_by_warp(q_buf, lane);
      }
      // S = Q K^T of the block in stage k_stage, issued (not waited for).
      auto issue_s = [&](uint32_t k_stage) {
        if constexpr (kQInRegisters)
          warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/true, /*kWait=*/false>(
              mma_qk, tSrQ, tSrK(_, _, _, k_stage), tSrS);
        else
          warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false, /*kWait=*/false>(
              mma_qk, tSrQ(_, _, _, q_buf), tSrK(_, _, _, k_stage), tSrS);
      };
      softmax.reset();
      clear(tOrO);

      // The KV blocks the tile visits and, inside them, the bulk the mask policy proves mask-free.
      // n_hi: the first block visited (the top of the range; with BlockSparse its top visible block).
      const auto walk = kv_block_walk<Traits>(p, t);
      const int32_t n_lo = static_cast<int32_t>(t.kv_blocks.lo),
                    n_hi = walk.at_or_below(static_cast<int32_t>(t.kv_blocks.hi), n_lo);
      int32_t bulk_lo = static_cast<int32_t>(t.unmasked.lo), bulk_hi = static_cast<int32_t>(t.unmasked.hi);
      if (bulk_lo > bulk_hi) {  // no mask-free block: everything is the masked tail
        bulk_lo = n_hi + 1;
        bulk_hi = n_hi;
      }

      // Per row, from one block's softmax to the next O rescale: the factor for the new running
      // max; and ALiBi's row constants (its slope the tile's head's, read once per tile).
      float correction[kRows];
      const float alibi_slope = Step::Mod::raw_slope(p.score_mod, t.head);
      [[maybe_unused]] float row_offset[kRows];
      // One block's scores to its probabilities (fp32, in place): the modifier, the mask outside
      // the mask-free bulk, the online softmax. The peeled first block and the loop's blocks both
      // take it.
      auto scores_to_p = [&](int32_t n) {
        if constexpr (!Step::Mod::kNone) Step::modify_scores(s_rc, row_offset, p, t, n, coords, alibi_slope);
        if (n > bulk_hi || n < bulk_lo) Step::mask_block(s_rc, p, t, n, coords);
        Step::update_softmax(s_rc, softmax, correction, row_offset, p);
      };
      // Whether the next block's K and V were seen loaded already: probed (without blocking)
      // while the warpgroup waits for its S anyway, so the barrier waits at the top of the
      // next block leave the critical path.
      bool next_kv_ready = false;
      // Called before this block's k_uses/v_uses increments; v_ahead: 1 if this block uses a V.
      auto probe_next_kv = [&](bool exists, uint32_t v_ahead) {
        const uint32_t k_next = k_uses + 1, v_next = v_uses + v_ahead;
        const bool k_ready = smem.k_ring().ready(k_next);
        const bool v_ready = smem.v_ring().ready(v_next);
        next_kv_ready = exists & k_ready & v_ready;
      };
      // The block after the first: with BlockSparse read from the map once, here, and inside the
      // loop once per block at its top (the byte load's latency then hides behind the waits).
      const int32_t n_second = walk.after(n_hi, n_lo);
      if (n_lo <= n_hi) {
        // The first block (the last in key order, usually masked) is peeled: S alone, there is
        // no P V to overlap yet. Every later block then issues both GEMMs as two groups, so
        // the wait for S leaves P V running (one wait<1>, no branch between issue and wait: an
        // empty group committed on a conditional path makes ptxas emit a dummy wgmma group
        // after P V, and wait<1> then waits for P V too, which loses the overlap; check_sass
        // rule 3 looks for that group).
        const uint32_t k_stage = k_uses % kStages;
        smem.k_ring().wait(k_uses);
        turns.wait_turn();
        issue_s(k_stage);
        turns.pass_turn();
        probe_next_kv(Traits::kBlockSparse ? n_second >= n_lo : n_hi > n_lo,
                      0);  // this block's V is the next one's
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
        __syncwarp();
        smem.k_ring().release_by_warp(k_stage, lane);
        ++k_uses;
        scores_to_p(n_hi);  // correction = 0: O is still zero
        Step::p_to_a_operand(tOrP, tSrS);
      }
      // Intra-warpgroup overlap: S of block n is issued, O is rescaled for the running max of
      // block n+1 while S runs, then O += P V of block n+1 is issued; the softmax of block n
      // runs while that GEMM is in flight, and only the conversion of P waits for it.
      for (int32_t n = n_second, n_next = 0; n >= n_lo; n = n_next) {
        n_next = walk.after(n, n_lo);
        const uint32_t k_stage = k_uses % kStages, v_stage = v_uses % kStages;
        trace.stamp(trace_thread, kTraceTop);
        if (!next_kv_ready) {
          smem.k_ring().wait(k_uses);
          smem.v_ring().wait(v_uses);
        }
        turns.wait_turn();
        trace.stamp(trace_thread, kTraceIssue);
        issue_s(k_stage);
        OnlineSoftmax<kRows>::rescale(o_rc, correction, p.keep_max);  // no GEMM in flight uses O
        warpgroup_gemm</*kZeroInit=*/false, /*kARegisters=*/true, /*kWait=*/false>(
            mma_pv, tOrP_a, tOrV(_, _, _, v_stage), tOrO);
        turns.pass_turn();
        probe_next_kv(Traits::kBlockSparse ? n_next >= n_lo : n > n_lo, 1);
        warpgroup_wait<1>();  // S is ready; O += P V may still run
        warpgroup_fence_operand(tSrS);
        trace.stamp(trace_thread, kTraceScores);
        __syncwarp();
        smem.k_ring().release_by_warp(k_stage, lane);
        ++k_uses;
        scores_to_p(n);
        trace.stamp(trace_thread, kTraceSoftmax);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        warpgroup_fence_operand(tOrP);
        trace.stamp(trace_thread, kTraceGemmDone);
        __syncwarp();
        smem.v_ring().release_by_warp(v_stage, lane);
        ++v_uses;
        Step::p_to_a_operand(tOrP, tSrS);
        trace.stamp(trace_thread, kTraceEnd);
        trace.block_done();
      }
      if (n_lo <= n_hi) {
        // Last block's O += P V, after O's rescale for its running max.
        const uint32_t v_stage = v_uses % kStages;
        smem.v_ring().wait(v_uses);
        turns.wait_turn();
        OnlineSoftmax<kRows>::rescale(o_rc, correction, p.keep_max);
        warpgroup_gemm</*kZeroInit=*/false, /*kARegisters=*/true, /*kWait=*/false>(
            mma_pv, tOrP_a, tOrV(_, _, _, v_stage), tOrO);
        turns.pass_turn();
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        __syncwarp();
        smem.v_ring().release_by_warp(v_stage, lane);
        ++v_uses;
      }

      if constexpr (!kQInRegisters) {
        __syncwarp();
        smem.q_ring().release_by_warp(q_buf, lane);  // the last S GEMM has read Q
      }
      // The epilogue reads the tile from its slot again (after the loop's memory clobbers):
      // nothing of it stays live in registers across the loop.
      store_tile<Traits>(p, smem, smem.tile[slot], o_rc, softmax);  // ends with a warpgroup barrier
      smem.tile_ring().release_by_warp(slot, lane);                 // the slot is read for the last time
      ++q_uses;
    }
  }
};

}  // namespace jagflash::kernels::fwd
