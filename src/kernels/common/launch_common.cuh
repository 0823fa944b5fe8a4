// Host-side pieces both directions' launchers use: the SM count, and a caller's tensor as the
// TMA sees it.
#pragma once

#include <jagflash/jagflash.h>

#include <cute/tensor.hpp>

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace jagflash::kernels::common {

using namespace cute;

// cudaFuncSetAttribute(kKernel, MaxDynamicSharedMemorySize, bytes) once per device: the attribute
// stays set on the device's function, and set at every call it cost a driver call each (issue 18:
// the host time of small calls). Devices past ordinal 63 get it every call.
template <auto kKernel>
cudaError_t allow_dynamic_smem(size_t bytes) {
  static std::atomic<uint64_t> set_on{0};
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const uint64_t bit = device >= 0 && device < 64 ? uint64_t(1) << device : 0;
  if (bit != 0 && (set_on.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
  err = cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err == cudaSuccess) set_on.fetch_or(bit, std::memory_order_acq_rel);
  return err;
}

inline int sm_count() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 132;
  return count;
}

// A [rows, heads, head_dim] view as the TMA's (rows, head dim, heads) tensor. A tensor with no
// rows still needs a valid descriptor (it is never loaded from): it borrows `fallback`. The head
// dim is the view's own (the kernel's kHeadDim, or less with PaddedHeadDim: the TMA's box, kHeadDim
// wide, then reads zeros past it); the descriptor's type is the same either way.
template <class Traits>
auto gmem_tensor(const jf_tensor& t, const jf_tensor& fallback) {
  using Element = typename Traits::Element;
  const jf_tensor& src = t.rows > 0 ? t : fallback;
  const int32_t rows = static_cast<int32_t>(src.rows);
  // A single head's stride is never stepped over, but the TMA still requires it 16-byte aligned.
  const int64_t head_stride = src.heads > 1 ? src.head_stride : Traits::kHeadDim;
  return make_tensor(make_gmem_ptr(static_cast<const Element*>(src.data)),
                     make_layout(make_shape(rows, static_cast<int32_t>(src.head_dim), src.heads),
                                 make_stride(src.row_stride, _1{}, head_stride)));
}

}  // namespace jagflash::kernels::common
