// Does compute-sanitizer's racecheck model a plain bulk copy (cp.async.bulk global -> shared)
// completing on an mbarrier? The pattern of the backward's lse/delta loads, alone: one producer
// thread fills a 2-stage ring by bulk copies (arrive.expect_tx, copy, complete_tx on the stage's
// full barrier), 128 consumer threads wait on the full barrier, read the stage with ordinary loads
// and release it on the stage's empty barrier; the producer waits for that before the next copy
// into the stage. Correct by the PTX memory model (the mbarrier waits acquire, the arrivals
// release). The result is checked against a host sum, so a real race would also show as a wrong
// total. `fenced` adds fence.proxy.async before each release (the cross-proxy WAR fence) to see
// whether racecheck distinguishes the two.
//
//   nvcc -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o racecheck_bulk_copy racecheck_bulk_copy.cu
//   compute-sanitizer --tool racecheck ./racecheck_bulk_copy [fenced]
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

constexpr int kStages = 2;
constexpr int kFloats = 68;  // one Q block's stats: 64 rows + 4
constexpr int kConsumers = 128;
constexpr int kBlocks = 64;  // ring uses per CTA

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t phase) {
  asm volatile(
      "{\n .reg .pred p;\n"
      "wait_%=:\n"
      " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra wait_%=;\n}" ::"r"(smem_u32(bar)),
      "r"(phase)
      : "memory");
}
__device__ __forceinline__ void bulk_copy_g2s(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(smem)),
      "l"(gmem), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

__global__ void ring_kernel(const float* src, float* sums, int fenced) {
  __shared__ alignas(128) float stage_data[kStages][kFloats];
  __shared__ uint64_t full[kStages], empty[kStages];
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumers / 32);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const float* cta_src = src + int64_t(blockIdx.x) * kBlocks * kFloats;
  if (threadIdx.x == 0) {  // producer
    for (int use = 0; use < kBlocks; ++use) {
      const int s = use % kStages, round = use / kStages;
      if (round > 0) mbar_wait(&empty[s], (round - 1) & 1);
      mbar_arrive_expect_tx(&full[s], kFloats * sizeof(float));
      bulk_copy_g2s(stage_data[s], cta_src + use * kFloats, kFloats * sizeof(float), &full[s]);
    }
  } else if (threadIdx.x >= 32) {  // consumers
    const int c = threadIdx.x - 32;
    float sum = 0.f;
    for (int use = 0; use < kBlocks; ++use) {
      const int s = use % kStages;
      mbar_wait(&full[s], (use / kStages) & 1);
      sum += stage_data[s][c % kFloats];
      if (fenced) asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      __syncwarp();
      if (c % 32 == 0) mbar_arrive(&empty[s]);
    }
    sums[blockIdx.x * kConsumers + c] = sum;
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int fenced = argc > 1 && std::strcmp(argv[1], "fenced") == 0;
  constexpr int kCtas = 4;
  std::vector<float> host(kCtas * kBlocks * kFloats);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>((i * 7919) % 1000) / 100.f;
  float *src = nullptr, *sums = nullptr;
  if (cudaMalloc(&src, host.size() * sizeof(float)) != cudaSuccess ||
      cudaMalloc(&sums, kCtas * kConsumers * sizeof(float)) != cudaSuccess) {
    std::printf("cudaMalloc failed\n");
    return 2;
  }
  cudaMemcpy(src, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
  ring_kernel<<<kCtas, 32 + kConsumers>>>(src, sums, fenced);
  const cudaError_t err = cudaDeviceSynchronize();
  if (err != cudaSuccess) {
    std::printf("kernel failed: %s\n", cudaGetErrorString(err));
    return 2;
  }
  std::vector<float> got(kCtas * kConsumers);
  cudaMemcpy(got.data(), sums, got.size() * sizeof(float), cudaMemcpyDeviceToHost);
  int wrong = 0;
  for (int b = 0; b < kCtas; ++b)
    for (int c = 0; c < kConsumers; ++c) {
      float want = 0.f;
      for (int use = 0; use < kBlocks; ++use) want += host[(b * kBlocks + use) * kFloats + c % kFloats];
      wrong += got[b * kConsumers + c] != want;
    }
  std::printf("racecheck_bulk_copy (%s): %d of %d sums wrong\n", fenced ? "fenced" : "unfenced", wrong,
              kCtas * kConsumers);
  return wrong == 0 ? 0 : 1;
}
