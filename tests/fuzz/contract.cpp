#include "contract.hpp"

#include "fuzz_case.hpp"

#include "core/score_mod.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <utility>

namespace jagflash::fuzz {
namespace {

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

// A byte range [begin, end); empty when begin == end.
struct Span {
  uintptr_t begin = 0, end = 0;
  bool empty() const { return begin == end; }
  bool overlaps(const Span& o) const { return !empty() && !o.empty() && begin < o.end && o.begin < end; }
};

class Judge {
 public:
  explicit Judge(bool gpu_present) : gpu_present_(gpu_present) {}

  void add(const std::string& argument, const std::string& rule, jf_status status = JF_ERR_INVALID_ARGUMENT,
           bool offsets_values = false) {
    verdict_.violations.push_back({argument, status, offsets_values, rule});
  }
  Verdict take() { return std::move(verdict_); }

  // The problem and launch fields both directions share.
  void problem(const jf_problem& p, const jf_launch& l) {
    dtype_ = enum_value(p.dtype);
    device_ = enum_value(p.device);
    const int mask = enum_value(p.mask);
    elem_ = element_bytes(dtype_);
    if (dtype_ < JF_BF16 || dtype_ > JF_FP32) add("problem.dtype", "one of JF_BF16, JF_FP16, JF_FP32");
    if (device_ != JF_DEVICE_CPU && device_ != JF_DEVICE_CUDA)
      add("problem.device", "JF_DEVICE_CPU or _CUDA");
    if (device_ == JF_DEVICE_CUDA && !gpu_present_) add("problem.device", "CUDA without a CUDA device");
    on_gpu_ = device_ == JF_DEVICE_CUDA;
    // Any value: non-zero vouches for the pointers, and the library then asks nobody where they
    // live (the fuzzer never vouches falsely on a machine with a GPU: fuzz_main.cpp).
    pointers_vouched_ = l.caller_checked_pointers != 0;
    if (mask < JF_MASK_NONE || mask > JF_MASK_WINDOW) add("problem.mask", "one of the jf_mask values");

    if (p.batch_size < 0) add("problem.batch_size", ">= 0");
    // Pooled attention: q [Lq] shared by every sequence, no q_offsets, B * Lq output rows.
    pooled_ = p.pooled_q_rows > 0;
    if (p.pooled_q_rows < 0) add("problem.pooled_q_rows", ">= 0");
    if (pooled_) {
      if (p.q_offsets != nullptr) add("problem.q_offsets", "NULL when pooled");
      if (p.batch_size >= 0 && int64_t{p.batch_size} * p.pooled_q_rows > std::numeric_limits<int32_t>::max())
        add("problem.pooled_q_rows", "B * Lq output rows within int32");
      if (p.q.rows != p.pooled_q_rows) add("problem.q.rows", "pooled_q_rows when pooled");
    }
    if (p.q.heads <= 0) add("problem.q.heads", "> 0");
    if (p.k.heads <= 0) add("problem.k.heads", "> 0");
    if (p.q.heads > 0 && p.k.heads > 0 && p.q.heads % p.k.heads != 0)
      add("problem.k.heads", "divides q.heads");
    // Head dims: q's (and k's) any multiple of 8 from 8 to 256, v's one up to q's. Which head dims a
    // GPU call can run (a q head dim, a v head dim of its own) depends on the dtype, the direction,
    // the modifier and the GPU (jagflash.h, jagflash_query_backend): no fuzz call gets that far,
    // since each CUDA call holds host pointers (the offsets at least) and is refused for them, or
    // for the missing GPU, first.
    const int32_t d = p.q.head_dim, dv = p.v.head_dim;
    if (d < 8 || d > 256 || d % 8 != 0)
      add("problem.q.head_dim", "a multiple of 8 up to 256", JF_ERR_UNSUPPORTED);
    if (dv < 8 || dv > d || dv % 8 != 0)
      add("problem.v.head_dim", "a multiple of 8 up to q's", JF_ERR_UNSUPPORTED);
    for (const auto& [name, rows] : {std::pair<const char*, int64_t>{"problem.q.rows", p.q.rows},
                                     std::pair<const char*, int64_t>{"problem.k.rows", p.k.rows}})
      if (rows < 0 || rows > std::numeric_limits<int32_t>::max())
        add(name, "a row count int32 offsets can reach");
    tensor("problem.q", p.q, p.q.rows, p.q.heads, d);
    tensor("problem.k", p.k, p.k.rows, p.k.heads, d);
    tensor("problem.v", p.v, p.k.rows, p.k.heads, dv);

    if (mask == JF_MASK_WINDOW) {
      if (p.window_left < -1) add("problem.window_left", ">= -1 with JF_MASK_WINDOW");
      if (p.window_right < -1) add("problem.window_right", ">= -1 with JF_MASK_WINDOW");
    } else {
      if (p.window_left != -1) add("problem.window_left", "-1 without JF_MASK_WINDOW");
      if (p.window_right != -1) add("problem.window_right", "-1 without JF_MASK_WINDOW");
    }
    if (!std::isfinite(p.scale)) add("problem.scale", "finite");
    score_mod(p);
    sinks(p);

    const int offsets_check = enum_value(l.offsets_check);
    if (offsets_check != JF_CHECK_OFFSETS_HOST && offsets_check != JF_CHECK_OFFSETS_DEVICE)
      add("launch.offsets_check", "one of the jf_offsets_check values");
    const int backend = enum_value(l.backend);
    if (backend < JF_BACKEND_AUTO || backend > JF_BACKEND_HOPPER) add("launch.backend", "a jf_backend value");
    if (backend == JF_BACKEND_REFERENCE && device_ != JF_DEVICE_CPU)
      add("launch.backend", "REFERENCE on the CPU");
    if ((backend == JF_BACKEND_ORACLE || backend == JF_BACKEND_HOPPER) && device_ != JF_DEVICE_CUDA)
      add("launch.backend", "a GPU backend on the GPU");
    if (l.max_seqlen_hint < 0) add("launch.max_seqlen_hint", ">= 0");
    // The workspace: a CPU call needs none, so any workspace is accepted (and left alone).

    if (!pooled_) offsets("problem.q_offsets", p.q_offsets, p.batch_size, p.q.rows);
    offsets("problem.kv_offsets", p.kv_offsets, p.batch_size, p.k.rows);
    pointer("launch.workspace", l.workspace);
  }

  // A [rows, heads, head_dim] view: shape as the problem says, strides that keep (row, head)
  // slices apart, data non-null with rows and aligned to the element, a span an address can hold.
  void tensor(const std::string& name, const jf_tensor& t, int64_t rows, int32_t heads, int32_t head_dim) {
    if (t.rows != rows) add(name + ".rows", "the problem's row count");
    if (t.heads != heads) add(name + ".heads", "the problem's head count");
    if (t.head_dim != head_dim) add(name + ".head_dim", "q's head dim");
    if (t.head_stride < head_dim) add(name + ".head_stride", ">= head_dim");
    const __int128 min_row_stride = static_cast<__int128>(heads - int64_t{1}) * t.head_stride + head_dim;
    if (heads > 0 && t.row_stride < min_row_stride)
      add(name + ".row_stride", ">= (heads-1)*head_stride + head_dim");
    if (rows > 0 && t.data == nullptr) add(name + ".data", "non-null with rows");
    const auto address = reinterpret_cast<uintptr_t>(t.data);
    if (address % static_cast<uintptr_t>(elem_) != 0) add(name + ".data", "aligned to the element size");
    if (on_gpu_) {
      const int64_t unit = 16 / elem_;
      if (address % 16 != 0) add(name + ".data", "16-byte aligned on the GPU");
      if (t.row_stride % unit != 0) add(name + ".row_stride", "16-byte multiple on the GPU");
      if (t.heads > 1 && t.head_stride % unit != 0) add(name + ".head_stride", "16-byte multiple on the GPU");
    }
    pointer(name + ".data", t.data);
    // The bytes from the first element to one past the last must fit in an address space
    // (int64): larger strides describe memory no caller can have.
    if (t.rows > 0 && t.heads > 0 && t.head_dim > 0 && view_bytes(t, elem_) < 0) {
      add(name + ".row_stride", "a view that fits in memory");
      add(name + ".head_stride", "a view that fits in memory");
    }
  }

  // The score modifier: a jf_score_mod value; with SOFTCAP a cap that is finite and > 0, else a
  // cap of 0; with ALIBI slopes that are non-null, float-aligned and (on the GPU) device memory,
  // else NULL. Their values: head_values.
  void score_mod(const jf_problem& p) {
    const int kind = enum_value(p.score_mod);
    if (!ScoreModTypes::contains(static_cast<jf_score_mod>(kind))) {
      add("problem.score_mod", "one of the jf_score_mod values");
      return;
    }
    // The table: only a kind that reads one (none the fuzzer picks) takes it.
    bool reads_table = false;
    ScoreModTypes::visit(p.score_mod,
                         [&](auto mod) { reads_table = (decltype(mod)::kFields & kTableField) != 0; });
    if (!reads_table && p.score_mod_table != nullptr)
      add("problem.score_mod_table", "NULL without a table's kind");
    if (!reads_table && p.score_mod_table_width != 0)
      add("problem.score_mod_table_width", "0 without a table's kind");
    if (reads_table) {
      if (p.score_mod_table == nullptr) add("problem.score_mod_table", "non-null with a table's kind");
      if (p.score_mod_table_width <= 0) add("problem.score_mod_table_width", "> 0 with a table's kind");
      // The kind's own check of its values (core/score_mod.hpp), as the caller reads its contract.
      ScoreModTypes::visit(p.score_mod, [&](auto mod) {
        const ScoreModCheck c = decltype(mod)::check(p);
        if (c.argument != nullptr) add(c.argument, c.expected);
      });
      if (reinterpret_cast<uintptr_t>(p.score_mod_table) % alignof(float) != 0)
        add("problem.score_mod_table", "4-byte aligned (float32)");
      pointer("problem.score_mod_table", p.score_mod_table);
    }
    if (kind == JF_SCORE_MOD_SOFTCAP) {
      if (!std::isfinite(p.softcap) || !(p.softcap > 0.0f))
        add("problem.softcap", "finite and > 0 with JF_SCORE_MOD_SOFTCAP");
    } else if (p.softcap != 0.0f) {  // NaN included; -0 is 0
      add("problem.softcap", "0 without JF_SCORE_MOD_SOFTCAP");
    }
    if (kind == JF_SCORE_MOD_ALIBI) {
      if (p.alibi_slopes == nullptr) add("problem.alibi_slopes", "non-null with JF_SCORE_MOD_ALIBI");
      if (reinterpret_cast<uintptr_t>(p.alibi_slopes) % alignof(float) != 0)
        add("problem.alibi_slopes", "4-byte aligned (float32)");
      pointer("problem.alibi_slopes", p.alibi_slopes);
    } else if (p.alibi_slopes != nullptr) {
      add("problem.alibi_slopes", "NULL without JF_SCORE_MOD_ALIBI");
    }
  }

  // The learnable sinks: NULL (none), or one float32 per query head, 4-byte aligned and (on the
  // GPU) device memory, whatever the modifier. Their values: head_values.
  void sinks(const jf_problem& p) {
    if (reinterpret_cast<uintptr_t>(p.learnable_sink) % alignof(float) != 0)
      add("problem.learnable_sink", "4-byte aligned (float32)");
    pointer("problem.learnable_sink", p.learnable_sink);
  }

  // The backward's dlearnable_sink: NULL (not wanted), or, with sinks only, one float32 per query
  // head, 4-byte aligned and (on the GPU) device memory. Where it may lie: disjoint().
  void sink_gradient(const jf_bwd_args& a) {
    if (a.dlearnable_sink != nullptr && a.problem.learnable_sink == nullptr)
      add("dlearnable_sink", "NULL without problem.learnable_sink");
    if (reinterpret_cast<uintptr_t>(a.dlearnable_sink) % alignof(float) != 0)
      add("dlearnable_sink", "4-byte aligned (float32)");
    pointer("dlearnable_sink", a.dlearnable_sink);
  }

  // On the CPU the sinks' and the slopes' values must be finite (a sink of +inf would zero every
  // row, one of -inf is no sink). The library reads them last, once every other rule holds, so
  // they are read here only then, and only where memory backs them (an unbacked call gets broken
  // offsets, which the library reads first); a workspace query never reads them (a values rule,
  // as the offsets').
  void head_values(const jf_problem& p) {
    if (!verdict_.violations.empty() || device_ != JF_DEVICE_CPU) return;
    if (p.learnable_sink != nullptr) finite_per_head("problem.learnable_sink", p.learnable_sink, p.q.heads);
    if (enum_value(p.score_mod) == JF_SCORE_MOD_ALIBI)
      finite_per_head("problem.alibi_slopes", p.alibi_slopes, p.q.heads);
  }

  Span span(const jf_tensor& t) const {
    const int64_t bytes = t.data == nullptr ? 0 : view_bytes(t, elem_);
    if (bytes <= 0) return {};  // no elements, or broken fields another rule already names
    const auto b = reinterpret_cast<uintptr_t>(t.data);
    return {b, b + static_cast<uintptr_t>(bytes)};
  }
  // Rows of out, dout and lse: B * Lq when pooled, else q.rows.
  int64_t out_rows(const jf_problem& p) const {
    return pooled_ ? int64_t{std::max(p.batch_size, 0)} * p.pooled_q_rows : p.q.rows;
  }
  Span lse_span(const void* lse, const jf_problem& p) const {
    if (lse == nullptr || p.q.heads <= 0 || out_rows(p) <= 0) return {};
    const __int128 bytes = static_cast<__int128>(p.q.heads) * out_rows(p) * 4;
    if (bytes > kI64Max) return {};
    const auto b = reinterpret_cast<uintptr_t>(lse);
    return {b, b + static_cast<uintptr_t>(bytes)};
  }
  // One float per query head: ALiBi's slopes and the sinks (inputs like q, which outputs must not
  // overlap), the sinks' gradient (an output).
  Span head_floats_span(const float* f, const jf_problem& p) const {
    if (f == nullptr || p.q.heads <= 0) return {};
    const auto b = reinterpret_cast<uintptr_t>(f);
    return {b, b + static_cast<uintptr_t>(p.q.heads) * sizeof(float)};
  }
  Span offsets_span(const int32_t* o, int32_t batch_size) const {
    if (o == nullptr || batch_size < 0) return {};
    const auto b = reinterpret_cast<uintptr_t>(o);
    return {b, b + (static_cast<uintptr_t>(batch_size) + 1) * sizeof(int32_t)};
  }

  // lse: float32, so 4-byte aligned like every float the caller passes.
  void lse(const void* lse) {
    if (reinterpret_cast<uintptr_t>(lse) % alignof(float) != 0) add("lse", "4-byte aligned (float32)");
    pointer("lse", lse);
  }

  // Outputs must be disjoint from each other and from every input, the offsets included: a write
  // through one would change what another reads.
  void disjoint(const std::vector<std::pair<std::string, Span>>& outputs,
                const std::vector<std::pair<std::string, Span>>& inputs) {
    for (size_t i = 0; i < outputs.size(); ++i) {
      for (size_t j = i + 1; j < outputs.size(); ++j)
        if (outputs[i].second.overlaps(outputs[j].second)) {
          add(outputs[i].first, "disjoint from " + outputs[j].first);
          add(outputs[j].first, "disjoint from " + outputs[i].first);
        }
      for (const auto& in : inputs)
        if (outputs[i].second.overlaps(in.second))
          add(outputs[i].first, "disjoint from the input " + in.first);
    }
  }

 private:
  void finite_per_head(const char* name, const float* values, int32_t heads) {
    for (int32_t h = 0; h < heads; ++h)
      if (!std::isfinite(values[h])) {
        add(name, "finite values on the CPU", JF_ERR_INVALID_ARGUMENT, true);
        return;
      }
  }

  // Offsets: int32 [B+1] (4-byte aligned), [0] == 0, non-decreasing, [B] == the row count.
  void offsets(const std::string& name, const int32_t* o, int32_t batch_size, int64_t rows) {
    if (o == nullptr) {
      add(name, "non-null");
      return;
    }
    if (reinterpret_cast<uintptr_t>(o) % alignof(int32_t) != 0) add(name, "4-byte aligned (int32)");
    pointer(name, o);
    if (batch_size < 0) return;
    auto at = [&](int32_t i) {  // o may be misaligned: read it as bytes
      int32_t v;
      std::memcpy(&v, reinterpret_cast<const unsigned char*>(o) + static_cast<size_t>(i) * sizeof v,
                  sizeof v);
      return v;
    };
    if (at(0) != 0) add(name, "[0] == 0", JF_ERR_INVALID_ARGUMENT, true);
    for (int32_t b = 0; b < batch_size; ++b)
      if (at(b + 1) < at(b)) {
        add(name, "non-decreasing", JF_ERR_INVALID_ARGUMENT, true);
        break;
      }
    if (at(batch_size) != rows) add(name, "[B] == rows", JF_ERR_INVALID_ARGUMENT, true);
  }

  // On the GPU every pointer must be device memory; the fuzzer's are all host memory.
  void pointer(const std::string& name, const void* p) {
    if (on_gpu_ && gpu_present_ && !pointers_vouched_ && p != nullptr)
      add(name, "a device pointer on the GPU");
  }

  bool gpu_present_;
  bool on_gpu_ = false;
  bool pointers_vouched_ = false;
  bool pooled_ = false;
  int dtype_ = 0, device_ = 0, elem_ = 2;
  Verdict verdict_;
};

}  // namespace

bool Verdict::query_valid() const {
  for (const Violation& v : violations)
    if (!v.offsets_values) return false;
  return true;
}

const Violation* Verdict::named_by(const std::string& message, jf_status status, bool query) const {
  const size_t colon = message.find(": ");
  if (colon == std::string::npos) return nullptr;
  const std::string argument = message.substr(0, colon);
  for (const Violation& v : violations) {
    if (query && v.offsets_values) continue;
    if (v.status != status) continue;
    const bool same = argument == v.argument;
    const bool indexed = argument.size() > v.argument.size() &&
                         argument.compare(0, v.argument.size(), v.argument) == 0 &&
                         argument[v.argument.size()] == '[';
    if (same || indexed) return &v;
  }
  return nullptr;
}

std::string Verdict::list(bool query) const {
  std::ostringstream s;
  bool first = true;
  for (const Violation& v : violations) {
    if (query && v.offsets_values) continue;
    s << (first ? "" : "; ") << v.argument << " (" << v.rule << ")";
    first = false;
  }
  return first ? "none" : s.str();
}

Verdict judge_forward(const jf_fwd_args* a, bool bytes_null, bool gpu_present, bool backed) {
  Judge j(gpu_present);
  if (a == nullptr) j.add("args", "non-null");
  if (bytes_null) j.add("bytes", "non-null");
  if (a == nullptr) return j.take();
  const jf_problem& p = a->problem;
  j.problem(p, a->launch);
  j.tensor("out", a->out, j.out_rows(p), p.q.heads, p.v.head_dim);
  j.lse(a->lse);
  j.disjoint({{"out", j.span(a->out)}, {"lse", j.lse_span(a->lse, p)}},
             {{"problem.q", j.span(p.q)},
              {"problem.k", j.span(p.k)},
              {"problem.v", j.span(p.v)},
              {"problem.q_offsets", j.offsets_span(p.q_offsets, p.batch_size)},
              {"problem.kv_offsets", j.offsets_span(p.kv_offsets, p.batch_size)},
              {"problem.alibi_slopes", j.head_floats_span(p.alibi_slopes, p)},
              {"problem.learnable_sink", j.head_floats_span(p.learnable_sink, p)}});
  if (backed) j.head_values(p);
  return j.take();
}

Verdict judge_backward(const jf_bwd_args* a, bool bytes_null, bool gpu_present, bool backed) {
  Judge j(gpu_present);
  if (a == nullptr) j.add("args", "non-null");
  if (bytes_null) j.add("bytes", "non-null");
  if (a == nullptr) return j.take();
  const jf_problem& p = a->problem;
  j.problem(p, a->launch);
  j.tensor("out", a->out, j.out_rows(p), p.q.heads, p.v.head_dim);
  j.tensor("dout", a->dout, j.out_rows(p), p.q.heads, p.v.head_dim);
  j.tensor("dq", a->dq, p.q.rows, p.q.heads, p.q.head_dim);
  j.tensor("dk", a->dk, p.k.rows, p.k.heads, p.q.head_dim);
  j.tensor("dv", a->dv, p.k.rows, p.k.heads, p.v.head_dim);
  if (a->lse == nullptr && j.out_rows(p) > 0) j.add("lse", "the forward's lse (required)");
  j.lse(a->lse);
  j.sink_gradient(*a);
  j.disjoint({{"dq", j.span(a->dq)},
              {"dk", j.span(a->dk)},
              {"dv", j.span(a->dv)},
              {"dlearnable_sink", j.head_floats_span(a->dlearnable_sink, p)}},
             {{"problem.q", j.span(p.q)},
              {"problem.k", j.span(p.k)},
              {"problem.v", j.span(p.v)},
              {"out", j.span(a->out)},
              {"dout", j.span(a->dout)},
              {"lse", j.lse_span(a->lse, p)},
              {"problem.q_offsets", j.offsets_span(p.q_offsets, p.batch_size)},
              {"problem.kv_offsets", j.offsets_span(p.kv_offsets, p.batch_size)},
              {"problem.alibi_slopes", j.head_floats_span(p.alibi_slopes, p)},
              {"problem.learnable_sink", j.head_floats_span(p.learnable_sink, p)}});
  if (backed) j.head_values(p);
  return j.take();
}

}  // namespace jagflash::fuzz
