// Diagnostic clock stamps of the forward's consumer loop, compiled in only with
// -DJAGFLASH_FWD_TRACE (a diagnostic build, never the library's): thread 0 of each consumer
// warpgroup of CTA 0 stamps six points of every KV block of its first tile; the launcher prints
// them after each launch (a tile is complete once the warpgroup starts its second). bench/trace_fwd.py turns
// the printout into per-phase medians (barrier wait, S latency, softmax, P V wait, rescale + conversion,
// period): the phases that show whether the intra-warpgroup overlap is on (bench/NOTES.md).
#pragma once

#include <cstdint>
#include <cstdio>

#include <cuda_runtime.h>

namespace jagflash::kernels::fwd {

// Stamp points, in the order the loop reaches them.
enum TracePoint : int {
  kTraceTop = 0,       // block starts: before the K/V full-barrier waits
  kTraceIssue = 1,     // barriers passed: the GEMMs are issued next
  kTraceScores = 2,    // S is ready
  kTraceSoftmax = 3,   // softmax done
  kTraceGemmDone = 4,  // O += P V of the previous block is done
  kTraceEnd = 5,       // O rescaled, P converted
  kTracePoints = 6
};

#ifdef JAGFLASH_FWD_TRACE
__device__ long long g_fwd_trace[2][256][kTracePoints];
__device__ int g_fwd_trace_blocks[2];

// No printf here: a call anywhere in the kernel makes ptxas serialize every wgmma (C7510), and
// the trace would time another kernel. The host prints the stamps after the launch
// (print_forward_trace in fwd_launch.cuh).
struct ConsumerTrace {
  int block = 0;
  bool on = false;
  // At every tile start: the first tile is traced.
  __device__ void tile_start(int thread, uint32_t tiles_done) {
    const bool leader = blockIdx.x == 0 && thread % 128 == 0 && thread / 128 < 2;
    on = leader && tiles_done == 0;
    if (leader && tiles_done == 1) g_fwd_trace_blocks[thread / 128] = block;
  }
  __device__ void stamp(int thread, TracePoint point) {
    if (on) g_fwd_trace[thread / 128][block][point] = clock64();
  }
  __device__ void block_done() {
    if (on && block < 255) ++block;
  }
};

// Host side: waits for the launch, then prints the stamps as "TRACE wg W blk B : t0 .. t5".
inline void print_forward_trace() {
  long long stamps[2][256][kTracePoints];
  int blocks[2] = {0, 0};
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpyFromSymbol(blocks, g_fwd_trace_blocks, sizeof(blocks)) != cudaSuccess ||
      cudaMemcpyFromSymbol(stamps, g_fwd_trace, sizeof(stamps)) != cudaSuccess)
    return;
  for (int wg = 0; wg < 2; ++wg)
    for (int i = 0; i < blocks[wg] && i < 256; ++i) {
      const long long* r = stamps[wg][i];
      std::printf("TRACE wg %d blk %d : %lld %lld %lld %lld %lld %lld\n", wg, i, r[0], r[1], r[2], r[3], r[4],
                  r[5]);
    }
  const int zero[2] = {0, 0};
  cudaMemcpyToSymbol(g_fwd_trace_blocks, zero, sizeof(zero));
}
#else
struct ConsumerTrace {
  __device__ void tile_start(int, uint32_t) {}
  __device__ void stamp(int, TracePoint) {}
  __device__ void block_done() {}
};
inline void print_forward_trace() {}
#endif

}  // namespace jagflash::kernels::fwd
