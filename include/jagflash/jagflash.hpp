// jagflash C++ API: the C API with exceptions and defaults. Header-only over the C symbols, so
// C and C++ callers run exactly the same validation and kernels.
#pragma once

#include <jagflash/jagflash.h>

#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace jagflash {

// Thrown for every status other than JF_OK; what() is the library's message.
class Error : public std::runtime_error {
 public:
  Error(jf_status status, const std::string& message) : std::runtime_error(message), status_(status) {}
  jf_status status() const { return status_; }

 private:
  jf_status status_;
};

inline void throw_if_error(jf_status status) {
  if (status != JF_OK) throw Error(status, jagflash_last_error());
}

inline std::string version() { return jagflash_version(); }

// A [rows, heads, head_dim] view with packed heads unless strides are given.
inline jf_tensor tensor_view(void* data, int64_t rows, int32_t heads, int32_t head_dim,
                             int64_t row_stride = 0, int64_t head_stride = 0) {
  jf_tensor t{};
  t.data = data;
  t.rows = rows;
  t.heads = heads;
  t.head_dim = head_dim;
  t.head_stride = head_stride ? head_stride : head_dim;
  t.row_stride = row_stride ? row_stride : static_cast<int64_t>(heads) * t.head_stride;
  return t;
}

// A problem with defaults: no mask, default scale (1/sqrt of q's head dim), default launch. v may
// have a head dim of its own (Dv <= q's): out, dout and dv are then [.., Dv] (jagflash.h).
// Views of CUDA memory are served at head dims 64, 128 and 256 with Dv equal to it; others
// throw Error with JF_ERR_UNSUPPORTED naming the head dim (query_backend says so up front).
inline jf_problem make_problem(jf_dtype dtype, jf_device device, int32_t batch_size, const int32_t* q_offsets,
                               const int32_t* kv_offsets, jf_tensor q, jf_tensor k, jf_tensor v) {
  jf_problem p{};
  p.dtype = dtype;
  p.device = device;
  p.batch_size = batch_size;
  p.q_offsets = q_offsets;
  p.kv_offsets = kv_offsets;
  p.q = q;
  p.k = k;
  p.v = v;
  p.mask = JF_MASK_NONE;
  p.window_left = -1;
  p.window_right = -1;
  p.scale = 0.f;
  return p;
}

inline void set_causal(jf_problem& p) {
  p.mask = JF_MASK_CAUSAL;
  p.window_left = p.window_right = -1;
}

inline void set_window(jf_problem& p, int32_t left, int32_t right) {
  p.mask = JF_MASK_WINDOW;
  p.window_left = left;
  p.window_right = right;
}

// Score modifiers (jf_score_mod): a tanh softcap, cap * tanh(s / cap) of the scaled score s, or
// ALiBi, s - slope_h * |i + Lk - Lq - j| with one fp32 slope per query head (slopes [H], in the
// memory q lives in; read during the call only). Served on CPU and CUDA views alike (jagflash.h
// says which kernel serves which head dim).
inline void set_softcap(jf_problem& p, float cap) {
  p.score_mod = JF_SCORE_MOD_SOFTCAP;
  p.softcap = cap;
  p.alibi_slopes = nullptr;
  p.score_mod_table = nullptr;
  p.score_mod_table_width = 0;
}

inline void set_alibi(jf_problem& p, const float* slopes) {
  p.score_mod = JF_SCORE_MOD_ALIBI;
  p.softcap = 0.f;
  p.alibi_slopes = slopes;
  p.score_mod_table = nullptr;
  p.score_mod_table_width = 0;
}

// A modifier that reads a table (the kinds after ALiBi, jf_score_mod): fp32 [H][width] in the
// memory q lives in, read during the call only.
inline void set_score_mod_table(jf_problem& p, jf_score_mod kind, const float* table, int32_t width) {
  p.score_mod = kind;
  p.softcap = 0.f;
  p.alibi_slopes = nullptr;
  p.score_mod_table = table;
  p.score_mod_table_width = width;
}

// A block-sparse map (jf_block_mask): sequence b's ceil(Lq/128) x ceil(Lk/128) bytes at
// blocks + offsets[b], nonzero = the (query block, key block) pair may attend; both in the memory
// q lives in, read during the call only. `bytes` is the size of the buffer at blocks: the call
// refuses offsets whose offsets[B] exceeds it. Composes with the mask (causal, windows).
inline void set_block_mask(jf_problem& p, const uint8_t* blocks, const int32_t* offsets, int64_t bytes) {
  p.block_mask.blocks = blocks;
  p.block_mask.offsets = offsets;
  p.block_mask.bytes = bytes;
}

// Pooled attention (jf_problem.pooled_q_rows): q [lq, H, D] shared by every sequence, so no q
// offsets; out [B*lq, H, Dv], lse [H, B*lq], dq [lq, H, D] (Dv: v's head dim).
inline void set_pooled(jf_problem& p, int32_t lq) {
  p.pooled_q_rows = lq;
  p.q_offsets = nullptr;
}

// Learnable attention sinks (jf_problem.learnable_sink): one fp32 logit per query head [H], in
// the memory q lives in, read during the call only. A backward call may ask for their gradient
// in jf_bwd_args.dlearnable_sink ([H] fp32, overwritten).
inline void set_learnable_sink(jf_problem& p, const float* sink) { p.learnable_sink = sink; }

inline size_t forward_workspace_size(const jf_fwd_args& args) {
  size_t bytes = 0;
  throw_if_error(jagflash_fwd_workspace_size(&args, &bytes));
  return bytes;
}

inline size_t backward_workspace_size(const jf_bwd_args& args) {
  size_t bytes = 0;
  throw_if_error(jagflash_bwd_workspace_size(&args, &bytes));
  return bytes;
}

// The backend a call of `direction` runs (jagflash_query_backend).
inline jf_backend query_backend(const jf_problem& problem, const jf_launch& launch, jf_direction direction) {
  jf_backend served = JF_BACKEND_AUTO;
  throw_if_error(jagflash_query_backend(&problem, &launch, direction, &served));
  return served;
}

inline void forward(const jf_fwd_args& args) { throw_if_error(jagflash_fwd(&args)); }
inline void backward(const jf_bwd_args& args) { throw_if_error(jagflash_bwd(&args)); }
// Syncs `stream`; throws if an earlier call's device offsets check failed unreported
// (jagflash_synchronize).
inline void synchronize(void* stream = nullptr) { throw_if_error(jagflash_synchronize(stream)); }

inline std::vector<int32_t> generate_lengths(const std::string& distribution, uint64_t seed) {
  int32_t batch = 0;
  throw_if_error(jagflash_generate_lengths(distribution.c_str(), seed, nullptr, 0, &batch));
  std::vector<int32_t> lengths(static_cast<size_t>(batch));
  throw_if_error(jagflash_generate_lengths(distribution.c_str(), seed, lengths.data(), batch, &batch));
  return lengths;
}

}  // namespace jagflash
