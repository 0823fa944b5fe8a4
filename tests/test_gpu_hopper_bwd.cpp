// GPU tests of the Hopper backward (the default GPU backward for bf16/fp16 at head dims 64/128):
// dq, dk, dv against the GPU oracle on the full benchmark batches and against the CPU float64
// reference on awkward ones (lengths, windows, GQA/MQA, fp16, q != kv, row strides); gradients
// never written past the last sequence or into row padding; bitwise-identical repeats (dq too in
// deterministic mode); many zero-length sequences and empty batches; rows that see no key and
// keys that no query sees get exact zeros; the calls it must refuse; AUTO picks it; query-head
// groups split over several tiles (few tiles for the SMs) at every split count.
//
// JAGFLASH_TEST_BWD_DETERMINISTIC=1 (scripts/gpu-check.sh) runs every backward of this file that
// does not test a mode explicitly in deterministic mode.
#include "core/dtype.hpp"
#include "gen/distributions.hpp"
#include "hopper_served.hpp"
#include "testing/gpu_batch.hpp"

#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

namespace jagflash {
namespace {

using testing::BatchSpec;
using testing::DeviceBuffer;
using testing::GpuBatch;

int knob_deterministic() {
  static const int value = [] {
    const char* e = std::getenv("JAGFLASH_TEST_BWD_DETERMINISTIC");
    return e != nullptr && *e != '\0' && std::strcmp(e, "0") != 0 ? 1 : 0;
  }();
  return value;
}

std::string mask_label(const BatchSpec& s) {
  if (s.mask == JF_MASK_NONE) return "none";
  if (s.mask == JF_MASK_CAUSAL) return "causal";
  return "window(" + std::to_string(s.window_left) + "," + std::to_string(s.window_right) + ")";
}

std::string label(const BatchSpec& s) {
  return mask_label(s) + " " + dtype_name(s.dtype) + " D=" + std::to_string(s.head_dim) +
         " H=" + std::to_string(s.heads) + " H_kv=" + std::to_string(s.heads_kv) +
         " row_pad=" + std::to_string(s.row_pad) + " seed=" + std::to_string(s.seed);
}

std::vector<int32_t> all_sequences(const GpuBatch& g) {
  std::vector<int32_t> seqs(g.spec.len_q.size());
  for (size_t b = 0; b < seqs.size(); ++b) seqs[b] = static_cast<int32_t>(b);
  return seqs;
}

// The forward the backward needs (its out and lse).
jf_status forward(const GpuBatch& g, jf_backend backend = JF_BACKEND_HOPPER) {
  const jf_fwd_args fa = g.forward_args(backend);
  return jagflash_fwd(&fa);
}

// The backward's arguments, with a workspace of at least the size queried for exactly this call
// (make_gpu_batch sizes it for AUTO in the default mode).
jf_bwd_args bwd_args(GpuBatch& g, jf_backend backend, int deterministic) {
  jf_bwd_args a = g.backward_args(backend);
  a.launch.deterministic = deterministic;
  size_t bytes = 0;
  if (jagflash_bwd_workspace_size(&a, &bytes) == JF_OK && bytes > g.workspace.bytes()) {
    testing::cuda_check(cudaDeviceSynchronize(), "before replacing the workspace");
    g.workspace = DeviceBuffer(bytes);
    a.launch.workspace = g.workspace.get();
    a.launch.workspace_bytes = g.workspace.bytes();
  }
  return a;
}

// `to` (made from the same spec, so the same inputs) gets `from`'s forward results, so that two
// backends' backwards read the same out and lse and differ only by themselves.
void copy_forward(const GpuBatch& from, GpuBatch& to) {
  if (from.out.bytes() > 0)
    testing::cuda_check(cudaMemcpy(to.out.get(), from.out.get(), from.out.bytes(), cudaMemcpyDeviceToDevice),
                        "copy out");
  if (from.lse.bytes() > 0)
    testing::cuda_check(cudaMemcpy(to.lse.get(), from.lse.get(), from.lse.bytes(), cudaMemcpyDeviceToDevice),
                        "copy lse");
}

// dq, dk, dv (padding included) set to NaN; out and lse, which the backward reads, kept.
void poison_gradients(GpuBatch& g) {
  const jf_dtype dt = g.spec.dtype;
  for (DeviceBuffer* b : {&g.dq, &g.dk, &g.dv})
    testing::fill_buffer(b->get(), b->bytes() / dtype_size(dt), dt, std::nanf(""));
  testing::cuda_check(cudaDeviceSynchronize(), "poison_gradients");
}

std::vector<unsigned char> to_host(const DeviceBuffer& b) {
  std::vector<unsigned char> h(b.bytes());
  b.to_host(h.data());
  return h;
}

bool is_nan_at(const std::vector<unsigned char>& host, int64_t element, jf_dtype dt) {
  if (dt == JF_FP32) {
    float x;
    std::memcpy(&x, host.data() + element * 4, 4);
    return std::isnan(x);
  }
  uint16_t x;
  std::memcpy(&x, host.data() + element * 2, 2);
  if (dt == JF_BF16) return (x & 0x7f80) == 0x7f80 && (x & 0x7f) != 0;
  return (x & 0x7c00) == 0x7c00 && (x & 0x3ff) != 0;  // fp16
}

bool is_zero_at(const std::vector<unsigned char>& host, int64_t element, jf_dtype dt) {
  if (dt == JF_FP32) {
    float x;
    std::memcpy(&x, host.data() + element * 4, 4);
    return x == 0.f;
  }
  uint16_t x;
  std::memcpy(&x, host.data() + element * 2, 2);
  return (x & 0x7fff) == 0;  // +0 or -0 in both 16-bit formats
}

// Some element of the view is NaN (an unwritten one keeps its poison).
bool view_has_nan(const std::vector<unsigned char>& host, const jf_tensor& view, jf_dtype dt) {
  for (int64_t r = 0; r < view.rows; ++r)
    for (int h = 0; h < view.heads; ++h)
      for (int d = 0; d < view.head_dim; ++d)
        if (is_nan_at(host, r * view.row_stride + h * view.head_stride + d, dt)) return true;
  return false;
}

// Every element of the buffer (padding included) still NaN.
bool all_nan(const DeviceBuffer& b, jf_dtype dt) {
  const std::vector<unsigned char> host = to_host(b);
  const int64_t n = static_cast<int64_t>(host.size() / dtype_size(dt));
  for (int64_t i = 0; i < n; ++i)
    if (!is_nan_at(host, i, dt)) return false;
  return true;
}

// Waits for the device at most `seconds`. A kernel that hangs (a peer's backward hangs on batches
// of zero-length sequences) fails here and ends the process, whose context cannot be recovered,
// instead of eating the step's whole time limit in silence.
void expect_finishes_within(double seconds, const std::string& what) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(nullptr);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      ADD_FAILURE() << what << ": " << cudaGetErrorString(e);
      return;
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) {
      ADD_FAILURE() << what << ": the backward did not finish within " << seconds << " s (hung kernel?)";
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(1);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

// The whole batch against the CPU float64 reference (forward and backward).
void expect_matches_reference(const GpuBatch& g) {
  const testing::SampleCheck c = testing::check_sample_against_reference(g, all_sequences(g), true);
  EXPECT_TRUE(c.finite) << "a gradient element was left unwritten (NaN poison survived) or is NaN";
  EXPECT_TRUE(c.lse_inf_match);
  EXPECT_LE(c.out_rel, testing::forward_tolerance(g.spec.dtype));
  EXPECT_LE(c.dq_rel, testing::backward_tolerance(g.spec.dtype)) << "dq";
  EXPECT_LE(c.dk_rel, testing::backward_tolerance(g.spec.dtype)) << "dk";
  EXPECT_LE(c.dv_rel, testing::backward_tolerance(g.spec.dtype)) << "dv";
}

// Hopper forward + Hopper backward on a new batch of `s`, then the CPU reference on all of it; a
// case this build does not serve is noted in `cases` and not run.
void run_hopper_and_check(testing::HopperCases& cases, const BatchSpec& s, int deterministic) {
  if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/true)) return;
  SCOPED_TRACE(label(s) + " deterministic=" + std::to_string(deterministic));
  GpuBatch g = testing::make_gpu_batch(s);
  ASSERT_EQ(forward(g), JF_OK) << jagflash_last_error();
  const jf_bwd_args ba = bwd_args(g, JF_BACKEND_HOPPER, deterministic);
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  expect_finishes_within(60, "backward");
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_matches_reference(g);
}

// dq, dk, dv of `fast` against those of `slow` (the oracle's), relative L2 over the views.
void expect_gradients_close(const GpuBatch& fast, const GpuBatch& slow, double tol) {
  const jf_dtype dt = fast.spec.dtype;
  EXPECT_LE(testing::device_rel_error(fast.dq.get(), slow.dq.get(), fast.dq_view, dt), tol) << "dq";
  EXPECT_LE(testing::device_rel_error(fast.dk.get(), slow.dk.get(), fast.dk_view, dt), tol) << "dk";
  EXPECT_LE(testing::device_rel_error(fast.dv.get(), slow.dv.get(), fast.dv_view, dt), tol) << "dv";
}

// Small enough for compute-sanitizer (scripts/gpu-check.sh SANITIZE=1): both modes, every
// sequence ending inside a tile, GQA, q != kv, lengths 0, 1, 2, row padding.
TEST(GpuHopperBackward, SmallAgainstReference) {
  testing::HopperCases cases;
  BatchSpec a;
  a.len_q = {1, 63, 65, 129, 0, 2};
  a.len_kv = {2, 64, 63, 130, 5, 0};
  a.heads = 2;
  a.heads_kv = 1;
  a.head_dim = 64;
  a.mask = JF_MASK_CAUSAL;
  a.row_pad = 8;
  a.seed = 3;
  BatchSpec b = a;
  b.heads_kv = 2;
  b.head_dim = 128;
  b.dtype = JF_FP16;
  b.mask = JF_MASK_WINDOW;
  b.window_left = 3;
  b.window_right = 20;
  b.row_pad = 0;
  b.seed = 4;
  BatchSpec c = a;  // the wide kernel (64-key tiles, the head dim split between the warpgroups)
  c.head_dim = 256;
  c.heads = 4;
  c.heads_kv = 2;
  c.seed = 5;
  for (const BatchSpec& s : {a, b, c})
    for (int det : {0, 1}) run_hopper_and_check(cases, s, det);
  JF_REPORT_UNSERVED(cases);
}

// Sets a backward knob the dispatcher and the launch read at every call
// (JAGFLASH_BWD_GROUP_SPLITS, JAGFLASH_BWD_L2_GROUP_MB, JAGFLASH_BWD_ROTATE) for one scope; an
// empty value leaves it unset.
struct EnvOverride {
  EnvOverride(const char* name, const char* value) : name_(name) {
    if (*value != '\0') setenv(name, value, 1);
  }
  ~EnvOverride() { unsetenv(name_); }
  const char* name_;
};

// A query-head group split over several tiles (kernels::backward_group_splits: too few tiles for
// the SMs, as MQA/GQA on a few long sequences), each tile's dK/dV going to fp32 partials the
// postprocess sums: every split count forced (8 does not divide b's group of 4: the dispatcher
// falls back to 1 there) and the rule's own choice, against the CPU reference; then 20 repeats
// with 4 splits bitwise equal.
TEST(GpuHopperBackward, SplitGroupsAgainstReference) {
  testing::HopperCases cases;
  BatchSpec a;
  a.len_q = {400, 129, 1, 0, 64};
  a.len_kv = {380, 300, 2, 5, 0};
  a.heads = 8;
  a.heads_kv = 1;
  a.head_dim = 128;
  a.mask = JF_MASK_CAUSAL;
  a.seed = 21;
  BatchSpec b = a;
  b.heads_kv = 2;
  b.head_dim = 64;
  b.dtype = JF_FP16;
  b.mask = JF_MASK_NONE;
  b.row_pad = 8;
  b.seed = 22;
  for (const BatchSpec& s : {a, b})
    for (const char* splits : {"1", "2", "4", "8", ""}) {
      SCOPED_TRACE(std::string("JAGFLASH_BWD_GROUP_SPLITS=") + splits);
      EnvOverride knob("JAGFLASH_BWD_GROUP_SPLITS", splits);
      run_hopper_and_check(cases, s, knob_deterministic());
    }
  if (!cases.serve(testing::HopperCall::of(a), /*with_backward=*/true)) {
    JF_REPORT_UNSERVED(cases);
    return;
  }
  EnvOverride knob("JAGFLASH_BWD_GROUP_SPLITS", "4");
  GpuBatch g = testing::make_gpu_batch(a);
  ASSERT_EQ(forward(g), JF_OK) << jagflash_last_error();
  const jf_bwd_args ba = bwd_args(g, JF_BACKEND_HOPPER, 0);
  std::vector<unsigned char> first_dk, first_dv;
  for (int run = 0; run < 20; ++run) {
    poison_gradients(g);
    ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (run == 0) {
      expect_matches_reference(g);
      first_dk = to_host(g.dk);
      first_dv = to_host(g.dv);
      continue;
    }
    ASSERT_TRUE(to_host(g.dk) == first_dk) << "dk differs from the first run's in run " << run;
    ASSERT_TRUE(to_host(g.dv) == first_dv) << "dv differs from the first run's in run " << run;
  }
  JF_REPORT_UNSERVED(cases);
}

// The tile orders outside the deterministic mode: the L2 groups of (KV head, split) pairs at
// sizes that split these batches' heads into groups of 1, 2-3 (a partial last group) and all
// (0: the plain order), each with and without the rotated start Q block, GQA with split groups
// and MHA, against the CPU reference. The default budget makes one group of every small batch,
// so only the knob reaches the grouped decode on batches a test can check.
TEST(GpuHopperBackward, TileOrdersAgainstReference) {
  testing::HopperCases cases;
  BatchSpec a;
  a.len_q = {700, 129, 1, 0, 300, 64};
  a.len_kv = {650, 300, 2, 5, 300, 0};
  a.heads = 6;
  a.heads_kv = 6;
  a.head_dim = 128;
  a.mask = JF_MASK_NONE;
  a.seed = 31;
  BatchSpec b = a;
  b.heads = 8;
  b.heads_kv = 2;
  b.head_dim = 64;
  b.dtype = JF_FP16;
  b.mask = JF_MASK_CAUSAL;
  b.row_pad = 8;
  b.seed = 32;
  // 1 MB is 1024 rows at D = 128 and 2048 at D = 64: groups of 1 (700 rows) up to all (129 rows).
  for (const BatchSpec& s : {a, b})
    for (const char* mb : {"0", "1", "3"})
      for (const char* rotate : {"0", "1"})
        for (int det : {0, 1}) {  // the deterministic mode takes the groups, never the rotation
          SCOPED_TRACE(std::string("JAGFLASH_BWD_L2_GROUP_MB=") + mb + " JAGFLASH_BWD_ROTATE=" + rotate);
          EnvOverride group("JAGFLASH_BWD_L2_GROUP_MB", mb), rot("JAGFLASH_BWD_ROTATE", rotate);
          run_hopper_and_check(cases, s, det);
        }
  // In the deterministic mode a Q block's partials add in the same turns whatever the tiles'
  // order: dq, dk and dv bitwise the same with groups of one pair as with none.
  for (const BatchSpec& s : {a, b}) {
    if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/true)) continue;
    GpuBatch g = testing::make_gpu_batch(s);
    ASSERT_EQ(forward(g), JF_OK) << jagflash_last_error();
    std::vector<unsigned char> plain[3];
    for (const char* mb : {"0", "1"}) {
      SCOPED_TRACE(std::string("deterministic, JAGFLASH_BWD_L2_GROUP_MB=") + mb);
      EnvOverride group("JAGFLASH_BWD_L2_GROUP_MB", mb);
      poison_gradients(g);
      const jf_bwd_args ba = bwd_args(g, JF_BACKEND_HOPPER, 1);
      ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<unsigned char> now[3] = {to_host(g.dq), to_host(g.dk), to_host(g.dv)};
      if (*mb == '0') {
        for (int i = 0; i < 3; ++i) plain[i] = now[i];
        continue;
      }
      EXPECT_TRUE(now[0] == plain[0]) << "dq";
      EXPECT_TRUE(now[1] == plain[1]) << "dk";
      EXPECT_TRUE(now[2] == plain[2]) << "dv";
    }
  }
  EnvOverride group("JAGFLASH_BWD_L2_GROUP_MB", "1"), splits("JAGFLASH_BWD_GROUP_SPLITS", "2");
  run_hopper_and_check(cases, b, 0);
  JF_REPORT_UNSERVED(cases);
}

TEST(GpuHopperBackward, MatchesOracleOnTheFiveDistributions) {
  testing::HopperCases cases;
  for (const std::string& name : gen::distribution_names())
    for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL})
      for (int d : {64, 128}) {
        BatchSpec s;
        s.len_q = gen::generate_lengths(name, gen::kDefaultSeed);
        s.heads = 4;
        s.heads_kv = 2;
        s.head_dim = d;
        s.mask = mask;
        s.seed = 91;
        SCOPED_TRACE(name + " " + label(s));
        if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/true)) continue;
        GpuBatch fast = testing::make_gpu_batch(s);
        GpuBatch slow = testing::make_gpu_batch(s);  // same seed, same inputs
        ASSERT_EQ(forward(fast), JF_OK) << jagflash_last_error();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        copy_forward(fast, slow);
        const jf_bwd_args fb = bwd_args(fast, JF_BACKEND_HOPPER, knob_deterministic());
        const jf_bwd_args ob = bwd_args(slow, JF_BACKEND_ORACLE, 0);
        ASSERT_EQ(jagflash_bwd(&fb), JF_OK) << jagflash_last_error();
        expect_finishes_within(60, "Hopper backward");
        ASSERT_EQ(jagflash_bwd(&ob), JF_OK) << jagflash_last_error();
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        expect_gradients_close(fast, slow, testing::backward_tolerance(s.dtype));
      }
  JF_REPORT_UNSERVED(cases);
}

// Lengths 0, 1, 2, around the 64/128 tiles, primes (2, 5, 17, 97, 127, 131, 257), q != kv both ways
// (lq > lk under bottom-right alignment leaves rows with no key), every mask kind, MHA/GQA/MQA,
// fp16 and bf16, with and without row padding.
TEST(GpuHopperBackward, AwkwardLengthsWindowsGqaMqaFp16AndStrides) {
  testing::HopperCases cases;
  const std::vector<int32_t> len_q = {0, 1, 2, 63, 64, 65, 127, 129, 131, 5, 0, 257, 1, 200, 97};
  const std::vector<int32_t> len_kv = {3, 1, 0, 64, 65, 63, 129, 127, 17, 200, 0, 256, 130, 10, 97};
  struct Mask {
    jf_mask m;
    int l, r;
  };
  // Not (0, 0): a query that sees one key has P = 1 and dS = dP - delta = 0 in exact arithmetic,
  // so the reference's dq and dk are float64 rounding noise (~1e-17) and a relative error against
  // them means nothing (it comes out astronomically large while dv matches; figures:
  // bench/NOTES.md, "Figures moved out of code comments"). (1, 0) keeps the narrowest window that
  // has a gradient.
  const Mask masks[] = {{JF_MASK_NONE, -1, -1},  {JF_MASK_CAUSAL, -1, -1}, {JF_MASK_WINDOW, 1, 0},
                        {JF_MASK_WINDOW, -1, 5}, {JF_MASK_WINDOW, 100, 0}, {JF_MASK_WINDOW, 7, 300}};
  const int heads_kv[] = {4, 2, 1};
  uint64_t seed = 700;
  int block = 0;
  for (int d : {64, 128, 256})
    for (jf_dtype dtype : {JF_BF16, JF_FP16}) {
      for (int j = 0; j < 6; ++j) {
        BatchSpec s;
        s.len_q = len_q;
        s.len_kv = len_kv;
        s.heads = 4;
        s.heads_kv = heads_kv[(j + block) % 3];  // each mask meets every head layout
        s.head_dim = d;
        s.dtype = dtype;
        s.mask = masks[j].m;
        s.window_left = masks[j].l;
        s.window_right = masks[j].r;
        s.row_pad = (j + block / 2) % 2 ? 8 : 0;
        s.seed = ++seed;
        run_hopper_and_check(cases, s, knob_deterministic());
      }
      ++block;
    }
  JF_REPORT_UNSERVED(cases);
}

// The gradient buffers are longer than their views: the rows after the last sequence belong to
// the caller and must keep their poison, and so must the padding between rows. Everything in the
// views is written (keys that no query sees included: zeros).
TEST(GpuHopperBackward, NeverWritesPastTheLastSequence) {
  testing::HopperCases cases;
  struct Case {
    int d;
    jf_dtype dtype;
  };
  for (Case c : {Case{64, JF_BF16}, Case{128, JF_FP16}}) {
    BatchSpec s;
    s.len_q = {130, 1, 0, 77};  // every sequence ends inside a tile
    s.len_kv = {200, 3, 9, 64};
    s.heads = 4;
    s.heads_kv = 2;
    s.head_dim = c.d;
    s.dtype = c.dtype;
    s.row_pad = 8;
    s.mask = JF_MASK_CAUSAL;
    SCOPED_TRACE(label(s));
    if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/true)) continue;
    GpuBatch g = testing::make_gpu_batch(s);
    ASSERT_EQ(forward(g), JF_OK) << jagflash_last_error();
    const int64_t extra_rows = 200;
    const size_t elem = dtype_size(s.dtype);
    auto poisoned = [&](const jf_tensor& view) {
      DeviceBuffer b(static_cast<size_t>((view.rows + extra_rows) * view.row_stride) * elem);
      testing::fill_buffer(b.get(), b.bytes() / elem, s.dtype, std::nanf(""));
      return b;
    };
    DeviceBuffer big_dq = poisoned(g.dq_view), big_dk = poisoned(g.dk_view), big_dv = poisoned(g.dv_view);
    jf_bwd_args ba = bwd_args(g, JF_BACKEND_HOPPER, knob_deterministic());
    ba.dq.data = big_dq.get();
    ba.dk.data = big_dk.get();
    ba.dv.data = big_dv.get();
    ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    struct Out {
      const char* name;
      const DeviceBuffer* buffer;
      const jf_tensor* view;
    };
    for (Out o :
         {Out{"dq", &big_dq, &g.dq_view}, Out{"dk", &big_dk, &g.dk_view}, Out{"dv", &big_dv, &g.dv_view}}) {
      const std::vector<unsigned char> host = to_host(*o.buffer);
      const int64_t row_stride = o.view->row_stride, written = int64_t(o.view->heads) * o.view->head_dim;
      const int64_t n = static_cast<int64_t>(host.size() / elem);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t row = i / row_stride, col = i % row_stride;
        const bool must_be_written = row < o.view->rows && col < written;
        ASSERT_NE(must_be_written, is_nan_at(host, i, s.dtype)) << o.name << " row " << row << " col " << col;
      }
    }
  }
  JF_REPORT_UNSERVED(cases);
}

// Mid-size batches where many KV blocks (so many CTAs) add into each dq row.
std::vector<BatchSpec> repeat_specs() {
  BatchSpec a;
  a.len_q = gen::generate_lengths("gemskew", 5);
  a.heads = 2;
  a.heads_kv = 1;
  a.head_dim = 128;
  a.mask = JF_MASK_CAUSAL;
  a.seed = 11;
  BatchSpec b;
  b.len_q = {4096, 2500, 1000, 129, 64, 1};
  b.len_kv = {4096, 2600, 900, 129, 300, 1};
  b.heads = 4;
  b.heads_kv = 2;
  b.head_dim = 64;
  b.mask = JF_MASK_NONE;
  b.seed = 12;
  return {a, b};
}

// 100 backwards, the gradients poisoned before each: the first against the oracle, every later
// one bitwise equal to the first (dk and dv; dq too when `compare_dq`). Not run (noted in `cases`)
// where this build does not serve `s`.
void expect_bitwise_repeatable(testing::HopperCases& cases, const BatchSpec& s, int deterministic,
                               bool compare_dq) {
  if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/true)) return;
  SCOPED_TRACE(label(s) + " deterministic=" + std::to_string(deterministic));
  GpuBatch g = testing::make_gpu_batch(s);
  GpuBatch slow = testing::make_gpu_batch(s);
  ASSERT_EQ(forward(g), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  copy_forward(g, slow);
  const jf_bwd_args ob = bwd_args(slow, JF_BACKEND_ORACLE, 0);
  ASSERT_EQ(jagflash_bwd(&ob), JF_OK) << jagflash_last_error();
  const jf_bwd_args ba = bwd_args(g, JF_BACKEND_HOPPER, deterministic);
  std::vector<unsigned char> first_dq, first_dk, first_dv;
  for (int run = 0; run < 100; ++run) {
    poison_gradients(g);
    ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    if (run == 0) {
      expect_gradients_close(g, slow, testing::backward_tolerance(s.dtype));
      if (compare_dq) first_dq = to_host(g.dq);
      first_dk = to_host(g.dk);
      first_dv = to_host(g.dv);
      continue;
    }
    ASSERT_TRUE(to_host(g.dk) == first_dk) << "dk differs from the first run's in run " << run;
    ASSERT_TRUE(to_host(g.dv) == first_dv) << "dv differs from the first run's in run " << run;
    if (compare_dq) {
      ASSERT_TRUE(to_host(g.dq) == first_dq) << "dq differs from the first run's in run " << run;
    }
  }
}

TEST(GpuHopperBackward, DkDvBitwiseIdenticalOverHundredRuns) {
  testing::HopperCases cases;
  for (const BatchSpec& s : repeat_specs()) expect_bitwise_repeatable(cases, s, knob_deterministic(), false);
  JF_REPORT_UNSERVED(cases);
}

TEST(GpuHopperBackward, DeterministicDqBitwiseIdenticalOverHundredRuns) {
  testing::HopperCases cases;
  for (const BatchSpec& s : repeat_specs()) expect_bitwise_repeatable(cases, s, /*deterministic=*/1, true);
  JF_REPORT_UNSERVED(cases);
}

// 2000 sequences, most of length 0, some of length 1 or 2, q != kv (lq > 0 with lk = 0: rows
// with no key; lq = 0 with lk > 0: keys no query sees), and 3000 empty sequences around one of
// 129: they must finish (a peer hangs on such batches) and be right, in both modes.
TEST(GpuHopperBackward, ManyZeroLengthSequencesFinishAndAreCorrect) {
  testing::HopperCases cases;
  std::vector<int32_t> sparse_q(2000, 0), sparse_kv(2000, 0);
  for (int b = 0; b < 2000; ++b) {
    if (b % 10 == 3) {
      sparse_q[b] = sparse_kv[b] = 1;
    } else if (b % 97 == 50) {
      sparse_q[b] = 2;
      sparse_kv[b] = 3;
    } else if (b % 13 == 7) {
      sparse_kv[b] = 1;  // keys no query sees
    } else if (b % 17 == 11) {
      sparse_q[b] = 1;  // a row with no key
    }
  }
  std::vector<int32_t> one_in_3000(3000, 0);
  one_in_3000[1500] = 129;
  struct Lengths {
    const std::vector<int32_t>* q;
    const std::vector<int32_t>* kv;
  };
  uint64_t seed = 40;
  for (Lengths lengths : {Lengths{&sparse_q, &sparse_kv}, Lengths{&one_in_3000, &one_in_3000}})
    for (int d : {64, 128})
      for (int det : {0, 1}) {
        BatchSpec s;
        s.len_q = *lengths.q;
        s.len_kv = *lengths.kv;
        s.heads = 4;
        s.heads_kv = d == 64 ? 1 : 4;
        s.head_dim = d;
        s.mask = det ? JF_MASK_CAUSAL : JF_MASK_NONE;
        s.seed = ++seed;
        run_hopper_and_check(cases, s, det);
      }
  JF_REPORT_UNSERVED(cases);
}

// Batches of 0 rows: no sequence at all, only empty sequences, no queries (keys get dk = dv = 0),
// no keys (rows get dq = 0). Each call succeeds and finishes.
TEST(GpuHopperBackward, EmptyBatches) {
  testing::HopperCases served;
  struct Case {
    const char* what;
    std::vector<int32_t> q, kv;
  };
  const Case cases[] = {{"B = 0", {}, {}},
                        {"three empty sequences", {0, 0, 0}, {0, 0, 0}},
                        {"no queries", {0, 0, 0}, {7, 130, 0}},
                        {"no keys", {5, 0, 64}, {0, 0, 0}}};
  for (const Case& c : cases)
    for (int det : {0, 1}) {
      SCOPED_TRACE(std::string(c.what) + " deterministic=" + std::to_string(det));
      BatchSpec s;
      s.len_q = c.q;
      s.len_kv = c.kv;
      s.heads = 4;
      s.heads_kv = 2;
      s.head_dim = 128;
      s.mask = JF_MASK_CAUSAL;
      if (!served.serve(testing::HopperCall::of(s), /*with_backward=*/true)) continue;
      GpuBatch g = testing::make_gpu_batch(s);
      ASSERT_EQ(forward(g), JF_OK) << jagflash_last_error();
      const jf_bwd_args ba = bwd_args(g, JF_BACKEND_HOPPER, det);
      ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
      expect_finishes_within(30, c.what);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      ASSERT_EQ(cudaGetLastError(), cudaSuccess);
      struct Out {
        const char* name;
        const DeviceBuffer* buffer;
        const jf_tensor* view;
      };
      for (Out o :
           {Out{"dq", &g.dq, &g.dq_view}, Out{"dk", &g.dk, &g.dk_view}, Out{"dv", &g.dv, &g.dv_view}}) {
        const std::vector<unsigned char> host = to_host(*o.buffer);
        for (int64_t r = 0; r < o.view->rows; ++r)
          for (int h = 0; h < o.view->heads; ++h)
            for (int d = 0; d < o.view->head_dim; ++d) {
              const int64_t i = r * o.view->row_stride + h * o.view->head_stride + d;
              ASSERT_TRUE(is_zero_at(host, i, s.dtype))
                  << o.name << " row " << r << " head " << h << " not 0";
            }
      }
    }
  JF_REPORT_UNSERVED(served);
}

// Rows that see no key (lk = 0, or lq > lk under bottom-right alignment) get dq = 0 exactly; keys
// that no query sees get dk = dv = 0 exactly; everything else matches the reference.
TEST(GpuHopperBackward, RowsThatSeeNoKeyGetZeroGradients) {
  testing::HopperCases cases;
  BatchSpec causal;
  causal.len_q = {200, 64, 0, 130};
  causal.len_kv = {10, 0, 64, 129};
  causal.heads = 4;
  causal.heads_kv = 2;
  causal.head_dim = 128;
  causal.mask = JF_MASK_CAUSAL;
  causal.seed = 61;
  BatchSpec window;
  window.len_q = {10, 300, 129};
  window.len_kv = {200, 40, 129};
  window.heads = 4;
  window.heads_kv = 1;
  window.head_dim = 64;
  window.dtype = JF_FP16;
  window.mask = JF_MASK_WINDOW;
  window.window_left = 3;
  window.window_right = 2;
  window.row_pad = 8;
  window.seed = 62;
  for (const BatchSpec& s : {causal, window})
    for (int det : {0, 1}) {
      SCOPED_TRACE(label(s) + " deterministic=" + std::to_string(det));
      if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/true)) continue;
      GpuBatch g = testing::make_gpu_batch(s);
      ASSERT_EQ(forward(g), JF_OK) << jagflash_last_error();
      const jf_bwd_args ba = bwd_args(g, JF_BACKEND_HOPPER, det);
      ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const int left = s.mask == JF_MASK_CAUSAL ? -1 : s.window_left;
      const int right = s.mask == JF_MASK_CAUSAL ? 0 : s.window_right;
      auto sees = [&](int64_t i, int64_t j, int64_t lq, int64_t lk) {  // the rule of jagflash.h
        const int64_t shift = lk - lq;
        return (left < 0 || j >= i + shift - left) && (right < 0 || j <= i + shift + right);
      };
      const std::vector<unsigned char> dq = to_host(g.dq), dk = to_host(g.dk), dv = to_host(g.dv);
      int64_t blind_rows = 0, unseen_keys = 0;
      for (size_t b = 0; b < s.len_q.size(); ++b) {
        const int64_t lq = s.len_q[b], lk = s.len_kv[b];
        for (int64_t i = 0; i < lq; ++i) {
          bool any = false;
          for (int64_t j = 0; j < lk && !any; ++j) any = sees(i, j, lq, lk);
          if (any) continue;
          ++blind_rows;
          const int64_t row = g.q_offsets[b] + i;
          for (int h = 0; h < s.heads; ++h)
            for (int d = 0; d < s.head_dim; ++d)
              ASSERT_TRUE(is_zero_at(dq, row * g.dq_view.row_stride + h * g.dq_view.head_stride + d, s.dtype))
                  << "dq of sequence " << b << " row " << i << " (sees no key) head " << h << " d " << d;
        }
        for (int64_t j = 0; j < lk; ++j) {
          bool any = false;
          for (int64_t i = 0; i < lq && !any; ++i) any = sees(i, j, lq, lk);
          if (any) continue;
          ++unseen_keys;
          const int64_t row = g.kv_offsets[b] + j;
          for (int h = 0; h < s.heads_kv; ++h)
            for (int d = 0; d < s.head_dim; ++d) {
              const int64_t e = row * g.dk_view.row_stride + h * g.dk_view.head_stride + d;
              ASSERT_TRUE(is_zero_at(dk, e, s.dtype) && is_zero_at(dv, e, s.dtype))
                  << "dk/dv of sequence " << b << " key " << j << " (no query sees it) head " << h << " d "
                  << d;
            }
        }
      }
      ASSERT_GT(blind_rows, 0) << "the test batch has no row that sees no key";
      ASSERT_GT(unseen_keys, 0) << "the test batch has no key that no query sees";
      expect_matches_reference(g);
    }
  JF_REPORT_UNSERVED(cases);
}

// JF_BACKEND_HOPPER serves bf16/fp16 at head dims 64, 128 and 256 (at 256 with softcap and
// ALiBi, not the relative bias): anything else, fp32 here, is refused with a message and nothing
// is written; AUTO serves the same call with the oracle.
TEST(GpuHopperBackward, RefusesWhatItCannotServe) {
  struct Case {
    jf_dtype dtype;
    int d;
    jf_score_mod mod;
  };
  testing::HopperCases cases;
  for (Case c : {Case{JF_FP32, 256, JF_SCORE_MOD_SOFTCAP}, Case{JF_FP32, 256, JF_SCORE_MOD_NONE},
                 Case{JF_FP32, 128, JF_SCORE_MOD_NONE}, Case{JF_FP32, 64, JF_SCORE_MOD_NONE}}) {
    if (!cases.oracle_has(c.dtype, c.d)) continue;  // AUTO serves the call with the oracle
    BatchSpec s;
    s.len_q = {5, 9, 130};
    s.len_kv = {5, 70, 100};
    s.heads = 2;
    s.heads_kv = 1;
    s.head_dim = c.d;
    s.dtype = c.dtype;
    s.mask = JF_MASK_CAUSAL;
    s.score_mod = c.mod;
    s.softcap = c.mod == JF_SCORE_MOD_SOFTCAP ? 20.f : 0.f;
    SCOPED_TRACE(label(s));
    GpuBatch g = testing::make_gpu_batch(s);
    ASSERT_EQ(forward(g, JF_BACKEND_AUTO), JF_OK) << jagflash_last_error();  // fp32: the oracle
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    for (int det : {0, 1}) {
      jf_bwd_args ba = bwd_args(g, JF_BACKEND_HOPPER, det);
      EXPECT_EQ(jagflash_bwd(&ba), JF_ERR_UNSUPPORTED);
      const std::string message = jagflash_last_error();
      EXPECT_NE(message.find("JF_BACKEND_HOPPER"), std::string::npos) << message;
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(all_nan(g.dq, s.dtype)) << "dq was written by a refused call";
    EXPECT_TRUE(all_nan(g.dk, s.dtype)) << "dk was written by a refused call";
    EXPECT_TRUE(all_nan(g.dv, s.dtype)) << "dv was written by a refused call";
    const jf_bwd_args auto_args = bwd_args(g, JF_BACKEND_AUTO, 0);
    ASSERT_EQ(jagflash_bwd(&auto_args), JF_OK) << jagflash_last_error();
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    expect_matches_reference(g);
  }
  JF_REPORT_UNSERVED(cases);
}

// On an sm_90 GPU, AUTO runs the Hopper backward: dk and dv bitwise those of JF_BACKEND_HOPPER
// (the oracle's would differ), dq too in deterministic mode. (Sequences too long for the CPU
// reference: the Hopper results' correctness is the other tests' business.)
TEST(GpuHopperBackward, AutoMatchesHopperBitwise) {
  testing::HopperCases cases;
  BatchSpec a;
  a.len_q = {1000, 3, 517, 0, 64, 129, 2048};
  a.heads = 4;
  a.heads_kv = 2;
  a.head_dim = 128;
  a.mask = JF_MASK_CAUSAL;
  a.seed = 81;
  BatchSpec b = a;
  b.len_kv = {900, 30, 517, 5, 64, 200, 1024};
  b.head_dim = 64;
  b.dtype = JF_FP16;
  b.mask = JF_MASK_WINDOW;
  b.window_left = 200;
  b.window_right = 17;
  b.row_pad = 8;
  b.seed = 82;
  for (const BatchSpec& s : {a, b})
    for (int det : {0, 1}) {
      SCOPED_TRACE(label(s) + " deterministic=" + std::to_string(det));
      if (!cases.serve(testing::HopperCall::of(s), /*with_backward=*/true)) continue;
      GpuBatch g = testing::make_gpu_batch(s);
      ASSERT_EQ(forward(g), JF_OK) << jagflash_last_error();
      const jf_bwd_args hopper = bwd_args(g, JF_BACKEND_HOPPER, det);
      ASSERT_EQ(jagflash_bwd(&hopper), JF_OK) << jagflash_last_error();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const std::vector<unsigned char> dq = to_host(g.dq), dk = to_host(g.dk), dv = to_host(g.dv);
      ASSERT_FALSE(view_has_nan(dq, g.dq_view, s.dtype)) << "dq left unwritten or NaN";
      ASSERT_FALSE(view_has_nan(dk, g.dk_view, s.dtype)) << "dk left unwritten or NaN";
      ASSERT_FALSE(view_has_nan(dv, g.dv_view, s.dtype)) << "dv left unwritten or NaN";
      poison_gradients(g);
      const jf_bwd_args automatic = bwd_args(g, JF_BACKEND_AUTO, det);
      ASSERT_EQ(jagflash_bwd(&automatic), JF_OK) << jagflash_last_error();
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(to_host(g.dk) == dk) << "dk: AUTO did not run the Hopper backward";
      EXPECT_TRUE(to_host(g.dv) == dv) << "dv: AUTO did not run the Hopper backward";
      const std::vector<unsigned char> auto_dq = to_host(g.dq);
      if (det) {
        EXPECT_TRUE(auto_dq == dq) << "dq (deterministic mode): AUTO differs from HOPPER";
      } else {
        EXPECT_FALSE(view_has_nan(auto_dq, g.dq_view, s.dtype)) << "dq left unwritten by AUTO";
      }
    }
  JF_REPORT_UNSERVED(cases);
}

}  // namespace
}  // namespace jagflash

namespace jagflash {
namespace {

// jf_launch.reuse_plan in the backward: a plan built by one call (either mode) serves the next
// (same dk/dv bits, and dq in deterministic mode); a workspace whose plan was built for another
// batch is refused on the device (nothing written, jagflash_read_device_error names reuse_plan).
TEST(GpuHopperBackward, ReusedPlanAcrossModesAndMisuse) {
  BatchSpec s;
  s.len_q = {700, 5, 0, 129, 2000};
  s.heads = 4;
  s.heads_kv = 2;
  s.head_dim = 128;
  s.mask = JF_MASK_CAUSAL;
  s.seed = 91;
  JF_SKIP_UNLESS_HOPPER_SERVES(testing::HopperCall::of(s), /*with_backward=*/true);
  GpuBatch g = testing::make_gpu_batch(s);
  ASSERT_EQ(forward(g), JF_OK) << jagflash_last_error();
  jf_bwd_args built = bwd_args(g, JF_BACKEND_HOPPER, 1);
  ASSERT_EQ(jagflash_bwd(&built), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<unsigned char> dq = to_host(g.dq), dk = to_host(g.dk), dv = to_host(g.dv);
  ASSERT_FALSE(view_has_nan(dk, g.dk_view, s.dtype));
  // The plan the deterministic call built (KV blocks last to first), reused in both modes; the
  // default order, and L2 groups of one (KV head) pair (the grouped decode of a last-to-first plan).
  // The rotated start Q block (JAGFLASH_BWD_ROTATE=1) sums a tile's dK/dV in another order, so
  // bitwise equality with the deterministic call holds without it only: off here, whatever the
  // environment says (TileOrdersAgainstReference checks it against the reference).
  EnvOverride no_rotation("JAGFLASH_BWD_ROTATE", "0");
  for (const char* group_mb : {"", "1"})
    for (int det : {1, 0}) {
      SCOPED_TRACE("reused in deterministic=" + std::to_string(det) +
                   " JAGFLASH_BWD_L2_GROUP_MB=" + group_mb);
      EnvOverride group("JAGFLASH_BWD_L2_GROUP_MB", group_mb);
      poison_gradients(g);
      jf_bwd_args reuse = bwd_args(g, JF_BACKEND_HOPPER, det);
      reuse.launch.reuse_plan = 1;
      ASSERT_EQ(jagflash_bwd(&reuse), JF_OK) << jagflash_last_error();
      ASSERT_EQ(jagflash_read_device_error(reuse.launch.workspace, nullptr), JF_OK) << jagflash_last_error();
      EXPECT_TRUE(to_host(g.dk) == dk) << "dk with a reused plan";
      EXPECT_TRUE(to_host(g.dv) == dv) << "dv with a reused plan";
      if (det) {
        EXPECT_TRUE(to_host(g.dq) == dq) << "dq with a reused plan (deterministic)";
      }
    }
  // Another batch (one row fewer) in the same workspace, told to reuse: the plan key differs.
  BatchSpec other = s;
  other.len_q = {700, 5, 0, 129, 1999};
  GpuBatch h = testing::make_gpu_batch(other);
  ASSERT_EQ(forward(h), JF_OK) << jagflash_last_error();
  jf_bwd_args misuse = bwd_args(h, JF_BACKEND_HOPPER, 0);
  size_t bytes = 0;
  ASSERT_EQ(jagflash_bwd_workspace_size(&misuse, &bytes), JF_OK);
  ASSERT_LE(bytes, g.workspace.bytes());
  misuse.launch.workspace = g.workspace.get();
  misuse.launch.workspace_bytes = g.workspace.bytes();
  misuse.launch.reuse_plan = 1;
  poison_gradients(h);
  ASSERT_EQ(jagflash_bwd(&misuse), JF_OK) << jagflash_last_error();
  EXPECT_EQ(jagflash_read_device_error(misuse.launch.workspace, nullptr), JF_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(jagflash_last_error()).find("launch.reuse_plan"), std::string::npos)
      << jagflash_last_error();
  EXPECT_TRUE(all_nan(h.dq, other.dtype)) << "dq written although the plan was refused";
  EXPECT_TRUE(all_nan(h.dk, other.dtype)) << "dk written although the plan was refused";
  EXPECT_TRUE(all_nan(h.dv, other.dtype)) << "dv written although the plan was refused";
}

}  // namespace
}  // namespace jagflash
