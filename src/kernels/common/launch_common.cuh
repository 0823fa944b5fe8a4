// Host-side pieces both directions' launchers use: the SM count, and a caller's tensor as the
// TMA sees it.
#pragma once

#include <jagflash/jagflash.h>

#include <cute/tensor.hpp>

#include <cuda_runtime.h>

#include <cstdint>

namespace jagflash::kernels::common {

using namespace cute;

inline int sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 132;
  return count;
}

// A [rows, heads, head_dim] view as the TMA's (rows, head dim, heads) tensor. A tensor with no
// rows still needs a valid descriptor (it is never loaded from): it borrows `fallback`.
template <class Traits>
auto gmem_tensor(const jf_tensor& t, const jf_tensor& fallback) {
  using Element = typename Traits::Element;
  const jf_tensor& src = t.rows > 0 ? t : fallback;
  const int32_t rows = static_cast<int32_t>(src.rows);
  // A single head's stride is never stepped over, but the TMA still requires it 16-byte aligned.
  const int64_t head_stride = src.heads > 1 ? src.head_stride : Traits::kHeadDim;
  return make_tensor(make_gmem_ptr(static_cast<const Element*>(src.data)),
                     make_layout(make_shape(rows, typename Traits::HeadDim{}, src.heads),
                                 make_stride(src.row_stride, _1{}, head_stride)));
}

}  // namespace jagflash::kernels::common
