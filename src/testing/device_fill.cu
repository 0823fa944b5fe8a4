#include "testing/device_buffer.hpp"

#include "core/dtype.hpp"

namespace jagflash::testing {
namespace {

__device__ __forceinline__ uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename T>
__global__ void fill_uniform_kernel(T* data, int64_t rows, int heads, int head_dim, int64_t row_stride,
                                    int64_t head_stride, uint64_t seed, float lo, float hi) {
  const int64_t n = rows * heads * head_dim;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / (int64_t(heads) * head_dim);
    const int64_t rest = e % (int64_t(heads) * head_dim);
    const int64_t h = rest / head_dim, d = rest % head_dim;
    const float u = (mix64(seed * 0x9e3779b97f4a7c15ull + e) >> 40) * (1.0f / 16777216.0f);
    data[r * row_stride + h * head_stride + d] = from_float<T>(lo + (hi - lo) * u);
  }
}

template <typename T>
__global__ void fill_buffer_kernel(T* data, size_t n, float value) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    data[i] = from_float<T>(value);
}

}  // namespace

void fill_uniform(const jf_tensor& t, jf_dtype dtype, uint64_t seed, float lo, float hi,
                  cudaStream_t stream) {
  if (t.rows == 0) return;
  dispatch_dtype(dtype, [&](auto storage) {
    using T = decltype(storage);
    fill_uniform_kernel<T><<<2048, 256, 0, stream>>>(static_cast<T*>(t.data), t.rows, t.heads, t.head_dim,
                                                     t.row_stride, t.head_stride, seed, lo, hi);
  });
  cuda_check(cudaGetLastError(), "fill_uniform launch");
}

void fill_buffer(void* data, size_t elements, jf_dtype dtype, float value, cudaStream_t stream) {
  if (elements == 0) return;
  dispatch_dtype(dtype, [&](auto storage) {
    using T = decltype(storage);
    fill_buffer_kernel<T><<<2048, 256, 0, stream>>>(static_cast<T*>(data), elements, value);
  });
  cuda_check(cudaGetLastError(), "fill_buffer launch");
}

}  // namespace jagflash::testing
