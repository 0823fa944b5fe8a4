// Backward epilogue: dK (times the softmax scale) and dV of the tile, stored for the keys inside
// the sequence only (the keys after its end belong to the next sequence and are never touched).
// A tile whose keys no query sees stores zeros. A tile that holds its whole group converts them
// to the input dtype into dk, dv; a tile holding one split of a group writes them in fp32 to its
// split's slot of the partials, which the dK/dV postprocess sums in split order.
#pragma once

#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/common/accumulator.cuh"

namespace jagflash::kernels::bwd {

using namespace cute;

// One store per column pair straight from the accumulators: a warp's store covers 8 rows of 16
// contiguous bytes each (32 in fp32).
template <class Traits, class TensorDK, class TensorDV>
__device__ __forceinline__ void store_dkdv(const Params<Traits>& p, const TileInfo& t, TensorDK& dk_acc,
                                           TensorDV& dv_acc, int thread) {
  using Element = typename Traits::Element;
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
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int32_t j = t.n_block * Traits::kBlockN + coords.row(r);
    if (j >= t.len_kv) continue;
    const int64_t row = int64_t(t.kv_start) + j;
    Element* dk_row = p.dk + row * p.dk_row_stride + int64_t(t.kv_head) * p.dk_head_stride;
    Element* dv_row = p.dv + row * p.dv_row_stride + int64_t(t.kv_head) * p.dv_head_stride;
#pragma unroll
    for (int c = 0; c < size<1>(dk_rc); c += 2) {
      const int col = coords.col(c);
      *reinterpret_cast<uint32_t*>(dk_row + col) =
          common::pack2(Element{}, dk_rc(r, c) * p.scale, dk_rc(r, c + 1) * p.scale);
      *reinterpret_cast<uint32_t*>(dv_row + col) = common::pack2(Element{}, dv_rc(r, c), dv_rc(r, c + 1));
    }
  }
}

}  // namespace jagflash::kernels::bwd
