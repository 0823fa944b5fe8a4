// GPU oracle: a plain CUDA implementation of forward and backward (fp32 math, no tensor cores),
// correct over fast. It checks the Hopper kernels on batches too large for the CPU reference.
//
// One warp owns one (row, head): the lanes split the head dim, a shuffle reduction gives each
// score, and the loop runs only over the keys the mask leaves visible. The call's score modifier
// (core/score_mod.hpp: softcap, ALiBi) maps each scaled score and gives dS its derivative, as in
// the CPU reference; problem.alibi_slopes is read on the device. No atomics anywhere, so results
// are bitwise reproducible.
#pragma once

#include <jagflash/jagflash.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jagflash::oracle {

struct Workspace {
  const int32_t* error_flag;  // non-zero: offsets were found invalid on the device; write nothing
  float* delta;               // [H, total_q], backward only
};

using ForwardFn = cudaError_t (*)(const jf_fwd_args&, const Workspace&, cudaStream_t);
using BackwardFn = cudaError_t (*)(const jf_bwd_args&, const Workspace&, cudaStream_t);

struct Entry {
  jf_dtype dtype;
  int head_dim;
  ForwardFn forward;
  BackwardFn backward;
};

// The entry for (dtype, head_dim), or nullptr when this build did not instantiate it.
const Entry* find(jf_dtype dtype, int head_dim);

// "bf16/128, fp16/64, ...": for error messages of trimmed builds.
std::string instantiated();

// Bits of the device error flag.
enum OffsetsError : int32_t {
  kQFirstNotZero = 1 << 0,
  kQDecreasing = 1 << 1,
  kQLastNotTotal = 1 << 2,
  kKvFirstNotZero = 1 << 3,
  kKvDecreasing = 1 << 4,
  kKvLastNotTotal = 1 << 5,
};

// Zeroes `flag`, then (when `check` is true) validates both offset arrays on the device and
// sets the bits above; q_offsets NULL (pooled attention) checks kv_offsets alone. Every oracle kernel reads
// the flag first. A failing check also ORs its bits into the current device's latch (below), so that a later
// call learns of it without a sync.
cudaError_t launch_offsets_check(const int32_t* q_offsets, const int32_t* kv_offsets, int32_t batch_size,
                                 int64_t total_q, int64_t total_kv, int32_t* flag, bool check,
                                 cudaStream_t stream);

// The latch: one int32 per device in mapped pinned host memory, allocated by the first checking
// call on that device that is not being captured into a CUDA graph (an allocation inside a
// capture would break it; a call captured before any allocation latches nothing, and only
// jagflash_read_device_error reports it), never freed. The check kernel writes it; the host reads
// it with a plain load, no sync, so a call sees the failures of the calls the GPU has already run.
// take: the bits latched on `device` (0: none, or no latch yet), cleared, so each is reported once.
int32_t take_latched_offsets_error(int device);
// clear: drops `bits` from `device`'s latch (jagflash_read_device_error reported them).
void clear_latched_offsets_error(int device, int32_t bits);

// Attributes of the offsets check kernel as the current device loads it: the image the
// oracle's files run from (they are all built with the same flags). ptxVersion 80 with
// binaryVersion 90 on an H200 means the driver compiled the compute_80 PTX; an error
// (cudaErrorNoKernelImageForDevice) means this build has no device code for the GPU. The first
// call on a device loads the module (and compiles PTX, once).
cudaError_t portable_image(cudaFuncAttributes* attributes);

}  // namespace jagflash::oracle
