// Tile shapes of the Hopper forward kernel, chosen in one place.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace jagflash::kernels::fwd {

// kBlockM = 128 query rows per tile: two consumer warpgroups of 64 rows each (the M of one
//   wgmma), sharing every K/V stage, so each loaded key block feeds 128 rows.
// kBlockN = 128 keys per block: S (64 x 128 fp32) and O (64 x D fp32) fit in the 240 registers
//   a consumer thread gets after setmaxnreg, with room for P in bf16.
// kStages K/V stages: at D = 128, Q (32 KB) + 2 x (K 32 KB + V 32 KB) + the O staging tile
//   (34 KB) = 194 KB of the 227 KB a CTA may use, so 2; at D = 64 everything halves and a third
//   stage fits (113 KB), which gives the producer a block more of lead.
// kPingPong: the two consumer warpgroups take turns issuing their GEMMs (named barriers), so
// one's softmax runs while the other's GEMMs use the tensor cores.
template <class Element_, int kHeadDim_, bool kPingPong_ = true>
struct TileConfig {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kPingPong = kPingPong_;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockN = 128;
  static constexpr int kStages = kHeadDim_ == 64 ? 3 : 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kRowsPerWarpgroup = kBlockM / kConsumerWarpgroups;
  static constexpr int kThreads = 128 * (1 + kConsumerWarpgroups);  // producer warpgroup + consumers
  // Registers after setmaxnreg: 56 x 128 + 224 x 256 <= 64K per SM. The producer decodes the
  // next tile while it waits for Q to free, and spilled at 24 and 40; the consumers fit in 224
  // at D = 128 without spills.
  static constexpr int kProducerRegisters = 56;
  static constexpr int kConsumerRegisters = 224;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "the Hopper forward serves head dims 64 and 128");
};

}  // namespace jagflash::kernels::fwd
