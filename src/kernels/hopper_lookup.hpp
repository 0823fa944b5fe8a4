// The registry's search (kernels/hopper_registry.cu.in runs it over its generated tables): here so
// that a host test can run it over a trimmed build's table.
#pragma once

#include "kernels/hopper_forward.hpp"

#include <jagflash/jagflash.h>

namespace jagflash::kernels {

// The entry serving a caller's (dtype, head dim, score modifier, block-sparse map or not, v's head
// dim, 0 = q's) among `entries` (HopperForwardEntry or HopperBackwardEntry; those with run null are
// skipped): the narrowest kernel at or above the head dim that has the variant, padded when below it
// or when v's head dim is narrower (V zero-filled past it, as a padded head dim does all of them);
// nullptr when none has it.
template <class Entry, size_t N>
const Entry* find_narrowest(const Entry (&entries)[N], jf_dtype dtype, int head_dim, jf_score_mod score_mod,
                            bool block_sparse, int v_head_dim) {
  if (kernel_head_dim(head_dim) == 0) return nullptr;
  const Entry* best = nullptr;
  for (const Entry& e : entries) {
    const bool padded = e.head_dim != head_dim || (v_head_dim != 0 && v_head_dim != head_dim);
    if (e.run != nullptr && e.dtype == dtype && e.head_dim >= head_dim && e.score_mod == score_mod &&
        e.padded == padded && e.block_sparse == block_sparse &&
        (best == nullptr || e.head_dim < best->head_dim))
      best = &e;
  }
  return best;
}

}  // namespace jagflash::kernels
