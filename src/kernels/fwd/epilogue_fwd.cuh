// Forward epilogue: O normalised by the softmax sum, converted, and stored for the rows inside
// the sequence only (the rows after its end belong to the next sequence and are never touched);
// lse per row, -inf and O = 0 for rows that see no key; a learnable sink joins each row's sum.
#pragma once

#include "kernels/fwd/barrier_ids_fwd.hpp"
#include "kernels/fwd/kernel_traits.cuh"
#include "kernels/fwd/softmax.cuh"

namespace jagflash::kernels::fwd {

using namespace cute;

using common::pack2;  // kernels/common/accumulator.cuh

// O goes registers -> shared memory (one 32-bit store per column pair) -> global memory in
// 16-byte row chunks, so the global stores are full-width and coalesced whatever the
// accumulator layout, and a row past the sequence's end is simply skipped.
// Every address here derives from the thread index, read afresh (an asm volatile the compiler
// cannot hoist): otherwise it computes them once before the persistent loop and keeps them live
// across the main loop, which spilled with three consumer warpgroups.
template <class Traits, class TensorO, class Softmax>
__device__ __forceinline__ void store_tile(const Params<Traits>& p, SharedStorage<Traits>& smem,
                                           const TileInfo& t, TensorO& o_rc, Softmax& softmax) {
  using Element = typename Traits::Element;
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  // Consumer threads follow the producer warpgroup; each pair's threads follow the previous pair's.
  constexpr int kPairThreads = 128 * Traits::kConsumerWarpgroups;
  const int pair = Traits::kPairs == 1 ? 0 : (static_cast<int>(tid) - 128) / kPairThreads;
  const int thread = static_cast<int>(tid) - 128 - pair * kPairThreads;
  const AccumulatorCoords coords(thread);
  constexpr int kRows = decltype(size<0>(o_rc))::value;
  constexpr int kWgRows = Traits::kRowsPerWarpgroup;
  constexpr int kStride = Traits::kOSmemStride;
  constexpr int kChunk = 16 / int(sizeof(Element));  // elements per 16-byte chunk
  // The staging tile holds kOStagingColumns of the head dim (all of it, or half: tile_config.hpp),
  // so the rows go out in kRounds rounds of that many columns each.
  constexpr int kRounds = Traits::kHeadDim / Traits::kOStagingColumns;
  constexpr int kChunksPerRow = Traits::kOStagingColumns / kChunk;
  constexpr int kPairsPerRound = decltype(size<1>(o_rc))::value / kRounds;  // accumulator columns
  const int warpgroup = thread / 128, wg_thread = thread % 128;
  // Each warpgroup stages its own 64 rows and synchronises on its own named barrier (by its index
  // among all consumer warpgroups: barrier_ids_fwd.hpp).
  Element* o_smem = smem.o.data() + warpgroup * kWgRows * kStride;
  // Passed to CUTLASS's NamedBarrier, which adds its reserved 8 to the id it is given.
  constexpr int kFirstBarrier =
      warpgroup_barrier(0) - static_cast<int>(cutlass::arch::NamedBarrier::ReservedNamedBarrierCount);
  const uint32_t barrier = kFirstBarrier + pair * Traits::kConsumerWarpgroups + warpgroup;

  // The sink is one more term of the row's sum, exp(sink - max) with no value: it rescales O and
  // moves lse. Taken on a common max so that a sink far above the scores does not overflow.
  const float sink = p.learnable_sink != nullptr ? p.learnable_sink[t.head] : -INFINITY;
  float inv_l[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const float l = Softmax::quad_sum(softmax.row_sum[r]);
    const float row_max = softmax.row_max[r] * p.scale;  // natural units, as lse
    float lse = l > 0.f ? row_max + logf(l) : -INFINITY;
    inv_l[r] = l > 0.f ? 1.f / l : 0.f;
    if (p.learnable_sink != nullptr) {
      if (l > 0.f) {
        const float max = fmaxf(row_max, sink);
        const float keep = expf(row_max - max);
        const float sum = l * keep + expf(sink - max);
        inv_l[r] = keep / sum;
        lse = max + logf(sum);
      } else {
        lse = sink;  // no visible key: O = 0, the sink alone in the sum
      }
    }
    const int32_t i = t.m_block * Traits::kBlockM + coords.row(r);
    if (p.lse != nullptr && thread % 4 == 0 && i < t.len_q)
      p.lse[int64_t(t.head) * p.total_q + t.q_start + i] = lse;
  }
#pragma unroll
  for (int round = 0; round < kRounds; ++round) {
    // Accumulator columns [round * kPairsPerRound, +kPairsPerRound) are head-dim columns
    // [round * kOStagingColumns, +kOStagingColumns) (AccumulatorCoords::col_offset).
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      Element* row_smem = o_smem + (coords.row(r) - warpgroup * kWgRows) * kStride;
#pragma unroll
      for (int c = round * kPairsPerRound; c < (round + 1) * kPairsPerRound; c += 2)
        *reinterpret_cast<uint32_t*>(row_smem + coords.col(c) - round * Traits::kOStagingColumns) =
            pack2(Element{}, o_rc(r, c) * inv_l[r], o_rc(r, c + 1) * inv_l[r]);
    }
    cutlass::arch::NamedBarrier::sync(128, barrier);
    for (int idx = wg_thread; idx < kWgRows * kChunksPerRow; idx += 128) {
      const int row_local = idx / kChunksPerRow, chunk_local = idx % kChunksPerRow;
      const int chunk = round * kChunksPerRow + chunk_local;  // in the whole row
      const int32_t i = t.m_block * Traits::kBlockM + warpgroup * kWgRows + row_local;
      if (i >= t.len_q) continue;
      if constexpr (Traits::kPaddedHeadDim)
        if (chunk >= p.head_dim_chunks) continue;  // a zero column past the caller's head dim
      const int64_t row = int64_t(t.q_start) + i;
      Element* dst = p.out + row * p.out_row_stride + int64_t(t.head) * p.out_head_stride + chunk * kChunk;
      *reinterpret_cast<uint4*>(dst) =
          *reinterpret_cast<const uint4*>(o_smem + row_local * kStride + chunk_local * kChunk);
    }
    cutlass::arch::NamedBarrier::sync(128, barrier);  // the staging rows are free again
  }
}

}  // namespace jagflash::kernels::fwd
