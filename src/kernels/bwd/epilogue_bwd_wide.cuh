// The wide backward's epilogue (head dims 192 and 256; mainloop_bwd_wide.cuh): each warpgroup holds
// dK and dV of all the tile's 64 keys for its half of the head dim, and stores that half: dK
// (times the softmax scale) and dV for the keys inside the sequence only, converted to the input
// dtype through a staging of the warpgroup's own (two of the four P/dS buffers, 16 KB: free once
// both warpgroups' last GEMMs of the tile are done, mainloop_bwd_wide.cuh), or in fp32 to its split's slot of
// the partials (a split group, summed by the dK/dV postprocess). The same contract as epilogue_bwd.cuh's,
// split by columns, not keys.
#pragma once

#include "kernels/bwd/barrier_ids_bwd.hpp"
#include "kernels/bwd/epilogue_bwd.cuh"
#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/common/accumulator.cuh"
#include "kernels/common/barriers.cuh"

namespace jagflash::kernels::bwd {

using namespace cute;

// A warpgroup's staging of its half of dK or dV: 64 keys x kHalf columns of the input dtype, a
// key's row at key x 256 bytes (16 chunks of 16 bytes, 12 of them used at D = 192), its chunks
// XOR-ed with key % 8 (a warp's accumulator stores, 8 keys x one chunk, hit distinct banks; the
// XOR keeps a chunk inside its row's 16).
template <int kHeadDim, int kElementBytes>
struct WideDkvStaging {
  static constexpr int kHalf = kHeadDim / 2;
  static constexpr int kChunks = kHalf * kElementBytes / 16;  // the half's chunks a key
  static constexpr int kRowBytes = 256;
  static constexpr uint32_t kBytes = 64 * kRowBytes;  // 16 KB, a warpgroup's two dS buffers
  static_assert(kChunks <= 16 && kChunks % 4 == 0, "a key's half row fits 16 chunks");
  static __host__ __device__ __forceinline__ uint32_t offset(int key, int chunk) {
    return static_cast<uint32_t>(key * kRowBytes + ((chunk ^ (key & 7)) * 16));
  }
};

// One of dK, dV (the warpgroup's half, acc_rc as (keys, columns)) times `factor` in the input
// dtype into `out`: registers -> the staging at shared address `staging` -> global memory in
// 16-byte chunks of whole half rows, keys past the sequence's end skipped. chunks: the tensor's
// head dim in 16-byte chunks (kPaddedHeadDim: q's for dk, v's for dv); the chunks past it are zero
// columns, never stored. Every thread of the warpgroup calls it (its named barrier counts 128).
template <class Traits, class TensorAcc>
__device__ __forceinline__ void stage_and_store_half(const TileInfo& t, TensorAcc& acc_rc, float factor,
                                                     typename Traits::Element* out, int64_t row_stride,
                                                     int64_t head_stride, int32_t chunks, uint32_t staging,
                                                     int thread) {
  using Element = typename Traits::Element;
  using Staging = WideDkvStaging<Traits::kHeadDim, int(sizeof(Element))>;
  constexpr int kRows = decltype(size<0>(acc_rc))::value;
  const int wg = thread / 128, wg_thread = thread % 128;
  const common::AccumulatorCoords coords(wg_thread);  // keys 0-63 of the tile, columns of the half
  const uint32_t barrier = warpgroup_barrier(wg);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int key = coords.row(r);
#pragma unroll
    for (int c = 0; c < size<1>(acc_rc); c += 2) {
      const int col = coords.col(c);
      st_shared_b32(staging + Staging::offset(key, col / 8) + (col % 8) * int(sizeof(Element)),
                    common::pack2(Element{}, acc_rc(r, c) * factor, acc_rc(r, c + 1) * factor));
    }
  }
  common::named_barrier_sync(barrier, 128);
  const int32_t key_lo = t.n_block * Traits::kBlockN;
  const int first_chunk = wg * Staging::kChunks;  // the half's first chunk in the row
#pragma unroll
  for (int i = 0; i < 64 * Staging::kChunks / 128; ++i) {
    const int idx = wg_thread + 128 * i;
    const int key = idx / Staging::kChunks, chunk = idx % Staging::kChunks;
    const uint4 v = ld_shared_v4(staging + Staging::offset(key, chunk));
    if (key_lo + key < t.len_kv && (!Traits::kPaddedHeadDim || first_chunk + chunk < chunks)) {
      const int64_t row = int64_t(t.kv_start) + key_lo + key;
      *reinterpret_cast<uint4*>(out + row * row_stride + int64_t(t.kv_head) * head_stride +
                                (first_chunk + chunk) * (16 / int(sizeof(Element)))) = v;
    }
  }
  common::named_barrier_sync(barrier, 128);  // the staging bytes are free again
}

// The tile's dK and dV, this warpgroup's half. staging: the warpgroup's 16 KB (two P/dS buffers).
template <class Traits, class TensorDK, class TensorDV>
__device__ __forceinline__ void store_dkdv_wide(const Params<Traits>& p, const TileInfo& t, TensorDK& dk_acc,
                                                TensorDV& dv_acc, uint32_t staging, int thread) {
  Tensor dk_rc = make_tensor(dk_acc.data(), common::rowcol_layout(dk_acc.layout()));
  Tensor dv_rc = make_tensor(dv_acc.data(), common::rowcol_layout(dv_acc.layout()));
  constexpr int kRows = decltype(size<0>(dk_rc))::value;
  if (p.dk_partial != nullptr) {
    const int wg = thread / 128;
    const common::AccumulatorCoords coords(thread % 128);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int32_t j = t.n_block * Traits::kBlockN + coords.row(r);
      if (j >= t.len_kv) continue;
      const int64_t at =
          ((int64_t(t.split) * p.total_kv + t.kv_start + j) * p.num_heads_kv + t.kv_head) * Traits::kHeadDim +
          wg * (Traits::kHeadDim / 2);
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
  stage_and_store_half<Traits>(t, dk_rc, p.scale, p.dk, p.dk_row_stride, p.dk_head_stride, p.head_dim_chunks,
                               staging, thread);
  stage_and_store_half<Traits>(t, dv_rc, 1.f, p.dv, p.dv_row_stride, p.dv_head_stride, p.v_head_dim_chunks,
                               staging, thread);
}

}  // namespace jagflash::kernels::bwd
