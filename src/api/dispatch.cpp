#include "api/dispatch.hpp"

#include "api/device_error.hpp"
#include "api/error.hpp"
#include "api/offsets_check_device.hpp"
#include "api/sink_gradient_device.hpp"
#include "api/validate.hpp"
#include "api/workspace.hpp"
#include "core/bench_knobs.hpp"
#include "core/dtype.hpp"
#include "core/pooled.hpp"
#include "kernels/fwd/variants.hpp"
#include "kernels/hopper_backward.hpp"
#include "kernels/hopper_forward.hpp"
#include "oracle/oracle.hpp"
#include "reference/reference.hpp"

#include <cuda_runtime.h>

#include <cstdlib>
#include <sstream>
#include <string>

namespace jagflash::detail {
namespace {

// The current GPU can run the oracle's device code: this build's SASS for it, or the portable PTX
// (compute_80) the driver compiles for any GPU of that compute capability or newer. Else a clear
// refusal, where the launch would fail with the runtime's "no kernel image".
void require_oracle_image() {
  cudaFuncAttributes attributes{};
  const cudaError_t err = portable_image(&attributes);
  if (err == cudaSuccess) return;
  cudaGetLastError();  // not sticky: clear it
  if (err == cudaErrorUnsupportedPtxVersion)
    fail_argument("problem.device",
                  "a driver that can compile this build's PTX (one for the CUDA version the library was "
                  "built with)",
                  "an older driver (cudaErrorUnsupportedPtxVersion)", JF_ERR_CUDA);
  if (err != cudaErrorNoKernelImageForDevice && err != cudaErrorInvalidDeviceFunction)
    fail_cuda("cudaFuncGetAttributes (loading the oracle)", err, cudaGetErrorName(err));
  int device = 0, major = 0, minor = 0;
  JF_CUDA_CHECK(cudaGetDevice(&device));
  JF_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  JF_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  std::ostringstream given;
  given << "a GPU of compute capability " << major << "." << minor;
  fail_argument("problem.device", "a GPU of compute capability 8.0 or newer (this build's device code)",
                given.str(), JF_ERR_UNSUPPORTED);
}

// A GPU call no Hopper kernel serves goes to the oracle, which has head dims 64, 128 and 256 only:
// any other head dim is refused here, saying what serves it (the Hopper kernels: bf16/fp16 without a
// score modifier, on a compute capability 9.0 GPU, either direction up to 256).
void require_served_head_dim(const jf_problem& p) {
  const int32_t d = p.q.head_dim, dv = p.v.head_dim;
  // The oracle takes one head dim for q, k and v; the Hopper kernels (their padded ones) take a
  // narrower v, and the CPU reference any.
  if (dv != d) {
    std::ostringstream e;
    e << "q's head dim (" << d << ") for this call on CUDA (a v head dim of its own, " << dv
      << " here, runs on the Hopper kernels on a compute capability 9.0 GPU with bf16/fp16, no score "
         "modifier, no block mask, not pooled, "
      << "either direction; otherwise on CPU tensors only so far)";
    fail_argument("problem.v.head_dim", e.str(), dv, JF_ERR_UNSUPPORTED);
  }
  if (d == 64 || d == 128 || d == 256) return;
  std::ostringstream e;
  e << "64, 128 or 256 for this call on CUDA (head dim " << d << " runs on the Hopper kernels on a compute "
    << "capability 9.0 GPU with bf16/fp16 and no score modifier, either direction; otherwise on CPU tensors "
    << "only so far)";
  fail_argument("problem.q.head_dim", e.str(), d, JF_ERR_UNSUPPORTED);
}

// The oracle entry serving a GPU call, checked to be instantiated and runnable on this GPU.
const oracle::Entry& oracle_for(const jf_problem& p) {
  require_served_head_dim(p);
  const oracle::Entry* e = oracle::find(p.dtype, p.q.head_dim);
  if (e == nullptr) {
    std::ostringstream given;
    given << dtype_name(p.dtype) << "/" << p.q.head_dim;
    fail_argument("problem.dtype/head_dim", "one this build instantiates (" + oracle::instantiated() + ")",
                  given.str(), JF_ERR_UNSUPPORTED);
  }
  require_oracle_image();
  return *e;
}

char* workspace_at(const jf_launch& l, size_t offset) { return static_cast<char*>(l.workspace) + offset; }

// The Hopper entry `found` (nullptr: not instantiated) for a call, or nullptr when the oracle
// serves it (AUTO); an explicit JF_BACKEND_HOPPER that cannot be served is an error saying what
// `served` (the dtypes and head dims that direction has).
template <class Entry>
const Entry* hopper_entry_for(const jf_problem& p, const jf_launch& l, const Entry* found,
                              const char* served) {
  if (p.device != JF_DEVICE_CUDA || l.backend == JF_BACKEND_ORACLE) return nullptr;
  const bool device_ok = kernels::hopper_device_present();
  if (l.backend == JF_BACKEND_HOPPER) {
    if (found == nullptr) {
      std::ostringstream given;
      given << dtype_name(p.dtype) << "/" << p.q.head_dim;
      fail_argument("launch.backend", served, given.str(), JF_ERR_UNSUPPORTED);
    }
    if (!device_ok)
      fail_argument("launch.backend", "JF_BACKEND_HOPPER on a compute capability 9.0 GPU", "another GPU",
                    JF_ERR_UNSUPPORTED);
  }
  return device_ok ? found : nullptr;
}

const kernels::HopperForwardEntry* hopper_forward_for(const jf_problem& p, const jf_launch& l) {
  return hopper_entry_for(
      p, l,
      // A narrower v: the padded kernels, not pooled (untested there).
      p.v.head_dim != p.q.head_dim && is_pooled(p)
          ? nullptr
          : kernels::find_hopper_forward(p.dtype, p.q.head_dim, p.score_mod, p.block_mask.blocks != nullptr,
                                         p.v.head_dim),
      "JF_BACKEND_HOPPER with bf16/fp16 and a head dim up to 256 (64, 128 or 256 with a score modifier, 64 "
      "or "
      "128 with a block mask; as instantiated in this build)");
}
const kernels::HopperForwardEntry* hopper_forward_for(const jf_fwd_args& a) {
  return hopper_forward_for(a.problem, a.launch);
}

// A pooled problem as the Hopper kernels take it: the output rows as the query side (q.rows =
// B * Lq, q_offsets = `pooled_offsets`, b * Lq, which run_forward/run_backward write into the
// workspace; null for the size queries), with pooled_q_rows (= Lq, the rows q itself holds) kept
// for the launchers, which load every sequence's queries from q's first row. Any other problem
// as it is.
jf_problem hopper_view(const jf_problem& p, const int32_t* pooled_offsets = nullptr) {
  if (!is_pooled(p)) return p;
  jf_problem v = p;
  v.q.rows = output_rows(p);
  v.q_offsets = pooled_offsets;
  return v;
}
template <class Args>
Args hopper_view(const Args& a, const int32_t* pooled_offsets = nullptr) {
  Args v = a;
  v.problem = hopper_view(a.problem, pooled_offsets);
  return v;
}

// The forward's workspace before its plan: the flag, the plan key and, pooled, the output rows'
// offsets.
WorkspaceLayout hopper_forward_layout(const jf_fwd_args& a) {
  const WorkspaceLayout w = WorkspaceLayout::forward_gpu();
  return is_pooled(a.problem) ? WorkspaceLayout::with_pooled_offsets(w, a.problem.batch_size) : w;
}

// The plan is built for the tile shape of the variant the launcher runs (HopperForwardLaunch).
schedule::DevicePlanLayout hopper_plan_layout(const jf_fwd_args& a,
                                              const kernels::fwd::ForwardVariant& variant) {
  const jf_fwd_args v = hopper_view(a);
  return schedule::DevicePlanLayout::make(hopper_forward_layout(a).total_bytes, v.problem.batch_size,
                                          v.problem.q.rows, v.problem.k.rows, variant.block_m(),
                                          variant.block_n, v.problem.block_mask.blocks != nullptr);
}

// A forward call's decision: which Hopper entry serves it (null: the oracle or the CPU), the tile
// shape it runs with, that shape's plan layout and the bytes of workspace it needs. Made once a
// call (the size query's checks, then the call's own run on the same answer, which passes the
// variant on to the launcher).
struct ForwardWorkspace {
  const kernels::HopperForwardEntry* hopper = nullptr;
  kernels::fwd::ForwardVariant variant{};
  schedule::DevicePlanLayout plan{};
  size_t bytes = 0;
};

ForwardWorkspace forward_workspace(const jf_fwd_args& a) {
  validate_forward_shapes(a);
  ForwardWorkspace w;
  if (a.problem.device != JF_DEVICE_CUDA) return w;
  w.hopper = hopper_forward_for(a);
  if (w.hopper != nullptr) {
    w.variant = kernels::fwd::choose_forward_variant(hopper_view(a), w.hopper);
    w.plan = hopper_plan_layout(a, w.variant);
    w.bytes = w.plan.total_bytes;
    return w;
  }
  require_served_head_dim(a.problem);
  w.bytes = WorkspaceLayout::forward_gpu().total_bytes;
  return w;
}

const kernels::HopperBackwardEntry* hopper_backward_for(const jf_problem& p, const jf_launch& l) {
  return hopper_entry_for(
      p, l,
      // A narrower v: the padded kernels, not pooled (as the forward).
      p.v.head_dim != p.q.head_dim && is_pooled(p)
          ? nullptr
          : kernels::find_hopper_backward(p.dtype, p.q.head_dim, p.score_mod, p.block_mask.blocks != nullptr,
                                          p.v.head_dim),
      "JF_BACKEND_HOPPER with bf16/fp16 and a head dim up to 256 for the backward (64 or 128 with a score "
      "modifier or a block mask, 256 with softcap or ALiBi; as instantiated in this build; head dim 256 with "
      "a "
      "relative bias is served by the oracle)");
}
const kernels::HopperBackwardEntry* hopper_backward_for(const jf_bwd_args& a) {
  return hopper_backward_for(a.problem, a.launch);
}

// Benchmark and test knob: JAGFLASH_BWD_GROUP_SPLITS = n forces n splits (where n divides the
// group), else kernels::backward_group_splits decides. Read at every call (bench/gqa_bwd.py and
// the tests compare split counts in one process); a getenv is far below a call's cost.
int32_t group_splits_knob() {
  const char* v = bench_knob("JAGFLASH_BWD_GROUP_SPLITS");
  return v != nullptr ? static_cast<int32_t>(std::atoi(v)) : 0;
}

int32_t current_sm_count() {
  int device = 0, count = 0;
  JF_CUDA_CHECK(cudaGetDevice(&device));
  JF_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// How many tiles a query-head group is split over: from the shapes and the GPU alone, so the
// workspace size and the call agree.
int32_t backward_group_splits(const jf_bwd_args& a, int block_n, int block_m) {
  const jf_problem p = hopper_view(a.problem);
  const int32_t group = p.k.heads > 0 ? p.q.heads / p.k.heads : 1;
  if (group <= 1) return 1;
  const int64_t max_pairs =
      schedule::DevicePlanLayout::make(0, p.batch_size, p.k.rows, p.q.rows, block_n, block_m).max_pairs;
  return kernels::backward_group_splits(max_pairs * p.k.heads, group, current_sm_count(),
                                        p.mask != JF_MASK_NONE, group_splits_knob());
}

// A backward call's workspace: which Hopper entry serves it (null: the oracle or the CPU), the
// Hopper layouts (the workspace's regions, then the plan over KV blocks, built by the forward's
// plan builder with the two sides swapped) and the bytes it needs. Computed once a call: the
// group split it depends on asks the device for its SM count.
struct BackwardWorkspace {
  const kernels::HopperBackwardEntry* hopper = nullptr;
  WorkspaceLayout layout;
  schedule::DevicePlanLayout plan{};
  size_t bytes = 0;
};

// The workspace's slack after the last Q row holds a Q block of any backward kernel.
static_assert(kernels::backward_block_m(64) <= WorkspaceLayout::kMaxBlockM &&
                  kernels::backward_block_m(128) <= WorkspaceLayout::kMaxBlockM,
              "WorkspaceLayout::kMaxBlockM");

BackwardWorkspace backward_workspace(const jf_bwd_args& a) {
  validate_backward_shapes(a);
  BackwardWorkspace w;
  const jf_problem& p = a.problem;
  if (p.device != JF_DEVICE_CUDA) return w;
  w.hopper = hopper_backward_for(a);
  if (w.hopper == nullptr) {
    require_served_head_dim(p);
    w.layout = WorkspaceLayout::backward_gpu(p.q.heads, output_rows(p));
    w.bytes = w.layout.total_bytes;
    return w;
  }
  // The dQ accumulator and the split partials keep the kernel's head dim (a padded one's too); the
  // plan's KV blocks are the kernel's (64 keys in the wide one).
  const int block_n = kernels::backward_block_n(w.hopper->head_dim);
  const int block_m =
      kernels::backward_block_m(w.hopper->head_dim, w.hopper->score_mod, w.hopper->block_sparse);
  w.layout = WorkspaceLayout::backward_hopper(p.q.heads, output_rows(p), w.hopper->head_dim, p.k.heads,
                                              p.k.rows, backward_group_splits(a, block_n, block_m));
  if (is_pooled(p)) w.layout = WorkspaceLayout::with_pooled_offsets(w.layout, p.batch_size);
  w.plan = schedule::DevicePlanLayout::make(w.layout.total_bytes, p.batch_size, p.k.rows, output_rows(p),
                                            block_n, block_m, p.block_mask.blocks != nullptr);
  w.bytes = w.plan.total_bytes;
  return w;
}

}  // namespace

jf_backend query_backend(const jf_problem& p, const jf_launch& l, bool backward, int32_t* kernel_head_dim) {
  validate_problem_and_launch(p, l);
  if (kernel_head_dim != nullptr) *kernel_head_dim = p.q.head_dim;  // the reference's and the oracle's
  if (p.device != JF_DEVICE_CUDA) return JF_BACKEND_REFERENCE;
  int hopper_head_dim = 0;
  if (backward) {
    if (const kernels::HopperBackwardEntry* e = hopper_backward_for(p, l)) hopper_head_dim = e->head_dim;
  } else if (const kernels::HopperForwardEntry* e = hopper_forward_for(p, l)) {
    hopper_head_dim = e->head_dim;
  }
  if (hopper_head_dim != 0) {
    if (kernel_head_dim != nullptr) *kernel_head_dim = hopper_head_dim;
    return JF_BACKEND_HOPPER;
  }
  oracle_for(p);  // the call's own checks: head dim, instantiated, device code for this GPU
  return JF_BACKEND_ORACLE;
}

size_t forward_workspace_size(const jf_fwd_args& a) { return forward_workspace(a).bytes; }

size_t backward_workspace_size(const jf_bwd_args& a) { return backward_workspace(a).bytes; }

void run_forward(const jf_fwd_args& a) {
  const jf_problem& p = a.problem;
  const ForwardWorkspace work = forward_workspace(a);
  validate_forward(a, work.bytes, /*require_workspace=*/true);
  if (p.device == JF_DEVICE_CPU) {
    reference::forward(a);
    return;
  }
  const kernels::HopperForwardEntry* hopper = work.hopper;
  const oracle::Entry* entry = hopper ? nullptr : &oracle_for(p);
  const WorkspaceLayout layout = WorkspaceLayout::forward_gpu();
  auto* flag = reinterpret_cast<int32_t*>(workspace_at(a.launch, layout.error_flag_offset));
  auto stream = static_cast<cudaStream_t>(a.launch.stream);
  JF_CUDA_CHECK(launch_offsets_check(p.q_offsets, p.kv_offsets, p.block_mask.offsets, p.block_mask.bytes,
                                     p.batch_size, p.q.rows, p.k.rows, flag,
                                     a.launch.offsets_check == JF_CHECK_OFFSETS_DEVICE, stream));
  if (hopper != nullptr) {
    auto* plan_key = reinterpret_cast<schedule::PlanKey*>(workspace_at(a.launch, layout.plan_key_offset));
    const kernels::HopperForwardLaunch launch{flag,
                                              a.launch.workspace,
                                              plan_key,
                                              work.plan,
                                              /*build_plan=*/a.launch.reuse_plan == 0,
                                              work.variant};
    int32_t* pooled_offsets = nullptr;
    if (is_pooled(p)) {
      pooled_offsets =
          reinterpret_cast<int32_t*>(workspace_at(a.launch, hopper_forward_layout(a).pooled_offsets_offset));
      JF_CUDA_CHECK(schedule::fill_uniform_offsets(pooled_offsets, p.batch_size, p.pooled_q_rows, stream));
    }
    JF_CUDA_CHECK(hopper->run(hopper_view(a, pooled_offsets), launch, stream));
    return;
  }
  JF_CUDA_CHECK(entry->forward(a, oracle::Workspace{flag, nullptr}, stream));
}

void run_backward(const jf_bwd_args& a) {
  const jf_problem& p = a.problem;
  const BackwardWorkspace work = backward_workspace(a);
  validate_backward(a, work.bytes, /*require_workspace=*/true);
  if (p.device == JF_DEVICE_CPU) {
    reference::backward(a);
    return;
  }
  const kernels::HopperBackwardEntry* hopper = work.hopper;
  const oracle::Entry* entry = hopper ? nullptr : &oracle_for(p);
  const WorkspaceLayout& layout = work.layout;
  auto* flag = reinterpret_cast<int32_t*>(workspace_at(a.launch, layout.error_flag_offset));
  auto* delta = reinterpret_cast<float*>(workspace_at(a.launch, layout.delta_offset));
  auto stream = static_cast<cudaStream_t>(a.launch.stream);
  JF_CUDA_CHECK(launch_offsets_check(p.q_offsets, p.kv_offsets, p.block_mask.offsets, p.block_mask.bytes,
                                     p.batch_size, p.q.rows, p.k.rows, flag,
                                     a.launch.offsets_check == JF_CHECK_OFFSETS_DEVICE, stream));
  if (hopper != nullptr) {
    kernels::HopperBackwardLaunch launch{};
    launch.error_flag = flag;
    launch.workspace = a.launch.workspace;
    launch.plan_key = reinterpret_cast<schedule::PlanKey*>(workspace_at(a.launch, layout.plan_key_offset));
    launch.plan = work.plan;
    launch.build_plan = a.launch.reuse_plan == 0;
    launch.lse_log2 = reinterpret_cast<float*>(workspace_at(a.launch, layout.lse_log2_offset));
    launch.delta = delta;
    launch.q_stride = layout.q_stride;
    launch.dq_accum = reinterpret_cast<float*>(workspace_at(a.launch, layout.dq_accum_offset));
    launch.dq_rows = layout.dq_rows;
    launch.dq_sems = a.launch.deterministic
                         ? reinterpret_cast<int32_t*>(workspace_at(a.launch, layout.dq_sems_offset))
                         : nullptr;
    launch.group_splits = layout.group_splits;
    launch.dk_partial = launch.group_splits > 1
                            ? reinterpret_cast<float*>(workspace_at(a.launch, layout.dk_partial_offset))
                            : nullptr;
    launch.dv_partial = launch.group_splits > 1
                            ? reinterpret_cast<float*>(workspace_at(a.launch, layout.dv_partial_offset))
                            : nullptr;
    int32_t* pooled_offsets = nullptr;
    if (is_pooled(p)) {
      pooled_offsets = reinterpret_cast<int32_t*>(workspace_at(a.launch, layout.pooled_offsets_offset));
      JF_CUDA_CHECK(schedule::fill_uniform_offsets(pooled_offsets, p.batch_size, p.pooled_q_rows, stream));
    }
    JF_CUDA_CHECK(hopper->run(hopper_view(a, pooled_offsets), launch, stream));
  } else {
    JF_CUDA_CHECK(entry->backward(a, oracle::Workspace{flag, delta}, stream));
  }
  if (a.dlearnable_sink != nullptr) {
    // Both backwards leave each row's delta in the workspace: the Hopper one in rows of q_stride.
    const SinkGradientArgs sink{flag,
                                a.lse,
                                delta,
                                hopper != nullptr ? layout.q_stride : output_rows(p),
                                output_rows(p),
                                p.q.heads,
                                p.learnable_sink,
                                a.dlearnable_sink};
    JF_CUDA_CHECK(launch_sink_gradient(sink, stream));
  }
}

void read_device_error(const void* workspace, void* stream) {
  if (workspace == nullptr)
    fail_argument("workspace", "the workspace of a JF_CHECK_OFFSETS_DEVICE call", "NULL");
  // A CPU call's workspace (or any host pointer) holds no device flag: say so, not a CUDA error.
  if (!is_device_pointer(workspace))
    fail_argument("workspace", "device memory (the workspace of a GPU call)", "a host pointer");
  int32_t flag = 0;
  auto s = static_cast<cudaStream_t>(stream);
  JF_CUDA_CHECK(cudaMemcpyAsync(
      &flag, static_cast<const char*>(workspace) + WorkspaceLayout::forward_gpu().error_flag_offset,
      sizeof(flag), cudaMemcpyDeviceToHost, s));
  JF_CUDA_CHECK(cudaStreamSynchronize(s));
  if (flag == 0) return;
  // Reported here: a later call must not report the same failure again.
  int device = 0;
  JF_CUDA_CHECK(cudaGetDevice(&device));
  clear_latched_offsets_error(device, flag);
  throw ApiError(JF_ERR_INVALID_ARGUMENT, device_check_failures(flag));
}

}  // namespace jagflash::detail
