#include "oracle/oracle.hpp"

namespace jagflash::oracle {
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

__global__ void offsets_check_kernel(const int32_t* q_offsets, const int32_t* kv_offsets, int32_t batch_size,
                                     int64_t total_q, int64_t total_kv, int32_t* flag) {
  const int32_t bits =
      check_one(q_offsets, batch_size, total_q, kQFirstNotZero, kQDecreasing, kQLastNotTotal) |
      check_one(kv_offsets, batch_size, total_kv, kKvFirstNotZero, kKvDecreasing, kKvLastNotTotal);
  if (bits) atomicOr(flag, bits);
}

}  // namespace

cudaError_t launch_offsets_check(const int32_t* q_offsets, const int32_t* kv_offsets, int32_t batch_size,
                                 int64_t total_q, int64_t total_kv, int32_t* flag, bool check,
                                 cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(flag, 0, sizeof(int32_t), stream);
  if (err != cudaSuccess || !check) return err;
  offsets_check_kernel<<<1, 256, 0, stream>>>(q_offsets, kv_offsets, batch_size, total_q, total_kv, flag);
  return cudaGetLastError();
}

cudaError_t portable_image(cudaFuncAttributes* attributes) {
  return cudaFuncGetAttributes(attributes, offsets_check_kernel);
}

}  // namespace jagflash::oracle
