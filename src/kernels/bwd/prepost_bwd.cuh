// The light kernels around the main backward kernel.
//  preprocess: delta = rowsum(dO * O) in fp32 and the lse in log2 units (+inf where a row sees
//    no key, so every probability of it is exp2(-inf) = 0), into the workspace's [H][q_stride]
//    arrays that the main kernel loads by TMA; the rows past total_q are set likewise.
//  postprocess: dQ = scale x the fp32 accumulator, converted to the input dtype, in the caller's
//    layout (pooled attention: the sum of the sequences' rows of each shared query row).
//  dK/dV postprocess (split groups only): dK, dV = the sum of the splits' fp32 partials, in split
//    order (so bitwise repeatable), converted into the caller's layout.
#pragma once

#include "kernels/common/accumulator.cuh"

#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>

namespace jagflash::kernels::bwd {

struct PreprocessParams {
  const void* out;
  const void* dout;
  int64_t out_row_stride, out_head_stride, dout_row_stride, dout_head_stride;
  const float* lse;  // [H, total_q]
  float* lse_log2;   // [H][q_stride]
  float* delta;      // [H][q_stride]
  int64_t total_q, q_stride;
  int32_t num_heads;
  const int32_t* error_flag;
  // kPadded: out's and dout's head dim (v's) in 16-byte chunks (the rest reads as 0)
  int32_t head_dim_chunks;
};

// kRowsPerCta rows of one head a CTA, kLanesPerRow lanes a row, each lane one 16-byte
// load of O and of dO (the GPU path's tensors are 16-byte aligned with 16-byte strides): one warp
// a (row, head) with 8-byte loads and a 64-bit division per item read O and dO at about half the
// memory's rate.
template <int kHeadDim>
struct PreprocessShape {
  // A row's 16-byte chunks; the lanes a row, a power of two (the shuffle reduction's): at D = 96
  // 16 lanes for 12 chunks, at D = 192 32 lanes for 24, the last ones idle (kIdleLanes).
  static constexpr int kChunks = kHeadDim / 8;
  static constexpr int kLanesPerRow = kChunks <= 8 ? 8 : kChunks <= 16 ? 16 : 32;
  static constexpr bool kIdleLanes = kLanesPerRow != kChunks;
  static_assert(kChunks == 8 || kChunks == 12 || kChunks == 16 || kChunks == 24 || kChunks == 32,
                "head dims 64, 96, 128, 192, 256");
  static constexpr int kThreads = 256;
  static constexpr int kRowsPerCta = kThreads / kLanesPerRow;
  // CTA c serves rows [kRowsPerCta (c / H), ...) of head c % H: consecutive CTAs read one row
  // block's heads, contiguous memory in the usual [rows][heads][D] layout.
  static __host__ __device__ int64_t ctas(int64_t rows, int32_t heads) {
    return (rows + kRowsPerCta - 1) / kRowsPerCta * heads;
  }
  static __device__ int64_t thread_row(int64_t cta, int32_t heads) {
    return (cta / heads) * kRowsPerCta + threadIdx.x / kLanesPerRow;
  }
  // The launch: one CTA per (row block, head), at most 2^30 (a grid-stride loop takes the rest).
  static unsigned grid(int64_t rows, int32_t heads) {
    const int64_t n = ctas(rows, heads);
    return static_cast<unsigned>(n < (int64_t(1) << 30) ? n : (int64_t(1) << 30));
  }
};

template <class Element, int kHeadDim, bool kPadded>
__global__ void __launch_bounds__(PreprocessShape<kHeadDim>::kThreads)
    preprocess_kernel(const PreprocessParams p) {
  if (*p.error_flag) return;
  using Shape = PreprocessShape<kHeadDim>;
  const int sub = threadIdx.x % Shape::kLanesPerRow;
  for (int64_t cta = blockIdx.x; cta < Shape::ctas(p.q_stride, p.num_heads); cta += gridDim.x) {
    const int32_t h = static_cast<int32_t>(cta % p.num_heads);
    const int64_t row = Shape::thread_row(cta, p.num_heads);
    float sum = 0.f;
    if (row < p.total_q && (!kPadded || sub < p.head_dim_chunks) &&
        (!Shape::kIdleLanes || sub < Shape::kChunks)) {
      const uint4 o = *reinterpret_cast<const uint4*>(
          static_cast<const Element*>(p.out) + row * p.out_row_stride + h * p.out_head_stride + sub * 8);
      const uint4 d = *reinterpret_cast<const uint4*>(
          static_cast<const Element*>(p.dout) + row * p.dout_row_stride + h * p.dout_head_stride + sub * 8);
      const Element* oe = reinterpret_cast<const Element*>(&o);
      const Element* de = reinterpret_cast<const Element*>(&d);
#pragma unroll
      for (int e = 0; e < 8; ++e) sum += static_cast<float>(oe[e]) * static_cast<float>(de[e]);
    }
    // The row's lanes are kLanesPerRow consecutive lanes of one warp: xor offsets below it stay
    // among them.
#pragma unroll
    for (int off = Shape::kLanesPerRow / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, off);
    if (sub == 0 && row < p.q_stride) {
      const float lse = row < p.total_q ? p.lse[int64_t(h) * p.total_q + row] : -INFINITY;
      const int64_t at = int64_t(h) * p.q_stride + row;
      p.lse_log2[at] = lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
      p.delta[at] = sum;
    }
  }
}

// Eight consecutive fp32 values summed over `count` copies `stride` floats apart, in order (the
// copy at `first` first), times `factor`, rounded to Element and packed into 16 bytes: the dq
// postprocess (a pooled query's B sequences) and the dK/dV postprocess (a split group's slots).
template <class Element>
__device__ __forceinline__ uint4 sum8_strided(const float* first, int32_t count, int64_t stride,
                                              float factor) {
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
  for (int32_t s = 0; s < count; ++s) {
    const float4* src = reinterpret_cast<const float4*>(first + s * stride);
    const float4 x = src[0], y = src[1];
    a.x += x.x, a.y += x.y, a.z += x.z, a.w += x.w;
    b.x += y.x, b.y += y.y, b.z += y.z, b.w += y.w;
  }
  uint4 packed;
  packed.x = common::pack2(Element{}, a.x * factor, a.y * factor);
  packed.y = common::pack2(Element{}, a.z * factor, a.w * factor);
  packed.z = common::pack2(Element{}, b.x * factor, b.y * factor);
  packed.w = common::pack2(Element{}, b.z * factor, b.w * factor);
  return packed;
}

struct PostprocessParams {
  const float* dq_accum;  // [H][dq_rows][D]
  int64_t dq_rows;
  void* dq;
  int64_t dq_row_stride, dq_head_stride;
  int64_t total_q;  // rows of dq
  // dq row i = scale x the sum over s < sum_count of accumulator row i + s x sum_stride: 1 and 0,
  // or for pooled attention B and Lq (the sequences' rows of one shared query), summed in order.
  int32_t sum_count;
  int64_t sum_stride;
  int32_t num_heads;
  float scale;
  const int32_t* error_flag;
  int32_t head_dim_chunks;  // kPadded: the caller's head dim in 16-byte chunks
};

// Eight elements a thread: two 16-byte loads of the accumulator, one 16-byte store; a CTA takes
// kRowsPerCta rows of one head, as the preprocess does. Memory-bound: its index arithmetic does not
// show in its time (figures: bench/NOTES.md, "Figures moved out of code comments").
template <class Element, int kHeadDim, bool kPadded>
__global__ void __launch_bounds__(PreprocessShape<kHeadDim>::kThreads)
    postprocess_kernel(const PostprocessParams p) {
  if (*p.error_flag) return;
  using Shape = PreprocessShape<kHeadDim>;
  const int chunk = threadIdx.x % Shape::kLanesPerRow;
  for (int64_t cta = blockIdx.x; cta < Shape::ctas(p.total_q, p.num_heads); cta += gridDim.x) {
    const int32_t h = static_cast<int32_t>(cta % p.num_heads);
    const int64_t row = Shape::thread_row(cta, p.num_heads);
    if (row >= p.total_q || (kPadded && chunk >= p.head_dim_chunks) ||
        (Shape::kIdleLanes && chunk >= Shape::kChunks))
      continue;
    const float* head_rows = p.dq_accum + int64_t(h) * p.dq_rows * kHeadDim + chunk * 8;
    const uint4 packed =
        sum8_strided<Element>(head_rows + row * kHeadDim, p.sum_count, p.sum_stride * kHeadDim, p.scale);
    Element* dst = static_cast<Element*>(p.dq) + row * p.dq_row_stride + h * p.dq_head_stride + chunk * 8;
    *reinterpret_cast<uint4*>(dst) = packed;
  }
}

struct DkvPostprocessParams {
  const float* dk_partial;  // [splits][total_kv][heads_kv][D]
  const float* dv_partial;
  int32_t splits;
  int64_t total_kv;
  int32_t num_heads_kv;
  void* dk;
  void* dv;
  int64_t dk_row_stride, dk_head_stride, dv_row_stride, dv_head_stride;
  const int32_t* error_flag;
  int32_t head_dim_chunks;    // kPadded: the caller's head dim in 16-byte chunks (dk's)
  int32_t v_head_dim_chunks;  // kPadded: v's (dv's), below q's with a v head dim of its own
};

// Every row of every sequence has its partials written (every KV block of a sequence is a tile
// of each split, including blocks no query sees, which write zeros), and offsets end at
// total_kv: the rows [0, total_kv) are all read and written, nothing past them.
template <class Element, int kHeadDim, bool kPadded>
__global__ void __launch_bounds__(PreprocessShape<kHeadDim>::kThreads)
    dkv_postprocess_kernel(const DkvPostprocessParams p) {
  if (*p.error_flag) return;
  using Shape = PreprocessShape<kHeadDim>;
  const int chunk = threadIdx.x % Shape::kLanesPerRow;
  const int64_t split_stride = p.total_kv * p.num_heads_kv * kHeadDim;
  for (int64_t cta = blockIdx.x; cta < Shape::ctas(p.total_kv, p.num_heads_kv); cta += gridDim.x) {
    const int32_t h = static_cast<int32_t>(cta % p.num_heads_kv);
    const int64_t row = Shape::thread_row(cta, p.num_heads_kv);
    if (row >= p.total_kv || (kPadded && chunk >= p.head_dim_chunks) ||
        (Shape::kIdleLanes && chunk >= Shape::kChunks))
      continue;
    const int64_t at = (row * p.num_heads_kv + h) * kHeadDim + chunk * 8;
    *reinterpret_cast<uint4*>(static_cast<Element*>(p.dk) + row * p.dk_row_stride + h * p.dk_head_stride +
                              chunk * 8) =
        sum8_strided<Element>(p.dk_partial + at, p.splits, split_stride, 1.f);
    if (kPadded && chunk >= p.v_head_dim_chunks) continue;
    *reinterpret_cast<uint4*>(static_cast<Element*>(p.dv) + row * p.dv_row_stride + h * p.dv_head_stride +
                              chunk * 8) =
        sum8_strided<Element>(p.dv_partial + at, p.splits, split_stride, 1.f);
  }
}

}  // namespace jagflash::kernels::bwd
