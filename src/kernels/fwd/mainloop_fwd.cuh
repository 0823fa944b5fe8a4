// The forward's two roles inside a persistent CTA.
//  Producer (one thread of the producer warpgroup): takes tiles from the plan through an atomic
//    counter, publishes each to the consumers, and issues the TMA loads: Q once per tile, K and V
//    through the kStages ring.
//  Consumers (two warpgroups, 64 rows each): S = Q K^T, mask (only on the peeled blocks), online
//    softmax, O += P V, then the epilogue.
#pragma once

#include "kernels/fwd/epilogue_fwd.cuh"
#include "kernels/fwd/kernel_traits.cuh"
#include "kernels/fwd/softmax.cuh"

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

namespace jagflash::kernels::fwd {

using namespace cute;
using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;

// Issues a whole warpgroup GEMM over the K blocks of its operands and waits for it.
// kARegisters: A is a register fragment (P), which must be fenced like the accumulator.
template <bool kZeroInit, bool kARegisters, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, TA const& a, TB const& b, TC& c) {
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TA&>(a));
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_wait<0>();
  warpgroup_fence_operand(c);
  if constexpr (kARegisters) warpgroup_fence_operand(const_cast<TA&>(a));
}

template <class Traits>
struct Producer {
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using HeadDim = typename Traits::HeadDim;
  static constexpr int kStages = Traits::kStages;

  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem) {
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.total_q, HeadDim{}, p.num_heads));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.total_kv, HeadDim{}, p.num_heads_kv));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.total_kv, HeadDim{}, p.num_heads_kv));
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});

    const int32_t total_tiles = *p.num_pairs * p.num_heads;
    uint32_t q_uses = 0, kv_uses = 0;
    for (;;) {
      const int32_t tile = atomicAdd(p.tile_counter, 1);
      if (q_uses > 0) EmptyBarrier::wait(&smem.q_empty, (q_uses - 1) & 1);
      if (tile >= total_tiles) {
        smem.tile = -1;
        EmptyBarrier::arrive(&smem.q_full);  // release semantics: the consumers see tile = -1
        return;
      }
      smem.tile = tile;
      const TileInfo t = decode_tile(p, tile);

      // Rows are addressed from the sequence's first token: loads past its end read the next
      // sequence (masked by the consumers, never stored) or are zero-filled past the tensor.
      Tensor gQ = local_tile(domain_offset(make_coord(t.q_start, _0{}), mQ(_, _, t.head)), Shape<BlockM, HeadDim>{},
                             make_coord(t.m_block, _0{}));
      auto [tQg, tQs] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      FullBarrier::arrive_and_expect_tx(&smem.q_full, Traits::kQBytes);
      copy(p.tma_q.with(smem.q_full), tQg, tQs);

      Tensor gK = local_tile(domain_offset(make_coord(t.kv_start, _0{}), mK(_, _, t.kv_head)),
                             Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));
      Tensor gV = local_tile(domain_offset(make_coord(t.kv_start, _0{}), mV(_, _, t.kv_head)),
                             Shape<BlockN, HeadDim>{}, make_coord(_, _0{}));
      auto [tKg, tKs] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tVg, tVs] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      // Same order as the consumers: last block first (the masked tail), down to the first.
      for (int32_t n = static_cast<int32_t>(t.kv_blocks.hi); n >= t.kv_blocks.lo; --n) {
        const uint32_t stage = kv_uses % kStages, round = kv_uses / kStages;
        if (round > 0) EmptyBarrier::wait(&smem.kv_empty[stage], (round - 1) & 1);
        FullBarrier::arrive_and_expect_tx(&smem.kv_full[stage], Traits::kKVStageBytes);
        copy(p.tma_k.with(smem.kv_full[stage]), tKg(_, n), tKs(_, stage));
        copy(p.tma_v.with(smem.kv_full[stage]), tVg(_, n), tVs(_, stage));
        ++kv_uses;
      }
      ++q_uses;
    }
  }
};

template <class Traits>
struct Consumer {
  using Element = typename Traits::Element;
  using BlockM = typename Traits::BlockM;
  using BlockN = typename Traits::BlockN;
  using HeadDim = typename Traits::HeadDim;
  static constexpr int kStages = Traits::kStages;

  __device__ static void run(const Params<Traits>& p, SharedStorage<Traits>& smem, int thread) {
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(thread);
    auto thr_pv = mma_pv.get_thread_slice(thread);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
    Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // smem descriptors
    Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
    Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, D, keys, stage)

    Tensor tSrS = partition_fragment_C(mma_qk, Shape<BlockM, BlockN>{});
    Tensor tOrO = partition_fragment_C(mma_pv, Shape<BlockM, HeadDim>{});
    Tensor s_rc = make_tensor(tSrS.data(), rowcol_layout(tSrS.layout()));
    Tensor o_rc = make_tensor(tOrO.data(), rowcol_layout(tOrO.layout()));
    const AccumulatorCoords coords(thread);
    constexpr int kRows = decltype(size<0>(s_rc))::value;
    OnlineSoftmax<kRows> softmax;

    const int lane = thread % 32;
    uint32_t q_uses = 0, kv_uses = 0;
    for (;;) {
      EmptyBarrier::wait(&smem.q_full, q_uses & 1);
      const int32_t tile = smem.tile;
      if (tile < 0) return;
      const TileInfo t = decode_tile(p, tile);
      softmax.reset();
      clear(tOrO);

      auto block_step = [&](int32_t n, auto masked) {
        const uint32_t stage = kv_uses % kStages;
        EmptyBarrier::wait(&smem.kv_full[stage], (kv_uses / kStages) & 1);
        warpgroup_gemm</*kZeroInit=*/true, /*kARegisters=*/false>(mma_qk, tSrQ, tSrK(_, _, _, stage), tSrS);
        if constexpr (decltype(masked)::value) {
#pragma unroll
          for (int r = 0; r < kRows; ++r) {
            const IndexRange keys = p.mask.key_range(t.m_block * Traits::kBlockM + coords.row(r), t.len_q, t.len_kv);
            // Visible columns of this block, relative to the thread's first column.
            const int first = static_cast<int>(keys.lo) - n * Traits::kBlockN - coords.col_base;
            const int last = static_cast<int>(keys.hi) - n * Traits::kBlockN - coords.col_base;
#pragma unroll
            for (int c = 0; c < size<1>(s_rc); ++c) {
              const int col = AccumulatorCoords::col_offset(c);
              if (col < first || col > last) s_rc(r, c) = -INFINITY;
            }
          }
        }
        softmax.step(s_rc, o_rc, p.scale_log2);
        Tensor tOrP = make_tensor_like<Element>(tSrS);
#pragma unroll
        for (int e = 0; e < size(tSrS); ++e) tOrP(e) = static_cast<Element>(tSrS(e));
        Tensor tOrP_a = make_tensor(tOrP.data(), acc_as_a_operand_layout(tOrP.layout()));
        warpgroup_gemm</*kZeroInit=*/false, /*kARegisters=*/true>(mma_pv, tOrP_a, tOrV(_, _, _, stage), tOrO);
        __syncwarp();
        if (lane == 0) EmptyBarrier::arrive(&smem.kv_empty[stage]);
        ++kv_uses;
      };

      // Loop peeling: the masked blocks above the mask-free bulk, the bulk, the masked blocks
      // below it. The mask policy gives both ranges.
      const int32_t n_lo = static_cast<int32_t>(t.kv_blocks.lo), n_hi = static_cast<int32_t>(t.kv_blocks.hi);
      int32_t bulk_lo = static_cast<int32_t>(t.unmasked.lo), bulk_hi = static_cast<int32_t>(t.unmasked.hi);
      if (bulk_lo > bulk_hi) {  // no mask-free block: everything is the masked tail
        bulk_lo = n_hi + 1;
        bulk_hi = n_hi;
      }
      int32_t n = n_hi;
      for (; n > bulk_hi; --n) block_step(n, cute::true_type{});
      for (; n >= bulk_lo; --n) block_step(n, cute::false_type{});
      for (; n >= n_lo; --n) block_step(n, cute::true_type{});

      __syncwarp();
      if (lane == 0) EmptyBarrier::arrive(&smem.q_empty);  // the last S GEMM has read Q
      store_tile<Traits>(p, t, o_rc, coords, softmax, thread);
      ++q_uses;
    }
  }
};

}  // namespace jagflash::kernels::fwd
