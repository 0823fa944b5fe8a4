// How the persistent kernels of both directions get their tiles, and the rule that hands a CTA
// its round-th tile. Host and device.
#pragma once

#include <cstdint>

namespace jagflash::kernels::common {

// kDynamic is the default; the others exist to be measured against it.
enum class Schedule : int32_t {
  kDynamic = 0,  // persistent; next tile of the plan (heaviest sequence first) through an atomic counter
  kZigzag = 1,   // persistent; static snake over the plan (round r: SM c or N-1-c)
  kGrid = 2      // one CTA per tile in plan order: the plain grid
};

#if defined(__CUDACC__)
// The round-th tile of CTA `cta` of `ctas` (past the end of the plan: no more work).
__device__ __forceinline__ int32_t next_tile_index(Schedule schedule, int32_t round, int32_t ctas,
                                                   int32_t cta, int32_t* tile_counter) {
  switch (schedule) {
    case Schedule::kZigzag:
      return round * ctas + ((round & 1) ? ctas - 1 - cta : cta);
    case Schedule::kGrid:
      return round == 0 ? cta : INT32_MAX;
    default:
      return atomicAdd(tile_counter, 1);
  }
}
#endif

}  // namespace jagflash::kernels::common
