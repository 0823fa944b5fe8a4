#include "testing/gpu_batch.hpp"

#include "core/block_mask.hpp"
#include "core/dtype.hpp"
#include "core/mask.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace jagflash::testing {
namespace {

jf_tensor packed_view(void* data, int64_t rows, int heads, int head_dim, int row_pad) {
  jf_tensor t{};
  t.data = data;
  t.rows = rows;
  t.heads = heads;
  t.head_dim = head_dim;
  t.head_stride = head_dim;
  t.row_stride = static_cast<int64_t>(heads) * head_dim + row_pad;
  return t;
}

DeviceBuffer alloc_tensor(int64_t rows, int heads, int head_dim, int row_pad, jf_dtype dtype) {
  return DeviceBuffer(static_cast<size_t>(rows * (int64_t(heads) * head_dim + row_pad)) * dtype_size(dtype));
}

void check_status(jf_status s, const char* what) {
  if (s != JF_OK) throw std::runtime_error(std::string(what) + ": " + jagflash_last_error());
}

// Rows of the sequences `seqs`, copied from a device tensor into a packed host tensor.
test::HostTensor download_rows(const void* device_data, const jf_tensor& view, jf_dtype dtype,
                               const std::vector<int32_t>& offsets, const std::vector<int32_t>& seqs) {
  int64_t rows = 0;
  for (int32_t b : seqs) rows += offsets[b + 1] - offsets[b];
  test::HostTensor t =
      test::make_tensor(dtype, rows, view.heads, view.head_dim,
                        static_cast<int>(view.row_stride - int64_t(view.heads) * view.head_dim));
  const size_t row_bytes = static_cast<size_t>(view.row_stride) * dtype_size(dtype);
  int64_t dst_row = 0;
  for (int32_t b : seqs) {
    const int64_t n = offsets[b + 1] - offsets[b];
    if (n > 0)
      cuda_check(cudaMemcpy(t.bytes.data() + dst_row * row_bytes,
                            static_cast<const char*>(device_data) + offsets[b] * row_bytes, n * row_bytes,
                            cudaMemcpyDeviceToHost),
                 "cudaMemcpy sample rows");
    dst_row += n;
  }
  return t;
}

// lse [H, total] of the sampled sequences, packed as [H, sample_total].
std::vector<float> download_lse(const DeviceBuffer& lse, int heads, int64_t total,
                                const std::vector<int32_t>& offsets, const std::vector<int32_t>& seqs) {
  int64_t rows = 0;
  for (int32_t b : seqs) rows += offsets[b + 1] - offsets[b];
  std::vector<float> host(static_cast<size_t>(heads * rows));
  for (int h = 0; h < heads; ++h) {
    int64_t dst = 0;
    for (int32_t b : seqs) {
      const int64_t n = offsets[b + 1] - offsets[b];
      if (n > 0)
        cuda_check(cudaMemcpy(host.data() + h * rows + dst, lse.as<float>() + h * total + offsets[b],
                              n * sizeof(float), cudaMemcpyDeviceToHost),
                   "cudaMemcpy sample lse");
      dst += n;
    }
  }
  return host;
}

std::vector<int32_t> sample_lengths(const std::vector<int32_t>& offsets, const std::vector<int32_t>& seqs) {
  std::vector<int32_t> lengths;
  for (int32_t b : seqs) lengths.push_back(offsets[b + 1] - offsets[b]);
  return lengths;
}

}  // namespace

jf_problem GpuBatch::problem() const {
  jf_problem p{};
  p.dtype = spec.dtype;
  p.device = JF_DEVICE_CUDA;
  p.batch_size = static_cast<int32_t>(q_offsets.size()) - 1;
  p.q_offsets = d_q_offsets.as<int32_t>();
  p.kv_offsets = d_kv_offsets.as<int32_t>();
  p.q = q_view;
  p.k = k_view;
  p.v = v_view;
  p.mask = spec.mask;
  p.window_left = spec.window_left;
  p.window_right = spec.window_right;
  p.scale = 0.f;
  p.score_mod = spec.score_mod;
  p.softcap = spec.softcap;
  p.alibi_slopes = spec.alibi_slopes.empty() ? nullptr : d_alibi_slopes.as<float>();
  p.learnable_sink = spec.learnable_sink.empty() ? nullptr : d_sink.as<float>();
  if (spec.block_mask) {
    p.block_mask.blocks = d_blocks.as<uint8_t>();
    p.block_mask.offsets = d_block_offsets.as<int32_t>();
    p.block_mask.bytes = static_cast<int64_t>(d_blocks.bytes());
  }
  return p;
}

jf_fwd_args GpuBatch::forward_args(jf_backend backend) const {
  jf_fwd_args a{};
  a.problem = problem();
  a.out = out_view;
  a.lse = lse.as<float>();
  a.launch.workspace = workspace.get();
  a.launch.workspace_bytes = workspace.bytes();
  a.launch.backend = backend;
  a.launch.max_seqlen_hint = spec.max_seqlen_hint;
  return a;
}

jf_bwd_args GpuBatch::backward_args(jf_backend backend) const {
  jf_bwd_args a{};
  a.problem = problem();
  a.out = out_view;
  a.dout = dout_view;
  a.lse = lse.as<float>();
  a.dq = dq_view;
  a.dk = dk_view;
  a.dv = dv_view;
  a.dlearnable_sink = spec.learnable_sink.empty() ? nullptr : d_dsink.as<float>();
  a.launch.workspace = workspace.get();
  a.launch.workspace_bytes = workspace.bytes();
  a.launch.backend = backend;
  a.launch.max_seqlen_hint = spec.max_seqlen_hint;
  return a;
}

double GpuBatch::forward_flops() const {
  const MaskPolicy mask = MaskPolicy::from(spec.mask, spec.window_left, spec.window_right);
  BlockMask blocks;
  if (spec.block_mask) {
    blocks.blocks = spec.blocks.data();
    blocks.offsets = spec.block_offsets.data();
  }
  double pairs = 0;
  for (size_t b = 0; b + 1 < q_offsets.size(); ++b) {
    const int64_t lq = q_offsets[b + 1] - q_offsets[b], lk = kv_offsets[b + 1] - kv_offsets[b];
    if (!blocks.present()) {
      pairs += static_cast<double>(mask.visible_pairs(lq, lk));
      continue;
    }
    // Each row's key range cut to its query block's visible key blocks.
    for (int64_t i = 0; i < lq; ++i) {
      const IndexRange r = mask.key_range(i, lq, lk);
      if (r.empty()) continue;
      for (int64_t kb = r.lo / BlockMask::kBlock; kb <= r.hi / BlockMask::kBlock; ++kb) {
        if (!blocks.block_visible(static_cast<int32_t>(b), i / BlockMask::kBlock, kb, lk)) continue;
        const IndexRange keys = MaskPolicy::block_rows(kb, BlockMask::kBlock, lk);
        pairs += static_cast<double>(std::min(r.hi, keys.hi) - std::max(r.lo, keys.lo) + 1);
      }
    }
  }
  return 4.0 * spec.heads * spec.head_dim * pairs;
}

GpuBatch make_gpu_batch(const BatchSpec& spec_in) {
  GpuBatch g;
  g.spec = spec_in;
  BatchSpec& s = g.spec;
  if (s.len_kv.empty()) s.len_kv = s.len_q;
  g.q_offsets = test::offsets_from_lengths(s.len_q);
  g.kv_offsets = test::offsets_from_lengths(s.len_kv);
  g.d_q_offsets = DeviceBuffer::from_host(g.q_offsets);
  g.d_kv_offsets = DeviceBuffer::from_host(g.kv_offsets);
  if (!s.alibi_slopes.empty()) g.d_alibi_slopes = DeviceBuffer::from_host(s.alibi_slopes);
  if (!s.learnable_sink.empty()) {
    g.d_sink = DeviceBuffer::from_host(s.learnable_sink);
    g.d_dsink = DeviceBuffer(s.learnable_sink.size() * sizeof(float));
  }
  if (s.block_mask) {
    // At least one byte: a map of no bytes (every sequence empty) still needs a non-null pointer.
    std::vector<uint8_t> bytes = s.blocks;
    if (bytes.empty()) bytes.push_back(0);
    g.d_blocks = DeviceBuffer::from_host(bytes);
    g.d_block_offsets = DeviceBuffer::from_host(s.block_offsets);
  }
  const int64_t tq = g.total_q(), tk = g.total_kv();
  const int dv = s.v_head_dim > 0 ? s.v_head_dim : s.head_dim;
  g.q = alloc_tensor(tq, s.heads, s.head_dim, s.row_pad, s.dtype);
  g.out = alloc_tensor(tq, s.heads, dv, s.row_pad, s.dtype);
  g.dout = alloc_tensor(tq, s.heads, dv, s.row_pad, s.dtype);
  g.dq = alloc_tensor(tq, s.heads, s.head_dim, s.row_pad, s.dtype);
  g.k = alloc_tensor(tk, s.heads_kv, s.head_dim, s.row_pad, s.dtype);
  g.v = alloc_tensor(tk, s.heads_kv, dv, s.row_pad, s.dtype);
  g.dk = alloc_tensor(tk, s.heads_kv, s.head_dim, s.row_pad, s.dtype);
  g.dv = alloc_tensor(tk, s.heads_kv, dv, s.row_pad, s.dtype);
  g.lse = DeviceBuffer(static_cast<size_t>(s.heads * tq) * sizeof(float));
  g.q_view = packed_view(g.q.get(), tq, s.heads, s.head_dim, s.row_pad);
  g.out_view = packed_view(g.out.get(), tq, s.heads, dv, s.row_pad);
  g.dout_view = packed_view(g.dout.get(), tq, s.heads, dv, s.row_pad);
  g.dq_view = packed_view(g.dq.get(), tq, s.heads, s.head_dim, s.row_pad);
  g.k_view = packed_view(g.k.get(), tk, s.heads_kv, s.head_dim, s.row_pad);
  g.v_view = packed_view(g.v.get(), tk, s.heads_kv, dv, s.row_pad);
  g.dk_view = packed_view(g.dk.get(), tk, s.heads_kv, s.head_dim, s.row_pad);
  g.dv_view = packed_view(g.dv.get(), tk, s.heads_kv, dv, s.row_pad);
  fill_uniform(g.q_view, s.dtype, s.seed * 4 + 0, -s.input_range, s.input_range);
  fill_uniform(g.k_view, s.dtype, s.seed * 4 + 1, -s.input_range, s.input_range);
  fill_uniform(g.v_view, s.dtype, s.seed * 4 + 2, -s.input_range, s.input_range);
  fill_uniform(g.dout_view, s.dtype, s.seed * 4 + 3, -s.input_range, s.input_range);
  poison_outputs(g);
  size_t fwd_bytes = 0, bwd_bytes = 0, bwd_det_bytes = 0;
  const jf_fwd_args fa = g.forward_args(JF_BACKEND_AUTO);
  jf_bwd_args ba = g.backward_args(JF_BACKEND_AUTO);
  // A direction no path serves for this spec (JF_ERR_UNSUPPORTED: e.g. the backward at a head dim
  // only the forward takes) needs no workspace: its calls are refused before they use one.
  auto size_or_unsupported = [](jf_status status, const char* what) {
    if (status != JF_ERR_UNSUPPORTED) check_status(status, what);
  };
  size_or_unsupported(jagflash_fwd_workspace_size(&fa, &fwd_bytes), "forward workspace size");
  size_or_unsupported(jagflash_bwd_workspace_size(&ba, &bwd_bytes), "backward workspace size");
  ba.launch.deterministic = 1;  // the deterministic backward needs more (its semaphores)
  size_or_unsupported(jagflash_bwd_workspace_size(&ba, &bwd_det_bytes), "backward workspace size");
  g.workspace = DeviceBuffer(std::max({fwd_bytes, bwd_bytes, bwd_det_bytes}));
  cuda_check(cudaDeviceSynchronize(), "make_gpu_batch");
  return g;
}

void poison_outputs(GpuBatch& g) {
  const jf_dtype dt = g.spec.dtype;
  const float nan = std::nanf("");
  fill_buffer(g.out.get(), g.out.bytes() / dtype_size(dt), dt, nan);
  fill_buffer(g.dq.get(), g.dq.bytes() / dtype_size(dt), dt, nan);
  fill_buffer(g.dk.get(), g.dk.bytes() / dtype_size(dt), dt, nan);
  fill_buffer(g.dv.get(), g.dv.bytes() / dtype_size(dt), dt, nan);
  fill_buffer(g.lse.get(), g.lse.bytes() / sizeof(float), JF_FP32, nan);
  if (g.d_dsink.bytes() > 0) fill_buffer(g.d_dsink.get(), g.d_dsink.bytes() / sizeof(float), JF_FP32, nan);
  cuda_check(cudaDeviceSynchronize(), "poison_outputs");
}

double forward_tolerance(jf_dtype dtype) { return dtype == JF_BF16 ? 1e-2 : dtype == JF_FP16 ? 2e-3 : 1e-5; }
double backward_tolerance(jf_dtype dtype) { return dtype == JF_BF16 ? 2e-2 : dtype == JF_FP16 ? 5e-3 : 1e-4; }

SampleCheck check_sample_against_reference(const GpuBatch& g, const std::vector<int32_t>& seqs,
                                           bool with_backward) {
  const BatchSpec& s = g.spec;
  test::HostBatch host;
  host.dtype = s.dtype;
  host.H = s.heads;
  host.H_kv = s.heads_kv;
  host.D = s.head_dim;
  host.q_offsets = test::offsets_from_lengths(sample_lengths(g.q_offsets, seqs));
  host.kv_offsets = test::offsets_from_lengths(sample_lengths(g.kv_offsets, seqs));
  host.q = download_rows(g.q.get(), g.q_view, s.dtype, g.q_offsets, seqs);
  host.k = download_rows(g.k.get(), g.k_view, s.dtype, g.kv_offsets, seqs);
  host.v = download_rows(g.v.get(), g.v_view, s.dtype, g.kv_offsets, seqs);
  const int64_t sample_q = host.total_q();

  jf_fwd_args fa{};
  fa.problem = test::make_problem(host, s.mask, s.window_left, s.window_right);
  fa.problem.score_mod = s.score_mod;
  fa.problem.softcap = s.softcap;
  fa.problem.alibi_slopes = s.alibi_slopes.empty() ? nullptr : s.alibi_slopes.data();
  fa.problem.learnable_sink = s.learnable_sink.empty() ? nullptr : s.learnable_sink.data();
  // The sampled sequences' maps, back to back (the map of sequence b is its own, whatever its place).
  std::vector<uint8_t> sample_blocks(1, 0);  // at least one byte: a non-null pointer
  std::vector<int32_t> sample_block_offsets(1, 0);
  if (s.block_mask) {
    sample_blocks.clear();
    for (int32_t b : seqs) {
      sample_blocks.insert(sample_blocks.end(), s.blocks.begin() + s.block_offsets[b],
                           s.blocks.begin() + s.block_offsets[b + 1]);
      sample_block_offsets.push_back(static_cast<int32_t>(sample_blocks.size()));
    }
    if (sample_blocks.empty()) sample_blocks.push_back(0);
    fa.problem.block_mask.blocks = sample_blocks.data();
    fa.problem.block_mask.offsets = sample_block_offsets.data();
    fa.problem.block_mask.bytes = static_cast<int64_t>(sample_blocks.size());
  }
  const int dv = s.v_head_dim > 0 ? s.v_head_dim : s.head_dim;
  test::HostTensor ref_out = test::make_tensor(s.dtype, sample_q, s.heads, dv, s.row_pad);
  std::vector<float> ref_lse(static_cast<size_t>(s.heads * sample_q));
  fa.out = ref_out.view();
  fa.lse = ref_lse.data();
  check_status(jagflash_fwd(&fa), "reference forward");

  SampleCheck c;
  const test::HostTensor gpu_out = download_rows(g.out.get(), g.out_view, s.dtype, g.q_offsets, seqs);
  const std::vector<float> gpu_lse = download_lse(g.lse, s.heads, g.total_q(), g.q_offsets, seqs);
  c.out_rel = test::rel_error(gpu_out, ref_out);
  for (size_t i = 0; i < ref_lse.size(); ++i) {
    if (std::isinf(ref_lse[i]) || std::isinf(gpu_lse[i])) {
      if (ref_lse[i] != gpu_lse[i]) c.lse_inf_match = false;
      continue;
    }
    const double d = std::abs(double(gpu_lse[i]) - ref_lse[i]);
    if (!(d <= c.lse_max_abs)) c.lse_max_abs = d;  // NaN propagates
  }
  if (!std::isfinite(c.out_rel) || !std::isfinite(c.lse_max_abs)) c.finite = false;
  if (!with_backward) return c;

  jf_bwd_args ba{};
  ba.problem = fa.problem;
  test::HostTensor dout = download_rows(g.dout.get(), g.dout_view, s.dtype, g.q_offsets, seqs);
  test::HostTensor ref_dq = test::make_tensor(s.dtype, sample_q, s.heads, s.head_dim, s.row_pad);
  test::HostTensor ref_dk = test::make_tensor(s.dtype, host.total_kv(), s.heads_kv, s.head_dim, s.row_pad);
  test::HostTensor ref_dv = test::make_tensor(s.dtype, host.total_kv(), s.heads_kv, dv, s.row_pad);
  ba.out = ref_out.view();
  ba.dout = dout.view();
  ba.lse = ref_lse.data();
  ba.dq = ref_dq.view();
  ba.dk = ref_dk.view();
  ba.dv = ref_dv.view();
  // d sink sums over every row of the batch: comparable only when the sample is the whole batch.
  const bool whole_batch = seqs.size() + 1 == g.q_offsets.size();
  std::vector<float> ref_dsink(s.learnable_sink.size());
  if (!s.learnable_sink.empty() && whole_batch) ba.dlearnable_sink = ref_dsink.data();
  check_status(jagflash_bwd(&ba), "reference backward");
  if (ba.dlearnable_sink != nullptr) {
    std::vector<float> gpu_dsink(ref_dsink.size());
    g.d_dsink.to_host(gpu_dsink.data());
    double diff = 0, scale = 0;
    for (size_t h = 0; h < ref_dsink.size(); ++h) {
      diff = std::max(diff, std::abs(double(gpu_dsink[h]) - ref_dsink[h]));
      if (std::isnan(gpu_dsink[h])) diff = NAN;
      double magnitude = 0;  // sum_i exp(s_h - lse_i) |rowsum(dout_i * out_i)|, from the reference's
      for (int64_t i = 0; i < sample_q; ++i) {
        const float lse_i = ref_lse[h * static_cast<size_t>(sample_q) + static_cast<size_t>(i)];
        if (std::isinf(lse_i)) continue;
        double delta_i = 0;
        for (int d = 0; d < dv; ++d)
          delta_i += ref_out.get(i, static_cast<int>(h), d) * dout.get(i, static_cast<int>(h), d);
        magnitude += std::exp(double(s.learnable_sink[h]) - lse_i) * std::abs(delta_i);
      }
      scale = std::max(scale, magnitude);
    }
    c.dsink_rel = diff / std::max(scale, 1e-30);
  }
  c.dq_rel = test::rel_error(download_rows(g.dq.get(), g.dq_view, s.dtype, g.q_offsets, seqs), ref_dq);
  c.dk_rel = test::rel_error(download_rows(g.dk.get(), g.dk_view, s.dtype, g.kv_offsets, seqs), ref_dk);
  c.dv_rel = test::rel_error(download_rows(g.dv.get(), g.dv_view, s.dtype, g.kv_offsets, seqs), ref_dv);
  if (!std::isfinite(c.dq_rel) || !std::isfinite(c.dk_rel) || !std::isfinite(c.dv_rel) ||
      !std::isfinite(c.dsink_rel))
    c.finite = false;
  return c;
}

}  // namespace jagflash::testing

namespace jagflash::testing {

double device_rel_error(const void* a, const void* b, const jf_tensor& view, jf_dtype dtype) {
  if (view.rows == 0) return 0.0;
  const size_t bytes = static_cast<size_t>(view.rows * view.row_stride) * dtype_size(dtype);
  std::vector<unsigned char> ha(bytes), hb(bytes);
  cuda_check(cudaMemcpy(ha.data(), a, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy compare");
  cuda_check(cudaMemcpy(hb.data(), b, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy compare");
  return dispatch_dtype(dtype, [&](auto storage) {
    using T = decltype(storage);
    const T* pa = reinterpret_cast<const T*>(ha.data());
    const T* pb = reinterpret_cast<const T*>(hb.data());
    double diff2 = 0, ref2 = 0;
    for (int64_t r = 0; r < view.rows; ++r)
      for (int h = 0; h < view.heads; ++h)
        for (int d = 0; d < view.head_dim; ++d) {
          const int64_t i = r * view.row_stride + h * view.head_stride + d;
          const double x = to_float(pa[i]), y = to_float(pb[i]);
          diff2 += (x - y) * (x - y);
          ref2 += y * y;
        }
    return std::sqrt(diff2) / std::max(std::sqrt(ref2), 1e-30);
  });
}

}  // namespace jagflash::testing
