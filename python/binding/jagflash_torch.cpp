// The compiled PyTorch binding: torch.ops.jagflash_c.fwd / .bwd, registered through torch's stable
// C ABI (torch/csrc/stable, built with TORCH_TARGET_VERSION 2.9), so one binary serves every torch
// release from 2.9 on that keeps that ABI, and it has no Python dependency of its own.
//
// No math here, as in the ctypes path it replaces (python/jagflash/_launch.py): it checks what
// must hold before the C library can be described the call, copies inputs whose layout the C API
// cannot read, allocates the outputs and the workspace through torch (the caching allocator on
// CUDA, on the tensors' device), fills jf_fwd_args / jf_bwd_args and calls the C API on torch's
// current stream. A non-OK status becomes a std::runtime_error whose message starts with
// "[jagflash status N] " and continues with jagflash_last_error(): python/jagflash/_launch.py
// maps it to the package's exception classes (RuntimeError is what torch makes of it).
//
// The Python custom ops torch.ops.jagflash.fwd / .bwd (fake kernels, autograd, the check_offsets
// modes) and the eager fast path call these ops; python/jagflash/ops.py.
#include <jagflash/jagflash.h>

#include <torch/csrc/stable/accelerator.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#define JAGFLASH_TORCH_EXPORT extern "C" __attribute__((visibility("default")))

namespace jagflash {
namespace torch_binding {
namespace {

using torch::stable::Tensor;

// The GPU path loads with TMA: bases and strides must be multiples of 16 bytes.
constexpr int64_t kGpuAlignBytes = 16;

[[noreturn]] void fail(int status, const std::string& message) {
  throw std::runtime_error("[jagflash status " + std::to_string(status) + "] " + message);
}

void check_status(jf_status status) {
  if (status != JF_OK) fail(status, jagflash_last_error());
}

// A failed input check: Python's check_inputs (python/jagflash/_launch.py, shared with the fake
// kernels) words these, so the binding only has to detect them; the tag tells _launch.py to.
[[noreturn]] void fail_input(const std::string& what) {
  fail(JF_ERR_INVALID_ARGUMENT, "input check: " + what);
}

// torch's dtype and device codes, asked of libtorch once (they are functions of the shim).
struct Codes {
  int32_t bf16 = aoti_torch_dtype_bfloat16();
  int32_t fp16 = aoti_torch_dtype_float16();
  int32_t fp32 = aoti_torch_dtype_float32();
  int32_t int32 = aoti_torch_dtype_int32();
  int32_t uint8 = aoti_torch_dtype_uint8();
  int32_t cpu = aoti_torch_device_type_cpu();
  int32_t cuda = aoti_torch_device_type_cuda();
};

const Codes& codes() {
  static const Codes instance;
  return instance;
}

int32_t dtype_of(const Tensor& t) {
  int32_t dtype = 0;
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_dtype(t.get(), &dtype));
  return dtype;
}

struct Place {
  int32_t type;
  int32_t index;
  bool operator==(const Place& other) const { return type == other.type && index == other.index; }
  bool is_cuda() const { return type == codes().cuda; }
};

Place place_of(const Tensor& t) {
  Place place{};
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_type(t.get(), &place.type));
  TORCH_ERROR_CODE_CHECK(aoti_torch_get_device_index(t.get(), &place.index));
  return place;
}

int64_t element_bytes(int32_t dtype) {
  const Codes& c = codes();
  return dtype == c.fp32 || dtype == c.int32 ? 4 : dtype == c.uint8 ? 1 : 2;
}

// A failed allocation: the shim turns torch's exception into a bare error code (its message goes
// to the log only), and with sizes the C library accepts and a device torch knows, what fails is
// the memory. The "out of memory: " tag tells python/jagflash/_launch.py to raise torch's own
// torch.OutOfMemoryError with what was asked for; nothing has been written by then.
[[noreturn]] void fail_out_of_memory(const char* what, int64_t bytes, const Place& place) {
  fail(JF_ERR_CUDA, std::string("out of memory: ") + what + ", " + std::to_string(bytes) + " bytes, on " +
                        (place.is_cuda() ? "cuda:" + std::to_string(place.index) : std::string("cpu")));
}

// A fresh dense tensor; `what` names it in the out-of-memory error ("the backward's workspace").
Tensor empty(std::initializer_list<int64_t> sizes, int32_t dtype, const Place& place, const char* what) {
  std::array<int64_t, 3> size{};
  std::array<int64_t, 3> stride{};
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  std::copy(sizes.begin(), sizes.end(), size.begin());
  int64_t step = 1;
  for (int64_t d = ndim - 1; d >= 0; --d) {
    stride[d] = step;
    step *= size[d] > 1 ? size[d] : 1;
  }
  AtenTensorHandle handle = nullptr;
  if (aoti_torch_empty_strided(ndim, size.data(), stride.data(), dtype, place.type, place.index, &handle) !=
      AOTI_TORCH_SUCCESS) {
    int64_t elements = 1;
    for (int64_t d = 0; d < ndim; ++d) elements *= size[d];
    fail_out_of_memory(what, elements * element_bytes(dtype), place);
  }
  return Tensor(handle);
}

Tensor empty_like_dense(const Tensor& t, const Place& place, const char* what) {
  return empty({t.size(0), t.size(1), t.size(2)}, dtype_of(t), place, what);
}

// What python/jagflash/_launch.py's check_inputs requires, detected here; it words the message.
void check_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_offsets,
                  const Tensor& kv_offsets) {
  const Codes& c = codes();
  if (q.dim() != 3 || k.dim() != 3 || v.dim() != 3) fail_input("q, k and v must be 3-D");
  const int32_t dtype = dtype_of(q);
  if (dtype != c.bf16 && dtype != c.fp16 && dtype != c.fp32) fail_input("q's dtype");
  if (dtype_of(k) != dtype || dtype_of(v) != dtype) fail_input("k or v's dtype");
  const Place place = place_of(q);
  if (!(place_of(k) == place && place_of(v) == place && place_of(q_offsets) == place &&
        place_of(kv_offsets) == place)) {
    fail_input("devices");
  }
  if (place.type != c.cpu && place.type != c.cuda) fail_input("q's device");
  for (const Tensor* offsets : {&q_offsets, &kv_offsets}) {
    if (offsets->dim() != 1 || offsets->numel() < 1 || dtype_of(*offsets) != c.int32) fail_input("offsets");
  }
  if (kv_offsets.numel() != q_offsets.numel()) fail_input("offsets lengths");
}

// (row_stride, head_stride) as the C API reads them. A stride over a dimension of size 1 is never
// used to address anything, so it is replaced by the smallest legal one (torch leaves arbitrary
// values there); an empty tensor (an expanded zero-row gradient has strides 0) gets dense ones.
std::pair<int64_t, int64_t> strides_of(const Tensor& t) {
  const int64_t rows = t.size(0), heads = t.size(1), head_dim = t.size(2);
  if (t.numel() == 0) return {heads * head_dim, head_dim};
  const int64_t head_stride = heads > 1 ? t.stride(1) : head_dim;
  const int64_t row_stride = rows > 1 ? t.stride(0) : (heads - 1) * head_stride + head_dim;
  return {row_stride, head_stride};
}

// Whether the C API accepts t's layout as is: contiguous head dim, rows and heads that do not
// overlap, rows outermost, and on the GPU 16-byte aligned base and strides.
bool usable(const Tensor& t, bool cuda) {
  if (t.numel() == 0) return true;
  const int64_t heads = t.size(1), head_dim = t.size(2);
  const auto [row_stride, head_stride] = strides_of(t);
  if (t.stride(2) != 1 && head_dim > 1) return false;
  if (head_stride < head_dim || row_stride < (heads - 1) * head_stride + head_dim) return false;
  if (cuda) {
    const int64_t unit = kGpuAlignBytes / static_cast<int64_t>(t.element_size());
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) % kGpuAlignBytes != 0 || row_stride % unit != 0 ||
        (heads > 1 && head_stride % unit != 0)) {
      return false;
    }
  }
  return true;
}

// t itself when the C API can read it in place, else a dense copy (a fresh allocation, so also
// 16-byte aligned).
Tensor prepared(const Tensor& t, const Place& place) {
  if (usable(t, place.is_cuda())) return t;
  Tensor fresh = empty_like_dense(t, place, "a dense copy of an input");
  torch::stable::copy_(fresh, t);
  return fresh;
}

Tensor contiguous_offsets(const Tensor& offsets, const Place& place) {
  if (offsets.numel() <= 1 || offsets.stride(0) == 1) return offsets;
  Tensor fresh = empty({offsets.size(0)}, codes().int32, place, "a contiguous copy of the offsets");
  torch::stable::copy_(fresh, offsets);
  return fresh;
}

jf_tensor describe(const Tensor& t) {
  const auto [row_stride, head_stride] = strides_of(t);
  return jf_tensor{t.data_ptr(), t.size(0),  static_cast<int32_t>(t.size(1)), static_cast<int32_t>(t.size(2)),
                   row_stride,   head_stride};
}

// The score modifier as the ops take it: softcap (0 = none), ALiBi's slopes, and a modifier that
// reads a table named by its kind (jf_score_mod, 0 = none of those) with its table.
struct ScoreModInputs {
  double softcap = 0.0;
  std::optional<Tensor> alibi_slopes;
  int64_t kind = 0;
  std::optional<Tensor> table;
};

// The score modifier (jf_score_mod): a table's kind when one is given (the table float32 [H, W],
// contiguous, on q's device), else ALiBi when slopes are given (float32 [H], contiguous, on q's
// device: python/jagflash/_launch.py's check_score_mod words a failure), else softcap when it is
// not 0. More than one given: the C library refuses the fields the kind does not read. A cap
// beyond float's range is passed on as infinity (refused there under the value's sign), not
// converted (undefined).
void set_score_mod(jf_problem& p, const Tensor& q, const ScoreModInputs& mod) {
  if (mod.alibi_slopes.has_value()) {
    const Tensor& slopes = *mod.alibi_slopes;
    if (slopes.dim() != 1 || slopes.numel() != q.size(1) || dtype_of(slopes) != codes().fp32 ||
        !(place_of(slopes) == place_of(q)) || (slopes.numel() > 1 && slopes.stride(0) != 1)) {
      fail_input("alibi_slopes");
    }
    p.score_mod = JF_SCORE_MOD_ALIBI;
    p.alibi_slopes = static_cast<const float*>(slopes.data_ptr());
  } else if (mod.softcap != 0.0) {
    p.score_mod = JF_SCORE_MOD_SOFTCAP;
  }
  if (mod.kind != 0 || mod.table.has_value()) {
    if (!mod.table.has_value()) fail_input("score_mod_table");
    const Tensor& table = *mod.table;
    if (table.dim() != 2 || table.size(0) != q.size(1) || table.size(1) < 1 || table.size(1) > INT32_MAX ||
        dtype_of(table) != codes().fp32 || !(place_of(table) == place_of(q)) || !table.is_contiguous()) {
      fail_input("score_mod_table");
    }
    if (mod.kind < 0 || mod.kind > INT32_MAX) fail_input("score_mod");
    p.score_mod = static_cast<jf_score_mod>(mod.kind);
    p.score_mod_table = static_cast<const float*>(table.data_ptr());
    p.score_mod_table_width = static_cast<int32_t>(table.size(1));
  }
  constexpr double kFloatMax = static_cast<double>(std::numeric_limits<float>::max());
  const double softcap = mod.softcap;
  p.softcap = std::fabs(softcap) <= kFloatMax ? static_cast<float>(softcap)
              : std::isnan(softcap)           ? std::numeric_limits<float>::quiet_NaN()
                                    : std::copysign(std::numeric_limits<float>::infinity(), softcap);
}

// The block-sparse map (jf_block_mask): none when both are absent; else blocks a uint8 vector and
// offsets an int32 vector of B+1 entries, on q's device (python/jagflash/_launch.py's
// check_block_mask words a failure). Strided ones are copied into `kept` (which the call keeps
// alive). The C library checks the offsets' values against the sequences' lengths and offsets[B]
// against blocks' size (jf_block_mask.bytes = blocks.numel()), where it checks the other offsets.
struct KeptBlockMask {
  Tensor blocks;
  Tensor offsets;
};

void set_block_mask(jf_problem& p, const Tensor& q, int64_t batch_entries, const std::optional<Tensor>& blocks,
                    const std::optional<Tensor>& offsets, KeptBlockMask& kept) {
  if (!blocks.has_value() && !offsets.has_value()) return;
  if (!blocks.has_value() || !offsets.has_value()) fail_input("block_mask: one of blocks and offsets");
  const Place place = place_of(q);
  if (blocks->dim() != 1 || dtype_of(*blocks) != codes().uint8 || !(place_of(*blocks) == place)) {
    fail_input("block_mask blocks");
  }
  if (offsets->dim() != 1 || offsets->numel() != batch_entries || dtype_of(*offsets) != codes().int32 ||
      !(place_of(*offsets) == place)) {
    fail_input("block_mask offsets");
  }
  kept.offsets = contiguous_offsets(*offsets, place);
  kept.blocks = *blocks;
  if (blocks->numel() > 1 && blocks->stride(0) != 1) {
    kept.blocks = empty({blocks->size(0)}, codes().uint8, place, "a contiguous copy of the block mask");
    torch::stable::copy_(kept.blocks, *blocks);
  }
  // An empty map (no sequence has both a query and a key block) still is a block mask: torch may
  // give its empty tensor no address, and NULL blocks beside offsets would read as a half-given
  // mask, so blocks then points at the offsets (on the same device; no byte of it is read).
  p.block_mask.blocks = kept.blocks.numel() ? static_cast<const uint8_t*>(kept.blocks.data_ptr())
                                            : static_cast<const uint8_t*>(kept.offsets.data_ptr());
  p.block_mask.offsets = static_cast<const int32_t*>(kept.offsets.data_ptr());
  p.block_mask.bytes = kept.blocks.numel();
}

// The learnable sinks (jf_problem.learnable_sink): none, or float32 [H], contiguous, on q's device
// (python/jagflash/_launch.py converts other dtypes and strided ones before the call, and its
// check_learnable_sink words a failure). Their values are the C library's to check.
void set_learnable_sink(jf_problem& p, const Tensor& q, const std::optional<Tensor>& sink) {
  if (!sink.has_value()) return;
  if (sink->dim() != 1 || sink->size(0) != q.size(1) || dtype_of(*sink) != codes().fp32 ||
      !(place_of(*sink) == place_of(q)) || (sink->numel() > 1 && sink->stride(0) != 1)) {
    fail_input("learnable_sink");
  }
  p.learnable_sink = static_cast<const float*>(sink->data_ptr());
}

// Where the sinks' gradient goes (jf_bwd_args.dlearnable_sink): a float32 [H] tensor, contiguous,
// on q's device, given only with sinks (python/jagflash/_launch.py allocates it when the gradient
// is wanted); none: NULL, and the C library computes no gradient for the sinks. An argument
// rather than an output: the backwards' outputs stay dq, dk, dv and the workspace.
void set_sink_gradient(jf_bwd_args& args, const Tensor& q, const std::optional<Tensor>& dsink) {
  if (!dsink.has_value()) return;
  if (args.problem.learnable_sink == nullptr || dsink->dim() != 1 || dsink->size(0) != q.size(1) ||
      dtype_of(*dsink) != codes().fp32 || !(place_of(*dsink) == place_of(q)) ||
      (dsink->numel() > 1 && dsink->stride(0) != 1)) {
    fail_input("dlearnable_sink");
  }
  args.dlearnable_sink = static_cast<float*>(dsink->data_ptr());
}

jf_problem problem_of(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q_offsets,
                      const Tensor& kv_offsets, int64_t mask, int64_t window_left, int64_t window_right,
                      double scale, const Place& place) {
  const Codes& c = codes();
  const int32_t dtype = dtype_of(q);
  jf_problem p{};
  p.dtype = dtype == c.bf16 ? JF_BF16 : dtype == c.fp16 ? JF_FP16 : JF_FP32;
  p.device = place.is_cuda() ? JF_DEVICE_CUDA : JF_DEVICE_CPU;
  p.batch_size = static_cast<int32_t>(q_offsets.numel() - 1);
  p.q_offsets = static_cast<const int32_t*>(q_offsets.data_ptr());
  p.kv_offsets = static_cast<const int32_t*>(kv_offsets.data_ptr());
  p.q = describe(q);
  p.k = describe(k);
  p.v = describe(v);
  // The C API validates the mask as an int (any value a caller passes); storing an out-of-range
  // value through the enum type would be undefined, so its bytes are written as an int.
  const int32_t mask_value = static_cast<int32_t>(mask);
  static_assert(sizeof(p.mask) == sizeof(mask_value), "jf_mask is int-sized");
  std::memcpy(&p.mask, &mask_value, sizeof(mask_value));
  p.window_left = static_cast<int32_t>(window_left);
  p.window_right = static_cast<int32_t>(window_right);
  p.scale = static_cast<float>(scale);
  return p;
}

// torch's current CUDA stream. aoti_torch_get_current_cuda_stream lives in libtorch_cuda.so, which
// the binding does not link (it loads with a CPU-only torch too): it is looked up, once, in the
// libtorch_cuda.so next to the libtorch_cpu.so torch has loaded.
using CurrentCudaStreamFn = AOTITorchError (*)(int32_t, void**);

CurrentCudaStreamFn current_cuda_stream_fn() {
  static const CurrentCudaStreamFn fn = [] {
    constexpr const char* kName = "aoti_torch_get_current_cuda_stream";
    Dl_info info{};
    if (dladdr(reinterpret_cast<void*>(&aoti_torch_empty_strided), &info) != 0 && info.dli_fname != nullptr) {
      std::string path(info.dli_fname);
      path = path.substr(0, path.find_last_of('/') + 1) + "libtorch_cuda.so";
      if (void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD)) {
        if (void* symbol = dlsym(handle, kName)) return reinterpret_cast<CurrentCudaStreamFn>(symbol);
      }
    }
    // A torch laid out otherwise that loaded libtorch_cuda.so into the global scope.
    return reinterpret_cast<CurrentCudaStreamFn>(dlsym(RTLD_DEFAULT, kName));
  }();
  return fn;
}

void* current_stream(const Place& place) {
  if (!place.is_cuda()) return nullptr;
  const CurrentCudaStreamFn fn = current_cuda_stream_fn();
  if (fn == nullptr) {
    fail(JF_ERR_INTERNAL, "torch's libtorch_cuda.so (aoti_torch_get_current_cuda_stream) was not found");
  }
  void* stream = nullptr;
  TORCH_ERROR_CODE_CHECK(fn(place.index, &stream));
  return stream;
}

// Test hook (python/tests/conftest.py's `launches`): every call's jf_launch as the C library saw
// it, while recording is on. Off, a call pays one relaxed atomic load.
constexpr int kRecordFields = 10;
std::atomic<bool> g_recording{false};
std::mutex g_records_mutex;
std::vector<int64_t> g_records;

void record(int direction, const jf_launch& launch) {
  if (!g_recording.load(std::memory_order_relaxed)) return;
  const std::lock_guard<std::mutex> lock(g_records_mutex);
  const int64_t fields[kRecordFields] = {direction,
                                         static_cast<int64_t>(launch.offsets_check),
                                         static_cast<int64_t>(launch.backend),
                                         launch.reuse_plan,
                                         launch.max_seqlen_hint,
                                         launch.deterministic,
                                         launch.caller_checked_pointers,
                                         static_cast<int64_t>(reinterpret_cast<intptr_t>(launch.stream)),
                                         static_cast<int64_t>(launch.workspace_bytes),
                                         static_cast<int64_t>(reinterpret_cast<intptr_t>(launch.workspace))};
  g_records.insert(g_records.end(), fields, fields + kRecordFields);
}

jf_launch launch_of(const Place& place, int64_t offsets_check, int64_t max_seqlen, bool deterministic) {
  jf_launch launch{};
  launch.stream = current_stream(place);
  launch.offsets_check = static_cast<jf_offsets_check>(offsets_check);
  launch.backend = JF_BACKEND_AUTO;
  launch.max_seqlen_hint = static_cast<int32_t>(max_seqlen);
  launch.deterministic = deterministic ? 1 : 0;
  // Every pointer comes from a tensor on `place` (checked above), so the C library need not ask
  // the driver where they live.
  launch.caller_checked_pointers = 1;
  return launch;
}

// Workspace query, allocation through torch on the tensors' device, then the call.
template <typename Args, typename SizeFn, typename RunFn>
Tensor run(Args& args, SizeFn size_fn, RunFn run_fn, const Place& place, int direction) {
  size_t bytes = 0;
  check_status(size_fn(&args, &bytes));
  // No bytes (CPU calls): no allocation, and Python gets None for the workspace.
  Tensor workspace =
      bytes ? empty({static_cast<int64_t>(bytes)}, codes().uint8, place,
                    direction == JF_DIRECTION_BACKWARD ? "the backward's workspace" : "the forward's workspace")
            : Tensor();
  args.launch.workspace = bytes ? workspace.data_ptr() : nullptr;
  args.launch.workspace_bytes = bytes;
  check_status(run_fn(&args));
  record(direction, args.launch);
  return workspace;
}

// The C library launches on the current CUDA device: make it the tensors' one for the call
// (allocations go by the place given; the guard is for the launches). Usually it already is, and
// then no guard is made (a heap allocation and two device queries less per call).
void guard_device(std::optional<torch::stable::accelerator::DeviceGuard>& guard, const Place& place) {
  if (!place.is_cuda()) return;
  if (torch::stable::accelerator::getCurrentDeviceIndex() != place.index) guard.emplace(place.index);
}

void check_offsets_mode(int64_t offsets_check) {
  if (offsets_check != JF_CHECK_OFFSETS_HOST && offsets_check != JF_CHECK_OFFSETS_DEVICE) {
    fail(JF_ERR_INVALID_ARGUMENT,
         "offsets_check: expected 0 (host) or 1 (device), got " + std::to_string(offsets_check));
  }
}

// The C API holds the scale as a float and reads 0 as 1/sqrt(D): a non-zero value that rounds to 0
// in float would silently become the default, and one that rounds to infinity would be refused
// under another value. Both are refused here with the value given (compared in double: the
// conversion of a double beyond float's range is undefined). Bounds: at or below 2^-150, half the
// smallest subnormal, rounds to 0 (the tie to even); at or above 2^128 - 2^103, halfway from the
// largest float to 2^128, to infinity. python/jagflash/_launch.py's check_op_scalars is the same.
void check_scale(double scale) {
  const double magnitude = std::fabs(scale);
  if (scale == 0.0 ||
      (magnitude > std::ldexp(1.0, -150) && magnitude < std::ldexp(1.0, 128) - std::ldexp(1.0, 103)))
    return;
  // The shortest text that reads back as the value (Python's repr: 1e+39, not 9.9999999999999994e+38).
  std::array<char, 32> text{};
  const auto written = std::to_chars(text.data(), text.data() + text.size(), scale);
  fail(JF_ERR_INVALID_ARGUMENT,
       "scale: expected 0 (1/sqrt(head_dim)) or a number that is finite and non-zero in float32, got " +
           std::string(text.data(), written.ptr));
}

// The forward once its inputs are checked: layouts the C API can read, out and lse, the call.
// q_offsets null: a pooled call (q is the shared query set, kv_offsets give the batch).
std::tuple<Tensor, Tensor, Tensor> run_forward(Tensor q, Tensor k, Tensor v, const Tensor* q_offsets,
                                               Tensor kv_offsets, int64_t mask, int64_t window_left,
                                               int64_t window_right, double scale, int64_t offsets_check,
                                               int64_t max_seqlen, const ScoreModInputs& mod,
                                               const std::optional<Tensor>& learnable_sink,
                                               const std::optional<Tensor>& block_mask_blocks = std::nullopt,
                                               const std::optional<Tensor>& block_mask_offsets = std::nullopt);

std::tuple<Tensor, Tensor, Tensor> fwd(Tensor q, Tensor k, Tensor v, Tensor q_offsets, Tensor kv_offsets,
                                       int64_t mask, int64_t window_left, int64_t window_right, double scale,
                                       int64_t offsets_check, int64_t max_seqlen, double softcap,
                                       std::optional<Tensor> alibi_slopes, std::optional<Tensor> block_mask_blocks,
                                       std::optional<Tensor> block_mask_offsets, int64_t score_mod,
                                       std::optional<Tensor> score_mod_table, std::optional<Tensor> learnable_sink) {
  check_inputs(q, k, v, q_offsets, kv_offsets);
  check_offsets_mode(offsets_check);
  check_scale(scale);
  return run_forward(q, k, v, &q_offsets, kv_offsets, mask, window_left, window_right, scale, offsets_check,
                     max_seqlen, ScoreModInputs{softcap, alibi_slopes, score_mod, score_mod_table}, learnable_sink,
                     block_mask_blocks, block_mask_offsets);
}

// out and dout: q's rows and heads, v's head dim (which may be smaller than q's), q's dtype and
// device.
bool shaped_like_out(const Tensor& t, const Tensor& q, const Tensor& v) {
  return t.dim() == 3 && t.size(0) == q.size(0) && t.size(1) == q.size(1) && t.size(2) == v.size(2) &&
         dtype_of(t) == dtype_of(q) && place_of(t) == place_of(q);
}

// The backward once its inputs are checked: layouts the C API can read, the gradients, the call.
// q_offsets null: a pooled call (q is the shared query set, kv_offsets give the batch).
// The sinks of a backward: the forward's, and where their gradient goes (none: not wanted).
struct SinkInputs {
  std::optional<Tensor> learnable_sink;
  std::optional<Tensor> gradient;
};

std::tuple<Tensor, Tensor, Tensor, Tensor> run_backward(
    Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, const Tensor* q_offsets, Tensor kv_offsets,
    int64_t mask, int64_t window_left, int64_t window_right, double scale, int64_t offsets_check,
    int64_t max_seqlen, bool deterministic, const ScoreModInputs& mod, const SinkInputs& sink,
    const std::optional<Tensor>& block_mask_blocks = std::nullopt,
    const std::optional<Tensor>& block_mask_offsets = std::nullopt);

std::tuple<Tensor, Tensor, Tensor, Tensor> bwd(
    Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor q_offsets, Tensor kv_offsets,
    int64_t mask, int64_t window_left, int64_t window_right, double scale, int64_t offsets_check,
    int64_t max_seqlen, bool deterministic, double softcap, std::optional<Tensor> alibi_slopes,
    std::optional<Tensor> block_mask_blocks, std::optional<Tensor> block_mask_offsets, int64_t score_mod,
    std::optional<Tensor> score_mod_table, std::optional<Tensor> learnable_sink,
    std::optional<Tensor> dlearnable_sink) {
  check_inputs(q, k, v, q_offsets, kv_offsets);
  check_offsets_mode(offsets_check);
  check_scale(scale);
  if (!shaped_like_out(dout, q, v) || !shaped_like_out(out, q, v)) fail_input("dout or out unlike q/v");
  // The C API takes lse as a bare float pointer: its shape and dtype can only be checked here.
  if (lse.dim() != 2 || lse.size(0) != q.size(1) || lse.size(1) != q.size(0) ||
      dtype_of(lse) != codes().fp32 || !(place_of(lse) == place_of(q))) {
    fail_input("lse");
  }
  return run_backward(dout, q, k, v, out, lse, &q_offsets, kv_offsets, mask, window_left, window_right, scale,
                      offsets_check, max_seqlen, deterministic,
                      ScoreModInputs{softcap, alibi_slopes, score_mod, score_mod_table},
                      SinkInputs{learnable_sink, dlearnable_sink}, block_mask_blocks, block_mask_offsets);
}

// ---- Pooled attention (jf_problem.pooled_q_rows): one query set q [Lq, H, D] shared by
// every sequence of k, v (kv_offsets [B+1]); out [B*Lq, H, Dv], lse [H, B*Lq], dq [Lq, H, D].

// check_inputs less q_offsets: python/jagflash/_launch.py's check_pooled_inputs words these.
void check_pooled_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_offsets) {
  check_inputs(q, k, v, kv_offsets, kv_offsets);
  if (q.size(0) < 1) fail_input("pooled q rows");
}

// The problem of a pooled call: batch size from kv_offsets, no q_offsets, Lq = q's rows.
jf_problem pooled_problem_of(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& kv_offsets,
                             int64_t mask, int64_t window_left, int64_t window_right, double scale,
                             const Place& place) {
  jf_problem p = problem_of(q, k, v, kv_offsets, kv_offsets, mask, window_left, window_right, scale, place);
  p.q_offsets = nullptr;
  p.pooled_q_rows = static_cast<int32_t>(q.size(0));
  return p;
}

// B * Lq: the rows of out, dout and lse.
int64_t pooled_rows(const Tensor& q, const Tensor& kv_offsets) {
  return (kv_offsets.numel() - 1) * q.size(0);
}

std::tuple<Tensor, Tensor, Tensor> pooled_fwd(Tensor q, Tensor k, Tensor v, Tensor kv_offsets, int64_t mask,
                                              int64_t window_left, int64_t window_right, double scale,
                                              int64_t offsets_check, int64_t max_seqlen, double softcap,
                                              std::optional<Tensor> alibi_slopes, int64_t score_mod,
                                              std::optional<Tensor> score_mod_table,
                                              std::optional<Tensor> learnable_sink) {
  check_pooled_inputs(q, k, v, kv_offsets);
  check_offsets_mode(offsets_check);
  check_scale(scale);
  return run_forward(q, k, v, nullptr, kv_offsets, mask, window_left, window_right, scale, offsets_check,
                     max_seqlen, ScoreModInputs{softcap, alibi_slopes, score_mod, score_mod_table}, learnable_sink);
}

std::tuple<Tensor, Tensor, Tensor> run_forward(Tensor q, Tensor k, Tensor v, const Tensor* q_offsets,
                                               Tensor kv_offsets, int64_t mask, int64_t window_left,
                                               int64_t window_right, double scale, int64_t offsets_check,
                                               int64_t max_seqlen, const ScoreModInputs& mod,
                                               const std::optional<Tensor>& learnable_sink,
                                               const std::optional<Tensor>& block_mask_blocks,
                                               const std::optional<Tensor>& block_mask_offsets) {
  const Place place = place_of(q);
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  guard_device(guard, place);
  q = prepared(q, place);
  k = prepared(k, place);
  v = prepared(v, place);
  Tensor q_offsets_c = q_offsets != nullptr ? contiguous_offsets(*q_offsets, place) : Tensor();
  kv_offsets = contiguous_offsets(kv_offsets, place);
  // The output rows: total_q, or B * Lq for a pooled call; v's head dim (the C library checks the
  // head dims).
  const int64_t rows = q_offsets != nullptr ? q.size(0) : pooled_rows(q, kv_offsets);
  Tensor out = empty({rows, q.size(1), v.size(2)}, dtype_of(q), place, "out");
  Tensor lse = empty({q.size(1), rows}, codes().fp32, place, "lse");
  jf_fwd_args args{};
  args.problem =
      q_offsets != nullptr
          ? problem_of(q, k, v, q_offsets_c, kv_offsets, mask, window_left, window_right, scale, place)
          : pooled_problem_of(q, k, v, kv_offsets, mask, window_left, window_right, scale, place);
  set_score_mod(args.problem, q, mod);
  set_learnable_sink(args.problem, q, learnable_sink);
  KeptBlockMask kept;
  set_block_mask(args.problem, q, kv_offsets.numel(), block_mask_blocks, block_mask_offsets, kept);
  args.out = describe(out);
  args.lse = static_cast<float*>(lse.data_ptr());
  args.launch = launch_of(place, offsets_check, max_seqlen, false);
  Tensor workspace = run(args, jagflash_fwd_workspace_size, jagflash_fwd, place, JF_DIRECTION_FORWARD);
  return {out, lse, workspace};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> pooled_bwd(
    Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor kv_offsets, int64_t mask,
    int64_t window_left, int64_t window_right, double scale, int64_t offsets_check, int64_t max_seqlen,
    bool deterministic, double softcap, std::optional<Tensor> alibi_slopes, int64_t score_mod,
    std::optional<Tensor> score_mod_table, std::optional<Tensor> learnable_sink,
    std::optional<Tensor> dlearnable_sink) {
  check_pooled_inputs(q, k, v, kv_offsets);
  check_offsets_mode(offsets_check);
  check_scale(scale);
  const int64_t rows = pooled_rows(q, kv_offsets);
  for (const Tensor* t : {&dout, &out}) {
    if (t->dim() != 3 || t->size(0) != rows || t->size(1) != q.size(1) || t->size(2) != v.size(2) ||
        dtype_of(*t) != dtype_of(q) || !(place_of(*t) == place_of(q))) {
      fail_input("pooled dout or out");
    }
  }
  if (lse.dim() != 2 || lse.size(0) != q.size(1) || lse.size(1) != rows || dtype_of(lse) != codes().fp32 ||
      !(place_of(lse) == place_of(q))) {
    fail_input("pooled lse");
  }
  return run_backward(dout, q, k, v, out, lse, nullptr, kv_offsets, mask, window_left, window_right, scale,
                      offsets_check, max_seqlen, deterministic,
                      ScoreModInputs{softcap, alibi_slopes, score_mod, score_mod_table},
                      SinkInputs{learnable_sink, dlearnable_sink});
}

std::tuple<Tensor, Tensor, Tensor, Tensor> run_backward(
    Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, const Tensor* q_offsets, Tensor kv_offsets,
    int64_t mask, int64_t window_left, int64_t window_right, double scale, int64_t offsets_check,
    int64_t max_seqlen, bool deterministic, const ScoreModInputs& mod, const SinkInputs& sink,
    const std::optional<Tensor>& block_mask_blocks, const std::optional<Tensor>& block_mask_offsets) {
  const Place place = place_of(q);
  std::optional<torch::stable::accelerator::DeviceGuard> guard;
  guard_device(guard, place);
  q = prepared(q, place);
  k = prepared(k, place);
  v = prepared(v, place);
  out = prepared(out, place);
  dout = prepared(dout, place);
  if (!lse.is_contiguous()) {
    Tensor fresh = empty({lse.size(0), lse.size(1)}, codes().fp32, place, "a contiguous copy of lse");
    torch::stable::copy_(fresh, lse);
    lse = fresh;
  }
  Tensor q_offsets_c = q_offsets != nullptr ? contiguous_offsets(*q_offsets, place) : Tensor();
  kv_offsets = contiguous_offsets(kv_offsets, place);
  Tensor dq = empty_like_dense(q, place, "dq");
  Tensor dk = empty_like_dense(k, place, "dk");
  Tensor dv = empty_like_dense(v, place, "dv");
  jf_bwd_args args{};
  args.problem =
      q_offsets != nullptr
          ? problem_of(q, k, v, q_offsets_c, kv_offsets, mask, window_left, window_right, scale, place)
          : pooled_problem_of(q, k, v, kv_offsets, mask, window_left, window_right, scale, place);
  set_score_mod(args.problem, q, mod);
  set_learnable_sink(args.problem, q, sink.learnable_sink);
  KeptBlockMask kept;
  set_block_mask(args.problem, q, kv_offsets.numel(), block_mask_blocks, block_mask_offsets, kept);
  set_sink_gradient(args, q, sink.gradient);
  args.out = describe(out);
  args.dout = describe(dout);
  args.lse = static_cast<const float*>(lse.data_ptr());
  args.dq = describe(dq);
  args.dk = describe(dk);
  args.dv = describe(dv);
  args.launch = launch_of(place, offsets_check, max_seqlen, deterministic);
  Tensor workspace = run(args, jagflash_bwd_workspace_size, jagflash_bwd, place, JF_DIRECTION_BACKWARD);
  return {dq, dk, dv, workspace};
}

}  // namespace
}  // namespace torch_binding
}  // namespace jagflash

// Outputs: out [total_q, H, Dv] (q's dtype, v's head dim), lse [H, total_q] float32 (natural log), then the
// workspace the call used (uint8; undefined, None in Python, when it needed none), in which a
// device offsets check leaves its flag (python/jagflash/_offsets_check.py keeps it).
// softcap (0 = none) and alibi_slopes (float32 [H], or None): the score modifier (jf_score_mod);
// score_mod (a jf_score_mod that reads a table, 0 = none) and score_mod_table (float32 [H, W]):
// a modifier with a table, after the block mask.
// block_mask_blocks (uint8) and block_mask_offsets (int32 [B+1]), or None: the block-sparse map
// (jf_block_mask; not with pooled attention, which the C API refuses it for).
// learnable_sink (float32 [H], or None): the sinks (jf_problem.learnable_sink), after the
// modifier's table; the backwards' dlearnable_sink, last (float32 [H], or None): overwritten with
// the sinks' gradient (jf_bwd_args.dlearnable_sink). Calls without sinks may leave both out.
STABLE_TORCH_LIBRARY(jagflash_c, m) {
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, Tensor q_offsets, Tensor kv_offsets, int mask, int window_left, "
      "int window_right, float scale, int offsets_check, int max_seqlen, float softcap=0., "
      "Tensor? alibi_slopes=None, Tensor? block_mask_blocks=None, Tensor? block_mask_offsets=None, "
      "int score_mod=0, Tensor? score_mod_table=None, Tensor? learnable_sink=None) -> (Tensor, Tensor, Tensor)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor q_offsets, "
      "Tensor kv_offsets, int mask, int window_left, int window_right, float scale, int offsets_check, "
      "int max_seqlen, bool deterministic, float softcap=0., Tensor? alibi_slopes=None, "
      "Tensor? block_mask_blocks=None, Tensor? block_mask_offsets=None, int score_mod=0, "
      "Tensor? score_mod_table=None, Tensor? learnable_sink=None, Tensor(a!)? dlearnable_sink=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // Pooled attention: q [Lq, H, D] shared by the B sequences of kv_offsets; out [B*Lq, H, Dv],
  // lse [H, B*Lq]; the backward's dq [Lq, H, D] is the sum over the sequences.
  m.def(
      "pooled_fwd(Tensor q, Tensor k, Tensor v, Tensor kv_offsets, int mask, int window_left, "
      "int window_right, float scale, int offsets_check, int max_seqlen, float softcap=0., "
      "Tensor? alibi_slopes=None, int score_mod=0, Tensor? score_mod_table=None, Tensor? learnable_sink=None) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "pooled_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor kv_offsets, "
      "int mask, int window_left, int window_right, float scale, int offsets_check, int max_seqlen, "
      "bool deterministic, float softcap=0., Tensor? alibi_slopes=None, int score_mod=0, "
      "Tensor? score_mod_table=None, Tensor? learnable_sink=None, Tensor(a!)? dlearnable_sink=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
}

STABLE_TORCH_LIBRARY_IMPL(jagflash_c, CPU, m) {
  m.impl("fwd", TORCH_BOX(&jagflash::torch_binding::fwd));
  m.impl("bwd", TORCH_BOX(&jagflash::torch_binding::bwd));
  m.impl("pooled_fwd", TORCH_BOX(&jagflash::torch_binding::pooled_fwd));
  m.impl("pooled_bwd", TORCH_BOX(&jagflash::torch_binding::pooled_bwd));
}

STABLE_TORCH_LIBRARY_IMPL(jagflash_c, CUDA, m) {
  m.impl("fwd", TORCH_BOX(&jagflash::torch_binding::fwd));
  m.impl("bwd", TORCH_BOX(&jagflash::torch_binding::bwd));
  m.impl("pooled_fwd", TORCH_BOX(&jagflash::torch_binding::pooled_fwd));
  m.impl("pooled_bwd", TORCH_BOX(&jagflash::torch_binding::pooled_bwd));
}

// Plain C entry points for the tests (ctypes): the recording above, and whether torch's CUDA
// stream query was found (checkable without a GPU: a CUDA build of torch has it loaded).
JAGFLASH_TORCH_EXPORT int jagflash_torch_found_cuda_stream_query(void) {
  return jagflash::torch_binding::current_cuda_stream_fn() != nullptr;
}

JAGFLASH_TORCH_EXPORT int jagflash_torch_record_fields(void) {
  return jagflash::torch_binding::kRecordFields;
}

JAGFLASH_TORCH_EXPORT void jagflash_torch_set_recording(int on) {
  jagflash::torch_binding::g_recording.store(on != 0, std::memory_order_relaxed);
}

// Copies up to `capacity` recorded fields into `out` and drops them; returns how many were
// recorded in all (call again with a larger buffer if that exceeds `capacity`: nothing is lost).
JAGFLASH_TORCH_EXPORT int64_t jagflash_torch_take_records(int64_t* out, int64_t capacity) {
  using namespace jagflash::torch_binding;
  const std::lock_guard<std::mutex> lock(g_records_mutex);
  const int64_t count = static_cast<int64_t>(g_records.size());
  if (count > capacity) return count;
  std::copy(g_records.begin(), g_records.end(), out);
  g_records.clear();
  return count;
}
