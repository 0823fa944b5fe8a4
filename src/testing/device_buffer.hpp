// Tools for the CLI, the GPU tests and the benchmarks (not part of the library's API):
// an owning device allocation and device-side fills for large jagged batches.
#pragma once

#include <jagflash/jagflash.h>

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace jagflash::testing {

inline void cuda_check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes > 0) cuda_check(cudaMalloc(&data_, bytes), "cudaMalloc");
  }
  ~DeviceBuffer() {
    if (data_) cudaFree(data_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      if (data_) cudaFree(data_);
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return data_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  size_t bytes() const { return bytes_; }

  template <typename T>
  static DeviceBuffer from_host(const std::vector<T>& host) {
    DeviceBuffer b(host.size() * sizeof(T));
    if (!host.empty())
      cuda_check(cudaMemcpy(b.data_, host.data(), b.bytes_, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
    return b;
  }
  void to_host(void* dst) const {
    if (bytes_ > 0) cuda_check(cudaMemcpy(dst, data_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// Uniform values in [lo, hi] (rounded to dtype) into the view's elements, from a counter-based
// hash of (seed, element index): the same on every run, never zeros, no host round trip.
void fill_uniform(const jf_tensor& t, jf_dtype dtype, uint64_t seed, float lo, float hi,
                  cudaStream_t stream = nullptr);

// Every element of the buffer behind the view (padding included) set to `value` (NaN to poison).
void fill_buffer(void* data, size_t elements, jf_dtype dtype, float value, cudaStream_t stream = nullptr);

}  // namespace jagflash::testing
