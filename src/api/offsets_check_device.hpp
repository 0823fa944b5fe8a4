// The device offsets check every GPU call runs first, whichever backend serves it (the Hopper
// kernels and the GPU oracle read its flag before anything else), and the per-device latch
// through which a later call learns of a failure without a sync. Its kernel is built with the
// portable gencode of the oracle's files (CMakeLists.txt), so it also says which image of that
// device code a GPU loads.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jagflash::detail {

// Bits of the device error flag (the workspace's first word; api/workspace.hpp).
enum OffsetsError : int32_t {
  kQFirstNotZero = 1 << 0,
  kQDecreasing = 1 << 1,
  kQLastNotTotal = 1 << 2,
  kKvFirstNotZero = 1 << 3,
  kKvDecreasing = 1 << 4,
  kKvLastNotTotal = 1 << 5,
  // Bit 6 is schedule::kPlanMismatchFlag (schedule/plan.hpp), set by the Hopper kernels.
  kBlockMaskFirstNotZero = 1 << 7,
  kBlockMaskSizeMismatch = 1 << 8,
  kBlockMaskPastEnd = 1 << 9,
};

// Zeroes `flag`, then (when `check` is true) validates the offset arrays on the device and sets
// the bits above; q_offsets NULL (pooled attention) checks kv_offsets alone; block_mask_offsets
// (NULL: no block mask) must start at 0 and give sequence b BlockMask::entries(Lq_b, Lk_b) bytes,
// the lengths read from q_offsets and kv_offsets (never with pooled attention), and its last entry
// must not pass block_mask_bytes, the size of the caller's map buffer. Every kernel of
// the call reads the flag first and writes nothing when it is set. A failing check also ORs its
// bits into the current device's latch (below), so that a later call learns of it without a sync.
cudaError_t launch_offsets_check(const int32_t* q_offsets, const int32_t* kv_offsets,
                                 const int32_t* block_mask_offsets, int64_t block_mask_bytes,
                                 int32_t batch_size, int64_t total_q, int64_t total_kv, int32_t* flag,
                                 bool check, cudaStream_t stream);

// The latch: one int32 per device in mapped pinned host memory, allocated by the first checking
// call on that device that is not being captured into a CUDA graph (an allocation inside a
// capture would break it; a call captured before any allocation latches nothing, and only
// jagflash_read_device_error reports it), never freed. The check kernel writes it; the host reads
// it with a plain load, no sync, so a call sees the failures of the calls the GPU has already run.
// take: the bits latched on `device` (0: none, or no latch yet), cleared, so each is reported once.
int32_t take_latched_offsets_error(int device);
// clear: drops `bits` from `device`'s latch (jagflash_read_device_error reported them).
void clear_latched_offsets_error(int device, int32_t bits);

// Attributes of the offsets check kernel as the current device loads it: the image the portable
// device code (this file and the oracle's, built with the same flags) runs from. ptxVersion 80
// with binaryVersion 90 on an H200 means the driver compiled the compute_80 PTX; an error
// (cudaErrorNoKernelImageForDevice) means this build has no device code for the GPU. The first
// call on a device loads the module (and compiles PTX, once).
cudaError_t portable_image(cudaFuncAttributes* attributes);

}  // namespace jagflash::detail
