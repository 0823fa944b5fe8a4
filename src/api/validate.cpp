#include "api/validate.hpp"

#include "api/device_error.hpp"
#include "api/error.hpp"
#include "core/block_mask.hpp"
#include "core/dtype.hpp"
#include "core/pooled.hpp"
#include "core/score_mod.hpp"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <array>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace jagflash::detail {
namespace {

constexpr int64_t kMaxTokens = std::numeric_limits<int32_t>::max();
// TMA (the Hopper kernels' loads) needs 16-byte aligned bases and strides; the GPU path enforces
// it for every backend so a caller's layout never works on one backend and fails on another.
constexpr size_t kGpuAlignBytes = 16;
constexpr int32_t kMinHeadDim = 8, kMaxHeadDim = 256, kHeadDimStep = 8;

const char* device_name(jf_device d) { return d == JF_DEVICE_CUDA ? "JF_DEVICE_CUDA" : "JF_DEVICE_CPU"; }

// a * b + c, or false when it (or a * b) does not fit in int64: signed overflow is undefined, and
// strides and row counts come from the caller.
bool checked_mul_add(int64_t a, int64_t b, int64_t c, int64_t* result) {
  int64_t product = 0;
  return !__builtin_mul_overflow(a, b, &product) && !__builtin_add_overflow(product, c, result);
}

// A C caller may store any int in an enum field (C allows it), but loading a value outside the
// enumeration's range through the enum type is undefined in C++: the field is read as an int
// until it has been checked.
template <typename E>
void check_enum(const char* name, const E& field, int lo, int hi, const char* expected) {
  static_assert(sizeof(E) == sizeof(int), "the jf_* enums are int-sized");
  int value = 0;
  std::memcpy(&value, &field, sizeof value);
  if (value < lo || value > hi) fail_argument(name, expected, value);
}

// "JF_SCORE_MOD_" and a modifier's name in capitals: its enum value's name in jagflash.h.
std::string score_mod_enum_name(const char* name) {
  std::string e = "JF_SCORE_MOD_";
  for (const char* c = name; *c != '\0'; ++c)
    e += static_cast<char>(std::toupper(static_cast<unsigned char>(*c)));
  return e;
}

// One of ScoreModTypes (core/score_mod.hpp), read as an int as check_enum reads.
void check_score_mod_kind(const jf_score_mod& field) {
  int value = 0;
  std::memcpy(&value, &field, sizeof value);
  std::string known;
  ScoreModTypes::for_each([&](auto mod) {
    known += (known.empty() ? "one of " : ", ") + score_mod_enum_name(decltype(mod)::kName);
  });
  if (!ScoreModTypes::contains(static_cast<jf_score_mod>(value)))
    fail_argument("problem.score_mod", known, value);
}

// q's (and k's) head dim: any multiple of 8 up to 256, as FlashAttention-2 takes. v's may be
// smaller (DeepSeek's 192 / 128): out, dout and dv then have v's.
void check_head_dims(const jf_problem& p) {
  const int32_t d = p.q.head_dim, dv = p.v.head_dim;
  if (d < kMinHeadDim || d > kMaxHeadDim || d % kHeadDimStep != 0)
    fail_argument("problem.q.head_dim", "a multiple of 8 from 8 to 256", d, JF_ERR_UNSUPPORTED);
  if (dv < kMinHeadDim || dv > d || dv % kHeadDimStep != 0) {
    std::ostringstream e;
    e << "a multiple of 8 from 8 to q's head dim (" << d << ")";
    fail_argument("problem.v.head_dim", e.str(), dv, JF_ERR_UNSUPPORTED);
  }
}

// lse (float) and the offsets (int32) are read and written as their type: a pointer that is not
// aligned to it would be undefined behaviour on the CPU and a misaligned access on the GPU.
void check_aligned(const char* name, const void* p, size_t align, const char* type) {
  if (reinterpret_cast<uintptr_t>(p) % align != 0)
    fail_argument(name, std::to_string(align) + "-byte alignment (" + type + ")", p);
}

// `ask`: false when the caller vouched for every pointer (launch.caller_checked_pointers).
void check_pointer_location(const std::string& name, const void* p, jf_device device, bool ask) {
  if (p == nullptr || !ask) return;
  const bool on_device = is_device_pointer(p);
  if (device == JF_DEVICE_CUDA && !on_device)
    fail_argument(name, "a CUDA device pointer (problem.device = JF_DEVICE_CUDA)", "a host pointer");
  if (device == JF_DEVICE_CPU && on_device)
    fail_argument(name, "a host pointer (problem.device = JF_DEVICE_CPU)", "a CUDA device pointer");
}

// The kinds that read a modifier field (ScoreModField), for the hint of a field set without one.
std::string score_mod_readers(unsigned field) {
  std::string readers;
  ScoreModTypes::for_each([&](auto mod) {
    if ((decltype(mod)::kFields & field) == 0) return;
    readers += (readers.empty() ? "" : " or ") + score_mod_enum_name(decltype(mod)::kName);
  });
  return readers;
}

// jf_problem's modifier fields, each with its ScoreModField bit, its unset value and the value
// given as a message writes it: the unset rule and the kinds' own checks read this one list.
struct ScoreModFieldValue {
  unsigned field;
  const char* argument;
  const char* unset;
  bool is_set;
  std::string given;
};
std::array<ScoreModFieldValue, 4> score_mod_field_values(const jf_problem& p) {
  auto text = [](const auto& value) {
    std::ostringstream t;
    t << value;
    return t.str();
  };
  auto pointer = [&](const void* q) { return q == nullptr ? std::string("NULL") : text(q); };
  return {{
      {kSoftcapField, "problem.softcap", "0", p.softcap != 0.0f, text(p.softcap)},  // -0 is 0; NaN is not
      {kAlibiSlopesField, "problem.alibi_slopes", "NULL", p.alibi_slopes != nullptr, pointer(p.alibi_slopes)},
      {kTableField, "problem.score_mod_table", "NULL", p.score_mod_table != nullptr,
       pointer(p.score_mod_table)},
      {kTableField, "problem.score_mod_table_width", "0", p.score_mod_table_width != 0,
       text(p.score_mod_table_width)},
  }};
}

// A modifier's float32 values (rows x columns, row-major) in host memory: each finite, since a NaN
// or an infinity there makes every score it touches NaN (out NaN with no error). Read on the host
// only: on the GPU it would cost a copy and a sync per call.
void check_finite_host_values(const char* name, const float* values, int64_t rows, int64_t columns) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < columns; ++c) {
      const float value = values[r * columns + c];
      if (std::isfinite(value)) continue;
      std::ostringstream argument;
      argument << name << "[" << r << "]";
      if (columns > 1) argument << "[" << c << "]";
      fail_argument(argument.str(), "a finite number", value);
    }
  }
}

// The score modifier's fields (core/score_mod.hpp): the kind's own as its check requires, every
// other one unset (0, NULL), so a value given by mistake is never silently ignored. The kind has
// been checked to be one of ScoreModTypes.
void check_score_mod(const jf_problem& p, bool ask_location) {
  const std::array<ScoreModFieldValue, 4> fields = score_mod_field_values(p);
  ScoreModTypes::visit(p.score_mod, [&](auto mod) {
    using Mod = decltype(mod);
    const std::string kind = score_mod_enum_name(Mod::kName);
    for (const ScoreModFieldValue& f : fields)
      if (f.is_set && (Mod::kFields & f.field) == 0)
        fail_argument(
            f.argument,
            std::string(f.unset) + " with " + kind + " (it is " + score_mod_readers(f.field) + "'s)",
            f.given);
    if ((Mod::kFields & kTableField) != 0) {
      if (p.score_mod_table == nullptr)
        fail_argument("problem.score_mod_table",
                      "a non-null pointer to H x score_mod_table_width float32 with " + kind, "NULL");
      if (p.score_mod_table_width <= 0)
        fail_argument("problem.score_mod_table_width", "> 0 with " + kind, p.score_mod_table_width);
    }
    const ScoreModCheck c = Mod::check(p);
    if (c.argument != nullptr) {
      for (const ScoreModFieldValue& f : fields)
        if (std::strcmp(f.argument, c.argument) == 0) fail_argument(f.argument, c.expected, f.given);
      fail_argument(c.argument, c.expected, "a value outside jf_problem's modifier fields");
    }
    if ((Mod::kFields & kAlibiSlopesField) != 0) {
      check_aligned("problem.alibi_slopes", p.alibi_slopes, alignof(float), "float32");
      check_pointer_location("problem.alibi_slopes", p.alibi_slopes, p.device, ask_location);
    }
    if ((Mod::kFields & kTableField) != 0) {
      check_aligned("problem.score_mod_table", p.score_mod_table, alignof(float), "float32");
      check_pointer_location("problem.score_mod_table", p.score_mod_table, p.device, ask_location);
    }
  });
}

// The block-sparse map (jf_block_mask): both pointers or neither, so half a map is never silently
// taken for none; bytes, the buffer's size, 0 without a map and never negative; the offsets are
// read as int32; both live where q does. The offsets' values, offsets[B] <= bytes among them, are
// checked with the other offsets (check_offsets, or the device check).
void check_block_mask(const jf_problem& p, bool ask_location) {
  const jf_block_mask& m = p.block_mask;
  if (m.blocks == nullptr && m.offsets != nullptr)
    fail_argument("problem.block_mask.blocks",
                  "a non-null pointer to the maps' bytes with problem.block_mask.offsets set (both NULL: "
                  "no block mask)",
                  "NULL");
  if (m.blocks != nullptr && m.offsets == nullptr)
    fail_argument("problem.block_mask.offsets",
                  "a non-null pointer to B+1 int32 with problem.block_mask.blocks set (both NULL: no "
                  "block mask)",
                  "NULL");
  if (m.blocks == nullptr && m.bytes != 0)
    fail_argument("problem.block_mask.bytes", "0 with problem.block_mask.blocks NULL (no block mask)",
                  m.bytes);
  if (m.bytes < 0)
    fail_argument("problem.block_mask.bytes", ">= 0 (the size of the buffer at problem.block_mask.blocks)",
                  m.bytes);
  if (m.blocks == nullptr) return;
  if (static_cast<uint64_t>(m.bytes) >
      std::numeric_limits<uintptr_t>::max() - reinterpret_cast<uintptr_t>(m.blocks))
    fail_argument("problem.block_mask.bytes", "a buffer within the address space", m.bytes);
  if (is_pooled(p))
    fail_argument("problem.block_mask",
                  "none (blocks and offsets NULL) with pooled attention (pooled_q_rows > 0)", "a block mask",
                  JF_ERR_UNSUPPORTED);
  check_aligned("problem.block_mask.offsets", m.offsets, alignof(int32_t), "int32");
  check_pointer_location("problem.block_mask.blocks", m.blocks, p.device, ask_location);
  check_pointer_location("problem.block_mask.offsets", m.offsets, p.device, ask_location);
}

struct ByteRange {
  uintptr_t begin = 0;
  uintptr_t end = 0;  // one past the last byte
  bool empty() const { return begin == end; }
};

ByteRange byte_range(const jf_tensor& t, jf_dtype dtype) {
  if (t.data == nullptr || t.rows == 0) return {};
  const int64_t last = (t.rows - 1) * t.row_stride + (t.heads - 1) * t.head_stride + t.head_dim;
  const auto begin = reinterpret_cast<uintptr_t>(t.data);
  return {begin, begin + static_cast<uintptr_t>(last) * dtype_size(dtype)};
}

bool overlaps(ByteRange a, ByteRange b) {
  return !a.empty() && !b.empty() && a.begin < b.end && b.begin < a.end;
}

// A [rows, heads, head_dim] view: shape as expected, strides that keep (row, head) slices
// apart, pointer non-null when there is data, alignment on the GPU.
void check_tensor(const std::string& name, const jf_tensor& t, int64_t rows, int32_t heads, int32_t head_dim,
                  const jf_problem& p, bool ask_location) {
  if (t.rows != rows) fail_argument(name + ".rows", rows, t.rows);
  if (t.heads != heads) fail_argument(name + ".heads", heads, t.heads);
  if (t.head_dim != head_dim) fail_argument(name + ".head_dim", head_dim, t.head_dim);
  if (t.head_stride < head_dim) {
    std::ostringstream e;
    e << ">= head_dim (" << head_dim << ")";
    fail_argument(name + ".head_stride", e.str(), t.head_stride);
  }
  int64_t min_row_stride = 0;  // also the elements a row's heads span
  const bool representable = checked_mul_add(heads - 1, t.head_stride, head_dim, &min_row_stride);
  if (!representable || t.row_stride < min_row_stride) {
    std::ostringstream e;
    e << ">= (heads-1)*head_stride + head_dim = ";
    if (representable)
      e << min_row_stride;
    else
      e << "more than int64 holds";
    fail_argument(name + ".row_stride", e.str(), t.row_stride);
  }
  // The view's bytes, from data to one past its last element, must fit in int64 (the overlap
  // checks compute them): larger strides describe more memory than any caller has.
  int64_t last = 0, span_bytes = 0;
  if (rows > 0 && (!checked_mul_add(rows - 1, t.row_stride, min_row_stride, &last) ||
                   __builtin_mul_overflow(last, static_cast<int64_t>(dtype_size(p.dtype)), &span_bytes))) {
    std::ostringstream e;
    e << "a view that fits in memory ((rows-1)*row_stride + (heads-1)*head_stride + head_dim elements of "
      << dtype_size(p.dtype) << " bytes within int64, rows = " << rows << ")";
    fail_argument(name + ".row_stride", e.str(), t.row_stride);
  }
  if (rows > 0 && t.data == nullptr) fail_argument(name + ".data", "a non-null pointer", "NULL");
  const size_t elem = dtype_size(p.dtype);
  if (reinterpret_cast<uintptr_t>(t.data) % elem != 0)
    fail_argument(name + ".data", std::to_string(elem) + "-byte alignment", t.data);
  if (p.device == JF_DEVICE_CUDA) {
    if (reinterpret_cast<uintptr_t>(t.data) % kGpuAlignBytes != 0)
      fail_argument(name + ".data", "16-byte alignment on the GPU", t.data);
    const int64_t stride_unit = static_cast<int64_t>(kGpuAlignBytes / elem);
    if (t.row_stride % stride_unit != 0)
      fail_argument(name + ".row_stride",
                    "a multiple of " + std::to_string(stride_unit) + " elements (16 bytes) on the GPU",
                    t.row_stride);
    if (heads > 1 && t.head_stride % stride_unit != 0)
      fail_argument(name + ".head_stride",
                    "a multiple of " + std::to_string(stride_unit) + " elements (16 bytes) on the GPU",
                    t.head_stride);
  }
  check_pointer_location(name + ".data", t.data, p.device, ask_location);
}

// Whether a call asks the driver where its pointers live (read as an int32, any value: like
// reuse_plan and deterministic, non-zero means yes to the caller's claim).
bool ask_locations(const jf_launch& l) { return l.caller_checked_pointers == 0; }

void check_problem(const jf_problem& p, bool ask_location) {
  check_enum("problem.dtype", p.dtype, JF_BF16, JF_FP32, "JF_BF16, JF_FP16 or JF_FP32");
  check_enum("problem.device", p.device, JF_DEVICE_CPU, JF_DEVICE_CUDA, "JF_DEVICE_CPU or JF_DEVICE_CUDA");
  check_enum("problem.mask", p.mask, JF_MASK_NONE, JF_MASK_WINDOW,
             "JF_MASK_NONE, JF_MASK_CAUSAL or JF_MASK_WINDOW");
  check_score_mod_kind(p.score_mod);
  // Head dims first: what no path serves on the device asked for is said as such, also in a
  // process that sees no GPU (where the device check below would refuse it anyway).
  check_head_dims(p);
  if (p.device == JF_DEVICE_CUDA && jagflash_cuda_device_count() == 0)
    fail_argument("problem.device", "JF_DEVICE_CPU (this process sees no CUDA device)", "JF_DEVICE_CUDA");
  if (p.batch_size < 0) fail_argument("problem.batch_size", ">= 0", p.batch_size);
  if (p.pooled_q_rows < 0)
    fail_argument("problem.pooled_q_rows", ">= 0 (0 = ordinary attention, Lq > 0 = pooled)", p.pooled_q_rows);
  if (is_pooled(p)) {
    // Sequence b's query rows are b*Lq .. (b+1)*Lq - 1 by construction: no q offsets to read.
    if (p.q_offsets != nullptr)
      fail_argument("problem.q_offsets", "NULL when problem.pooled_q_rows > 0 (pooled attention)",
                    "a non-null pointer");
    if (output_rows(p) > kMaxTokens) {
      std::ostringstream e, g;
      e << "batch_size * pooled_q_rows (the output rows) <= 2^31-1 (batch_size = " << p.batch_size << ")";
      g << p.pooled_q_rows << " (" << output_rows(p) << " output rows)";
      fail_argument("problem.pooled_q_rows", e.str(), g.str());
    }
  } else if (p.q_offsets == nullptr) {
    fail_argument("problem.q_offsets", "a non-null pointer to B+1 int32", "NULL");
  }
  if (p.kv_offsets == nullptr) fail_argument("problem.kv_offsets", "a non-null pointer to B+1 int32", "NULL");
  check_aligned("problem.q_offsets", p.q_offsets, alignof(int32_t), "int32");
  check_aligned("problem.kv_offsets", p.kv_offsets, alignof(int32_t), "int32");

  if (p.q.heads <= 0) fail_argument("problem.q.heads", "> 0", p.q.heads);
  if (p.k.heads <= 0) fail_argument("problem.k.heads", "> 0", p.k.heads);
  if (p.q.heads % p.k.heads != 0) {
    std::ostringstream e;
    e << "a divisor of q.heads (" << p.q.heads << ")";
    fail_argument("problem.k.heads", e.str(), p.k.heads);
  }
  if (p.q.rows < 0 || p.q.rows > kMaxTokens) fail_argument("problem.q.rows", "in [0, 2^31-1]", p.q.rows);
  if (is_pooled(p) && p.q.rows != p.pooled_q_rows) {
    std::ostringstream e;
    e << "problem.pooled_q_rows (" << p.pooled_q_rows << "): pooled q is [Lq, H, D]";
    fail_argument("problem.q.rows", e.str(), p.q.rows);
  }
  if (p.k.rows < 0 || p.k.rows > kMaxTokens) fail_argument("problem.k.rows", "in [0, 2^31-1]", p.k.rows);

  const int32_t h = p.q.heads, h_kv = p.k.heads, d = p.q.head_dim;
  check_tensor("problem.q", p.q, p.q.rows, h, d, p, ask_location);
  check_tensor("problem.k", p.k, p.k.rows, h_kv, d, p, ask_location);
  check_tensor("problem.v", p.v, p.k.rows, h_kv, p.v.head_dim, p, ask_location);

  if (p.mask == JF_MASK_WINDOW) {
    if (p.window_left < -1) fail_argument("problem.window_left", ">= -1 (-1 = unbounded)", p.window_left);
    if (p.window_right < -1) fail_argument("problem.window_right", ">= -1 (-1 = unbounded)", p.window_right);
  } else {
    const char* expected = p.mask == JF_MASK_CAUSAL
                               ? "-1 with JF_MASK_CAUSAL (use JF_MASK_WINDOW for a window)"
                               : "-1 with JF_MASK_NONE (use JF_MASK_WINDOW for a window)";
    if (p.window_left != -1) fail_argument("problem.window_left", expected, p.window_left);
    if (p.window_right != -1) fail_argument("problem.window_right", expected, p.window_right);
  }
  if (!std::isfinite(p.scale))
    fail_argument("problem.scale", "a finite number (0 = 1/sqrt(head_dim))", p.scale);
  check_score_mod(p, ask_location);
  check_block_mask(p, ask_location);
  check_aligned("problem.learnable_sink", p.learnable_sink, alignof(float), "float32");
  check_pointer_location("problem.learnable_sink", p.learnable_sink, p.device, ask_location);
  check_pointer_location("problem.q_offsets", p.q_offsets, p.device, ask_location);
  check_pointer_location("problem.kv_offsets", p.kv_offsets, p.device, ask_location);
}

void check_launch(const jf_launch& l, const jf_problem& p) {
  check_enum("launch.offsets_check", l.offsets_check, JF_CHECK_OFFSETS_HOST, JF_CHECK_OFFSETS_DEVICE,
             "JF_CHECK_OFFSETS_HOST or JF_CHECK_OFFSETS_DEVICE");
  check_enum("launch.backend", l.backend, JF_BACKEND_AUTO, JF_BACKEND_HOPPER,
             "JF_BACKEND_AUTO, JF_BACKEND_REFERENCE, JF_BACKEND_ORACLE or JF_BACKEND_HOPPER");
  if (l.backend == JF_BACKEND_REFERENCE && p.device != JF_DEVICE_CPU)
    fail_argument("launch.backend", "JF_BACKEND_REFERENCE only with problem.device = JF_DEVICE_CPU",
                  device_name(p.device));
  if ((l.backend == JF_BACKEND_ORACLE || l.backend == JF_BACKEND_HOPPER) && p.device != JF_DEVICE_CUDA)
    fail_argument("launch.backend", "a GPU backend only with problem.device = JF_DEVICE_CUDA",
                  device_name(p.device));
  if (l.max_seqlen_hint < 0) fail_argument("launch.max_seqlen_hint", ">= 0 (0 = unknown)", l.max_seqlen_hint);
}

void check_workspace(const jf_launch& l, const jf_problem& p, size_t needed) {
  if (needed == 0) return;
  if (l.workspace_bytes < needed)
    fail_argument("launch.workspace_bytes", ">= " + std::to_string(needed) + " (the queried size)",
                  l.workspace_bytes);
  if (l.workspace == nullptr) fail_argument("launch.workspace", "a non-null pointer", "NULL");
  if (reinterpret_cast<uintptr_t>(l.workspace) % 16 != 0)
    fail_argument("launch.workspace", "16-byte alignment", l.workspace);
  check_pointer_location("launch.workspace", l.workspace, p.device, ask_locations(l));
}

std::vector<int32_t> offsets_to_host(const int32_t* offsets, int32_t batch_size, const jf_problem& p,
                                     const jf_launch& l) {
  std::vector<int32_t> host(static_cast<size_t>(batch_size) + 1);
  if (p.device == JF_DEVICE_CPU) {
    std::copy(offsets, offsets + host.size(), host.begin());
    return host;
  }
  auto stream = static_cast<cudaStream_t>(l.stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  JF_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone)
    fail_argument("launch.offsets_check",
                  "JF_CHECK_OFFSETS_DEVICE while the stream is being captured (the host check syncs)",
                  "JF_CHECK_OFFSETS_HOST");
  JF_CUDA_CHECK(
      cudaMemcpyAsync(host.data(), offsets, host.size() * sizeof(int32_t), cudaMemcpyDeviceToHost, stream));
  JF_CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

// Last before a GPU call runs: an earlier call's failure that the device offsets check latched
// fails this one (which then runs nothing), so the caller hears of it without having synced.
void check_no_earlier_device_error(const jf_problem& p) {
  if (p.device != JF_DEVICE_CUDA) return;
  int device = 0;
  JF_CUDA_CHECK(cudaGetDevice(&device));
  report_latched_device_error(device);
}

// Checks the offsets on the host (CPU pointers, or JF_CHECK_OFFSETS_HOST: copied from the device,
// one sync per vector); the device check does it in a kernel instead.
void check_offsets(const jf_problem& p, const jf_launch& l) {
  if (p.device == JF_DEVICE_CUDA && l.offsets_check == JF_CHECK_OFFSETS_DEVICE) return;
  std::vector<int32_t> q_host;
  if (!is_pooled(p)) {  // pooled: no q offsets (NULL)
    q_host = offsets_to_host(p.q_offsets, p.batch_size, p, l);
    validate_host_offsets("problem.q_offsets", q_host.data(), p.batch_size, p.q.rows);
  }
  const std::vector<int32_t> kv_host = offsets_to_host(p.kv_offsets, p.batch_size, p, l);
  validate_host_offsets("problem.kv_offsets", kv_host.data(), p.batch_size, p.k.rows);
  if (p.block_mask.offsets == nullptr) return;  // never with pooled (check_block_mask)
  const std::vector<int32_t> map_host = offsets_to_host(p.block_mask.offsets, p.batch_size, p, l);
  validate_host_block_mask_offsets(map_host.data(), q_host.data(), kv_host.data(), p.batch_size,
                                   p.block_mask.bytes);
}

// On the CPU, the slopes' and the table's values (check_finite_host_values): read last, as the
// offsets are, once every field has been checked (pointers, sizes), and never by the workspace
// queries.
void check_score_mod_values(const jf_problem& p) {
  if (p.device != JF_DEVICE_CPU) return;
  // A sink of +inf would make every row's output 0 with no error; -inf is no sink, NaN is NaN.
  if (p.learnable_sink != nullptr)
    check_finite_host_values("problem.learnable_sink", p.learnable_sink, p.q.heads, 1);
  ScoreModTypes::visit(p.score_mod, [&](auto mod) {
    using Mod = decltype(mod);
    if ((Mod::kFields & kAlibiSlopesField) != 0)
      check_finite_host_values("problem.alibi_slopes", p.alibi_slopes, p.q.heads, 1);
    if ((Mod::kFields & kTableField) != 0)
      check_finite_host_values("problem.score_mod_table", p.score_mod_table, p.q.heads,
                               p.score_mod_table_width);
  });
}

using NamedRanges = std::vector<std::pair<std::string, ByteRange>>;

// Outputs must not overlap each other or any input: a kernel reading q while writing out over
// the same bytes would give a silently wrong result.
void check_no_overlap(const NamedRanges& outputs, const NamedRanges& inputs) {
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t j = 0; j < outputs.size(); ++j)
      if (i < j && overlaps(outputs[i].second, outputs[j].second))
        fail_argument(outputs[i].first, "memory disjoint from " + outputs[j].first, "an overlapping range");
    for (const auto& in : inputs)
      if (overlaps(outputs[i].second, in.second))
        fail_argument(outputs[i].first, "memory disjoint from the input " + in.first, "an overlapping range");
  }
}

ByteRange lse_range(const void* lse, int64_t heads, int64_t total_q) {
  if (lse == nullptr || heads * total_q == 0) return {};
  const auto b = reinterpret_cast<uintptr_t>(lse);
  return {b, b + static_cast<uintptr_t>(heads * total_q) * sizeof(float)};
}

// The block mask's whole buffer, [blocks, blocks + bytes): the offsets must keep within it
// (checked with them), so the kernels read no byte outside it.
ByteRange block_mask_range(const jf_block_mask& m) {
  if (m.blocks == nullptr || m.bytes <= 0) return {};
  const auto b = reinterpret_cast<uintptr_t>(m.blocks);
  return {b, b + static_cast<uintptr_t>(m.bytes)};
}

// The offsets are inputs too: the implementations read them while they write the outputs.
ByteRange offsets_range(const int32_t* offsets, int32_t batch_size) {
  if (offsets == nullptr) return {};  // pooled attention's q_offsets
  const auto b = reinterpret_cast<uintptr_t>(offsets);
  return {b, b + (static_cast<uintptr_t>(batch_size) + 1) * sizeof(int32_t)};
}

// The call writes the workspace's first `needed` bytes (scratch, plan, device error flag) while
// it reads the inputs and writes the outputs: those bytes must be disjoint from all of them.
void check_workspace_disjoint(const jf_launch& l, size_t needed, const NamedRanges& outputs,
                              const NamedRanges& inputs) {
  if (needed == 0 || l.workspace == nullptr) return;
  const auto b = reinterpret_cast<uintptr_t>(l.workspace);
  if (b > std::numeric_limits<uintptr_t>::max() - needed)
    fail_argument("launch.workspace", "a buffer of the queried size within the address space", l.workspace);
  const ByteRange ws{b, b + needed};
  for (const NamedRanges* list : {&outputs, &inputs})
    for (const auto& r : *list)
      if (overlaps(ws, r.second))
        fail_argument("launch.workspace",
                      "memory disjoint from " + std::string(list == &outputs ? "the output " : "the input ") +
                          r.first + " (the call writes the workspace's first " + std::to_string(needed) +
                          " bytes)",
                      "an overlapping range");
}

// What a forward writes and what it reads, by argument name.
NamedRanges forward_outputs(const jf_fwd_args& a) {
  const jf_problem& p = a.problem;
  return {{"out", byte_range(a.out, p.dtype)}, {"lse", lse_range(a.lse, p.q.heads, output_rows(p))}};
}
NamedRanges problem_inputs(const jf_problem& p) {
  return {{"q", byte_range(p.q, p.dtype)},
          {"k", byte_range(p.k, p.dtype)},
          {"v", byte_range(p.v, p.dtype)},
          {"problem.q_offsets", offsets_range(p.q_offsets, p.batch_size)},
          {"problem.kv_offsets", offsets_range(p.kv_offsets, p.batch_size)},
          {"problem.alibi_slopes", lse_range(p.alibi_slopes, p.q.heads, 1)},
          {"problem.score_mod_table", lse_range(p.score_mod_table, p.q.heads, p.score_mod_table_width)},
          {"problem.learnable_sink", lse_range(p.learnable_sink, p.q.heads, 1)},
          {"problem.block_mask.offsets", offsets_range(p.block_mask.offsets, p.batch_size)},
          {"problem.block_mask.blocks", block_mask_range(p.block_mask)}};
}
NamedRanges backward_outputs(const jf_bwd_args& a) {
  const jf_problem& p = a.problem;
  return {{"dq", byte_range(a.dq, p.dtype)},
          {"dk", byte_range(a.dk, p.dtype)},
          {"dv", byte_range(a.dv, p.dtype)},
          {"dlearnable_sink", lse_range(a.dlearnable_sink, p.q.heads, 1)}};
}
NamedRanges backward_inputs(const jf_bwd_args& a) {
  const jf_problem& p = a.problem;
  NamedRanges in = problem_inputs(p);
  in.insert(in.begin() + 3, {{"out", byte_range(a.out, p.dtype)},
                             {"dout", byte_range(a.dout, p.dtype)},
                             {"lse", lse_range(a.lse, p.q.heads, output_rows(p))}});
  return in;
}

}  // namespace

// Where a pointer lives. One driver query (cuPointerGetAttributes through the runtime's driver
// entry point: nothing more to link) gives the memory type and the allocation's whole address
// range; while a PointerLocationScope is open, a later pointer inside a range already asked about
// is answered from it, so a call asks once per distinct allocation (q, k and v views of one fused
// qkv buffer: one query), not once per pointer (that way, 22 runtime queries a Python forward).
// Unregistered host memory has no range: each such pointer is one query.
namespace {

struct KnownRange {
  uintptr_t begin = 0, end = 0;  // [begin, end)
  bool on_device = false;
};

struct LocationCache {
  int open_scopes = 0;
  std::vector<KnownRange> ranges;
};

thread_local LocationCache t_locations;
thread_local uint64_t t_location_queries = 0;

PFN_cuPointerGetAttributes_v7000 driver_pointer_get_attributes() {
  static const PFN_cuPointerGetAttributes_v7000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &f, 7000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // no driver: not sticky, clear it
      return PFN_cuPointerGetAttributes_v7000{nullptr};
    }
    return reinterpret_cast<PFN_cuPointerGetAttributes_v7000>(f);
  }();
  return fn;
}

// One query: the location of `p` and, when the driver knows its allocation, that range.
KnownRange query_location(const void* p) {
  ++t_location_queries;
  KnownRange r;
  if (PFN_cuPointerGetAttributes_v7000 get = driver_pointer_get_attributes()) {
    unsigned int memory_type = 0, managed = 0;
    CUdeviceptr start = 0;
    size_t size = 0;
    CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_IS_MANAGED,
                                        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                        CU_POINTER_ATTRIBUTE_RANGE_SIZE};
    void* data[] = {&memory_type, &managed, &start, &size};
    if (get(4, attributes, data, reinterpret_cast<CUdeviceptr>(p)) == CUDA_SUCCESS) {
      r.on_device = memory_type == CU_MEMORYTYPE_DEVICE || managed != 0;
      const auto address = reinterpret_cast<uintptr_t>(p);
      if (size > 0 && start <= address && address - start < size) {
        r.begin = static_cast<uintptr_t>(start);
        r.end = r.begin + size;
      }
      return r;
    }
  }
  // No driver entry point, or the driver refused the pointer: the runtime's answer.
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error of an unknown pointer
    return r;
  }
  r.on_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  return r;
}

}  // namespace

PointerLocationScope::PointerLocationScope() { ++t_locations.open_scopes; }

PointerLocationScope::~PointerLocationScope() {
  if (--t_locations.open_scopes == 0) t_locations.ranges.clear();
}

uint64_t pointer_location_queries() { return t_location_queries; }

bool is_device_pointer(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  const bool cached = t_locations.open_scopes > 0;
  if (cached)
    for (const KnownRange& r : t_locations.ranges)
      if (r.begin <= address && address < r.end) return r.on_device;
  const KnownRange r = query_location(p);
  if (cached && r.begin != r.end) t_locations.ranges.push_back(r);
  return r.on_device;
}

void validate_problem_and_launch(const jf_problem& p, const jf_launch& l) {
  check_problem(p, ask_locations(l));
  check_launch(l, p);
}

void validate_host_offsets(const char* name, const int32_t* offsets, int32_t batch_size, int64_t total) {
  if (offsets[0] != 0) fail_argument(std::string(name) + "[0]", 0, offsets[0]);
  for (int32_t b = 0; b < batch_size; ++b) {
    if (offsets[b + 1] < offsets[b]) {
      std::ostringstream e, g;
      e << "non-decreasing offsets (>= " << name << "[" << b << "] = " << offsets[b] << ")";
      g << offsets[b + 1];
      fail_argument(std::string(name) + "[" + std::to_string(b + 1) + "]", e.str(), g.str());
    }
  }
  if (offsets[batch_size] != total) {
    std::ostringstream e;
    e << "the token count " << total;
    fail_argument(std::string(name) + "[B=" + std::to_string(batch_size) + "]", e.str(), offsets[batch_size]);
  }
}

void validate_host_block_mask_offsets(const int32_t* map_offsets, const int32_t* q_offsets,
                                      const int32_t* kv_offsets, int32_t batch_size, int64_t bytes) {
  const char* name = "problem.block_mask.offsets";
  if (map_offsets[0] != 0) fail_argument(std::string(name) + "[0]", 0, map_offsets[0]);
  for (int32_t b = 0; b < batch_size; ++b) {
    const int64_t lq = q_offsets[b + 1] - q_offsets[b], lk = kv_offsets[b + 1] - kv_offsets[b];
    const int64_t entries = BlockMask::entries(lq, lk);
    if (int64_t{map_offsets[b + 1]} - map_offsets[b] == entries) continue;
    std::ostringstream e;
    e << name << "[" << b << "] + ceil(Lq/" << BlockMask::kBlock << ") * ceil(Lk/" << BlockMask::kBlock
      << ") = " << map_offsets[b] << " + " << BlockMask::blocks_of(lq) << " * " << BlockMask::blocks_of(lk)
      << " = " << map_offsets[b] + entries << " (sequence " << b << ": Lq = " << lq << ", Lk = " << lk << ")";
    fail_argument(std::string(name) + "[" + std::to_string(b + 1) + "]", e.str(), map_offsets[b + 1]);
  }
  // The kernels read the map up to [B]: past the caller's buffer would be out of bounds.
  if (map_offsets[batch_size] > bytes) {
    std::ostringstream e;
    e << "<= problem.block_mask.bytes = " << bytes << " (the size of the blocks buffer)";
    fail_argument(std::string(name) + "[B=" + std::to_string(batch_size) + "]", e.str(),
                  map_offsets[batch_size]);
  }
}

void validate_forward_shapes(const jf_fwd_args& a) {
  const jf_problem& p = a.problem;
  const bool ask = ask_locations(a.launch);
  check_problem(p, ask);
  check_launch(a.launch, p);
  check_tensor("out", a.out, output_rows(p), p.q.heads, p.v.head_dim, p, ask);
  check_aligned("lse", a.lse, alignof(float), "float32");
  check_pointer_location("lse", a.lse, p.device, ask);
  check_no_overlap(forward_outputs(a), problem_inputs(p));
}

void validate_backward_shapes(const jf_bwd_args& a) {
  const jf_problem& p = a.problem;
  const bool ask = ask_locations(a.launch);
  check_problem(p, ask);
  check_launch(a.launch, p);
  // Pooled: out and dout [B*Lq, H, Dv], dq [Lq, H, D] like q; otherwise out and dout
  // [total_q, H, Dv], dq [total_q, H, D]. dk like k, dv like v.
  check_tensor("out", a.out, output_rows(p), p.q.heads, p.v.head_dim, p, ask);
  check_tensor("dout", a.dout, output_rows(p), p.q.heads, p.v.head_dim, p, ask);
  check_tensor("dq", a.dq, p.q.rows, p.q.heads, p.q.head_dim, p, ask);
  check_tensor("dk", a.dk, p.k.rows, p.k.heads, p.k.head_dim, p, ask);
  check_tensor("dv", a.dv, p.k.rows, p.k.heads, p.v.head_dim, p, ask);
  if (a.lse == nullptr && output_rows(p) > 0)
    fail_argument(
        "lse",
        is_pooled(p) ? "the forward's lse [H, B*Lq] (non-null)" : "the forward's lse [H, total_q] (non-null)",
        "NULL");
  check_aligned("lse", a.lse, alignof(float), "float32");
  check_pointer_location("lse", a.lse, p.device, ask);
  if (a.dlearnable_sink != nullptr && p.learnable_sink == nullptr)
    fail_argument("dlearnable_sink",
                  "NULL without problem.learnable_sink (there is no sink to differentiate)",
                  static_cast<const void*>(a.dlearnable_sink));
  check_aligned("dlearnable_sink", a.dlearnable_sink, alignof(float), "float32");
  check_pointer_location("dlearnable_sink", a.dlearnable_sink, p.device, ask);
  check_no_overlap(backward_outputs(a), backward_inputs(a));
}

void validate_forward(const jf_fwd_args& a, size_t workspace_needed, bool require_workspace) {
  validate_forward_shapes(a);
  if (require_workspace) {
    check_workspace(a.launch, a.problem, workspace_needed);
    check_workspace_disjoint(a.launch, workspace_needed, forward_outputs(a), problem_inputs(a.problem));
    check_offsets(a.problem, a.launch);
    check_score_mod_values(a.problem);
    check_no_earlier_device_error(a.problem);
  }
}

void validate_backward(const jf_bwd_args& a, size_t workspace_needed, bool require_workspace) {
  validate_backward_shapes(a);
  if (require_workspace) {
    check_workspace(a.launch, a.problem, workspace_needed);
    check_workspace_disjoint(a.launch, workspace_needed, backward_outputs(a), backward_inputs(a));
    check_offsets(a.problem, a.launch);
    check_score_mod_values(a.problem);
    check_no_earlier_device_error(a.problem);
  }
}

}  // namespace jagflash::detail
