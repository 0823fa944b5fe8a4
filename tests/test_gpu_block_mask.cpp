// GPU tests of block-sparse attention (jf_problem.block_mask): the GPU oracle (JF_BACKEND_ORACLE)
// and the backend AUTO picks (the Hopper kernels on an H200), forward
// (out, lse) and backward (dq, dk, dv) against the CPU float64 reference on every sequence, which
// evaluates the same map (test_reference_block_mask.cpp checks the reference against a dense
// computation): random, document, prefix-LM maps, a map row of zeros (rows that see nothing) and a
// sequence hidden whole; composed with causal and a window; lengths 0 and 1, q != kv, several blocks
// with a cut-short last one, GQA, row padding; bf16 and fp16, D = 64 and 128. AUTO also in the
// deterministic mode, with bitwise repeats of dq, dk, dv. Bad map offsets refused by both offsets
// checks with nothing written (the device check: the call returns JF_OK and
// jagflash_read_device_error reports it); map pointers in host memory refused.
#include "core/dtype.hpp"
#include "gpu_call_checks.hpp"
#include "hopper_served.hpp"
#include "testing/gpu_batch.hpp"

#include <jagflash/jagflash.h>

#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace jagflash {
namespace {

using testing::BatchSpec;
using testing::DeviceBuffer;
using testing::GpuBatch;

constexpr int64_t kBlock = JF_BLOCK_MASK_BLOCK;
int64_t blocks_of(int64_t len) { return (len + kBlock - 1) / kBlock; }

// Whether query block qb sees key block kb of sequence b (the map has nq x nk blocks).
using MapFn = std::function<bool(int32_t b, int64_t qb, int64_t kb, int64_t nq, int64_t nk)>;

struct MapCase {
  const char* name;
  MapFn fn;
};

// Random blocks at ~60% (a fixed hash of the position: the same map on every run); documents of
// 1, 2, then 3+ blocks (block diagonal); prefix-LM (the first key block seen by all, then
// block-causal); query block 1 sees nothing and sequence 2 is hidden whole.
const std::vector<MapCase>& map_cases() {
  static const std::vector<MapCase> cases = {
      {"random",
       [](int32_t b, int64_t qb, int64_t kb, int64_t, int64_t) {
         uint64_t h =
             (uint64_t(b) * 1000003u + uint64_t(qb)) * 998244353u + uint64_t(kb) * 0x9E3779B97F4A7C15ull;
         h ^= h >> 29;
         return h * 0xBF58476D1CE4E5B9ull % 10 < 6;
       }},
      {"document",
       [](int32_t, int64_t qb, int64_t kb, int64_t, int64_t) {
         auto doc = [](int64_t block) { return block < 1 ? 0 : block < 3 ? 1 : 2; };
         return doc(qb) == doc(kb);
       }},
      {"prefix-lm", [](int32_t, int64_t qb, int64_t kb, int64_t, int64_t) { return kb < 1 || kb <= qb; }},
      {"empty row, hidden sequence",
       [](int32_t b, int64_t qb, int64_t, int64_t, int64_t) { return b != 2 && qb != 1; }},
  };
  return cases;
}

void set_map(BatchSpec& s, const MapFn& fn) {
  const std::vector<int32_t>& len_kv = s.len_kv.empty() ? s.len_q : s.len_kv;
  s.block_mask = true;
  s.blocks.clear();
  s.block_offsets.assign(1, 0);
  for (size_t b = 0; b < s.len_q.size(); ++b) {
    const int64_t nq = blocks_of(s.len_q[b]), nk = blocks_of(len_kv[b]);
    for (int64_t qb = 0; qb < nq; ++qb)
      for (int64_t kb = 0; kb < nk; ++kb)
        s.blocks.push_back(fn(static_cast<int32_t>(b), qb, kb, nq, nk) ? uint8_t{1} : uint8_t{0});
    s.block_offsets.push_back(static_cast<int32_t>(s.blocks.size()));
  }
}

// Lengths 1 and 0, one block, a cut-short last block, several blocks, q != kv; GQA 4 / 2; rows
// padded by 8 elements; causal, a window (150, 7) reaching over block edges, or none.
BatchSpec block_batch(int head_dim, jf_dtype dtype, jf_mask mask, uint64_t seed) {
  BatchSpec s = testing::awkward_batch(head_dim, dtype, mask, seed);  // heads, row padding, window (.., 7)
  s.len_q = {1, 0, 300, 129, 128, 2, 200};
  s.len_kv = {1, 3, 300, 260, 127, 0, 385};
  if (mask == JF_MASK_WINDOW) s.window_left = 150;
  return s;
}

std::string label(const BatchSpec& s, const char* map) {
  return std::string(map) + " mask=" + std::to_string(s.mask) + " " + dtype_name(s.dtype) +
         " D=" + std::to_string(s.head_dim) + " seed=" + std::to_string(s.seed);
}

// The workspace for `backend` in both directions and modes (make_gpu_batch sized it for AUTO,
// which may refuse the call).
void size_workspace(GpuBatch& g, jf_backend backend) {
  size_t need = g.workspace.bytes();
  for (int det : {0, 1}) {
    size_t f = 0, b = 0;
    const jf_fwd_args fa = g.forward_args(backend);
    jf_bwd_args ba = g.backward_args(backend);
    ba.launch.deterministic = det;
    ASSERT_EQ(jagflash_fwd_workspace_size(&fa, &f), JF_OK) << jagflash_last_error();
    ASSERT_EQ(jagflash_bwd_workspace_size(&ba, &b), JF_OK) << jagflash_last_error();
    need = std::max({need, f, b});
  }
  if (need > g.workspace.bytes()) g.workspace = DeviceBuffer(need);
}

// Whether AUTO serves g's block mask on this GPU: the Hopper kernels on an H200/H100 where this
// build has them (asserted: a Hopper GPU must not fall back to the oracle there), the oracle
// elsewhere.
bool auto_serves(const GpuBatch& g) {
  const jf_problem p = g.problem();
  jf_launch l{};
  for (jf_direction dir : {JF_DIRECTION_FORWARD, JF_DIRECTION_BACKWARD}) {
    jf_backend b = JF_BACKEND_AUTO;
    const jf_status st = jagflash_query_backend(&p, &l, dir, &b);
    EXPECT_EQ(st, JF_OK) << jagflash_last_error();
    if (st != JF_OK) return false;
    int device = 0, major = 0, minor = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    if (major == 9 && minor == 0 && testing::registry_serves(dir, testing::HopperCall::of(g.spec))) {
      EXPECT_EQ(b, JF_BACKEND_HOPPER) << "a block mask at D = " << p.q.head_dim << " on a Hopper GPU";
    }
  }
  return true;
}

// Forward, then backward on its out and lse, on `backend`; synchronised.
void run(GpuBatch& g, jf_backend backend, int deterministic) {
  const jf_fwd_args fa = g.forward_args(backend);
  ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
  jf_bwd_args ba = g.backward_args(backend);
  ba.launch.deterministic = deterministic;
  ASSERT_EQ(jagflash_bwd(&ba), JF_OK) << jagflash_last_error();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// Every map x mask x dtype x head dim on `backend`.
void sweep(jf_backend backend, uint64_t seed) {
  for (int d : {64, 128})
    for (jf_dtype dt : {JF_BF16, JF_FP16})
      for (jf_mask mask : {JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW})
        for (const MapCase& m : map_cases()) {
          BatchSpec s = block_batch(d, dt, mask, ++seed);
          set_map(s, m.fn);
          SCOPED_TRACE(label(s, m.name) + " backend=" + jagflash_backend_name(backend));
          GpuBatch g = testing::make_gpu_batch(s);
          if (backend == JF_BACKEND_AUTO && !auto_serves(g))
            GTEST_SKIP() << "no GPU backend AUTO picks on this GPU serves block masks yet";
          size_workspace(g, backend);
          if (::testing::Test::HasFatalFailure()) return;
          for (int det : backend == JF_BACKEND_AUTO ? std::vector<int>{0, 1} : std::vector<int>{0}) {
            SCOPED_TRACE("deterministic=" + std::to_string(det));
            testing::poison_outputs(g);
            run(g, backend, det);
            if (::testing::Test::HasFatalFailure()) return;
            testing::expect_matches_reference(g, /*with_backward=*/true);
          }
        }
}

TEST(GpuOracleBlockMask, AgainstReference) { sweep(JF_BACKEND_ORACLE, 1000); }

TEST(GpuBlockMask, AutoAgainstReferenceBothModes) { sweep(JF_BACKEND_AUTO, 2000); }

// A longer batch (several query and key blocks a sequence: the schedule's weights, the kernels'
// block skipping over many blocks) on AUTO in both modes, and on the oracle.
TEST(GpuBlockMask, LongerSequences) {
  for (jf_backend backend : {JF_BACKEND_ORACLE, JF_BACKEND_AUTO})
    for (const MapCase& m : map_cases()) {
      BatchSpec s;
      s.len_q = {1000, 700, 1, 1537};
      s.len_kv = {1000, 1500, 3, 1537};
      s.heads = 4;
      s.heads_kv = 4;
      s.head_dim = 128;
      s.mask = JF_MASK_CAUSAL;
      s.seed = 3000 + backend;
      set_map(s, m.fn);
      SCOPED_TRACE(label(s, m.name) + " backend=" + jagflash_backend_name(backend));
      GpuBatch g = testing::make_gpu_batch(s);
      if (backend == JF_BACKEND_AUTO && !auto_serves(g))
        GTEST_SKIP() << "no GPU backend AUTO picks on this GPU serves block masks yet";
      size_workspace(g, backend);
      for (int det : {0, 1}) {
        testing::poison_outputs(g);
        run(g, backend, det);
        if (::testing::Test::HasFatalFailure()) return;
        testing::expect_matches_reference(g, /*with_backward=*/true);
      }
    }
}

// A small case for compute-sanitizer (scripts/gpu-check.sh, SANITIZE=1): the Hopper kernels on
// a random map and one with an empty row and a hidden sequence, both head dims, causal, both
// backward modes.
TEST(GpuBlockMask, SmallCaseForSanitizers) {
  for (int d : {64, 128})
    for (size_t c : {size_t{0}, size_t{3}}) {
      const MapCase& m = map_cases()[c];
      BatchSpec s;
      s.len_q = {1, 300, 129, 0};
      s.len_kv = {2, 260, 129, 5};
      s.heads = 2;
      s.heads_kv = 1;
      s.head_dim = d;
      s.mask = JF_MASK_CAUSAL;
      s.seed = 5000 + d + c;
      set_map(s, m.fn);
      SCOPED_TRACE(label(s, m.name));
      GpuBatch g = testing::make_gpu_batch(s);
      if (!auto_serves(g)) return;
      size_workspace(g, JF_BACKEND_AUTO);
      for (int det : {0, 1}) {
        testing::poison_outputs(g);
        run(g, JF_BACKEND_AUTO, det);
        if (::testing::Test::HasFatalFailure()) return;
        testing::expect_matches_reference(g, /*with_backward=*/true);
      }
    }
}

// Deterministic mode on AUTO: dq, dk, dv bitwise identical over repeats, every map.
TEST(GpuBlockMask, DeterministicRepeatsAreBitwiseIdentical) {
  for (int d : {64, 128})
    for (const MapCase& m : map_cases()) {
      BatchSpec s = block_batch(d, JF_BF16, JF_MASK_CAUSAL, 4000 + d);
      s.len_q = {300, 17, 513, 129};
      s.len_kv = {300, 40, 513, 260};
      set_map(s, m.fn);
      SCOPED_TRACE(label(s, m.name));
      GpuBatch g = testing::make_gpu_batch(s);
      if (!auto_serves(g)) GTEST_SKIP() << "no GPU backend AUTO picks on this GPU serves block masks yet";
      size_workspace(g, JF_BACKEND_AUTO);
      testing::expect_deterministic_backward_repeats(g, 10);
      if (::testing::Test::HasFatalFailure()) return;
    }
}

// The map removes what it hides: a map that hides blocks changes out, one of ones does not.
TEST(GpuBlockMask, TheMapIsApplied) {
  for (jf_backend backend : {JF_BACKEND_ORACLE, JF_BACKEND_AUTO}) {
    BatchSpec plain = block_batch(128, JF_BF16, JF_MASK_NONE, 5000);
    BatchSpec ones = plain, sparse = plain;
    set_map(ones, [](int32_t, int64_t, int64_t, int64_t, int64_t) { return true; });
    set_map(sparse, map_cases()[0].fn);
    GpuBatch a = testing::make_gpu_batch(plain), b = testing::make_gpu_batch(ones),
             c = testing::make_gpu_batch(sparse);
    if (backend == JF_BACKEND_AUTO && !auto_serves(b)) continue;
    for (GpuBatch* g : {&a, &b, &c}) {
      size_workspace(*g, backend);
      const jf_fwd_args fa = g->forward_args(backend);
      ASSERT_EQ(jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_LT(testing::device_rel_error(b.out.get(), a.out.get(), a.out_view, JF_BF16), 1e-2)
        << jagflash_backend_name(backend);
    EXPECT_GT(testing::device_rel_error(c.out.get(), a.out.get(), a.out_view, JF_BF16), 0.05)
        << jagflash_backend_name(backend);
  }
}

std::vector<unsigned char> bytes_of(const DeviceBuffer& b) {
  std::vector<unsigned char> h(b.bytes());
  b.to_host(h.data());
  return h;
}

// Bad map offsets in both offsets-check modes, forward and backward, on the oracle and AUTO: the
// host check refuses the call naming the entry; the device check lets it return JF_OK, writes
// nothing, and jagflash_read_device_error reports it (which clears it: the next call runs).
// (Offsets past the buffer: the next test.)
TEST(GpuBlockMask, BadOffsetsRefusedByBothChecksWritingNothing) {
  BatchSpec s = block_batch(128, JF_BF16, JF_MASK_CAUSAL, 6000);
  set_map(s, map_cases()[0].fn);
  struct Bad {
    const char* what;
    std::function<void(std::vector<int32_t>&)> spoil;
    const char* host_message;
    const char* device_message;
  } bad[] = {
      {"[0] != 0", [](std::vector<int32_t>& o) { o[0] = 1; },
       "problem.block_mask.offsets[0]: expected 0, got 1", "problem.block_mask.offsets: expected [0] == 0"},
      {"a wrong size", [](std::vector<int32_t>& o) { o[3] += 1; }, "problem.block_mask.offsets[3]",
       "problem.block_mask.offsets: expected [b+1] - [b] == ceil(Lq_b/128) * ceil(Lk_b/128)"},
      {"negative", [](std::vector<int32_t>& o) { o[2] = -4; }, "problem.block_mask.offsets[2]",
       "problem.block_mask.offsets: expected [b+1] - [b]"},
  };
  for (jf_backend backend : {JF_BACKEND_ORACLE, JF_BACKEND_AUTO})
    for (const Bad& c : bad) {
      SCOPED_TRACE(std::string(c.what) + " backend=" + jagflash_backend_name(backend));
      GpuBatch g = testing::make_gpu_batch(s);
      if (backend == JF_BACKEND_AUTO && !auto_serves(g)) continue;
      size_workspace(g, backend);
      if (::testing::Test::HasFatalFailure()) return;
      std::vector<int32_t> offsets = s.block_offsets;
      c.spoil(offsets);
      g.d_block_offsets = DeviceBuffer::from_host(offsets);
      const std::vector<unsigned char> out0 = bytes_of(g.out), lse0 = bytes_of(g.lse), dq0 = bytes_of(g.dq),
                                       dk0 = bytes_of(g.dk), dv0 = bytes_of(g.dv);
      for (jf_offsets_check mode : {JF_CHECK_OFFSETS_HOST, JF_CHECK_OFFSETS_DEVICE}) {
        SCOPED_TRACE(mode == JF_CHECK_OFFSETS_HOST ? "host check" : "device check");
        jf_fwd_args fa = g.forward_args(backend);
        jf_bwd_args ba = g.backward_args(backend);
        fa.launch.offsets_check = ba.launch.offsets_check = mode;
        if (mode == JF_CHECK_OFFSETS_HOST) {
          EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
          EXPECT_NE(std::string(jagflash_last_error()).find(c.host_message), std::string::npos)
              << jagflash_last_error();
          EXPECT_EQ(jagflash_bwd(&ba), JF_ERR_INVALID_ARGUMENT);
          EXPECT_NE(std::string(jagflash_last_error()).find(c.host_message), std::string::npos)
              << jagflash_last_error();
        } else {
          for (int backward = 0; backward < 2; ++backward) {
            ASSERT_EQ(backward ? jagflash_bwd(&ba) : jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
            EXPECT_EQ(jagflash_read_device_error(fa.launch.workspace, nullptr), JF_ERR_INVALID_ARGUMENT)
                << (backward ? "backward" : "forward");
            EXPECT_NE(std::string(jagflash_last_error()).find(c.device_message), std::string::npos)
                << jagflash_last_error();
          }
        }
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(bytes_of(g.out), out0) << "out written";
        EXPECT_EQ(bytes_of(g.lse), lse0) << "lse written";
        EXPECT_EQ(bytes_of(g.dq), dq0) << "dq written";
        EXPECT_EQ(bytes_of(g.dk), dk0) << "dk written";
        EXPECT_EQ(bytes_of(g.dv), dv0) << "dv written";
      }
      // Reported and cleared: a good call runs after them.
      g.d_block_offsets = DeviceBuffer::from_host(s.block_offsets);
      run(g, backend, 0);
    }
}

// Offsets that are right for the sequences but whose last entry offsets[B] passes the caller's
// buffer (problem.block_mask.bytes = offsets[B] - 1, and 0): the host check refuses the call
// naming offsets[B] and bytes; the device check (kBlockMaskPastEnd) lets it return JF_OK, the
// kernels read no map byte and write nothing, and jagflash_read_device_error reports it (cleared:
// the next call runs). Forward and backward, the oracle and AUTO.
TEST(GpuBlockMask, OffsetsPastTheBufferRefusedByBothChecksWritingNothing) {
  BatchSpec s = block_batch(128, JF_BF16, JF_MASK_CAUSAL, 6500);
  set_map(s, map_cases()[0].fn);
  const int64_t map_bytes = s.block_offsets.back();
  ASSERT_GT(map_bytes, 0);
  for (jf_backend backend : {JF_BACKEND_ORACLE, JF_BACKEND_AUTO})
    for (int64_t bytes : {map_bytes - 1, int64_t{0}}) {
      SCOPED_TRACE("bytes=" + std::to_string(bytes) + " backend=" + jagflash_backend_name(backend));
      GpuBatch g = testing::make_gpu_batch(s);
      if (backend == JF_BACKEND_AUTO && !auto_serves(g)) continue;
      size_workspace(g, backend);
      if (::testing::Test::HasFatalFailure()) return;
      const std::vector<unsigned char> out0 = bytes_of(g.out), lse0 = bytes_of(g.lse), dq0 = bytes_of(g.dq),
                                       dk0 = bytes_of(g.dk), dv0 = bytes_of(g.dv);
      const std::string host_message = "problem.block_mask.offsets[B=" + std::to_string(s.len_q.size()) +
                                       "]: expected <= problem.block_mask.bytes = " + std::to_string(bytes) +
                                       " (the size of the blocks buffer), got " + std::to_string(map_bytes);
      const char* device_message = "problem.block_mask.offsets: expected [B] <= problem.block_mask.bytes";
      for (jf_offsets_check mode : {JF_CHECK_OFFSETS_HOST, JF_CHECK_OFFSETS_DEVICE}) {
        SCOPED_TRACE(mode == JF_CHECK_OFFSETS_HOST ? "host check" : "device check");
        jf_fwd_args fa = g.forward_args(backend);
        jf_bwd_args ba = g.backward_args(backend);
        fa.problem.block_mask.bytes = ba.problem.block_mask.bytes = bytes;
        fa.launch.offsets_check = ba.launch.offsets_check = mode;
        if (mode == JF_CHECK_OFFSETS_HOST) {
          EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
          EXPECT_NE(std::string(jagflash_last_error()).find(host_message), std::string::npos)
              << jagflash_last_error();
          EXPECT_EQ(jagflash_bwd(&ba), JF_ERR_INVALID_ARGUMENT);
          EXPECT_NE(std::string(jagflash_last_error()).find(host_message), std::string::npos)
              << jagflash_last_error();
        } else {
          for (int backward = 0; backward < 2; ++backward) {
            ASSERT_EQ(backward ? jagflash_bwd(&ba) : jagflash_fwd(&fa), JF_OK) << jagflash_last_error();
            EXPECT_EQ(jagflash_read_device_error(fa.launch.workspace, nullptr), JF_ERR_INVALID_ARGUMENT)
                << (backward ? "backward" : "forward");
            EXPECT_NE(std::string(jagflash_last_error()).find(device_message), std::string::npos)
                << jagflash_last_error();
          }
        }
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_EQ(bytes_of(g.out), out0) << "out written";
        EXPECT_EQ(bytes_of(g.lse), lse0) << "lse written";
        EXPECT_EQ(bytes_of(g.dq), dq0) << "dq written";
        EXPECT_EQ(bytes_of(g.dk), dk0) << "dk written";
        EXPECT_EQ(bytes_of(g.dv), dv0) << "dv written";
      }
      // Reported and cleared: a good call (bytes the buffer's size) runs after them.
      run(g, backend, 0);
    }
}

// The map's pointers must be device memory on a CUDA call, each named; one without the other is
// refused as on the CPU.
TEST(GpuBlockMask, HostPointersRefused) {
  BatchSpec s = block_batch(64, JF_BF16, JF_MASK_NONE, 7000);
  set_map(s, map_cases()[0].fn);
  GpuBatch g = testing::make_gpu_batch(s);
  size_workspace(g, JF_BACKEND_ORACLE);
  const std::vector<unsigned char> out0 = bytes_of(g.out);
  struct Case {
    const char* what;
    const uint8_t* blocks;
    const int32_t* offsets;
    const char* message;
  } cases[] = {
      {"blocks on the host", s.blocks.data(), g.d_block_offsets.as<int32_t>(),
       "problem.block_mask.blocks: expected a CUDA device pointer"},
      {"offsets on the host", g.d_blocks.as<uint8_t>(), s.block_offsets.data(),
       "problem.block_mask.offsets: expected a CUDA device pointer"},
      {"offsets NULL", g.d_blocks.as<uint8_t>(), nullptr, "problem.block_mask.offsets: expected a non-null"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    for (jf_backend backend : {JF_BACKEND_ORACLE, JF_BACKEND_AUTO}) {
      jf_fwd_args fa = g.forward_args(backend);
      fa.problem.block_mask.blocks = c.blocks;
      fa.problem.block_mask.offsets = c.offsets;
      EXPECT_EQ(jagflash_fwd(&fa), JF_ERR_INVALID_ARGUMENT);
      EXPECT_NE(std::string(jagflash_last_error()).find(c.message), std::string::npos)
          << jagflash_last_error();
      jf_bwd_args ba = g.backward_args(backend);
      ba.problem = fa.problem;
      EXPECT_EQ(jagflash_bwd(&ba), JF_ERR_INVALID_ARGUMENT);
    }
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(bytes_of(g.out), out0) << "out written";
}

}  // namespace
}  // namespace jagflash
