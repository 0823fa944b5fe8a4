// Compile-only: the Hopper forward kernel with the diagnostic clock-stamp trace
// (src/kernels/fwd/trace_fwd.cuh), which no library build enables, so that path keeps compiling.
// tests/CMakeLists.txt defines JAGFLASH_FWD_TRACE for this file alone.
#ifndef JAGFLASH_FWD_TRACE
#error "this file checks the trace build: compile it with -DJAGFLASH_FWD_TRACE"
#endif

#include "kernels/fwd/fwd_kernel.cuh"

namespace jagflash::kernels::fwd {
using TraceCheckConfig = TileConfig<cutlass::bfloat16_t, 128>;
template __global__ void forward_kernel<TraceCheckConfig>(
    const __grid_constant__ Params<KernelTraits<TraceCheckConfig>>);
}  // namespace jagflash::kernels::fwd
