// Diagnostic clock stamps of the forward's consumer loop, compiled in only with
// -DJAGFLASH_FWD_TRACE (a diagnostic build, never the library's): thread 0 of each consumer
// warpgroup of CTA 0 stamps six points of every KV block of its first tile and prints them
// when its second tile starts. bench/trace_fwd.py turns the printout into per-phase medians
// (barrier wait, S latency, softmax, P V wait, rescale + conversion, period). This is how the
// lost intra-warpgroup overlap was found in session 8 (bench/NOTES.md).
#pragma once

#include <cstdint>
#include <cstdio>

namespace jagflash::kernels::fwd {

// Stamp points, in the order the loop reaches them.
enum TracePoint : int {
  kTraceTop = 0,        // block starts: before the K/V full-barrier waits
  kTraceIssue = 1,      // barriers passed: the GEMMs are issued next
  kTraceScores = 2,     // S is ready
  kTraceSoftmax = 3,    // softmax done
  kTraceGemmDone = 4,   // O += P V of the previous block is done
  kTraceEnd = 5,        // O rescaled, P converted
  kTracePoints = 6
};

#ifdef JAGFLASH_FWD_TRACE
__device__ long long g_fwd_trace[2][256][kTracePoints];

struct ConsumerTrace {
  int block = 0;
  bool on = false;
  // At every tile start: tracing covers the first tile; the second prints it.
  __device__ void tile_start(int thread, uint32_t tiles_done) {
    const bool leader = blockIdx.x == 0 && thread % 128 == 0 && thread / 128 < 2;
    on = leader && tiles_done == 0;
    if (leader && tiles_done == 1)
      for (int i = 0; i < block; ++i) {
        const long long* r = g_fwd_trace[thread / 128][i];
        printf("TRACE wg %d blk %d : %lld %lld %lld %lld %lld %lld\n", thread / 128, i, r[0], r[1], r[2], r[3], r[4],
               r[5]);
      }
  }
  __device__ void stamp(int thread, TracePoint point) {
    if (on) g_fwd_trace[thread / 128][block][point] = clock64();
  }
  __device__ void block_done() {
    if (on && block < 255) ++block;
  }
};
#else
struct ConsumerTrace {
  __device__ void tile_start(int, uint32_t) {}
  __device__ void stamp(int, TracePoint) {}
  __device__ void block_done() {}
};
#endif

}  // namespace jagflash::kernels::fwd
