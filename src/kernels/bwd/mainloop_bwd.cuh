// The backward's consumers (two warpgroups, 64 keys each) inside a persistent CTA, beside the
// loading thread (loader_bwd.cuh) and the dQ writer (dq_writer.cuh). Per tile (a KV block of a
// KV head, against every Q block and query head that sees it) the tile loop runs one step per
// Q block: S^T and dP^T GEMMs, P^T and dS^T in registers (step_bwd.cuh), dS^T to shared memory,
// dV += P^T dO, dK += dS^T Q, and the previous Q block's dQ = dS K into a dQ stage for the writer
// (dq_handoff_bwd.cuh); dK and dV are stored at the tile's end through the dS buffers
// (epilogue_bwd.cuh).
#pragma once

#include "kernels/bwd/barrier_ids_bwd.hpp"
#include "kernels/bwd/dq_handoff_bwd.cuh"
#include "kernels/bwd/epilogue_bwd.cuh"
#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/bwd/loader_bwd.cuh"
#include "kernels/bwd/scheduler_bwd.cuh"
#include "kernels/bwd/smem_stores_bwd.cuh"
#include "kernels/bwd/smem_views_bwd.cuh"
#include "kernels/bwd/step_bwd.cuh"
#include "kernels/common/accumulator.cuh"
#include "kernels/common/barriers.cuh"
#include "kernels/common/ring.cuh"
#include "kernels/common/warpgroup_gemm.cuh"

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>

namespace jagflash::kernels::bwd {

using namespace cute;
using common::AccumulatorCoords;
using common::RingPosition;  // kernels/common/ring.cuh: the Q/dO ring's position
using common::warpgroup_gemm;

template <class Traits>
struct Consumer {
  using Element = typename Traits::Element;
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using HeadDim = typename Traits::HeadDim;
  static constexpr int kStages = Traits::kStages;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  using StoreOffsets = StoreOffsetsOf<Traits>;
  static constexpr uint32_t kDsBufferBytes = kBlockM * kBlockN * sizeof(Element);
  static_assert(kDsBufferBytes ==
                        DkvStaging<Traits::kHeadDim, int(sizeof(Element)), kDsBufferBytes>::kBufferBytes &&
                    Traits::kDsBuffers == 2 && Traits::WgKeys::value == 64,
                "the dK/dV staging's view of the dS buffers");

  static constexpr int kKeysPerWarpgroup = Traits::WgKeys::value;
  // dQ's k-blocks (16 keys each) over warpgroup 0's keys.
  static constexpr int kLowerKBlocks = kKeysPerWarpgroup / 16;
  // Warpgroup 1 idles on tiles whose upper keys are past the sequence (step). At D = 64 and 96
  // the branches spread the dV/dK wgmma issue and cost the long batches more than they gain on
  // short ones (bench/NOTES.md): D = 128 only.
  static constexpr bool kSkipIdleUpperKeys = Traits::kHeadDim == 128;

  // thread: index among the 256 consumer threads (warpgroup 0 owns keys 0-63 of the tile).
  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem, int thread) {
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmaDkv mma_dkv;
    typename Traits::TiledMmaDq mma_dq;
    // A GEMM's shared-memory operands depend on the warpgroup alone: sliced by a warpgroup index
    // the compiler knows to be uniform, their descriptors live in uniform registers.
    const int wg_thread0 = __shfl_sync(0xffffffff, thread / 128, 0) * 128;
    auto thr_sdp = mma_sdp.get_thread_slice(wg_thread0);
    auto thr_dkv = mma_dkv.get_thread_slice(wg_thread0);
    auto thr_dq = mma_dq.get_thread_slice(wg_thread0);

    // The shared-memory operands, from a base re-read at each step (smem_views_bwd.cuh).
    SmemViews<Traits> views{smem};

    // S^T = K Q^T, dP^T = V dO^T: A (MMA, M, K) from K, V; B (MMA, N, K, stage) from Q, dO.
    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
    Tensor tSrDp = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
    Tensor s_rc = make_tensor(tSrS.data(), common::rowcol_layout(tSrS.layout()));
    Tensor dp_rc = make_tensor(tSrDp.data(), common::rowcol_layout(tSrDp.layout()));
    // P^T and dS^T in the input dtype, as the A operands of dV += P^T dO and dK += dS^T Q.
    Tensor tPrP = make_tensor_like<Element>(tSrS);
    Tensor tPrP_a = make_tensor(tPrP.data(), common::acc_as_a_operand_layout(tPrP.layout()));
    Tensor tDsrDs = make_tensor_like<Element>(tSrS);
    Tensor tDsrDs_a = make_tensor(tDsrDs.data(), common::acc_as_a_operand_layout(tDsrDs.layout()));
    // dV, dK: B (MMA, N, K, stage) from dO^T and Q^T; fp32 accumulators for the whole tile.
    Tensor tDVrDV = partition_fragment_C(mma_dkv, Shape<BlockN, HeadDim>{});
    Tensor tDKrDK = partition_fragment_C(mma_dkv, Shape<BlockN, HeadDim>{});
    // dQ = dS K: A (MMA, M, K, buffer) from dS, B (MMA, N, K) from K^T; the partial goes to a dQ stage.
    Tensor tDQrDQ = partition_fragment_C(mma_dq, Shape<BlockM, HeadDim>{});
    using Math = StepMath<Traits>;
    [[maybe_unused]] typename Math::Dscore dscore;
    const AccumulatorCoords coords(thread);
    const int lane = thread % 32;
    DqHandoff<Traits> dq_handoff;
    // Q blocks consumed so far: the Q/dO ring's position and, as every block hands one dQ stage
    // to the writer, the dQ ring's too (one counter: two kept a register more across the loop).
    uint32_t uses = 0;
    constexpr uint32_t kSlots = SharedStorage<Traits>::kTileSlots;

    // The step's GEMMs and releases. Each GEMM builds its shared-memory descriptors right before
    // it is issued (SmemViews).
    // S^T = K Q^T, dP^T = V dO^T, in flight (gemm_stage: q_at's stage, warp-uniform).
    auto issue_s_dp = [&](RingPosition<kStages> q_at, uint32_t gemm_stage) {
      smem.q_ring().wait(q_at.uses);
      warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false, /*kWait=*/false>(
          mma_sdp, thr_sdp.partition_fragment_A(views.k()),
          thr_sdp.partition_fragment_B(views.q())(_, _, _, gemm_stage), tSrS);
      smem.do_ring().wait(q_at.uses);
      warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false, /*kWait=*/false>(
          mma_sdp, thr_sdp.partition_fragment_A(views.v()),
          thr_sdp.partition_fragment_B(views.dout())(_, _, _, gemm_stage), tSrDp);
    };
    auto issue_dq = [&](uint32_t ds_buf, bool upper_keys_seen) {  // dQ = dS K
      if (upper_keys_seen) {
        warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false, /*kWait=*/false>(
            mma_dq, thr_dq.partition_fragment_A(views.ds())(_, _, _, ds_buf),
            thr_dq.partition_fragment_B(views.kt()), tDQrDQ);
      } else {  // the lower 64 keys: the first half of the GEMM's k-blocks
        warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false, /*kWait=*/false, /*kCommit=*/true,
                       /*kKBlocks=*/kLowerKBlocks>(mma_dq,
                                                   thr_dq.partition_fragment_A(views.ds())(_, _, _, ds_buf),
                                                   thr_dq.partition_fragment_B(views.kt()), tDQrDQ);
      }
    };
    auto issue_dv = [&](uint32_t stage) {  // dV += P^T dO
      warpgroup_gemm</*kZeroInit=*/false, /*kARegisters=*/true, /*kWait=*/false>(
          mma_dkv, tPrP_a, thr_dkv.partition_fragment_B(views.doutt())(_, _, _, stage), tDVrDV);
    };
    auto issue_dk = [&](uint32_t stage) {  // dK += dS^T Q
      warpgroup_gemm</*kZeroInit=*/false, /*kARegisters=*/true, /*kWait=*/false>(
          mma_dkv, tDsrDs_a, thr_dkv.partition_fragment_B(views.qt())(_, _, _, stage), tDKrDK);
    };
    auto release_stage = [&](uint32_t stage) {  // dV and dK are done: Q and dO of the stage are free
      warpgroup_fence_operand(tDVrDV);
      warpgroup_fence_operand(tDKrDK);
      warpgroup_fence_operand(tPrP);
      warpgroup_fence_operand(tDsrDs);
      __syncwarp();
      if (lane == 0) {
        smem.q_ring().release(stage);
        smem.do_ring().release(stage);
      }
    };
    auto release_v = [&] {  // no dP GEMM of this warpgroup reads V any more (this tile)
      __syncwarp();
      smem.v_ring().release_by_warp(0, lane);
    };

    // S^T and dP^T of Q block m (first row row0, query head h; q_at: the Q/dO ring's position) to
    // P^T and dS^T in registers, in the input dtype (the A operands of dV and dK).
    auto p_and_ds = [&](const TileInfo& t, int32_t key0, int32_t h, int32_t m, int32_t row0,
                        RingPosition<kStages> q_at, uint32_t gemm_stage, bool last_dp) {
      issue_s_dp(q_at, gemm_stage);
      const int stat_skip = (t.q_start + row0) & 3;  // the stats load from an aligned row
      const float* lse_c = smem.lse.data() + q_at.stage() * Traits::kStatStride + stat_skip + coords.col_base;
      const float* delta_c =
          smem.delta.data() + q_at.stage() * Traits::kStatStride + stat_skip + coords.col_base;
      Math::scores_to_p(s_rc, dscore, p, t, h, m, row0, key0, coords, lse_c);
      warpgroup_wait<0>();
      warpgroup_fence_operand(tSrDp);
      if (last_dp) release_v();  // the tile's last dP GEMM has read V: the next tile's may load
      Math::ds_from_dp(dp_rc, s_rc, dscore, p, lse_c, delta_c);
#pragma unroll
      for (int e = 0; e < size(tSrS); ++e) {
        tPrP(e) = static_cast<Element>(tSrS(e));
        tDsrDs(e) = static_cast<Element>(tSrDp(e));
      }
    };
    // dS to shared memory for dQ = dS K (the other warpgroup needs this one's keys), by stmatrix
    // from addresses derived here from a thread index read afresh (kept across the loop, they
    // spilled).
    auto store_ds = [&](uint32_t ds_buf) {
      store_ds_smem<StoreOffsets>(tDsrDs,
                                  cute::cast_smem_ptr_to_uint(smem.ds.data()) + ds_buf * kDsBufferBytes,
                                  fresh_consumer_thread());
      cutlass::arch::fence_view_async_shared();
    };

    // The Q block whose dQ is still to be issued (its query head, or -1: none, and its index); its
    // ring position is uses - 1 (the step before).
    int32_t dq_h = -1, dq_m = 0;
    const int warpgroup = wg_thread0 / 128;
    auto hand_over_dq = [&](const TileInfo& t) {
      warpgroup_fence_operand(tDQrDQ);
      dq_handoff.hand_over(p, smem, t, dq_h, dq_m, dq_m * kBlockM, uses - 1, tDQrDQ, thread, lane);
    };
    // A short sequence's last KV block may end within the tile's lower 64 keys: then warpgroup 1
    // (the upper keys) skips S^T, dP^T, dS, dV and dK, and dQ = dS K runs over the lower 64 keys
    // only. (Per block, a causal or window edge hiding the upper keys from a Q block would qualify
    // too; the predicates it needed pushed the tile's round counter into local memory.)
    auto upper_keys_seen_in = [&](const TileInfo& t, int32_t key0) {
      return !kSkipIdleUpperKeys || key0 + kKeysPerWarpgroup < t.len_kv;
    };
    // One step: Q block m's (query head h, the tile's i-th step, against the tile's keys from
    // key0) scores, dS, dV and dK, and the dQ of the step before (in this tile).
    // A warpgroup issues a Q block's dQ = dS K one step late, beside the next block's dV and dK: it
    // reads the other warpgroup's dS, by then long in shared memory, so neither waits for the other
    // inside a step. (With dQ in its own step both met at a barrier every step and computed their
    // scores at the same time, the tensor cores idle meanwhile.) A warpgroup arrives on
    // ds_ready_barrier(warpgroup, u) after its u-th step (barrier_ids_bwd.hpp); the other
    // warpgroup consumes each arrival once: before its next step's dS store, or before the tile's
    // last dQ (drained at the tile's end).
    auto step = [&](const TileInfo& t, int32_t key0, int32_t h, int32_t i, int32_t m) {
      const RingPosition<kStages> q_at{uses};
      views.refresh();
      const uint32_t gemm_uses = __shfl_sync(0xffffffff, uses, 0);
      const uint32_t gemm_stage = gemm_uses % kStages, gemm_ds_buf = gemm_uses % Traits::kDsBuffers;
      // upper_keys_seen_in(t, key0), written out: through the lambda ptxas duplicated a dQ GEMM.
      const bool upper_keys_seen = !kSkipIdleUpperKeys || key0 + kKeysPerWarpgroup < t.len_kv;
      const bool computes = warpgroup == 0 || upper_keys_seen;
      const bool last_dp = !Traits::kBlockSparse && i == t.m_hi && h == t.head_end - 1;
      const bool dq_pending = dq_h >= 0;
      if (!computes) {  // warpgroup 1 with no visible key: the previous step's dQ over the lower keys
        if (last_dp) release_v();
        if (dq_pending) {
          common::named_barrier_sync_unaligned(ds_ready_barrier(1 - warpgroup, uses - 1), 256);
          issue_dq(gemm_ds_buf ^ 1, upper_keys_seen);
          warpgroup_wait<0>();
          hand_over_dq(t);
        }
        __syncwarp();
        common::named_barrier_arrive_unaligned(ds_ready_barrier(warpgroup, uses), 256);
        release_stage(q_at.stage());
      } else {
        p_and_ds(t, key0, h, m, m * kBlockM, q_at, gemm_stage, last_dp);
        issue_dv(gemm_stage);
        if (dq_pending) {
          // The other warpgroup's dS of the step before is in shared memory and its dQ before
          // that has read the buffer this step's dS goes to.
          common::named_barrier_sync_unaligned(ds_ready_barrier(1 - warpgroup, uses - 1), 256);
          store_ds(uses % Traits::kDsBuffers);
          issue_dq(gemm_ds_buf ^ 1, upper_keys_seen);
          issue_dk(gemm_stage);
          warpgroup_wait<1>();  // dV and dQ are done; dK may still run
          hand_over_dq(t);
        } else {
          store_ds(uses % Traits::kDsBuffers);
          issue_dk(gemm_stage);
        }
        __syncwarp();
        common::named_barrier_arrive_unaligned(ds_ready_barrier(warpgroup, uses), 256);
        warpgroup_wait<0>();
        release_stage(q_at.stage());
      }
      dq_h = h;
      dq_m = m;
      ++uses;
    };
    // At the tile's end: its last Q block's dQ, before K is released.
    auto drain_dq = [&](const TileInfo& t, int32_t key0) {
      if (dq_h < 0) return;
      common::named_barrier_sync_unaligned(ds_ready_barrier(1 - warpgroup, uses - 1), 256);
      views.refresh();
      const uint32_t gemm_uses = __shfl_sync(0xffffffff, uses, 0);
      issue_dq((gemm_uses - 1) % Traits::kDsBuffers, upper_keys_seen_in(t, key0));
      warpgroup_wait<0>();
      hand_over_dq(t);
      dq_h = -1;
    };

    for (uint32_t round = 0;; ++round) {
      const uint32_t slot = round % kSlots;
      smem.tile_ring().wait(round);
      if (!smem.has_tile[slot]) {
        dq_handoff.finish(p, smem, uses, thread, lane);
        return;
      }
      // The tile is read from its slot where it is used (the slot stays valid until this tile's
      // tile_empty arrival): kept in registers across the loop, its fields spilled.
      const TileInfo& t = smem.tile[slot];
      dq_handoff.begin_tile(p, smem, t, lane);
      smem.k_ring().wait(round);
      smem.v_ring().wait(round);
      clear(tDVrDV);
      clear(tDKrDK);
      const int32_t key0 = t.n_block * kBlockN;  // first key of the tile in its sequence
      for (int32_t h = t.head_lo; h < t.head_end; ++h) {
        for (int32_t i = t.m_lo; i <= t.m_hi; ++i) {
          const int32_t m = rotated_q_block(t, i);  // the Q block of the tile's i-th (from m_lo) step
          // With a block-sparse map the Q blocks it hides are skipped, as the loader skips them.
          if (q_block_visible(p, t, m)) step(t, key0, h, i, m);
        }
      }
      drain_dq(t, key0);
      // The tile's last dQ GEMM has read K (and its last dP GEMM V, freed there unless the tile
      // had no Q block or a block-sparse map): the loader may bring the next tile's.
      __syncwarp();
      if (lane == 0) {
        if (Traits::kBlockSparse || t.m_lo > t.m_hi) smem.v_ring().release(0);
        smem.k_ring().release(0);
      }
      store_dkdv<Traits>(p, t, tDKrDK, tDVrDV, cute::cast_smem_ptr_to_uint(smem.ds.data()),
                         fresh_consumer_thread());
      __syncwarp();
      smem.tile_ring().release_by_warp(slot, lane);
    }
  }
};

}  // namespace jagflash::kernels::bwd
