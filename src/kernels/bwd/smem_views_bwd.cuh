// The backward consumers' views of their shared-memory operands (mainloop_bwd.cuh,
// mainloop_bwd_wide.cuh), built from a base address the consumer re-reads once a step
// (refresh): through a warp shuffle, so that ptxas sees a warp-uniform value and builds the
// operands' descriptors (64-bit, one per k-block) on the uniform datapath, advancing them by
// uniform adds; and convergent, so that the compiler cannot hoist the descriptors out of the loop
// (built once before the tile loop, the ~90 of them stayed live across it and spilled).
#pragma once

#include "kernels/bwd/kernel_traits_bwd.cuh"

#include <cute/tensor.hpp>

namespace jagflash::kernels::bwd {

template <class Traits>
struct SmemViews {
  SharedStorage<Traits>& smem;
  uint32_t base = 0;  // smem's shared-space address, as last re-read

  __device__ __forceinline__ void refresh() {
    base = __shfl_sync(0xffffffffu, static_cast<uint32_t>(__cvta_generic_to_shared(&smem)), 0);
  }
  __device__ __forceinline__ SharedStorage<Traits>& fresh() const {
    return *reinterpret_cast<SharedStorage<Traits>*>(__cvta_shared_to_generic(base));
  }
  // Q, dO (rows, head dim, stage) and as (head dim, rows, stage); K, V (keys, head dim) and K^T.
  __device__ __forceinline__ auto q() const { return view(fresh().q.data(), typename Traits::SmemLayoutQ{}); }
  __device__ __forceinline__ auto dout() const {
    return view(fresh().dout.data(), typename Traits::SmemLayoutQ{});
  }
  __device__ __forceinline__ auto qt() const {
    return view(fresh().q.data(), typename Traits::SmemLayoutQt{});
  }
  __device__ __forceinline__ auto doutt() const {
    return view(fresh().dout.data(), typename Traits::SmemLayoutQt{});
  }
  __device__ __forceinline__ auto k() const { return view(fresh().k.data(), typename Traits::SmemLayoutK{}); }
  __device__ __forceinline__ auto v() const { return view(fresh().v.data(), typename Traits::SmemLayoutK{}); }
  __device__ __forceinline__ auto kt() const {
    return view(fresh().k.data(), typename Traits::SmemLayoutKt{});
  }
  // dS (rows, keys, buffer), and the same bytes as (keys, rows, buffer): the wide kernel's P^T
  // and dS^T, the A operands of its dV and dK GEMMs.
  __device__ __forceinline__ auto ds() const {
    return view(fresh().ds.data(), typename Traits::SmemLayoutDs{});
  }
  __device__ __forceinline__ auto dst() const {
    return view(fresh().ds.data(), typename Traits::SmemLayoutDst{});
  }

 private:
  template <class T, class Layout>
  __device__ __forceinline__ static auto view(T* p, Layout l) {
    return cute::make_tensor(cute::make_smem_ptr(p), l);
  }
};

}  // namespace jagflash::kernels::bwd
