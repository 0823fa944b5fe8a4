// The wide backward's consumers (head dims 192 and 256; TileConfig::kWide): two warpgroups on a
// tile of 64 keys, beside the same loading thread (loader_bwd.cuh) and dQ writer (dq_writer.cuh)
// as the 64/128 kernels. Per Q block each warpgroup computes S^T = K Q^T and dP^T = V dO^T of all
// 64 keys and its 32 of the block's 64 rows, P^T and dS^T in registers (step_bwd.cuh), and stores
// both into shared memory (buffers 2 + u % 2 of P, u % 2 of dS at step u), each read only once
// both warpgroups' rows are in. For its half of the head dim each then does dV += P^T dO (issued
// before the dS math, which runs under it), dK += dS^T Q (A: all 64 rows, from shared memory)
// and dQ = dS K in parts of kDqPartCols columns into the dQ stage (dq_handoff_bwd.cuh). dK and dV
// are stored at the tile's end through the four buffers (epilogue_bwd_wide.cuh).
#pragma once

#include "kernels/bwd/barrier_ids_bwd.hpp"
#include "kernels/bwd/dq_handoff_bwd.cuh"
#include "kernels/bwd/epilogue_bwd_wide.cuh"
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

template <class Traits>
struct ConsumerWide {
  using Element = typename Traits::Element;
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using HeadDim = typename Traits::HeadDim;
  static constexpr int kStages = Traits::kStages;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kDqPartCols = Traits::kDqPartCols;
  static constexpr int kDqParts = Traits::kDqParts;
  // A warpgroup's 32 rows of P^T or dS^T into a 64-row buffer by the 128 kernel's stmatrix
  // offsets (from store 2 wg on), given the thread's index in its warpgroup; a dQ part's stores by
  // the 128 kernel's offsets for
  // a (64 x 2 kDqPartCols) stage, from the part's first box.
  using DsOffsets = SmemStoreOffsets<kBlockM, Traits::kHeadDim, 64>;
  using DqOffsets = SmemStoreOffsets<kBlockM, 2 * kDqPartCols, 64>;
  static constexpr uint32_t kDsBufferBytes = kBlockM * kBlockN * sizeof(Element);
  static constexpr uint32_t kDqPartBytes = (2 * kDqPartCols / Traits::kDqBoxCols) * Traits::kDqBoxBytes;
  static constexpr int kWgRows = Traits::kStepRows;  // a warpgroup's rows of S^T and dP^T
  static_assert(Traits::kWide && kBlockN == 64 && Traits::WgKeys::value == 64 && Traits::kDsBuffers == 4 &&
                    2 * kWgRows == kBlockM &&
                    2 * kDsBufferBytes == WideDkvStaging<Traits::kHeadDim, int(sizeof(Element))>::kBytes,
                "the wide tile: 64 keys, two buffers of dS and two of P (each warpgroup's dK/dV staging)");

  // thread: index among the 256 consumer threads (warpgroup 0 owns the first half of the head dim).
  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem, int thread) {
    // A wgmma's operands are partitioned by warpgroup only: the slices are taken at the
    // warpgroup's first thread, read through a shuffle so that ptxas sees a warp-uniform value and
    // builds the shared-memory descriptors in uniform registers (taken at `thread`, the D = 256
    // S^T and dP^T GEMMs' 64 descriptors went to per-thread registers and spilled: 263 LDL/STL).
    const int wg = __shfl_sync(0xffffffffu, thread / 128, 0);
    typename Traits::TiledMmaSdP mma_sdp;
    typename Traits::TiledMmaDkv mma_dkv;
    typename Traits::TiledMmaDq mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(wg * 128);
    auto thr_dkv = mma_dkv.get_thread_slice(wg * 128);
    auto thr_dq = mma_dq.get_thread_slice(wg * 128);

    // The shared-memory operands, from a base re-read at each step (smem_views_bwd.cuh).
    SmemViews<Traits> views{smem};

    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
    Tensor tSrDp = partition_fragment_C(mma_sdp, Shape<BlockN, BlockM>{});
    Tensor s_rc = make_tensor(tSrS.data(), common::rowcol_layout(tSrS.layout()));
    Tensor dp_rc = make_tensor(tSrDp.data(), common::rowcol_layout(tSrDp.layout()));
    Tensor tPrP = make_tensor_like<Element>(tSrS);
    Tensor tDsrDs = make_tensor_like<Element>(tSrS);
    // This warpgroup's half of dV and dK (64 keys x D/2), and one dQ part (64 rows x kDqPartCols).
    Tensor tDVrDV = partition_fragment_C(mma_dkv, Shape<BlockN, HeadDim>{});
    Tensor tDKrDK = partition_fragment_C(mma_dkv, Shape<BlockN, HeadDim>{});
    Tensor tDQrDQ = partition_fragment_C(mma_dq, Shape<BlockM, Int<2 * kDqPartCols>>{});
    using Math = StepMath<Traits>;
    [[maybe_unused]] typename Math::Dscore dscore;
    const AccumulatorCoords coords(thread % 128);  // S^T's keys and rows, as in one warpgroup
    const int lane = thread % 32;
    uint32_t uses = 0;  // Q blocks consumed: the Q/dO ring's and the dQ ring's position
    constexpr uint32_t kSlots = SharedStorage<Traits>::kTileSlots;

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
    // dQ's columns [part x 2 kDqPartCols, +2 kDqPartCols) = dS K (dS: buffer ds_buf)
    auto issue_dq = [&](int part, uint32_t ds_buf) {
      Tensor k_part = local_tile(views.kt(), Shape<Int<2 * kDqPartCols>, BlockN>{}, make_coord(part, _0{}));
      warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false, /*kWait=*/false>(
          mma_dq, thr_dq.partition_fragment_A(views.ds())(_, _, _, ds_buf),
          thr_dq.partition_fragment_B(k_part), tDQrDQ);
    };
    auto issue_dv = [&](uint32_t stage,
                        uint32_t ds_buf) {  // dV += P^T dO (this warpgroup's half of dO's columns)
      warpgroup_gemm</*kZeroInit=*/false, /*kARegisters=*/false, /*kWait=*/false>(
          mma_dkv, thr_dkv.partition_fragment_A(views.dst())(_, _, _, 2 + ds_buf),
          thr_dkv.partition_fragment_B(views.doutt())(_, _, _, stage), tDVrDV);
    };
    auto issue_dk = [&](uint32_t stage, uint32_t ds_buf) {  // dK += dS^T Q
      warpgroup_gemm</*kZeroInit=*/false, /*kARegisters=*/false, /*kWait=*/false>(
          mma_dkv, thr_dkv.partition_fragment_A(views.dst())(_, _, _, ds_buf),
          thr_dkv.partition_fragment_B(views.qt())(_, _, _, stage), tDKrDK);
    };
    auto store_dq_part = [&](uint32_t dq_stage, int part) {
      warpgroup_fence_operand(tDQrDQ);
      store_dq_smem<DqOffsets>(tDQrDQ, dq_stage + part * kDqPartBytes, fresh_consumer_thread());
    };

    auto step = [&](const TileInfo& t, int32_t key0, int32_t h, int32_t i, int32_t m) {
      const RingPosition<kStages> q_at{uses};
      const uint32_t stage = q_at.stage();
      // The GEMMs' descriptors from warp-uniform values (smem_views_bwd.cuh).
      views.refresh();
      const uint32_t gemm_stage = __shfl_sync(0xffffffffu, stage, 0);
      // This step's dS buffer (and 2 + it, P's): the other warpgroup may still read the other pair
      // in its GEMMs of step u - 1, never those of u - 2 (it passed this step's barrier after them).
      const uint32_t ds_buf = __shfl_sync(0xffffffffu, uses & 1, 0);
      const int32_t row0 = m * kBlockM;
      const bool last_dp = !Traits::kBlockSparse && i == t.m_hi && h == t.head_end - 1;
      issue_s_dp(q_at, gemm_stage);
      const int stat_skip = (t.q_start + row0) & 3;  // the stats load from an aligned row
      const int stat_col = stage * Traits::kStatStride + stat_skip + wg * kWgRows + coords.col_base;
      const float* lse_c = smem.lse.data() + stat_col;
      const float* delta_c = smem.delta.data() + stat_col;
      Math::scores_to_p(s_rc, dscore, p, t, h, m, row0 + wg * kWgRows, key0, coords, lse_c);
      // This warpgroup's rows of P^T and of dS^T go into the step's buffers (the stores of rows
      // [32 wg, 32 wg + 32) of a 64-row buffer), each pair read only once both warpgroups' are in:
      // P^T first, so that dV += P^T dO runs under the dS math.
      const uint32_t ds_base = cute::cast_smem_ptr_to_uint(smem.ds.data());
      constexpr int kStoresPerWg = kWgRows / 16;
#pragma unroll
      for (int e = 0; e < size(tSrS); ++e) tPrP(e) = static_cast<Element>(tSrS(e));
      store_ds_smem<DsOffsets>(tPrP, ds_base + (2 + ds_buf) * kDsBufferBytes, fresh_consumer_thread() % 128,
                               wg * kStoresPerWg);
      cutlass::arch::fence_view_async_shared();
      common::named_barrier_sync(BwdBarrier::kWideStored, 256);
      issue_dv(gemm_stage, ds_buf);
      warpgroup_wait<1>();  // dP^T landed (dV may still run)
      warpgroup_fence_operand(tSrDp);
      if (last_dp) {  // the tile's last dP GEMM has read V: the next tile's may load
        __syncwarp();
        smem.v_ring().release_by_warp(0, lane);
      }
      Math::ds_from_dp(dp_rc, s_rc, dscore, p, lse_c, delta_c);
#pragma unroll
      for (int e = 0; e < size(tSrDp); ++e) tDsrDs(e) = static_cast<Element>(tSrDp(e));
      store_ds_smem<DsOffsets>(tDsrDs, ds_base + ds_buf * kDsBufferBytes, fresh_consumer_thread() % 128,
                               wg * kStoresPerWg);
      cutlass::arch::fence_view_async_shared();
      common::named_barrier_sync(BwdBarrier::kWideStored, 256);
      // Each ring released as soon as its last reader is done (with one Q/dO stage the next Q
      // block loads only then), so the loads run under the dQ GEMMs: dV (of dO) first, dK (of Q).
      issue_dk(gemm_stage, ds_buf);
      issue_dq(0, ds_buf);
      warpgroup_wait<2>();  // dV is done: dO is free
      warpgroup_fence_operand(tDVrDV);
      __syncwarp();
      smem.do_ring().release_by_warp(stage, lane);
      warpgroup_wait<1>();  // dK is done: Q is free
      warpgroup_fence_operand(tDKrDK);
      __syncwarp();
      smem.q_ring().release_by_warp(stage, lane);
      warpgroup_wait<0>();  // dQ's first part
      const uint32_t dq_stage = DqHandoff<Traits>::open_block_stage(smem, uses);
      store_dq_part(dq_stage, 0);
#pragma unroll
      for (int part = 1; part < kDqParts; ++part) {
        issue_dq(part, ds_buf);
        warpgroup_wait<0>();
        store_dq_part(dq_stage, part);
      }
      DqHandoff<Traits>::close_block_stage(p, smem, t, h, m, row0, uses, thread, lane);
      ++uses;
    };

    DqHandoff<Traits> dq_handoff;  // for finish(): the wide kernels never take pooled_dq_sum
    for (uint32_t round = 0;; ++round) {
      const uint32_t slot = round % kSlots;
      smem.tile_ring().wait(round);
      if (!smem.has_tile[slot]) {
        dq_handoff.finish(p, smem, uses, thread, lane);
        return;
      }
      const TileInfo& t = smem.tile[slot];
      smem.k_ring().wait(round);
      smem.v_ring().wait(round);
      clear(tDVrDV);
      clear(tDKrDK);
      const int32_t key0 = t.n_block * kBlockN;
      for (int32_t h = t.head_lo; h < t.head_end; ++h) {
        for (int32_t i = t.m_lo; i <= t.m_hi; ++i) {
          const int32_t m = rotated_q_block(t, i);
          if (q_block_visible(p, t, m)) step(t, key0, h, i, m);
        }
      }
      // The tile's last dQ GEMM has read K (and its last dP GEMM V, freed there unless the tile
      // had no Q block or a block-sparse map).
      __syncwarp();
      if (lane == 0) {
        if (Traits::kBlockSparse || t.m_lo > t.m_hi) smem.v_ring().release(0);
        smem.k_ring().release(0);
      }
      // The staging addresses from a thread index read afresh (from `thread`, ptxas kept the 64
      // of them across the loop, in local memory). The staging takes all four buffers (a
      // warpgroup's two): once both warpgroups' last GEMMs of the tile have read them, and until
      // both have stored, before the next tile's steps write them.
      common::named_barrier_sync(BwdBarrier::kWideStored, 256);
      const int epilogue_thread = fresh_consumer_thread();
      store_dkdv_wide<Traits>(
          p, t, tDKrDK, tDVrDV,
          cute::cast_smem_ptr_to_uint(smem.ds.data()) + 2 * (epilogue_thread / 128) * kDsBufferBytes,
          epilogue_thread);
      common::named_barrier_sync(BwdBarrier::kWideStored, 256);
      __syncwarp();
      smem.tile_ring().release_by_warp(slot, lane);
    }
  }
};

}  // namespace jagflash::kernels::bwd
