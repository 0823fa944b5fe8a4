// The backward's consumers (two warpgroups, 64 keys each) inside a persistent CTA, beside the
// loading thread (loader_bwd.cuh) and the dQ writer (dq_writer.cuh). Per tile (a KV block of a
// KV head, against every Q block and query head that sees it) the tile loop runs one step per
// Q block: S^T and dP^T GEMMs, P^T and dS^T in registers (step_bwd.cuh), dS^T to shared memory,
// dV += P^T dO, dK += dS^T Q, and dQ = dS K into a dQ stage for the writer (dq_handoff_bwd.cuh);
// dK and dV are stored at the tile's end through the dS buffers (epilogue_bwd.cuh).
#pragma once

#include "kernels/bwd/dq_handoff_bwd.cuh"
#include "kernels/bwd/epilogue_bwd.cuh"
#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/bwd/loader_bwd.cuh"
#include "kernels/bwd/scheduler_bwd.cuh"
#include "kernels/bwd/smem_stores_bwd.cuh"
#include "kernels/bwd/smem_views_bwd.cuh"
#include "kernels/bwd/step_bwd.cuh"
#include "kernels/common/accumulator.cuh"
#include "kernels/common/ring.cuh"
#include "kernels/common/warpgroup_gemm.cuh"

#include <cutlass/arch/barrier.h>
#include <cute/tensor.hpp>

namespace jagflash::kernels::bwd {

using namespace cute;
using common::AccumulatorCoords;
using common::RingPosition;  // kernels/common/ring.cuh: every barrier wait (wait_full, wait_released)
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
  // Warpgroup 1 idles on tiles whose upper keys are past the sequence (below). At D = 64 and 96
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
      wait_full(smem.q_full, q_at);
      warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false, /*kWait=*/false>(
          mma_sdp, thr_sdp.partition_fragment_A(views.k()),
          thr_sdp.partition_fragment_B(views.q())(_, _, _, gemm_stage), tSrS);
      wait_full(smem.do_full, q_at);
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
        ArrivalBarrier::arrive(&smem.q_empty[stage]);
        ArrivalBarrier::arrive(&smem.do_empty[stage]);
      }
    };
    auto release_v = [&] {  // no dP GEMM of this warpgroup reads V any more (this tile)
      __syncwarp();
      if (lane == 0) ArrivalBarrier::arrive(&smem.v_empty);
    };

    // One step: Q block m (query head h, the tile's i-th step) against the tile's keys from key0.
    auto step = [&](const TileInfo& t, int32_t key0, int32_t h, int32_t i, int32_t m) {
      const RingPosition<kStages> q_at{uses};  // the Q/dO ring
      const uint32_t stage = q_at.stage(), ds_buf = uses % Traits::kDsBuffers;
      // The same for the GEMMs' descriptors, as values the compiler knows to be warp-uniform.
      views.refresh();
      const uint32_t gemm_uses = __shfl_sync(0xffffffff, uses, 0);
      const uint32_t gemm_stage = gemm_uses % kStages, gemm_ds_buf = gemm_uses % Traits::kDsBuffers;
      const int32_t row0 = m * kBlockM;
      // A short sequence's last KV block may end within the tile's lower 64 keys: then
      // warpgroup 1 (the upper keys) skips S^T, dP^T, dS, dV and dK and dQ = dS K runs over
      // the lower 64 keys only. (Per block, a causal or window edge hiding the upper keys
      // from a Q block would qualify too; the predicates it needed pushed the tile's round
      // counter into local memory at D = 128.)
      const bool upper_keys_seen = !kSkipIdleUpperKeys || key0 + kKeysPerWarpgroup < t.len_kv;
      const bool computes = wg_thread0 == 0 || upper_keys_seen;
      // The tile's last dP GEMM frees V early; with a block-sparse map the last visible step is
      // not known ahead, so V is freed at the tile's end instead.
      const bool last_dp = !Traits::kBlockSparse && i == t.m_hi && h == t.head_end - 1;
      if (computes) {
        issue_s_dp(q_at, gemm_stage);
        const int stat_skip = (t.q_start + row0) & 3;  // the stats load from an aligned row
        const float* lse_c = smem.lse.data() + stage * Traits::kStatStride + stat_skip + coords.col_base;
        const float* delta_c = smem.delta.data() + stage * Traits::kStatStride + stat_skip + coords.col_base;
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
        // dS to shared memory for dQ = dS K (the other warpgroup needs this one's keys), by
        // stmatrix from addresses derived here from a thread index read afresh (kept across the
        // loop, they spilled).
        store_ds_smem<StoreOffsets>(tDsrDs,
                                    cute::cast_smem_ptr_to_uint(smem.ds.data()) + ds_buf * kDsBufferBytes,
                                    fresh_consumer_thread());
        cutlass::arch::fence_view_async_shared();
      } else if (last_dp) {
        release_v();
      }
      // Once dQ is done its partial goes to the dQ stage while the GEMMs after it still run, so
      // the tensor cores are not idle during the stage's stores.
      auto hand_over_dq = [&] {
        warpgroup_fence_operand(tDQrDQ);
        dq_handoff.hand_over(p, smem, t, h, m, row0, uses, tDQrDQ, thread, lane);
      };
      if (!computes) {  // warpgroup 1 with no visible key: its half of dQ only
        // Warpgroup 0 meets this barrier at another instruction (below): the unaligned form
        // (bar.sync there and here was a divergent barrier to compute-sanitizer's synccheck).
        __syncwarp();
        common::named_barrier_sync_unaligned(1, 256);  // warpgroup 0's dS is in shared memory
        issue_dq(gemm_ds_buf, upper_keys_seen);
        warpgroup_wait<0>();
        hand_over_dq();
        release_stage(stage);
      } else if constexpr (Traits::kHeadDim == 64) {
        // dQ first, then dV and dK.
        cutlass::arch::NamedBarrier::sync(256, 1);  // both warpgroups' dS are in shared memory
        issue_dq(gemm_ds_buf, upper_keys_seen);
        issue_dv(gemm_stage);
        issue_dk(gemm_stage);
        warpgroup_wait<2>();  // dQ is done; dV and dK may still run
        hand_over_dq();
        warpgroup_wait<0>();
        release_stage(stage);
      } else {
        // dV first, hiding the wait for the other warpgroup's dS; then dQ and dK (dQ first
        // after the barrier, with dV and dK behind it, spilled at D = 128).
        issue_dv(gemm_stage);
        // Unaligned where warpgroup 1 may meet it in the branch above instead.
        if constexpr (kSkipIdleUpperKeys) {
          common::named_barrier_sync_unaligned(1, 256);  // both warpgroups' dS are in shared memory
        } else {
          cutlass::arch::NamedBarrier::sync(256, 1);
        }
        issue_dq(gemm_ds_buf, upper_keys_seen);
        issue_dk(gemm_stage);
        warpgroup_wait<1>();  // dV and dQ are done; dK may still run
        hand_over_dq();
        warpgroup_wait<0>();
        release_stage(stage);
      }
      ++uses;
    };

    for (uint32_t round = 0;; ++round) {
      const uint32_t slot = round % kSlots;
      wait_full(smem.tile_full, RingPosition<kSlots>{round});
      if (!smem.has_tile[slot]) {
        dq_handoff.finish(p, smem, uses, thread, lane);
        return;
      }
      // The tile is read from its slot where it is used (the slot stays valid until this tile's
      // tile_empty arrival): kept in registers across the loop, its fields spilled.
      const TileInfo& t = smem.tile[slot];
      dq_handoff.begin_tile(p, smem, t, lane);
      wait_full(&smem.k_full, RingPosition<1>{round});
      wait_full(&smem.v_full, RingPosition<1>{round});
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
      // The tile's last dQ GEMM has read K (and its last dP GEMM V, freed there unless the tile
      // had no Q block or a block-sparse map): the loader may bring the next tile's.
      __syncwarp();
      if (lane == 0) {
        if (Traits::kBlockSparse || t.m_lo > t.m_hi) ArrivalBarrier::arrive(&smem.v_empty);
        ArrivalBarrier::arrive(&smem.k_empty);
      }
      store_dkdv<Traits>(p, t, tDKrDK, tDVrDV, cute::cast_smem_ptr_to_uint(smem.ds.data()),
                         fresh_consumer_thread());
      __syncwarp();
      if (lane == 0) ArrivalBarrier::arrive(&smem.tile_empty[slot]);
    }
  }
};

}  // namespace jagflash::kernels::bwd
