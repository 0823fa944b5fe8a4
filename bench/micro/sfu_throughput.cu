// Throughput of the softmax's instruction kinds on one SM (results per clock per SM), for
// choosing how to compute exp2 in the forward's softmax: MUFU.EX2 on f32, on packed f16x2 and
// bf16x2, FFMA, and the f32 -> bf16x2 conversion; and softcap's: MUFU.TANH, MUFU.LG2 (the
// backward's dscore from P) and MUFU.RCP (tanh as 1 - 2 / (1 + 2^(2 x log2 e))). Every warp runs independent
// chains (no latency bound); the clock is the SM's (clock64), so power capping does not enter.
//   build: part of the build with tests (build/tests/jagflash_sfu_throughput), or
//          nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/micro/sfu_throughput.cu -o sfu
//   run:   on the GPU machine, one line per kind and block size
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>

constexpr int kIters = 4096;
constexpr int kChains = 8;

enum Kind {
  kEx2F32,
  kEx2F16x2,
  kEx2Bf16x2,
  kFfma,
  kCvtBf16x2,
  kTanhF32,
  kLg2F32,
  kRcpF32,
  kSoftcapTanh,
  kSoftcapRcp,
  kKinds
};
const char* kNames[kKinds] = {
    "ex2.approx.ftz.f32", "ex2.approx.f16x2",      "ex2.approx.ftz.bf16x2", "fma.rn.f32",
    "cvt.rn.bf16x2.f32",  "tanh.approx.f32",       "lg2.approx.ftz.f32",    "rcp.approx.ftz.f32",
    "softcap: tanh, ex2", "softcap: ex2, rcp, ex2"};
// Results per instruction and lane (a packed instruction yields two).
const int kResults[kKinds] = {1, 2, 2, 1, 2, 1, 1, 1, 1, 1};

template <int K>
__global__ void run(long long* clocks, float* sink) {
  uint32_t v[kChains];
  for (int c = 0; c < kChains; ++c) v[c] = 0x3c003c00u ^ (threadIdx.x * 7 + c);  // small values
  __syncthreads();
  const long long t0 = clock64();
  for (int i = 0; i < kIters; ++i) {
#pragma unroll
    for (int c = 0; c < kChains; ++c) {
      if constexpr (K == kEx2F32) asm volatile("ex2.approx.ftz.f32 %0, %0;" : "+r"(v[c]));
      if constexpr (K == kEx2F16x2) asm volatile("ex2.approx.f16x2 %0, %0;" : "+r"(v[c]));
      if constexpr (K == kEx2Bf16x2) asm volatile("ex2.approx.ftz.bf16x2 %0, %0;" : "+r"(v[c]));
      if constexpr (K == kFfma) asm volatile("fma.rn.f32 %0, %0, %0, %0;" : "+r"(v[c]));
      if constexpr (K == kCvtBf16x2) asm volatile("cvt.rn.bf16x2.f32 %0, %0, %0;" : "+r"(v[c]));
      // softcap's tanh (forward and backward) and the backward's lg2 (its dscore from P)
      if constexpr (K == kTanhF32) asm volatile("tanh.approx.f32 %0, %0;" : "+r"(v[c]));
      if constexpr (K == kLg2F32) asm volatile("lg2.approx.ftz.f32 %0, %0;" : "+r"(v[c]));
      // (an add after each: ptxas folds rcp(rcp(x)) into x)
      if constexpr (K == kRcpF32)
        asm volatile("rcp.approx.ftz.f32 %0, %0;\n\tadd.ftz.f32 %0, %0, 0f3F800000;" : "+r"(v[c]));
      // One softcapped probability a result, p = 2^(k t - m) with t = tanh(x): by MUFU.TANH, or
      // as t = 1 - 2 / (1 + 2^(2 x log2 e)) (two MUFU.EX2 and a MUFU.RCP, exact to fp32 rounding).
      if constexpr (K == kSoftcapTanh)
        asm volatile(
            "tanh.approx.f32 %0, %0;\n\tfma.rn.ftz.f32 %0, %0, 0f3F000000, 0fBF000000;\n\t"
            "ex2.approx.ftz.f32 %0, %0;"
            : "+r"(v[c]));
      if constexpr (K == kSoftcapRcp)
        asm volatile(
            "{.reg .f32 e;\n\tmul.ftz.f32 e, %0, 0f3F38AA3B;\n\tex2.approx.ftz.f32 e, e;\n\t"
            "add.ftz.f32 e, e, 0f3F800000;\n\trcp.approx.ftz.f32 e, e;\n\t"
            "fma.rn.ftz.f32 e, e, 0fC0000000, 0f3F800000;\n\tfma.rn.ftz.f32 e, e, 0f3F000000, 0fBF000000;\n\t"
            "ex2.approx.ftz.f32 %0, e;}"
            : "+r"(v[c]));
    }
  }
  __syncthreads();
  const long long t1 = clock64();
  if (threadIdx.x == 0) clocks[blockIdx.x] = t1 - t0;
  uint32_t acc = 0;
  for (int c = 0; c < kChains; ++c) acc ^= v[c];
  if (acc == 0x12345678u) sink[threadIdx.x] = float(acc);
}

template <int K>
double measure(long long* clocks, float* sink, int threads) {
  run<K><<<1, threads>>>(clocks, sink);  // warm-up
  run<K><<<1, threads>>>(clocks, sink);
  long long c = 0;
  cudaMemcpy(&c, clocks, sizeof(c), cudaMemcpyDeviceToHost);
  return double(threads) * kIters * kChains * kResults[K] / double(c);
}

int main() {
  long long* clocks;
  float* sink;
  if (cudaMalloc(&clocks, sizeof(long long)) != cudaSuccess ||
      cudaMalloc(&sink, 1024 * sizeof(float)) != cudaSuccess) {
    std::printf("no GPU\n");
    return 1;
  }
  for (int threads : {128, 256, 1024}) {
    const double r[kKinds] = {
        measure<kEx2F32>(clocks, sink, threads),      measure<kEx2F16x2>(clocks, sink, threads),
        measure<kEx2Bf16x2>(clocks, sink, threads),   measure<kFfma>(clocks, sink, threads),
        measure<kCvtBf16x2>(clocks, sink, threads),   measure<kTanhF32>(clocks, sink, threads),
        measure<kLg2F32>(clocks, sink, threads),      measure<kRcpF32>(clocks, sink, threads),
        measure<kSoftcapTanh>(clocks, sink, threads), measure<kSoftcapRcp>(clocks, sink, threads)};
    for (int k = 0; k < kKinds; ++k)
      std::printf("%-24s %4d threads: %6.1f results/clock/SM\n", kNames[k], threads, r[k]);
  }
  return cudaGetLastError() == cudaSuccess ? 0 : 1;
}
