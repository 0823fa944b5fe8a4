// Walking the KV blocks a block-sparse map (core/block_mask.hpp) lets a forward tile visit (the
// backward asks per Q block: bwd::q_block_visible). Without a map every block of the mask's range
// is visited and this compiles to the plain loop's arithmetic (n - 1, n > lo).
#pragma once

#include "core/block_mask.hpp"

#include <cstdint>

namespace jagflash::kernels::common {

// The forward: the KV blocks (of kBlockN keys) of one query block's map row, from the top of the
// mask's range [lo, hi] down (the loops' order), hidden blocks skipped; without a map exactly the
// plain loop's expressions. The producer and the consumers walk the same blocks, so their K/V
// rings stay in step.
template <bool kSparse, int kBlockN>
struct KvBlockWalk {
  const uint8_t* row = nullptr;  // the map row of the tile's query block (kSparse only)

  __device__ __forceinline__ bool visible(int32_t n) const {
    return __ldg(row + n * kBlockN / BlockMask::kBlock) != 0;
  }
  // The first block to visit at or below n, down to lo: n itself without a map; lo - 1 when none.
  __device__ __forceinline__ int32_t at_or_below(int32_t n, int32_t lo) const {
    if constexpr (kSparse)
      while (n >= lo && !visible(n)) --n;
    return n;
  }
  // The block visited after n.
  __device__ __forceinline__ int32_t after(int32_t n, int32_t lo) const {
    if constexpr (kSparse)
      return at_or_below(n - 1, lo);
    else
      return n - 1;
  }
};

}  // namespace jagflash::kernels::common
