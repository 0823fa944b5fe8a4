// CPU reference in float64. Work is split into (sequence, kv head) tasks: a task loads its K and V
// once, runs every query head of the GQA group against them, and owns the dK/dV rows of that kv
// head outright, so tasks never write the same element and the result does not depend on how
// threads pick them up.
//
// Pooled attention (problem.pooled_q_rows = Lq > 0): every sequence reads the same q rows
// [0, Lq) and writes its own out/lse rows [b*Lq, (b+1)*Lq); dq [Lq, H, D] is the sum over the
// sequences, so the (sequence, kv head) tasks write dK/dV only and a second pass, one task per
// query head, adds every sequence's dQ contribution in sequence order (float64, rounded once).
//
// Per task, every operand is copied into a contiguous row-major [rows, D] double buffer; a query
// row then needs only its visible keys (the mask's key range, cut to the visible blocks of the
// block-sparse map when there is one: a few contiguous segments), so memory is O((Lq + Lk) * D) and no Lq x
// Lk matrix is ever built. q, k, dq and dk have q's head dim D; v, out, dout and dv have v's, Dv <= D (each
// buffer is as wide as the view it is loaded from).
#include "reference/reference.hpp"

#include "core/block_mask.hpp"
#include "core/dtype.hpp"
#include "core/mask.hpp"
#include "core/pooled.hpp"
#include "core/score_mod.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

namespace jagflash::reference {
namespace {

// Below this many multiply-adds per thread, starting a thread costs more than it saves.
constexpr int64_t kMinWorkPerThread = int64_t{1} << 22;

struct Task {
  int32_t batch;
  int32_t kv_head;
};

struct SequenceSpan {
  int64_t q_begin;    // first row of q (and of dq) the sequence reads
  int64_t out_begin;  // first row of out, dout and lse: q_begin, or b * Lq when pooled
  int64_t lq;
  int64_t kv_begin;
  int64_t lk;
};

SequenceSpan span_of(const jf_problem& problem, int32_t b) {
  SequenceSpan s;
  if (is_pooled(problem)) {
    s.q_begin = 0;
    s.lq = problem.pooled_q_rows;
    s.out_begin = int64_t{b} * s.lq;
  } else {
    s.q_begin = problem.q_offsets[b];
    s.lq = problem.q_offsets[b + 1] - s.q_begin;
    s.out_begin = s.q_begin;
  }
  s.kv_begin = problem.kv_offsets[b];
  s.lk = problem.kv_offsets[b + 1] - s.kv_begin;
  return s;
}

// Which keys a query row sees: the mask's key range (core/mask.hpp) and, with a block mask
// (core/block_mask.hpp), only the keys of the visible blocks of the row's query block. Given as
// contiguous segments in increasing key order: one (the range) without a map, none for a row that
// sees nothing.
struct Visibility {
  MaskPolicy mask;
  BlockMask blocks;

  static Visibility from(const jf_problem& p) {
    return {MaskPolicy::from(p.mask, p.window_left, p.window_right), BlockMask::from(p)};
  }

  void segments(int32_t b, int64_t i, int64_t lq, int64_t lk, std::vector<IndexRange>& out) const {
    out.clear();
    const IndexRange range = mask.key_range(i, lq, lk);
    if (range.empty()) return;
    if (!blocks.present()) {
      out.push_back(range);
      return;
    }
    constexpr int64_t kBlock = BlockMask::kBlock;
    const uint8_t* row = blocks.row(b, i / kBlock, lk);
    for (int64_t k_block = range.lo / kBlock; k_block <= range.hi / kBlock; ++k_block) {
      if (row[k_block] == 0) continue;
      const int64_t lo = std::max(range.lo, k_block * kBlock);
      const int64_t hi = std::min(range.hi, k_block * kBlock + kBlock - 1);
      if (!out.empty() && out.back().hi + 1 == lo)
        out.back().hi = hi;
      else
        out.push_back({lo, hi});
    }
  }
};

double softmax_scale(const jf_problem& problem) {
  return problem.scale != 0.0f ? static_cast<double>(problem.scale)
                               : 1.0 / std::sqrt(static_cast<double>(problem.q.head_dim));
}

// Every (sequence, kv head) with a row on either side: a sequence with Lq > 0 and Lk = 0 still
// writes out = 0 / lse = -inf (forward) or dq = 0 (backward), and Lq = 0, Lk > 0 writes
// dk = dv = 0.
std::vector<Task> make_tasks(const jf_problem& problem, int64_t* work) {
  std::vector<Task> tasks;
  *work = 0;
  for (int32_t b = 0; b < problem.batch_size; ++b) {
    const SequenceSpan s = span_of(problem, b);
    if (s.lq == 0 && s.lk == 0) continue;
    for (int32_t hk = 0; hk < problem.k.heads; ++hk) tasks.push_back({b, hk});
    *work += (s.lq + 1) * (s.lk + 1) * problem.q.heads * problem.q.head_dim;
  }
  return tasks;
}

// Runs body(i) for i in [0, count) on up to hardware_concurrency threads; the first exception
// thrown by any task is rethrown on the caller's thread once every thread has joined.
void parallel_for(size_t count, int64_t work, const std::function<void(size_t)>& body) {
  size_t threads = std::max(1u, std::thread::hardware_concurrency());
  threads = std::min(threads, count);
  threads = std::min(threads, static_cast<size_t>(std::max<int64_t>(1, work / kMinWorkPerThread)));
  if (threads <= 1) {
    for (size_t i = 0; i < count; ++i) body(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::atomic<bool> failed{false};
  std::vector<std::exception_ptr> errors(threads);
  std::vector<std::thread> pool;
  pool.reserve(threads);
  for (size_t t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      try {
        for (size_t i = next++; i < count && !failed; i = next++) body(i);
      } catch (...) {
        errors[t] = std::current_exception();
        failed = true;
      }
    });
  }
  for (std::thread& thread : pool) thread.join();
  for (const std::exception_ptr& error : errors) {
    if (error) std::rethrow_exception(error);
  }
}

// Copies rows [row_begin, row_begin + rows) of one head into dst as a contiguous [rows, D] block.
template <typename T>
void load_head(const jf_tensor& t, int64_t row_begin, int64_t rows, int32_t head, std::vector<double>& dst) {
  const int64_t d_count = t.head_dim;
  dst.resize(static_cast<size_t>(rows * d_count));
  if (rows == 0) return;  // an empty view may have any strides: no pointer into it is formed
  const T* base = static_cast<const T*>(t.data) + head * t.head_stride;
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = base + (row_begin + r) * t.row_stride;
    double* out = dst.data() + r * d_count;
    for (int64_t d = 0; d < d_count; ++d) out[d] = static_cast<double>(to_float(row[d]));
  }
}

// The inverse of load_head: writes only the view's elements of that head.
template <typename T>
void store_head(const jf_tensor& t, int64_t row_begin, int64_t rows, int32_t head,
                const std::vector<double>& src) {
  const int64_t d_count = t.head_dim;
  if (rows == 0) return;
  T* base = static_cast<T*>(t.data) + head * t.head_stride;
  for (int64_t r = 0; r < rows; ++r) {
    T* row = base + (row_begin + r) * t.row_stride;
    const double* in = src.data() + r * d_count;
    for (int64_t d = 0; d < d_count; ++d) row[d] = from_float<T>(static_cast<float>(in[d]));
  }
}

double dot(const double* a, const double* b, int64_t n) {
  double acc = 0.0;
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
}

// The modifier's score (at coords `at`, whose j is set here) of the scaled score of q_row against
// key j; with dscore non-null, also the modifier's derivative there.
double modified_score(const double* q_row, const std::vector<double>& k_f64, int64_t j, int64_t d_count,
                      double scale, const ScoreMod& mod, ScoreCoords at, double* dscore = nullptr) {
  const double s_scaled = scale * dot(q_row, k_f64.data() + j * d_count, d_count);
  at.j = j;
  if (dscore != nullptr) *dscore = mod.dscore(s_scaled, at);
  return mod.score(s_scaled, at);
}

// Fills p[j] for every key j of `keys` (segments, Visibility) with the softmax probabilities of
// query row q_row over those keys and the sink logit (-inf: none; it takes a share of the
// denominator and gives no value) and returns lse. `keys` must hold at least one key.
double row_softmax(const double* q_row, const std::vector<double>& k_f64, const std::vector<IndexRange>& keys,
                   int64_t d_count, double scale, const ScoreMod& mod, const ScoreCoords& at, double sink,
                   std::vector<double>& p) {
  double m_i = sink;
  for (const IndexRange& seg : keys)
    for (int64_t j = seg.lo; j <= seg.hi; ++j) {
      const double s = modified_score(q_row, k_f64, j, d_count, scale, mod, at);
      p[static_cast<size_t>(j)] = s;
      m_i = std::max(m_i, s);
    }
  double l_i = std::exp(sink - m_i);  // 0 without a sink (-inf)
  for (const IndexRange& seg : keys)
    for (int64_t j = seg.lo; j <= seg.hi; ++j) {
      p[static_cast<size_t>(j)] = std::exp(p[static_cast<size_t>(j)] - m_i);
      l_i += p[static_cast<size_t>(j)];
    }
  for (const IndexRange& seg : keys)
    for (int64_t j = seg.lo; j <= seg.hi; ++j) p[static_cast<size_t>(j)] /= l_i;
  return m_i + std::log(l_i);
}

// Query head h's sink logit (jf_problem::learnable_sink), -inf (no sink) without them.
double sink_of(const jf_problem& problem, int32_t h) {
  return problem.learnable_sink != nullptr ? static_cast<double>(problem.learnable_sink[h])
                                           : -std::numeric_limits<double>::infinity();
}

template <typename T>
void forward_task(const jf_fwd_args& args, const Task& task) {
  const jf_problem& problem = args.problem;
  const SequenceSpan s = span_of(problem, task.batch);
  const int64_t d_count = problem.q.head_dim, dv_count = problem.v.head_dim;
  const int32_t group = problem.q.heads / problem.k.heads;
  const int64_t lse_rows = output_rows(problem);
  const double scale = softmax_scale(problem);
  const Visibility visibility = Visibility::from(problem);
  const ScoreMod mod = ScoreMod::from(problem);

  std::vector<double> k_f64, v_f64, q_f64, o_f64, p(static_cast<size_t>(s.lk));
  std::vector<IndexRange> keys;
  load_head<T>(problem.k, s.kv_begin, s.lk, task.kv_head, k_f64);
  load_head<T>(problem.v, s.kv_begin, s.lk, task.kv_head, v_f64);
  for (int32_t h = task.kv_head * group; h < (task.kv_head + 1) * group; ++h) {
    load_head<T>(problem.q, s.q_begin, s.lq, h, q_f64);
    o_f64.assign(static_cast<size_t>(s.lq * dv_count), 0.0);
    for (int64_t i = 0; i < s.lq; ++i) {
      visibility.segments(task.batch, i, s.lq, s.lk, keys);
      double lse = sink_of(problem, h);  // a row that sees no key: out = 0, lse = the sink (or -inf)
      if (!keys.empty()) {
        lse = row_softmax(q_f64.data() + i * d_count, k_f64, keys, d_count, scale, mod, {h, i, 0, s.lq, s.lk},
                          sink_of(problem, h), p);
        double* o_row = o_f64.data() + i * dv_count;
        for (const IndexRange& seg : keys)
          for (int64_t j = seg.lo; j <= seg.hi; ++j) {
            const double p_ij = p[static_cast<size_t>(j)];
            const double* v_row = v_f64.data() + j * dv_count;
            for (int64_t d = 0; d < dv_count; ++d) o_row[d] += p_ij * v_row[d];
          }
      }
      if (args.lse != nullptr) args.lse[h * lse_rows + s.out_begin + i] = static_cast<float>(lse);
    }
    store_head<T>(args.out, s.out_begin, s.lq, h, o_f64);
  }
}

// The backward takes the forward's statistics from the caller, as FlashAttention's backward (and
// every GPU backward here) does: per query row i, lse_i from args.lse and O_i from args.out.
// Per visible key j:
//   P_ij = exp(score_ij - lse_i),  dV_j += P_ij dO_i,  dP_ij = dO_i . V_j,  delta_i = dO_i . O_i,
//   dS_ij = P_ij (dP_ij - delta_i) dscore_ij,  dQ_i = scale sum_j dS_ij K_j,  dK_j += scale dS_ij Q_i,
// where dscore_ij is the score modifier's derivative at the scaled score (1 without one). A row
// with lse = -inf sees no key (P = 0) and contributes nothing.
// Why the given lse and out rather than a softmax over this call's keys: a caller may split the
// keys over several calls and pass each the statistics of the whole row. Context parallelism
// (ring attention) calls the backward once per K/V block with the out and lse merged over every
// block; with P and delta of the whole row, the blocks' dQ sum and their dK, dV concatenate to
// the gradients over all keys, which a per-call softmax would not give. delta then carries the
// rounding of O to the caller's dtype, as the GPU backwards' does; all else is float64.
//
// One (sequence, query head h), operands as contiguous [rows, width] buffers (q, k: D; v, out,
// dout: Dv); lse_row points at the sequence's first lse entry of head h: adds the head's
// contributions to dq_f64 [lq, D] and to dk_f64 [lk, D], dv_f64 [lk, Dv], each skipped when null.
struct HeadGrads {
  double* dq_f64;
  double* dk_f64;
  double* dv_f64;
};

struct HeadOperands {
  const std::vector<double>& q_f64;
  const std::vector<double>& k_f64;
  const std::vector<double>& v_f64;
  const std::vector<double>& o_f64;
  const std::vector<double>& do_f64;
  const float* lse_row;
};

// Sequence b's keys as `visibility` says (the mask and the block mask).
void accumulate_head_backward(const HeadOperands& in, const SequenceSpan& s, int32_t b, int64_t d_count,
                              int64_t dv_count, const Visibility& visibility, const ScoreMod& mod, int32_t h,
                              double scale, HeadGrads grads) {
  std::vector<IndexRange> keys;
  for (int64_t i = 0; i < s.lq; ++i) {
    visibility.segments(b, i, s.lq, s.lk, keys);
    const double lse_i = static_cast<double>(in.lse_row[i]);
    if (keys.empty() || lse_i == -std::numeric_limits<double>::infinity()) continue;
    const double* q_row = in.q_f64.data() + i * d_count;
    const double* do_row = in.do_f64.data() + i * dv_count;
    const double delta_i = dot(do_row, in.o_f64.data() + i * dv_count, dv_count);
    double* dq_row = grads.dq_f64 != nullptr ? grads.dq_f64 + i * d_count : nullptr;
    const ScoreCoords at{h, i, 0, s.lq, s.lk};
    for (const IndexRange& seg : keys)
      for (int64_t j = seg.lo; j <= seg.hi; ++j) {
        double dscore_ij = 1.0;
        const double p_ij =
            std::exp(modified_score(q_row, in.k_f64, j, d_count, scale, mod, at, &dscore_ij) - lse_i);
        const double dp_ij = dot(do_row, in.v_f64.data() + j * dv_count, dv_count);
        const double ds_ij = p_ij * (dp_ij - delta_i) * dscore_ij;
        const double* k_row = in.k_f64.data() + j * d_count;
        if (dq_row != nullptr)
          for (int64_t d = 0; d < d_count; ++d) dq_row[d] += scale * ds_ij * k_row[d];
        if (grads.dk_f64 != nullptr) {
          double* dk_row = grads.dk_f64 + j * d_count;
          double* dv_row = grads.dv_f64 + j * dv_count;
          for (int64_t d = 0; d < d_count; ++d) dk_row[d] += scale * ds_ij * q_row[d];
          for (int64_t d = 0; d < dv_count; ++d) dv_row[d] += p_ij * do_row[d];
        }
      }
  }
}

// One (sequence, kv head): dK/dV of the sequence's keys, summed over the group's query heads,
// and (ordinary attention) the sequence's dQ rows. Pooled, dQ is left to pooled_dq_task.
template <typename T>
void backward_task(const jf_bwd_args& args, const Task& task) {
  const jf_problem& problem = args.problem;
  const SequenceSpan s = span_of(problem, task.batch);
  const int64_t d_count = problem.q.head_dim, dv_count = problem.v.head_dim;
  const int32_t group = problem.q.heads / problem.k.heads;
  const int64_t lse_rows = output_rows(problem);
  const double scale = softmax_scale(problem);
  const Visibility visibility = Visibility::from(problem);
  const ScoreMod mod = ScoreMod::from(problem);
  const bool own_dq = !is_pooled(problem);

  std::vector<double> k_f64, v_f64, q_f64, o_f64, do_f64, dq_f64;
  std::vector<double> dk_f64(static_cast<size_t>(s.lk * d_count), 0.0);
  std::vector<double> dv_f64(static_cast<size_t>(s.lk * dv_count), 0.0);
  load_head<T>(problem.k, s.kv_begin, s.lk, task.kv_head, k_f64);
  load_head<T>(problem.v, s.kv_begin, s.lk, task.kv_head, v_f64);
  for (int32_t h = task.kv_head * group; h < (task.kv_head + 1) * group; ++h) {
    load_head<T>(problem.q, s.q_begin, s.lq, h, q_f64);
    load_head<T>(args.out, s.out_begin, s.lq, h, o_f64);
    load_head<T>(args.dout, s.out_begin, s.lq, h, do_f64);
    if (own_dq) dq_f64.assign(static_cast<size_t>(s.lq * d_count), 0.0);
    const HeadOperands in{q_f64, k_f64, v_f64, o_f64, do_f64, args.lse + h * lse_rows + s.out_begin};
    accumulate_head_backward(in, s, task.batch, d_count, dv_count, visibility, mod, h, scale,
                             {own_dq ? dq_f64.data() : nullptr, dk_f64.data(), dv_f64.data()});
    if (own_dq) store_head<T>(args.dq, s.q_begin, s.lq, h, dq_f64);
  }
  store_head<T>(args.dk, s.kv_begin, s.lk, task.kv_head, dk_f64);
  store_head<T>(args.dv, s.kv_begin, s.lk, task.kv_head, dv_f64);
}

// Pooled dQ of query head h: every sequence's contribution added in sequence order into one
// float64 accumulator [Lq, D], rounded once. Sequences of length 0 contribute nothing; dq = 0
// when no query row sees a key anywhere (B = 0 included).
template <typename T>
void pooled_dq_task(const jf_bwd_args& args, int32_t h) {
  const jf_problem& problem = args.problem;
  const int64_t lq = problem.pooled_q_rows;
  const int64_t d_count = problem.q.head_dim, dv_count = problem.v.head_dim;
  const int32_t kv_head = h / (problem.q.heads / problem.k.heads);
  const int64_t lse_rows = output_rows(problem);
  const double scale = softmax_scale(problem);
  const Visibility visibility = Visibility::from(problem);  // no block mask with pooled attention
  const ScoreMod mod = ScoreMod::from(problem);

  std::vector<double> q_f64, k_f64, v_f64, o_f64, do_f64;
  std::vector<double> dq_f64(static_cast<size_t>(lq * d_count), 0.0);
  load_head<T>(problem.q, 0, lq, h, q_f64);
  for (int32_t b = 0; b < problem.batch_size; ++b) {
    const SequenceSpan s = span_of(problem, b);
    if (s.lk == 0) continue;
    load_head<T>(problem.k, s.kv_begin, s.lk, kv_head, k_f64);
    load_head<T>(problem.v, s.kv_begin, s.lk, kv_head, v_f64);
    load_head<T>(args.out, s.out_begin, s.lq, h, o_f64);
    load_head<T>(args.dout, s.out_begin, s.lq, h, do_f64);
    const HeadOperands in{q_f64, k_f64, v_f64, o_f64, do_f64, args.lse + h * lse_rows + s.out_begin};
    accumulate_head_backward(in, s, b, d_count, dv_count, visibility, mod, h, scale,
                             {dq_f64.data(), nullptr, nullptr});
  }
  store_head<T>(args.dq, 0, lq, h, dq_f64);
}

// d loss / d s_h of query head h: the sink's share exp(s_h - lse_i) of each row's softmax times
// the row's -delta_i = -rowsum(dout_i * out_i), summed over every output row in order.
template <typename T>
void sink_gradient_task(const jf_bwd_args& args, int32_t h) {
  const jf_problem& problem = args.problem;
  const int64_t rows = output_rows(problem), dv_count = problem.v.head_dim;
  const double sink = sink_of(problem, h);
  std::vector<double> o_f64, do_f64;
  load_head<T>(args.out, 0, rows, h, o_f64);
  load_head<T>(args.dout, 0, rows, h, do_f64);
  double dsink = 0.0;
  for (int64_t i = 0; i < rows; ++i) {
    const double delta_i = dot(do_f64.data() + i * dv_count, o_f64.data() + i * dv_count, dv_count);
    dsink -= std::exp(sink - static_cast<double>(args.lse[h * rows + i])) * delta_i;
  }
  args.dlearnable_sink[h] = static_cast<float>(dsink);
}

}  // namespace

void forward(const jf_fwd_args& args) {
  int64_t work = 0;
  const std::vector<Task> tasks = make_tasks(args.problem, &work);
  dispatch_dtype(args.problem.dtype, [&](auto storage) {
    using T = decltype(storage);
    parallel_for(tasks.size(), work, [&](size_t i) { forward_task<T>(args, tasks[i]); });
  });
}

void backward(const jf_bwd_args& args) {
  int64_t work = 0;
  const std::vector<Task> tasks = make_tasks(args.problem, &work);
  dispatch_dtype(args.problem.dtype, [&](auto storage) {
    using T = decltype(storage);
    parallel_for(tasks.size(), work, [&](size_t i) { backward_task<T>(args, tasks[i]); });
    if (is_pooled(args.problem)) {
      // The dQ pass recomputes what the dK/dV pass did: the same work again, over H tasks.
      parallel_for(static_cast<size_t>(args.problem.q.heads), work,
                   [&](size_t h) { pooled_dq_task<T>(args, static_cast<int32_t>(h)); });
    }
    if (args.dlearnable_sink != nullptr)
      for (int32_t h = 0; h < args.problem.q.heads; ++h) sink_gradient_task<T>(args, h);
  });
}

}  // namespace jagflash::reference
