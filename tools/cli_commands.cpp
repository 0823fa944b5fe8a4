#include "cli_commands.hpp"

#include "core/bench_knobs.hpp"
#include "core/mask.hpp"
#include "gen/distributions.hpp"
#include "reference/reference.hpp"
#include "testing/gpu_batch.hpp"
#include "testing/host_batch.hpp"

#include <jagflash/jagflash.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace jagflash::cli {
namespace {

using testing::BatchSpec;
using testing::GpuBatch;

// The sample of `run` and the CPU batch stay small enough for the float64 reference.
constexpr int kSampleSequences = 6;
constexpr int32_t kSampleMaxLength = 512;
constexpr int kCpuBatch = 12;    // run on the CPU: the first sequences of the batch, lengths / --scale-down
constexpr int kCheckBatch = 64;  // check's oracle-vs-reference comparison: likewise

const std::string& run_distribution(const Options& o) {
  static const std::string kDefault = "gemskew";
  return o.distributions.empty() ? kDefault : o.distributions.front();
}

// Why `run` takes the CPU reference path, or nullptr when it runs on the GPU.
const char* cpu_reason(const Options& o) {
  if (o.cpu) return "--cpu given";
  if (jagflash_cuda_device_count() == 0) return "no CUDA device found";
  return nullptr;
}

// The first `count` lengths of `name`, each divided by `scale_down` (at least 1).
std::vector<int32_t> scaled_down(const std::string& name, uint64_t seed, size_t count, int scale_down) {
  std::vector<int32_t> lengths = gen::generate_lengths(name, seed);
  if (lengths.size() > count) lengths.resize(count);
  for (int32_t& l : lengths) l = std::max(1, l / scale_down);
  return lengths;
}

// A --scale-down that leaves every sequence one token long checks nothing: each query sees one
// key, its softmax is 1 and out is v whatever q and k are.
void require_longer_than_one(const Options& o, const std::string& name, size_t count, const char* batch) {
  const int k = o.scale_down.value_or(kDefaultScaleDown);
  const std::vector<int32_t> full = scaled_down(name, o.seed, count, 1);
  const int32_t longest = *std::max_element(full.begin(), full.end());
  if (longest / k >= 2 || longest < 2) return;
  throw std::invalid_argument("--scale-down: " + std::to_string(k) + " leaves every sequence of " + batch +
                              " one token long (" + name + "'s first " + std::to_string(full.size()) +
                              " sequences, the longest " + std::to_string(longest) +
                              " tokens), which checks nothing; expected at most " +
                              std::to_string(longest / 2));
}

jf_dtype dtype_of(const std::string& s) { return s == "fp16" ? JF_FP16 : s == "fp32" ? JF_FP32 : JF_BF16; }

void apply_mask(const Options& o, BatchSpec& s) {
  s.mask = o.causal ? JF_MASK_CAUSAL : o.window ? JF_MASK_WINDOW : JF_MASK_NONE;
  s.window_left = o.window ? o.window_left : -1;
  s.window_right = o.window ? o.window_right : -1;
}

std::string mask_label(const BatchSpec& s) {
  if (s.mask == JF_MASK_CAUSAL) return "causal";
  if (s.mask == JF_MASK_WINDOW)
    return "window(" + std::to_string(s.window_left) + "," + std::to_string(s.window_right) + ")";
  return "none";
}

BatchSpec spec_for(const Options& o, std::vector<int32_t> lengths) {
  BatchSpec s;
  s.len_q = std::move(lengths);
  s.heads = o.heads;
  s.heads_kv = o.heads_kv;
  s.head_dim = o.head_dim;
  s.dtype = dtype_of(o.dtype);
  s.seed = o.seed;
  s.input_range = o.input_range;
  apply_mask(o, s);
  return s;
}

void check(jf_status status, const char* what) {
  if (status != JF_OK) throw std::runtime_error(std::string(what) + ": " + jagflash_last_error());
}

// Median of event-timed runs after warm-up.
double median_ms(const std::function<void()>& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t start, stop;
  testing::cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  testing::cuda_check(cudaEventCreate(&stop), "cudaEventCreate");
  std::vector<float> times;
  for (int i = 0; i < iters; ++i) {
    testing::cuda_check(cudaEventRecord(start), "cudaEventRecord");
    fn();
    testing::cuda_check(cudaEventRecord(stop), "cudaEventRecord");
    testing::cuda_check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    testing::cuda_check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// A few sequences short enough for the CPU reference: the shortest, the longest under the cap,
// and random others.
std::vector<int32_t> pick_sample(const std::vector<int32_t>& lengths, uint64_t seed) {
  std::vector<int32_t> eligible;
  for (int32_t b = 0; b < static_cast<int32_t>(lengths.size()); ++b)
    if (lengths[b] <= kSampleMaxLength) eligible.push_back(b);
  // Every sequence longer (uniform1k): the shortest one, so the check still checks something.
  if (eligible.empty())
    eligible.push_back(
        static_cast<int32_t>(std::min_element(lengths.begin(), lengths.end()) - lengths.begin()));
  std::vector<int32_t> sample;
  auto add = [&](int32_t b) {
    if (std::find(sample.begin(), sample.end(), b) == sample.end()) sample.push_back(b);
  };
  add(*std::min_element(eligible.begin(), eligible.end(),
                        [&](int32_t a, int32_t b) { return lengths[a] < lengths[b]; }));
  add(*std::max_element(eligible.begin(), eligible.end(),
                        [&](int32_t a, int32_t b) { return lengths[a] < lengths[b]; }));
  std::mt19937_64 rng(seed);
  for (int tries = 0; tries < 100 && static_cast<int>(sample.size()) < kSampleSequences; ++tries)
    add(eligible[rng() % eligible.size()]);
  std::sort(sample.begin(), sample.end());
  return sample;
}

bool report_sample(const testing::SampleCheck& c, jf_dtype dtype, bool with_backward) {
  const double ftol = testing::forward_tolerance(dtype), btol = testing::backward_tolerance(dtype);
  const double lse_tol = 1e-3;
  bool ok = c.finite && c.lse_inf_match && c.out_rel <= ftol && c.lse_max_abs <= lse_tol;
  std::printf("  out rel %.2e (tol %.0e)  lse max abs %.2e (tol %.0e)  -inf rows %s\n", c.out_rel, ftol,
              c.lse_max_abs, lse_tol, c.lse_inf_match ? "match" : "MISMATCH");
  if (with_backward) {
    ok = ok && c.dq_rel <= btol && c.dk_rel <= btol && c.dv_rel <= btol;
    std::printf("  dq rel %.2e  dk rel %.2e  dv rel %.2e (tol %.0e)\n", c.dq_rel, c.dk_rel, c.dv_rel, btol);
  }
  const double worst = std::max({c.out_rel, c.dq_rel, c.dk_rel, c.dv_rel});
  std::printf("max error %.2e: %s\n", worst, ok ? "PASS" : "FAIL");
  return ok;
}

int run_gpu(const Options& o) {
  const std::string& name = run_distribution(o);
  const std::vector<int32_t> lengths = gen::generate_lengths(name, o.seed);
  GpuBatch g = testing::make_gpu_batch(spec_for(o, lengths));
  const jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  const jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
  std::printf("jagflash %s run on the GPU: %s B=%zu tokens=%lld H=%d H_kv=%d D=%d %s mask=%s\n",
              jagflash_version(), name.c_str(), lengths.size(), static_cast<long long>(g.total_q()), o.heads,
              o.heads_kv, o.head_dim, o.dtype.c_str(), mask_label(g.spec).c_str());
  const int warmup = o.warmup.value_or(kGpuWarmup), iters = o.iters.value_or(kGpuIters);
  const double fwd_ms = median_ms([&] { check(jagflash_fwd(&fa), "forward"); }, warmup, iters);
  const double bwd_ms = median_ms([&] { check(jagflash_bwd(&ba), "backward"); }, warmup, iters);
  const double flops = g.forward_flops();
  std::printf("median of %d after %d warm-up\n", iters, warmup);
  std::printf("forward  %9.3f ms  %8.2f TFLOP/s\n", fwd_ms, flops / fwd_ms * 1e-9);
  std::printf("backward %9.3f ms  %8.2f TFLOP/s (2.5x forward FLOPs)\n", bwd_ms, 2.5 * flops / bwd_ms * 1e-9);

  testing::poison_outputs(g);
  check(jagflash_fwd(&fa), "forward");
  check(jagflash_bwd(&ba), "backward");
  testing::cuda_check(cudaDeviceSynchronize(), "run");
  const std::vector<int32_t> sample = pick_sample(lengths, o.seed);
  std::printf("checking %zu sequences against the CPU float64 reference:\n", sample.size());
  return report_sample(testing::check_sample_against_reference(g, sample, true), g.spec.dtype, true) ? 0 : 1;
}

// loss = <out, dout>, by the reference forward, for the finite-difference check.
double loss_of(test::HostBatch& h, const BatchSpec& s, const test::HostTensor& dout) {
  jf_fwd_args fa{};
  fa.problem = test::make_problem(h, s.mask, s.window_left, s.window_right);
  test::HostTensor out = test::make_tensor(h.dtype, h.total_q(), h.H, h.D);
  fa.out = out.view();
  check(jagflash_fwd(&fa), "reference forward");
  double loss = 0;
  for (int64_t r = 0; r < out.rows; ++r)
    for (int hh = 0; hh < h.H; ++hh)
      for (int d = 0; d < h.D; ++d) loss += out.get(r, hh, d) * dout.get(r, hh, d);
  return loss;
}

// The same values in another dtype: exact from bf16 or fp16 to fp32.
test::HostTensor converted(const test::HostTensor& t, jf_dtype dtype) {
  test::HostTensor c = test::make_tensor(dtype, t.rows, t.heads, t.head_dim);
  for (int64_t r = 0; r < t.rows; ++r)
    for (int hh = 0; hh < t.heads; ++hh)
      for (int d = 0; d < t.head_dim; ++d) c.set(r, hh, d, t.get(r, hh, d));
  return c;
}

// Median wall time of fn's runs after warm-up.
double median_host_ms(const std::function<void()>& fn, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> times;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// One reference forward and backward on h, outputs in h's dtype, with their times.
struct HostRun {
  test::HostTensor out, dq, dk, dv;
  std::vector<float> lse;
  double fwd_ms = 0, bwd_ms = 0;
};

// Each direction timed over `iters` runs after `warmup` (the reference is deterministic: every run
// writes the same outputs).
HostRun reference_run(test::HostBatch& h, const BatchSpec& s, test::HostTensor& dout, int warmup = 0,
                      int iters = 1) {
  HostRun run;
  run.out = test::make_tensor(h.dtype, h.total_q(), h.H, h.D);
  run.dq = test::make_tensor(h.dtype, h.total_q(), h.H, h.D);
  run.dk = test::make_tensor(h.dtype, h.total_kv(), h.H_kv, h.D);
  run.dv = test::make_tensor(h.dtype, h.total_kv(), h.H_kv, h.D);
  run.lse.resize(static_cast<size_t>(h.H * h.total_q()));
  jf_fwd_args fa{};
  fa.problem = test::make_problem(h, s.mask, s.window_left, s.window_right);
  fa.out = run.out.view();
  fa.lse = run.lse.data();
  jf_bwd_args ba{};
  ba.problem = fa.problem;
  ba.out = run.out.view();
  ba.dout = dout.view();
  ba.lse = run.lse.data();
  ba.dq = run.dq.view();
  ba.dk = run.dk.view();
  ba.dv = run.dv.view();
  run.fwd_ms = median_host_ms([&] { check(jagflash_fwd(&fa), "reference forward"); }, warmup, iters);
  run.bwd_ms = median_host_ms([&] { check(jagflash_bwd(&ba), "reference backward"); }, warmup, iters);
  return run;
}

int run_cpu(const Options& o, const char* why) {
  const std::string& name = run_distribution(o);
  const int scale_down = o.scale_down.value_or(kDefaultScaleDown);
  const std::vector<int32_t> lengths = scaled_down(name, o.seed, kCpuBatch, scale_down);
  const BatchSpec s = spec_for(o, lengths);
  std::printf(
      "jagflash %s run on the CPU reference (%s): scaled-down %s (first %zu sequences, lengths / %d, "
      "%lld tokens), H=%d H_kv=%d D=%d %s mask=%s\n",
      jagflash_version(), why, name.c_str(), lengths.size(), scale_down,
      static_cast<long long>(test::offsets_from_lengths(lengths).back()), s.heads, s.heads_kv, s.head_dim,
      o.dtype.c_str(), mask_label(s).c_str());
  test::HostBatch h =
      test::make_random_batch(lengths, lengths, s.heads, s.heads_kv, s.head_dim, s.dtype, o.seed);
  test::HostTensor dout = test::make_tensor(s.dtype, h.total_q(), h.H, h.D);
  // make_random_batch draws from U(-1, 1): q, k, v and dout are drawn again from --input-range's.
  std::mt19937_64 rng(o.seed + 7);
  for (test::HostTensor* t : {&h.q, &h.k, &h.v, &dout}) t->fill_random(rng, -o.input_range, o.input_range);
  const int warmup = o.warmup.value_or(kCpuWarmup), iters = o.iters.value_or(kCpuIters);
  const HostRun got = reference_run(h, s, dout, warmup, iters);
  std::printf("median of %d after %d warm-up\n", iters, warmup);
  std::printf("forward  %9.3f ms (CPU, float64)\nbackward %9.3f ms (CPU, float64)\n", got.fwd_ms, got.bwd_ms);

  // The finite differences below need fp32 inputs (bf16's 8 bits would round the step itself). A
  // bf16 or fp16 run is compared with an fp32 run on the same values, from which it may differ
  // only by the rounding of its outputs, and the fp32 run is the one differentiated.
  bool ok = true;
  double worst = 0;
  test::HostBatch h32;
  test::HostTensor dout32;
  HostRun got32;
  // What the finite differences read: the fp32 batch, its dout and its gradients.
  test::HostBatch* fp32_batch = &h;
  const test::HostTensor* fp32_dout = &dout;
  const HostRun* fp32_run = &got;
  if (s.dtype != JF_FP32) {
    h32 = h;
    h32.dtype = JF_FP32;
    h32.q = converted(h.q, JF_FP32);
    h32.k = converted(h.k, JF_FP32);
    h32.v = converted(h.v, JF_FP32);
    dout32 = converted(dout, JF_FP32);
    got32 = reference_run(h32, s, dout32);
    fp32_batch = &h32;
    fp32_dout = &dout32;
    fp32_run = &got32;
    const double ftol = testing::forward_tolerance(s.dtype), btol = testing::backward_tolerance(s.dtype);
    const double out_rel = test::rel_error(got.out, got32.out), dq_rel = test::rel_error(got.dq, got32.dq),
                 dk_rel = test::rel_error(got.dk, got32.dk), dv_rel = test::rel_error(got.dv, got32.dv);
    // Written so that a NaN fails.
    ok = out_rel <= ftol && dq_rel <= btol && dk_rel <= btol && dv_rel <= btol;
    worst = std::max({out_rel, dq_rel, dk_rel, dv_rel});
    std::printf(
        "  %s vs fp32 on the same values: out rel %.2e (tol %.0e), dq %.2e dk %.2e dv %.2e (tol %.0e)\n",
        o.dtype.c_str(), out_rel, ftol, dq_rel, dk_rel, dv_rel, btol);
  }

  // Directional finite differences of loss = <out, dout> along a random direction, one input at
  // a time: checks that the backward is the derivative of the forward.
  // Not smaller: the loss sums fp32 outputs, whose rounding swamps a smaller step's change at
  // the default H=16, D=128 (a step of 1e-3 misses d/dk by more than kTol; figures:
  // bench/NOTES.md, "Figures moved out of code comments"); the central difference's own error is
  // O(step^2).
  constexpr double kStep = 1e-2;
  constexpr double kTol = 2e-3;
  struct Input {
    const char* name;
    test::HostTensor* x;
    const test::HostTensor* grad;
  };
  std::printf("  finite differences (tol %.0e):\n", kTol);
  for (Input in : {Input{"q", &fp32_batch->q, &fp32_run->dq}, Input{"k", &fp32_batch->k, &fp32_run->dk},
                   Input{"v", &fp32_batch->v, &fp32_run->dv}}) {
    test::HostTensor dir = test::make_tensor(JF_FP32, in.x->rows, in.x->heads, in.x->head_dim);
    dir.fill_random(rng);
    const test::HostTensor saved = *in.x;
    double predicted = 0;
    for (int64_t r = 0; r < dir.rows; ++r)
      for (int hh = 0; hh < dir.heads; ++hh)
        for (int d = 0; d < dir.head_dim; ++d) predicted += in.grad->get(r, hh, d) * dir.get(r, hh, d);
    auto shifted_loss = [&](double t) {
      for (int64_t r = 0; r < dir.rows; ++r)
        for (int hh = 0; hh < dir.heads; ++hh)
          for (int d = 0; d < dir.head_dim; ++d)
            in.x->set(r, hh, d, saved.get(r, hh, d) + t * dir.get(r, hh, d));
      return loss_of(*fp32_batch, s, *fp32_dout);
    };
    const double measured = (shifted_loss(kStep) - shifted_loss(-kStep)) / (2 * kStep);
    *in.x = saved;
    const double err = std::abs(measured - predicted) / std::max(std::abs(measured), 1e-12);
    std::printf("  d loss / d %s along a random direction: backward %.6e, finite difference %.6e, rel %.2e\n",
                in.name, predicted, measured, err);
    ok = ok && err <= kTol;
    worst = std::max(worst, err);
  }
  ok = ok && std::isfinite(worst);
  std::printf("max error %.2e: %s\n", worst, ok ? "PASS" : "FAIL");
  return ok ? 0 : 1;
}

}  // namespace

void validate(const Options& o) {
  if (o.command == "run") {
    if (o.distributions.size() > 1) {
      std::string names;
      for (const std::string& n : o.distributions) names += (names.empty() ? "" : ",") + n;
      throw std::invalid_argument("--dist: run takes one distribution, got " +
                                  std::to_string(o.distributions.size()) + " (" + names + ")");
    }
    if (cpu_reason(o) == nullptr) {
      if (o.scale_down)
        throw std::invalid_argument(
            "--scale-down: applies to run on the CPU reference (--cpu, or no CUDA device); this run is on "
            "the GPU, on the full batch");
    } else {
      require_longer_than_one(o, run_distribution(o), kCpuBatch, "the CPU reference's batch");
    }
  } else if (o.command == "check") {
    for (const std::string& name :
         o.distributions.empty() ? std::vector<std::string>{"gemskew"} : o.distributions)
      require_longer_than_one(o, name, kCheckBatch, "the oracle-vs-reference comparison");
  }
}

int run(const Options& o) {
  const char* why = cpu_reason(o);
  return why != nullptr ? run_cpu(o, why) : run_gpu(o);
}

int check(const Options& o) {
  if (jagflash_cuda_device_count() == 0) {
    std::fprintf(stderr,
                 "jagflash check: needs a CUDA device (none found); `jagflash run` checks the CPU path\n");
    return 1;
  }
  const std::vector<std::string> dists =
      o.distributions.empty() ? std::vector<std::string>{"gemskew"} : o.distributions;
  bool all_ok = true;
  for (const std::string& name : dists) {
    const std::vector<int32_t> lengths = gen::generate_lengths(name, o.seed);
    // 1. The default GPU path against the GPU oracle on the full batch.
    GpuBatch g = testing::make_gpu_batch(spec_for(o, lengths));
    GpuBatch oracle = testing::make_gpu_batch(spec_for(o, lengths));  // same seed: same inputs
    const jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO), oa = oracle.forward_args(JF_BACKEND_ORACLE);
    const jf_bwd_args fb = g.backward_args(JF_BACKEND_AUTO), ob = oracle.backward_args(JF_BACKEND_ORACLE);
    check(jagflash_fwd(&fa), "forward");
    check(jagflash_bwd(&fb), "backward");
    check(jagflash_fwd(&oa), "oracle forward");
    check(jagflash_bwd(&ob), "oracle backward");
    testing::cuda_check(cudaDeviceSynchronize(), "check");
    const jf_dtype dt = g.spec.dtype;
    const double out_rel = testing::device_rel_error(g.out.get(), oracle.out.get(), g.out_view, dt);
    const double dq_rel = testing::device_rel_error(g.dq.get(), oracle.dq.get(), g.dq_view, dt);
    const double dk_rel = testing::device_rel_error(g.dk.get(), oracle.dk.get(), g.dk_view, dt);
    const double dv_rel = testing::device_rel_error(g.dv.get(), oracle.dv.get(), g.dv_view, dt);
    const bool full_ok = out_rel <= testing::forward_tolerance(dt) &&
                         std::max({dq_rel, dk_rel, dv_rel}) <= testing::backward_tolerance(dt);
    std::printf(
        "%s (B=%zu, %lld tokens, mask=%s): GPU path vs GPU oracle: out %.2e dq %.2e dk %.2e dv %.2e: %s\n",
        name.c_str(), lengths.size(), static_cast<long long>(g.total_q()), mask_label(g.spec).c_str(),
        out_rel, dq_rel, dk_rel, dv_rel, full_ok ? "PASS" : "FAIL");
    // 2. The oracle against the CPU reference on the batch scaled down, every sequence.
    const int scale_down = o.scale_down.value_or(kDefaultScaleDown);
    const std::vector<int32_t> small = scaled_down(name, o.seed, kCheckBatch, scale_down);
    GpuBatch s = testing::make_gpu_batch(spec_for(o, small));
    const jf_fwd_args sa = s.forward_args(JF_BACKEND_ORACLE);
    const jf_bwd_args sb = s.backward_args(JF_BACKEND_ORACLE);
    check(jagflash_fwd(&sa), "oracle forward");
    check(jagflash_bwd(&sb), "oracle backward");
    testing::cuda_check(cudaDeviceSynchronize(), "check");
    std::vector<int32_t> all(small.size());
    for (size_t b = 0; b < all.size(); ++b) all[b] = static_cast<int32_t>(b);
    std::printf("%s scaled down (first %zu sequences, lengths / %d): GPU oracle vs CPU reference\n",
                name.c_str(), small.size(), scale_down);
    const bool small_ok = report_sample(testing::check_sample_against_reference(s, all, true), dt, true);
    all_ok = all_ok && full_ok && small_ok;
  }
  return all_ok ? 0 : 1;
}

int bench(const Options& o) {
  if (jagflash_cuda_device_count() == 0) {
    std::fprintf(stderr, "jagflash bench: needs a CUDA device (none found)\n");
    return 1;
  }
  const std::vector<std::string> dists =
      o.distributions.empty() ? gen::distribution_names() : o.distributions;
  // The knobs the library reads (none in a build without them: core/bench_knobs.hpp), as it reads them.
  const char* schedule = bench_knob("JAGFLASH_FWD_SCHEDULE");
  const char* ping_pong = bench_knob("JAGFLASH_FWD_PINGPONG");
  const char* bwd_schedule = bench_knob("JAGFLASH_BWD_SCHEDULE");
  const bool hopper_bwd = (o.dtype == "bf16" || o.dtype == "fp16") && (o.head_dim == 64 || o.head_dim == 128);
  const int warmup = o.warmup.value_or(kGpuWarmup), iters = o.iters.value_or(kGpuIters);
  std::printf(
      "jagflash %s bench: H=%d H_kv=%d D=%d %s, median of %d after %d warm-up; default GPU path: forward = "
      "Hopper kernel where it serves the call (schedule=%s, ping-pong=%s), backward = %s (schedule=%s)\n",
      jagflash_version(), o.heads, o.heads_kv, o.head_dim, o.dtype.c_str(), iters, warmup,
      schedule ? schedule : "dynamic", ping_pong ? ping_pong : "0",
      hopper_bwd ? "Hopper kernel on compute capability 9.0" : "GPU oracle (fp32, no tensor cores)",
      bwd_schedule ? bwd_schedule : "dynamic");
  std::printf(
      "| dist | mask | B | tokens | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s "
      "|\n|---|---|---|---|---|---|---|---|\n");
  for (const std::string& name : dists) {
    GpuBatch g = testing::make_gpu_batch(spec_for(o, gen::generate_lengths(name, o.seed)));
    jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
    jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
    ba.launch.deterministic = o.deterministic ? 1 : 0;
    // The longest sequence, as a caller with FlashAttention's max_seqlen passes it (the peers in
    // bench/compare.py get it too); --no-max-seqlen-hint leaves it unknown.
    if (o.max_seqlen_hint) {
      int32_t longest = 0;
      for (size_t b = 0; b < g.spec.len_q.size(); ++b)
        longest =
            std::max({longest, g.q_offsets[b + 1] - g.q_offsets[b], g.kv_offsets[b + 1] - g.kv_offsets[b]});
      fa.launch.max_seqlen_hint = ba.launch.max_seqlen_hint = longest;
    }
    const double fwd_ms = median_ms([&] { check(jagflash_fwd(&fa), "forward"); }, warmup, iters);
    const double bwd_ms =
        o.forward_only ? NAN : median_ms([&] { check(jagflash_bwd(&ba), "backward"); }, warmup, iters);
    const double flops = g.forward_flops();
    std::printf("| %s | %s | %zu | %lld | %.3f | %.2f | %.3f | %.2f |\n", name.c_str(),
                mask_label(g.spec).c_str(), g.spec.len_q.size(), static_cast<long long>(g.total_q()), fwd_ms,
                flops / fwd_ms * 1e-9, bwd_ms, 2.5 * flops / bwd_ms * 1e-9);
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace jagflash::cli
