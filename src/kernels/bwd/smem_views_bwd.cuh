// The backward consumers' views of their shared-memory operands (mainloop_bwd.cuh,
// mainloop_bwd_wide.cuh), each built at its use from a base the compiler must reload: the
// operands' descriptors (64-bit, one per k-block) are then built right before each GEMM. Built
// once before the tile loop, the ~90 of them stayed live across it and spilled.
#pragma once

#include "kernels/bwd/kernel_traits_bwd.cuh"

#include <cute/tensor.hpp>

namespace jagflash::kernels::bwd {

template <class Traits>
struct SmemViews {
  SharedStorage<Traits>& smem;

  __device__ __forceinline__ SharedStorage<Traits>& fresh() const {
    SharedStorage<Traits>* s = &smem;
    asm volatile("" : "+l"(s));
    return *s;
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
  // dS (rows, keys, buffer).
  __device__ __forceinline__ auto ds() const {
    return view(fresh().ds.data(), typename Traits::SmemLayoutDs{});
  }

 private:
  template <class T, class Layout>
  __device__ __forceinline__ static auto view(T* p, Layout l) {
    return cute::make_tensor(cute::make_smem_ptr(p), l);
  }
};

}  // namespace jagflash::kernels::bwd
