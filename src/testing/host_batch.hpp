// Host-side jagged batches for the tests, the CLI and the GPU checks: strided tensors of any jf_dtype held as
// raw bytes, read and written as double, and a jf_problem that points into them.
#pragma once

#include "core/dtype.hpp"

#include <jagflash/jagflash.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

namespace jagflash::test {

// A [rows, heads, head_dim] tensor in host memory. The buffer holds rows * row_stride elements,
// so the padding after each row (and between heads, when head_stride > head_dim) is real memory
// that a test can poison and check.
struct HostTensor {
  jf_dtype dtype = JF_FP32;
  int64_t rows = 0;
  int heads = 0;
  int head_dim = 0;
  int64_t row_stride = 0;
  int64_t head_stride = 0;
  std::vector<unsigned char> bytes;

  int64_t offset(int64_t r, int h, int d) const { return r * row_stride + h * head_stride + d; }
  int64_t element_count() const { return rows * row_stride; }

  jf_tensor view() {
    jf_tensor t{};
    t.data = bytes.data();
    t.rows = rows;
    t.heads = heads;
    t.head_dim = head_dim;
    t.row_stride = row_stride;
    t.head_stride = head_stride;
    return t;
  }

  // Any element of the buffer, padding included, by its flat index.
  double get_flat(int64_t i) const {
    return dispatch_dtype(dtype, [&](auto storage) {
      using T = decltype(storage);
      T x;
      std::memcpy(&x, bytes.data() + i * sizeof(T), sizeof(T));
      return static_cast<double>(to_float(x));
    });
  }

  // Rounds x to the dtype (through float, as the library's conversions do).
  void set_flat(int64_t i, double x) {
    dispatch_dtype(dtype, [&](auto storage) {
      using T = decltype(storage);
      const T y = from_float<T>(static_cast<float>(x));
      std::memcpy(bytes.data() + i * sizeof(T), &y, sizeof(T));
    });
  }

  double get(int64_t r, int h, int d) const { return get_flat(offset(r, h, d)); }
  void set(int64_t r, int h, int d, double x) { set_flat(offset(r, h, d), x); }

  // Uniform values in [lo, hi] rounded to the dtype, on the view's elements only.
  void fill_random(std::mt19937_64& rng, double lo = -1.0, double hi = 1.0) {
    std::uniform_real_distribution<double> dist(lo, hi);
    for (int64_t r = 0; r < rows; ++r)
      for (int h = 0; h < heads; ++h)
        for (int d = 0; d < head_dim; ++d) set(r, h, d, dist(rng));
  }

  // Every element of the buffer, padding included.
  void fill(double x) {
    for (int64_t i = 0; i < element_count(); ++i) set_flat(i, x);
  }
};

// row_stride = heads * (head_dim + head_pad) + row_pad, head_stride = head_dim + head_pad.
inline HostTensor make_tensor(jf_dtype dtype, int64_t rows, int heads, int head_dim, int row_pad = 0,
                              int head_pad = 0) {
  HostTensor t;
  t.dtype = dtype;
  t.rows = rows;
  t.heads = heads;
  t.head_dim = head_dim;
  t.head_stride = head_dim + head_pad;
  t.row_stride = static_cast<int64_t>(heads) * t.head_stride + row_pad;
  t.bytes.assign(static_cast<size_t>(t.element_count()) * dtype_size(dtype), 0);
  return t;
}

inline std::vector<int32_t> offsets_from_lengths(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> offsets(lengths.size() + 1, 0);
  for (size_t b = 0; b < lengths.size(); ++b) offsets[b + 1] = offsets[b] + lengths[b];
  return offsets;
}

struct HostBatch {
  jf_dtype dtype = JF_FP32;
  int H = 0;
  int H_kv = 0;
  int D = 0;
  std::vector<int32_t> q_offsets;
  std::vector<int32_t> kv_offsets;
  HostTensor q, k, v;

  int32_t batch_size() const { return static_cast<int32_t>(q_offsets.size()) - 1; }
  int64_t total_q() const { return q_offsets.back(); }
  int64_t total_kv() const { return kv_offsets.back(); }
};

// q [total_q, H, D], k and v [total_kv, H_kv, D], values uniform in [-1, 1] rounded to dtype.
inline HostBatch make_random_batch(const std::vector<int32_t>& len_q, const std::vector<int32_t>& len_kv,
                                   int H, int H_kv, int D, jf_dtype dtype, uint64_t seed, int row_pad = 0) {
  if (len_q.size() != len_kv.size()) throw std::invalid_argument("len_q and len_kv differ in size");
  HostBatch batch;
  batch.dtype = dtype;
  batch.H = H;
  batch.H_kv = H_kv;
  batch.D = D;
  batch.q_offsets = offsets_from_lengths(len_q);
  batch.kv_offsets = offsets_from_lengths(len_kv);
  batch.q = make_tensor(dtype, batch.total_q(), H, D, row_pad);
  batch.k = make_tensor(dtype, batch.total_kv(), H_kv, D, row_pad);
  batch.v = make_tensor(dtype, batch.total_kv(), H_kv, D, row_pad);
  std::mt19937_64 rng(seed);
  batch.q.fill_random(rng);
  batch.k.fill_random(rng);
  batch.v.fill_random(rng);
  return batch;
}

// The problem over these inputs, which must outlive it: ordinary with q_offsets, or pooled with
// pooled_q_rows = Lq > 0 and q_offsets null. The batch size is kv_offsets' length - 1.
inline jf_problem make_problem(jf_dtype dtype, const int32_t* q_offsets,
                               const std::vector<int32_t>& kv_offsets, HostTensor& q, HostTensor& k,
                               HostTensor& v, jf_mask mask, int window_left, int window_right,
                               int32_t pooled_q_rows = 0, float scale = 0.0f) {
  jf_problem p{};
  p.dtype = dtype;
  p.device = JF_DEVICE_CPU;
  p.batch_size = static_cast<int32_t>(kv_offsets.size()) - 1;
  p.q_offsets = q_offsets;
  p.kv_offsets = kv_offsets.data();
  p.q = q.view();
  p.k = k.view();
  p.v = v.view();
  p.mask = mask;
  p.window_left = window_left;
  p.window_right = window_right;
  p.scale = scale;
  p.pooled_q_rows = pooled_q_rows;
  return p;
}

// Points into `batch`, which must outlive the problem.
inline jf_problem make_problem(HostBatch& batch, jf_mask mask, int window_left, int window_right,
                               float scale = 0.0f) {
  jf_problem p = make_problem(batch.dtype, batch.q_offsets.data(), batch.kv_offsets, batch.q, batch.k,
                              batch.v, mask, window_left, window_right, 0, scale);
  p.batch_size = batch.batch_size();
  return p;
}

// A call's arguments over `problem` and these buffers (which must outlive them).
inline jf_fwd_args forward_args(const jf_problem& problem, HostTensor& out, float* lse) {
  jf_fwd_args a{};
  a.problem = problem;
  a.out = out.view();
  a.lse = lse;
  return a;
}
inline jf_bwd_args backward_args(const jf_problem& problem, HostTensor& out, HostTensor& dout, float* lse,
                                 HostTensor& dq, HostTensor& dk, HostTensor& dv) {
  jf_bwd_args a{};
  a.problem = problem;
  a.out = out.view();
  a.dout = dout.view();
  a.lse = lse;
  a.dq = dq.view();
  a.dk = dk.view();
  a.dv = dv.view();
  return a;
}

// The unit roundoff of a storage dtype (half an ulp of 1).
inline double unit_roundoff(jf_dtype dtype) {
  switch (dtype) {
    case JF_BF16:
      return std::ldexp(1.0, -8);
    case JF_FP16:
      return std::ldexp(1.0, -11);
    case JF_FP32:
      return std::ldexp(1.0, -24);
  }
  return 0.0;
}

namespace detail {
inline void require_same_shape(const HostTensor& a, const HostTensor& b) {
  if (a.rows != b.rows || a.heads != b.heads || a.head_dim != b.head_dim)
    throw std::invalid_argument("tensors differ in shape");
}
}  // namespace detail

// ||got - want||_2 / max(||want||_2, 1e-30) over the views' elements.
inline double rel_error(const HostTensor& got, const HostTensor& want) {
  detail::require_same_shape(got, want);
  double diff2 = 0.0, want2 = 0.0;
  for (int64_t r = 0; r < got.rows; ++r)
    for (int h = 0; h < got.heads; ++h)
      for (int d = 0; d < got.head_dim; ++d) {
        const double w = want.get(r, h, d);
        const double e = got.get(r, h, d) - w;
        diff2 += e * e;
        want2 += w * w;
      }
  return std::sqrt(diff2) / std::max(std::sqrt(want2), 1e-30);
}

inline double max_abs_diff(const HostTensor& got, const HostTensor& want) {
  detail::require_same_shape(got, want);
  double worst = 0.0;
  for (int64_t r = 0; r < got.rows; ++r)
    for (int h = 0; h < got.heads; ++h)
      for (int d = 0; d < got.head_dim; ++d) {
        const double diff = std::abs(got.get(r, h, d) - want.get(r, h, d));
        // Written so that a NaN difference propagates instead of being skipped by std::max.
        if (!(diff <= worst)) worst = diff;
      }
  return worst;
}

}  // namespace jagflash::test
