#include "api/offsets_check_device.hpp"

#include "core/block_mask.hpp"

#include <array>
#include <atomic>
#include <mutex>

namespace jagflash::detail {
namespace {

__device__ int32_t check_one(const int32_t* offsets, int32_t batch_size, int64_t total, int32_t first_bit,
                             int32_t decreasing_bit, int32_t last_bit) {
  int32_t bits = 0;
  for (int32_t b = threadIdx.x; b < batch_size; b += blockDim.x)
    if (offsets[b + 1] < offsets[b]) bits |= decreasing_bit;
  if (threadIdx.x == 0) {
    if (offsets[0] != 0) bits |= first_bit;
    if (offsets[batch_size] != total) bits |= last_bit;
  }
  return bits;
}

// The block-sparse map's offsets: [0] == 0, sequence b's map of ceil(Lq_b/128) * ceil(Lk_b/128)
// bytes, the lengths as the (possibly bad: their own bits say so) q and kv offsets give them, and
// [B] within the caller's buffer of map_bytes bytes (the kernels read up to [B]).
__device__ int32_t check_block_mask(const int32_t* map_offsets, int64_t map_bytes, const int32_t* q_offsets,
                                    const int32_t* kv_offsets, int32_t batch_size) {
  int32_t bits = 0;
  for (int32_t b = threadIdx.x; b < batch_size; b += blockDim.x) {
    const int64_t lq = int64_t{q_offsets[b + 1]} - q_offsets[b];
    const int64_t lk = int64_t{kv_offsets[b + 1]} - kv_offsets[b];
    if (int64_t{map_offsets[b + 1]} - map_offsets[b] != BlockMask::entries(lq, lk))
      bits |= kBlockMaskSizeMismatch;
  }
  if (threadIdx.x == 0) {
    if (map_offsets[0] != 0) bits |= kBlockMaskFirstNotZero;
    if (map_offsets[batch_size] > map_bytes) bits |= kBlockMaskPastEnd;
  }
  return bits;
}

// One block. The threads' bits are gathered in shared memory so that one thread writes the
// workspace flag and the latch: the latch lives in host memory, where a plain store of the
// gathered bits needs no system-scope atomics (which not every host link supports natively).
// The flag is stored whole (0 when the offsets pass), so the call needs no memset before: the
// kernels after it in the stream read this call's verdict alone.
__global__ void offsets_check_kernel(const int32_t* q_offsets, const int32_t* kv_offsets,
                                     const int32_t* block_mask_offsets, int64_t block_mask_bytes,
                                     int32_t batch_size, int64_t total_q, int64_t total_kv, int32_t* flag,
                                     int32_t* latch) {
  __shared__ int32_t block_bits;
  if (threadIdx.x == 0) block_bits = 0;
  __syncthreads();
  // q_offsets NULL: pooled attention, whose query rows need no offsets (never read).
  const int32_t q_bits = q_offsets != nullptr ? check_one(q_offsets, batch_size, total_q, kQFirstNotZero,
                                                          kQDecreasing, kQLastNotTotal)
                                              : 0;
  // Never with pooled attention (validation refuses it): q_offsets is there when the map is.
  const int32_t map_bits =
      block_mask_offsets != nullptr && q_offsets != nullptr
          ? check_block_mask(block_mask_offsets, block_mask_bytes, q_offsets, kv_offsets, batch_size)
          : 0;
  const int32_t bits =
      q_bits | map_bits |
      check_one(kv_offsets, batch_size, total_kv, kKvFirstNotZero, kKvDecreasing, kKvLastNotTotal);
  if (bits) atomicOr(&block_bits, bits);
  __syncthreads();
  if (threadIdx.x != 0) return;
  *flag = block_bits;
  if (block_bits == 0) return;
  if (latch != nullptr) {
    // Another failing call may store concurrently: one of the two stores wins, and the latch still
    // holds a failure (the bits of one of them), which is what the next call must report.
    volatile int32_t* l = latch;
    *l = *l | block_bits;
    __threadfence_system();
  }
}

// Devices beyond this ordinal get no latch (their failures are reported by
// jagflash_read_device_error alone).
constexpr int kMaxLatchDevices = 64;
// host: the word as the host reads it; device: the same word as kernels address it.
std::array<std::atomic<int32_t*>, kMaxLatchDevices> g_latch_host{};
std::array<std::atomic<int32_t*>, kMaxLatchDevices> g_latch_device{};
std::mutex g_latch_mutex;

// The current device's latch for a launch on `stream`, allocated on first use outside a capture;
// *latch = nullptr where there is none (capturing before the first allocation, device ordinal too
// large).
cudaError_t latch_for_launch(cudaStream_t stream, int32_t** latch) {
  *latch = nullptr;
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess || device < 0 || device >= kMaxLatchDevices) return err;
  *latch = g_latch_device[device].load(std::memory_order_acquire);
  if (*latch != nullptr) return cudaSuccess;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    cudaGetLastError();  // e.g. the legacy stream while another stream captures: treat as captured
    return cudaSuccess;
  }
  if (capture != cudaStreamCaptureStatusNone) return cudaSuccess;
  std::lock_guard<std::mutex> lock(g_latch_mutex);
  *latch = g_latch_device[device].load(std::memory_order_acquire);
  if (*latch != nullptr) return cudaSuccess;
  // Relaxed capture mode for this thread: a capture another thread runs in global mode would
  // otherwise refuse the allocation (our own stream is not capturing, checked above).
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  err = cudaThreadExchangeStreamCaptureMode(&mode);
  if (err != cudaSuccess) return err;
  void* host = nullptr;
  void* mapped = nullptr;
  err = cudaHostAlloc(&host, sizeof(int32_t), cudaHostAllocMapped | cudaHostAllocPortable);
  if (err == cudaSuccess) {
    *static_cast<volatile int32_t*>(host) = 0;
    err = cudaHostGetDevicePointer(&mapped, host, 0);
    if (err != cudaSuccess) cudaFreeHost(host);
  }
  const cudaError_t restored = cudaThreadExchangeStreamCaptureMode(&mode);
  if (err != cudaSuccess) return err;
  if (restored != cudaSuccess) return restored;
  g_latch_host[device].store(static_cast<int32_t*>(host), std::memory_order_release);
  g_latch_device[device].store(static_cast<int32_t*>(mapped), std::memory_order_release);
  *latch = static_cast<int32_t*>(mapped);
  return cudaSuccess;
}

int32_t* latch_host(int device) {
  if (device < 0 || device >= kMaxLatchDevices) return nullptr;
  return g_latch_host[device].load(std::memory_order_acquire);
}

}  // namespace

cudaError_t launch_offsets_check(const int32_t* q_offsets, const int32_t* kv_offsets,
                                 const int32_t* block_mask_offsets, int64_t block_mask_bytes,
                                 int32_t batch_size, int64_t total_q, int64_t total_kv, int32_t* flag,
                                 bool check, cudaStream_t stream) {
  // Unchecked: the flag is zeroed for the kernels that read it; checked, the check kernel sets it.
  if (!check) return cudaMemsetAsync(flag, 0, sizeof(int32_t), stream);
  int32_t* latch = nullptr;
  cudaError_t err = latch_for_launch(stream, &latch);
  if (err != cudaSuccess) return err;
  offsets_check_kernel<<<1, 256, 0, stream>>>(q_offsets, kv_offsets, block_mask_offsets, block_mask_bytes,
                                              batch_size, total_q, total_kv, flag, latch);
  return cudaGetLastError();
}

int32_t take_latched_offsets_error(int device) {
  int32_t* word = latch_host(device);
  if (word == nullptr || __atomic_load_n(word, __ATOMIC_ACQUIRE) == 0) return 0;
  return __atomic_exchange_n(word, 0, __ATOMIC_ACQ_REL);
}

void clear_latched_offsets_error(int device, int32_t bits) {
  if (int32_t* word = latch_host(device)) __atomic_fetch_and(word, ~bits, __ATOMIC_ACQ_REL);
}

cudaError_t portable_image(cudaFuncAttributes* attributes) {
  return cudaFuncGetAttributes(attributes, offsets_check_kernel);
}

}  // namespace jagflash::detail
