// The block-sparse map (jf_block_mask) as a small policy object next to the mask (core/mask.hpp):
// the CPU reference, the GPU oracle, the scheduler's weights and the Hopper kernels ask it which
// (query block, key block) pairs of a sequence are visible. A pair (i, j) is visible when the
// MaskPolicy lets it and this map does: the map only removes blocks, the mask still shapes the
// pairs inside a visible block (causal, windows).
#pragma once

#include <jagflash/jagflash.h>

#include "core/mask.hpp"

#include <cstdint>

namespace jagflash {

struct BlockMask {
  static constexpr int kBlock = JF_BLOCK_MASK_BLOCK;  // tokens per block, both sides

  const uint8_t* blocks = nullptr;   // every sequence's map, at offsets[b]
  const int32_t* offsets = nullptr;  // [B+1]

  JF_HD static BlockMask from(const jf_problem& p) {
    BlockMask m;
    m.blocks = p.block_mask.blocks;
    m.offsets = p.block_mask.offsets;
    return m;
  }

  JF_HD bool present() const { return blocks != nullptr; }

  // Blocks of kBlock tokens covering a sequence side of `len` tokens.
  JF_HD static int64_t blocks_of(int64_t len) { return (len + kBlock - 1) / kBlock; }
  // The map's size for a sequence of lq queries and lk keys: what offsets[b+1] - offsets[b] must be.
  JF_HD static int64_t entries(int64_t lq, int64_t lk) { return blocks_of(lq) * blocks_of(lk); }

  // Sequence b's map row of query block q_block (of kBlock rows): one byte per key block.
  JF_HD const uint8_t* row(int32_t b, int64_t q_block, int64_t lk) const {
    return blocks + offsets[b] + q_block * blocks_of(lk);
  }

  // Whether query block q_block sees key block k_block at all (both of kBlock tokens).
  JF_HD bool block_visible(int32_t b, int64_t q_block, int64_t k_block, int64_t lk) const {
    return !present() || row(b, q_block, lk)[k_block] != 0;
  }

  // Whether the map lets query i see key j of sequence b (the mask decides the rest).
  JF_HD bool visible(int32_t b, int64_t i, int64_t j, int64_t lk) const {
    return block_visible(b, i / kBlock, j / kBlock, lk);
  }
};

}  // namespace jagflash
