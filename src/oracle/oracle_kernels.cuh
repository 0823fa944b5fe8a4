// Kernels of the GPU oracle (see oracle.hpp). Included only by the generated per-(dtype, head
// dim) instantiation files.
#pragma once

#include "core/block_mask.hpp"
#include "core/dtype.hpp"
#include "core/mask.hpp"
#include "core/pooled.hpp"
#include "core/score_mod.hpp"
#include "oracle/oracle.hpp"

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

namespace jagflash::oracle {

constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kThreadsPerBlock = kWarpsPerBlock * kWarpSize;
// Grid-stride loops keep the grid under the launch limit for any token count.
constexpr int64_t kMaxBlocks = 1 << 20;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename T>
struct TensorRef {
  T* data;
  int64_t row_stride;
  int64_t head_stride;
  __device__ T* at(int64_t row, int64_t head) const { return data + row * row_stride + head * head_stride; }
};

template <typename T>
TensorRef<T> ref(const jf_tensor& t) {
  return {static_cast<T*>(t.data), t.row_stride, t.head_stride};
}

// What every oracle kernel needs to locate a row in its sequence.
struct JaggedGeometry {
  const int32_t* q_offsets;  // NULL when pooled
  const int32_t* kv_offsets;
  int32_t batch_size;
  int32_t pooled_q_rows;  // Lq > 0: one query set [Lq] shared by every sequence (jf_problem)
  int64_t total_q;        // rows of out, dout, lse and delta: q.rows, or B * Lq when pooled
  int64_t total_kv;
  int32_t num_heads;
  int32_t group;  // query heads per kv head
  MaskPolicy mask;
  BlockMask blocks;  // the block-sparse map (device pointers); none when !blocks.present()
  ScoreMod mod;
  float scale;
  // What the row a warp holds (q; in the dk/dv kernel, k) is multiplied by as it is loaded, so that
  // its dot product with the other row is what log2_score takes: scale * log2(e) without a modifier
  // (the dot is then the score in log2 units and goes straight into exp2), scale with one (the dot
  // is the scaled score s in natural units, the modifier's input).
  float dot_scale;
  const int32_t* error_flag;
  const float* learnable_sink;  // [H] (natural units) or null
};

inline JaggedGeometry geometry(const jf_problem& p, const Workspace& ws) {
  JaggedGeometry g;
  g.q_offsets = p.q_offsets;
  g.kv_offsets = p.kv_offsets;
  g.batch_size = p.batch_size;
  g.pooled_q_rows = p.pooled_q_rows;
  g.total_q = output_rows(p);
  g.total_kv = p.k.rows;
  g.num_heads = p.q.heads;
  g.group = p.q.heads / p.k.heads;
  g.mask = MaskPolicy::from(p.mask, p.window_left, p.window_right);
  g.blocks = BlockMask::from(p);
  g.mod = ScoreMod::from(p);
  g.scale = p.scale != 0.f ? p.scale : 1.f / std::sqrt(static_cast<float>(p.q.head_dim));
  g.dot_scale = g.mod.is_none() ? g.scale * kLog2e : g.scale;
  g.error_flag = ws.error_flag;
  g.learnable_sink = p.learnable_sink;
  return g;
}

// The sequence holding token `row`: the last b with offsets[b] <= row (skips empty sequences).
__device__ __forceinline__ int32_t find_sequence(const int32_t* offsets, int32_t batch_size, int64_t row) {
  int32_t lo = 0, hi = batch_size;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int32_t mid = (lo + hi) / 2;
    if (offsets[mid] <= row)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// Where an output row (a row of out, dout, lse and delta) sits: its sequence, the q row it reads,
// its query index in the sequence, and the sequence's lengths. Pooled, output row b * Lq + i reads
// q row i; otherwise output rows are q rows.
struct OutputRowPlace {
  int32_t b;
  int64_t q_row;
  int64_t i;
  int64_t lq;
  int64_t kv_start;
  int64_t lk;
};

__device__ __forceinline__ OutputRowPlace place_output_row(const JaggedGeometry& g, int64_t row) {
  OutputRowPlace r;
  if (g.pooled_q_rows > 0) {
    r.b = static_cast<int32_t>(row / g.pooled_q_rows);
    r.i = row - int64_t(r.b) * g.pooled_q_rows;
    r.q_row = r.i;
    r.lq = g.pooled_q_rows;
  } else {
    r.b = find_sequence(g.q_offsets, g.batch_size, row);
    const int64_t q_start = g.q_offsets[r.b];
    r.i = row - q_start;
    r.q_row = row;
    r.lq = g.q_offsets[r.b + 1] - q_start;
  }
  r.kv_start = g.kv_offsets[r.b];
  r.lk = g.kv_offsets[r.b + 1] - r.kv_start;
  return r;
}

// The score modifier is a runtime branch here, not a template parameter as in the Hopper kernels:
// its kind is the same for every warp of a call (no divergence), the branch is noise next to the
// two shuffle reductions each key costs, and a template on it would triple the oracle's
// instantiations (build time and image) for code that is meant to be correct rather than fast.
// Without a modifier the arithmetic is today's: the pre-scaled dot goes into exp2 as it is.

// The score in log2 units (what exp2 takes, and what lse * log2(e) is compared with) of the pair
// whose dot product of pre-scaled rows (JaggedGeometry::dot_scale) is `dot`.
__device__ __forceinline__ float log2_score(const JaggedGeometry& g, float dot, const ScoreCoords& at) {
  return g.mod.is_none() ? dot : g.mod.score(dot, at) * kLog2e;
}

// dS = P (dP - delta) * dscore, dscore being the modifier's derivative at s (`dot` as above);
// `ds` is P (dP - delta), left as it is without a modifier.
__device__ __forceinline__ float modified_ds(const JaggedGeometry& g, float ds, float dot,
                                             const ScoreCoords& at) {
  return g.mod.is_none() ? ds : ds * g.mod.dscore(dot, at);
}

// The block mask in the loops over keys (or, in the dk/dv kernel, over queries): whether the pair
// (i, j) of sequence b is in a hidden block, and where the loop resumes, the last index of that
// block (the loop's ++ then steps to the next block's first). The index is the same in every
// lane, so the branch never diverges.
__device__ __forceinline__ bool block_hidden(const JaggedGeometry& g, int32_t b, int64_t i, int64_t j,
                                             int64_t lk) {
  return !g.blocks.visible(b, i, j, lk);  // visible() is true without a map
}
__device__ __forceinline__ int64_t last_of_block(int64_t index) {
  return (index / BlockMask::kBlock + 1) * BlockMask::kBlock - 1;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = kWarpSize / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// A head-dim vector spread over the warp: lane l holds elements l, l+32, ... (coalesced loads).
template <int D>
struct WarpVec {
  static_assert(D % kWarpSize == 0, "head dim must be a multiple of the warp size");
  static constexpr int kPerLane = D / kWarpSize;
  float x[kPerLane];

  template <typename T>
  __device__ void load(const T* p, int lane, float mul = 1.f) {
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) x[t] = to_float(p[lane + t * kWarpSize]) * mul;
  }
  template <typename T>
  __device__ void store(T* p, int lane, float mul = 1.f) const {
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) p[lane + t * kWarpSize] = from_float<T>(x[t] * mul);
  }
  __device__ void zero() {
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) x[t] = 0.f;
  }
  template <typename T>
  __device__ float dot(const T* p, int lane) const {
    float s = 0.f;
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) s += x[t] * to_float(p[lane + t * kWarpSize]);
    return warp_sum(s);
  }
  __device__ float dot(const WarpVec& o) const {
    float s = 0.f;
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) s += x[t] * o.x[t];
    return warp_sum(s);
  }
  // x = x * keep + w * p
  template <typename T>
  __device__ void scale_add(float keep, float w, const T* p, int lane) {
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) x[t] = x[t] * keep + w * to_float(p[lane + t * kWarpSize]);
  }
  __device__ void add_scaled(float w, const WarpVec& o) {
#pragma unroll
    for (int t = 0; t < kPerLane; ++t) x[t] += w * o.x[t];
  }
};

// ---- forward: one warp per (output row, head), online softmax over the visible keys ------------
template <typename T, int D>
__global__ void __launch_bounds__(kThreadsPerBlock)
    forward_kernel(JaggedGeometry g, TensorRef<const T> q, TensorRef<const T> k, TensorRef<const T> v,
                   TensorRef<T> out, float* lse) {
  if (*g.error_flag) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t num_items = g.total_q * g.num_heads;
  for (int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize; item < num_items;
       item += int64_t(gridDim.x) * kWarpsPerBlock) {
    const int64_t row = item / g.num_heads;
    const int32_t head = static_cast<int32_t>(item % g.num_heads);
    const int32_t kv_head = head / g.group;
    const OutputRowPlace place = place_output_row(g, row);
    const int64_t kv_start = place.kv_start;
    const IndexRange keys = g.mask.key_range(place.i, place.lq, place.lk);

    ScoreCoords at{head, place.i, 0, place.lq, place.lk};

    WarpVec<D> q_row, acc;
    q_row.load(q.at(place.q_row, head), lane, g.dot_scale);
    acc.zero();
    float m_i = -INFINITY, l_i = 0.f;  // log2 units
    for (int64_t j = keys.lo; j <= keys.hi; ++j) {
      if (block_hidden(g, place.b, place.i, j, place.lk)) {
        j = last_of_block(j);
        continue;
      }
      at.j = j;
      const float s = log2_score(g, q_row.dot(k.at(kv_start + j, kv_head), lane), at);
      const float m_new = fmaxf(m_i, s);
      const float correction = exp2f(m_i - m_new);
      const float p = exp2f(s - m_new);
      l_i = l_i * correction + p;
      acc.scale_add(correction, p, v.at(kv_start + j, kv_head), lane);
      m_i = m_new;
    }
    float out_scale = l_i > 0.f ? 1.f / l_i : 0.f;
    if (g.learnable_sink != nullptr) {  // one more term of the sum, with no value
      const float sink = g.learnable_sink[head] * kLog2e;
      const float m_new = fmaxf(m_i, sink);
      const float correction = exp2f(m_i - m_new);  // 0 when no key was seen (m_i = -inf)
      l_i = l_i * correction + exp2f(sink - m_new);
      out_scale = correction / l_i;
      m_i = m_new;
    }
    const bool any = l_i > 0.f;
    acc.store(out.at(row, head), lane, out_scale);
    if (lse != nullptr && lane == 0)
      lse[int64_t(head) * g.total_q + row] = any ? (m_i + log2f(l_i)) * kLn2 : -INFINITY;
  }
}

// ---- backward, part 1: one warp per (query row, head): delta, then dq over the visible keys ----
template <typename T, int D>
__global__ void __launch_bounds__(kThreadsPerBlock)
    backward_dq_kernel(JaggedGeometry g, TensorRef<const T> q, TensorRef<const T> k, TensorRef<const T> v,
                       TensorRef<const T> out, TensorRef<const T> dout, const float* lse, float* delta,
                       TensorRef<T> dq) {
  if (*g.error_flag) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t num_items = g.total_q * g.num_heads;
  for (int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize; item < num_items;
       item += int64_t(gridDim.x) * kWarpsPerBlock) {
    const int64_t row = item / g.num_heads;
    const int32_t head = static_cast<int32_t>(item % g.num_heads);
    const int32_t kv_head = head / g.group;
    const OutputRowPlace place = place_output_row(g, row);
    const int64_t kv_start = place.kv_start;
    const IndexRange keys = g.mask.key_range(place.i, place.lq, place.lk);

    ScoreCoords at{head, place.i, 0, place.lq, place.lk};

    WarpVec<D> q_row, do_row, o_row, dq_acc;
    q_row.load(q.at(row, head), lane, g.dot_scale);
    do_row.load(dout.at(row, head), lane);
    o_row.load(out.at(row, head), lane);
    const float delta_i = do_row.dot(o_row);
    if (lane == 0) delta[int64_t(head) * g.total_q + row] = delta_i;
    const float lse_log2 = lse[int64_t(head) * g.total_q + row] * kLog2e;
    dq_acc.zero();
    if (lse_log2 != -INFINITY) {
      for (int64_t j = keys.lo; j <= keys.hi; ++j) {
        if (block_hidden(g, place.b, place.i, j, place.lk)) {
          j = last_of_block(j);
          continue;
        }
        at.j = j;
        const T* k_row = k.at(kv_start + j, kv_head);
        const float dot = q_row.dot(k_row, lane);
        const float p = exp2f(log2_score(g, dot, at) - lse_log2);
        const float dp = do_row.dot(v.at(kv_start + j, kv_head), lane);
        dq_acc.scale_add(1.f, modified_ds(g, p * (dp - delta_i), dot, at), k_row, lane);
      }
    }
    dq_acc.store(dq.at(row, head), lane, g.scale);
  }
}

// ---- pooled backward, part 1: one warp per (query row i of the shared set, head): for every
// sequence in order, delta of its output row b * Lq + i, then that sequence's dq contribution, all
// added into one fp32 accumulator and rounded once (a fixed order: bitwise repeatable). --------
template <typename T, int D>
__global__ void __launch_bounds__(kThreadsPerBlock)
    pooled_backward_dq_kernel(JaggedGeometry g, TensorRef<const T> q, TensorRef<const T> k,
                              TensorRef<const T> v, TensorRef<const T> out, TensorRef<const T> dout,
                              const float* lse, float* delta, TensorRef<T> dq) {
  if (*g.error_flag) return;
  const int lane = threadIdx.x % kWarpSize;
  const int64_t lq = g.pooled_q_rows;
  const int64_t num_items = lq * g.num_heads;
  for (int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize; item < num_items;
       item += int64_t(gridDim.x) * kWarpsPerBlock) {
    const int64_t i = item / g.num_heads;
    const int32_t head = static_cast<int32_t>(item % g.num_heads);
    const int32_t kv_head = head / g.group;

    WarpVec<D> q_row, do_row, o_row, dq_acc;
    q_row.load(q.at(i, head), lane, g.dot_scale);
    dq_acc.zero();
    for (int32_t b = 0; b < g.batch_size; ++b) {
      const int64_t row = int64_t(b) * lq + i;
      const int64_t kv_start = g.kv_offsets[b], lk = g.kv_offsets[b + 1] - kv_start;
      do_row.load(dout.at(row, head), lane);
      o_row.load(out.at(row, head), lane);
      const float delta_i = do_row.dot(o_row);
      if (lane == 0) delta[int64_t(head) * g.total_q + row] = delta_i;
      const float lse_log2 = lse[int64_t(head) * g.total_q + row] * kLog2e;
      if (lse_log2 == -INFINITY) continue;  // no visible key (a sequence of length 0, or the mask)
      const IndexRange keys = g.mask.key_range(i, lq, lk);
      ScoreCoords at{head, i, 0, lq, lk};
      for (int64_t j = keys.lo; j <= keys.hi; ++j) {
        at.j = j;
        const T* k_row = k.at(kv_start + j, kv_head);
        const float dot = q_row.dot(k_row, lane);
        const float p = exp2f(log2_score(g, dot, at) - lse_log2);
        const float dp = do_row.dot(v.at(kv_start + j, kv_head), lane);
        dq_acc.scale_add(1.f, modified_ds(g, p * (dp - delta_i), dot, at), k_row, lane);
      }
    }
    dq_acc.store(dq.at(i, head), lane, g.scale);
  }
}

// ---- backward, part 2: one warp per (key row, kv head): dk, dv over the group's queries --------
template <typename T, int D>
__global__ void __launch_bounds__(kThreadsPerBlock)
    backward_dkdv_kernel(JaggedGeometry g, TensorRef<const T> q, TensorRef<const T> k, TensorRef<const T> v,
                         TensorRef<const T> dout, const float* lse, const float* delta, TensorRef<T> dk,
                         TensorRef<T> dv) {
  if (*g.error_flag) return;
  const int lane = threadIdx.x % kWarpSize;
  const int32_t num_kv_heads = g.num_heads / g.group;
  const int64_t num_items = g.total_kv * num_kv_heads;
  for (int64_t item = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize; item < num_items;
       item += int64_t(gridDim.x) * kWarpsPerBlock) {
    const int64_t row = item / num_kv_heads;
    const int32_t kv_head = static_cast<int32_t>(item % num_kv_heads);
    const int32_t b = find_sequence(g.kv_offsets, g.batch_size, row);
    const int64_t kv_start = g.kv_offsets[b], lk = g.kv_offsets[b + 1] - kv_start;
    // The sequence's q (and dq) rows start at q_start, its out/dout/lse/delta rows at out_start:
    // the same rows unless pooled (q rows 0 .. Lq-1 for every sequence, outputs at b * Lq).
    const bool pooled = g.pooled_q_rows > 0;
    const int64_t q_start = pooled ? 0 : g.q_offsets[b];
    const int64_t out_start = pooled ? int64_t(b) * g.pooled_q_rows : q_start;
    const int64_t lq = pooled ? g.pooled_q_rows : g.q_offsets[b + 1] - q_start;
    const IndexRange queries = g.mask.query_range(row - kv_start, lq, lk);
    ScoreCoords at{0, 0, row - kv_start, lq, lk};

    WarpVec<D> k_row, v_row, dk_acc, dv_acc;
    k_row.load(k.at(row, kv_head), lane, g.dot_scale);
    v_row.load(v.at(row, kv_head), lane);
    dk_acc.zero();
    dv_acc.zero();
    for (int32_t h = kv_head * g.group; h < (kv_head + 1) * g.group; ++h) {
      at.head = h;
      for (int64_t i = queries.lo; i <= queries.hi; ++i) {
        if (block_hidden(g, b, i, row - kv_start, lk)) {
          i = last_of_block(i);
          continue;
        }
        at.i = i;
        const int64_t out_row_idx = out_start + i;
        const float lse_log2 = lse[int64_t(h) * g.total_q + out_row_idx] * kLog2e;
        if (lse_log2 == -INFINITY) continue;  // cannot happen when i sees this key; kept as a guard
        const T* q_row = q.at(q_start + i, h);
        const T* do_row = dout.at(out_row_idx, h);
        const float dot = k_row.dot(q_row, lane);
        const float p = exp2f(log2_score(g, dot, at) - lse_log2);
        const float dp = v_row.dot(do_row, lane);
        const float ds = modified_ds(g, p * (dp - delta[int64_t(h) * g.total_q + out_row_idx]), dot, at);
        dv_acc.scale_add(1.f, p, do_row, lane);
        dk_acc.scale_add(1.f, ds, q_row, lane);
      }
    }
    dk_acc.store(dk.at(row, kv_head), lane, g.scale);
    dv_acc.store(dv.at(row, kv_head), lane);
  }
}

inline unsigned grid_for(int64_t warps) {
  int64_t blocks = (warps + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;
  return static_cast<unsigned>(blocks > 0 ? blocks : 1);
}

template <typename T, int D>
cudaError_t forward(const jf_fwd_args& a, const Workspace& ws, cudaStream_t stream) {
  const jf_problem& p = a.problem;
  const int64_t rows = output_rows(p);
  if (rows == 0) return cudaSuccess;
  const JaggedGeometry g = geometry(p, ws);
  forward_kernel<T, D><<<grid_for(rows * p.q.heads), kThreadsPerBlock, 0, stream>>>(
      g, ref<const T>(p.q), ref<const T>(p.k), ref<const T>(p.v), ref<T>(a.out), a.lse);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t backward(const jf_bwd_args& a, const Workspace& ws, cudaStream_t stream) {
  const jf_problem& p = a.problem;
  const JaggedGeometry g = geometry(p, ws);
  if (is_pooled(p)) {
    // Every dq row is written (0 when B = 0 or no row sees a key), before the dk/dv kernel reads
    // the delta it leaves in the workspace.
    pooled_backward_dq_kernel<T, D><<<grid_for(p.q.rows * p.q.heads), kThreadsPerBlock, 0, stream>>>(
        g, ref<const T>(p.q), ref<const T>(p.k), ref<const T>(p.v), ref<const T>(a.out), ref<const T>(a.dout),
        a.lse, ws.delta, ref<T>(a.dq));
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  } else if (p.q.rows > 0) {
    backward_dq_kernel<T, D><<<grid_for(p.q.rows * p.q.heads), kThreadsPerBlock, 0, stream>>>(
        g, ref<const T>(p.q), ref<const T>(p.k), ref<const T>(p.v), ref<const T>(a.out), ref<const T>(a.dout),
        a.lse, ws.delta, ref<T>(a.dq));
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (p.k.rows > 0) {
    backward_dkdv_kernel<T, D><<<grid_for(p.k.rows * p.k.heads), kThreadsPerBlock, 0, stream>>>(
        g, ref<const T>(p.q), ref<const T>(p.k), ref<const T>(p.v), ref<const T>(a.dout), a.lse, ws.delta,
        ref<T>(a.dk), ref<T>(a.dv));
    return cudaGetLastError();
  }
  return cudaSuccess;
}

// Storage types by the short names the build uses for instantiation files.
using bf16_t = __nv_bfloat16;
using fp16_t = __half;
using fp32_t = float;

}  // namespace jagflash::oracle

#define JF_ORACLE_DECLARE(dt, hd)                                                         \
  namespace jagflash::oracle {                                                            \
  cudaError_t forward_##dt##_hd##hd(const jf_fwd_args&, const Workspace&, cudaStream_t);  \
  cudaError_t backward_##dt##_hd##hd(const jf_bwd_args&, const Workspace&, cudaStream_t); \
  }

#define JF_ORACLE_DEFINE(dt, hd)                                                                 \
  namespace jagflash::oracle {                                                                   \
  cudaError_t forward_##dt##_hd##hd(const jf_fwd_args& a, const Workspace& w, cudaStream_t s) {  \
    return forward<dt##_t, hd>(a, w, s);                                                         \
  }                                                                                              \
  cudaError_t backward_##dt##_hd##hd(const jf_bwd_args& a, const Workspace& w, cudaStream_t s) { \
    return backward<dt##_t, hd>(a, w, s);                                                        \
  }                                                                                              \
  }
