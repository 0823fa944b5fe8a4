// Backward epilogue: dK (times the softmax scale) and dV of the tile, stored for the keys inside
// the sequence only (the keys after its end belong to the next sequence and are never touched).
// A tile whose keys no query sees stores zeros. A tile that holds its whole group converts them
// to the input dtype into dk, dv; a tile holding one split of a group writes them in fp32 to its
// split's slot of the partials, which the dK/dV postprocess sums in split order.
#pragma once

#include "kernels/bwd/barrier_ids_bwd.hpp"
#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/common/accumulator.cuh"
#include "kernels/common/barriers.cuh"

namespace jagflash::kernels::bwd {

using namespace cute;

// A warpgroup's staging of one of dK, dV (its 64 keys x D in the input dtype) in the dS buffers'
// bytes that hold its own keys (kStageHalf bytes, half of a kBufferBytes buffer (64 or 128 rows x
// 128 keys), in each of the two buffers; free once both
// warpgroups' last dQ GEMM of the tile is done), a key's row of D elements at key x row bytes,
// its 16-byte chunks XOR-ed with key % 8 so that a warp's accumulator stores (8 keys, one chunk)
// and its row reads (whole rows) hit distinct banks.
// At D = 96 a row (192 bytes, 12 chunks) divides neither a half nor a power of two: kRowsPerHalf
// = 42 rows in the first half, the rest in the second, and the XOR stays inside a row's groups
// of 4 chunks: 8 keys at a 192-byte pitch fall on two 64-byte bank halves (key % 2), and
// (chunk % 4) XOR (key / 2 % 4) spreads each half's 4 keys over its 4 chunk slots.
template <int kHeadDim, int kElementBytes, uint32_t kBufferBytes_ = 16 * 1024>
struct DkvStaging {
  static constexpr int kRowBytes = kHeadDim * kElementBytes;
  static constexpr int kChunks = kRowBytes / 16;
  static constexpr uint32_t kBufferBytes = kBufferBytes_;   // one dS buffer (kBlockM rows x 128 keys)
  static constexpr uint32_t kStageHalf = kBufferBytes / 2;  // a warpgroup's 64 keys of one dS buffer
  static constexpr bool kPowerOfTwoRows = kStageHalf % kRowBytes == 0;
  static constexpr int kRowsPerHalf = kStageHalf / kRowBytes;
  static_assert(2 * kRowsPerHalf >= 64 && (kPowerOfTwoRows || kChunks % 4 == 0), "a warpgroup's keys fit");
  // Byte offset of (key, 16-byte chunk) from the dS buffers' base, for warpgroup `wg`.
  static __host__ __device__ __forceinline__ uint32_t offset(int wg, int key, int chunk) {
    if constexpr (kPowerOfTwoRows) {
      const uint32_t linear = static_cast<uint32_t>(key * kRowBytes);
      const uint32_t half = linear / kStageHalf;
      return half * kBufferBytes + wg * kStageHalf + linear % kStageHalf +
             static_cast<uint32_t>((chunk ^ (key & 7)) * 16);
    } else {
      const int half = key >= kRowsPerHalf ? 1 : 0;
      const int row = key - half * kRowsPerHalf;
      const int swizzled = (chunk & ~3) | ((chunk ^ (key >> 1)) & 3);
      return static_cast<uint32_t>(half * kBufferBytes + wg * kStageHalf + row * kRowBytes + swizzled * 16);
    }
  }
};

__device__ __forceinline__ void st_shared_b32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// dK (times the scale) and dV in the input dtype: registers -> the staging above -> global
// memory in 16-byte chunks of whole rows (a warp writes 512 contiguous-row bytes a store, full
// 32-byte sectors), rows past the sequence's end skipped. Stored straight from the accumulators
// (a warp's store: 8 rows of 16 bytes, half sectors) the epilogue doubled the L2 write requests
// and bound a tile that sees one Q block (pooled attention, short sequences).
// Every consumer thread calls it once a tile (the barriers count them all). chunks: the
// tensor's head dim in 16-byte chunks (read with kPaddedHeadDim only: q's for dk, v's for dv).
template <class Traits, class TensorAcc>
__device__ __forceinline__ void stage_and_store(const TileInfo& t, TensorAcc& acc_rc, float factor,
                                                typename Traits::Element* out, int64_t row_stride,
                                                int64_t head_stride, int32_t chunks, uint32_t ds_base,
                                                int thread) {
  using Element = typename Traits::Element;
  using Staging = DkvStaging<Traits::kHeadDim, int(sizeof(Element)),
                             uint32_t(Traits::kBlockM * Traits::kBlockN * sizeof(Element))>;
  constexpr int kRows = decltype(size<0>(acc_rc))::value;
  const common::AccumulatorCoords coords(thread);
  const int wg = thread / 128, wg_thread = thread % 128;
  const uint32_t barrier = warpgroup_barrier(wg);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int key = coords.row(r) - 64 * wg;
#pragma unroll
    for (int c = 0; c < size<1>(acc_rc); c += 2) {
      const int col = coords.col(c);
      st_shared_b32(ds_base + Staging::offset(wg, key, col / 8) + (col % 8) * int(sizeof(Element)),
                    common::pack2(Element{}, acc_rc(r, c) * factor, acc_rc(r, c + 1) * factor));
    }
  }
  common::named_barrier_sync(barrier, 128);
  const int32_t key_lo = t.n_block * Traits::kBlockN + 64 * wg;  // the warpgroup's first key
#pragma unroll
  for (int i = 0; i < 64 * Staging::kChunks / 128; ++i) {
    const int idx = wg_thread + 128 * i;
    const int key = idx / Staging::kChunks, chunk = idx % Staging::kChunks;
    const uint4 v = ld_shared_v4(ds_base + Staging::offset(wg, key, chunk));
    // With a padded head dim the chunks past the caller's are zero columns, never stored.
    if (key_lo + key < t.len_kv && (!Traits::kPaddedHeadDim || chunk < chunks)) {
      const int64_t row = int64_t(t.kv_start) + key_lo + key;
      *reinterpret_cast<uint4*>(out + row * row_stride + int64_t(t.kv_head) * head_stride +
                                chunk * (16 / int(sizeof(Element)))) = v;
    }
  }
  common::named_barrier_sync(barrier, 128);  // the staging bytes are free again
}

// dk_partial, dv_partial (a split group's fp32 slots): one store per column pair straight from
// the accumulators. dk, dv: staged (above) through the dS buffers at shared address ds_base.
template <class Traits, class TensorDK, class TensorDV>
__device__ __forceinline__ void store_dkdv(const Params<Traits>& p, const TileInfo& t, TensorDK& dk_acc,
                                           TensorDV& dv_acc, uint32_t ds_base, int thread) {
  Tensor dk_rc = make_tensor(dk_acc.data(), common::rowcol_layout(dk_acc.layout()));
  Tensor dv_rc = make_tensor(dv_acc.data(), common::rowcol_layout(dv_acc.layout()));
  const common::AccumulatorCoords coords(thread);
  constexpr int kRows = decltype(size<0>(dk_rc))::value;
  if (p.dk_partial != nullptr) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int32_t j = t.n_block * Traits::kBlockN + coords.row(r);
      if (j >= t.len_kv) continue;
      const int64_t at =
          ((int64_t(t.split) * p.total_kv + t.kv_start + j) * p.num_heads_kv + t.kv_head) * Traits::kHeadDim;
#pragma unroll
      for (int c = 0; c < size<1>(dk_rc); c += 2) {
        const int col = coords.col(c);
        *reinterpret_cast<float2*>(p.dk_partial + at + col) =
            make_float2(dk_rc(r, c) * p.scale, dk_rc(r, c + 1) * p.scale);
        *reinterpret_cast<float2*>(p.dv_partial + at + col) = make_float2(dv_rc(r, c), dv_rc(r, c + 1));
      }
    }
    return;
  }
  // Both warpgroups' last dQ GEMM (which reads every key's dS) is done before either overwrites
  // its keys' dS bytes.
  common::named_barrier_sync(BwdBarrier::kDsFree, 256);
  stage_and_store<Traits>(t, dk_rc, p.scale, p.dk, p.dk_row_stride, p.dk_head_stride, p.head_dim_chunks,
                          ds_base, thread);
  stage_and_store<Traits>(t, dv_rc, 1.f, p.dv, p.dv_row_stride, p.dv_head_stride, p.v_head_dim_chunks,
                          ds_base, thread);
}

}  // namespace jagflash::kernels::bwd
