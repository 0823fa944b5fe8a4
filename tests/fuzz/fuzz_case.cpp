#include "fuzz_case.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <sstream>

namespace jagflash::fuzz {
namespace {

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();
constexpr int64_t kI64Min = std::numeric_limits<int64_t>::min();
constexpr int32_t kI32Max = std::numeric_limits<int32_t>::max();
constexpr int32_t kI32Min = std::numeric_limits<int32_t>::min();
// A region larger than this is not allocated: its views are then not backed.
constexpr int64_t kMaxRegionBytes = int64_t{4} << 20;
constexpr size_t kRegionAlign = 256;

const int kQSide[] = {kQ, kOut, kDout, kDq};
const int kKSide[] = {kK, kV, kDk, kDv};

std::vector<int> used_buffers(Direction d, bool with_lse) {
  std::vector<int> out;
  for (int b = 0; b < kBufferCount; ++b)
    if (is_used(d, b) && (with_lse || b != kLse)) out.push_back(b);
  return out;
}

std::vector<int32_t> offsets_of(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> o(lengths.size() + 1, 0);
  for (size_t i = 0; i < lengths.size(); ++i) o[i + 1] = o[i] + lengths[i];
  return o;
}

std::string lengths_text(const std::vector<int32_t>& offsets) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i + 1 < offsets.size(); ++i) s << (i ? "," : "") << offsets[i + 1] - offsets[i];
  s << "]";
  return s.str();
}

std::string values_text(const std::vector<int32_t>& v) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i == 16) {
      s << ",... (" << v.size() << " values)";
      break;
    }
    s << (i ? "," : "") << v[i];
  }
  s << "]";
  return s.str();
}

std::string floats_text(const std::vector<float>& v) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i == 8) {
      s << ",... (" << v.size() << " values)";
      break;
    }
    s << (i ? "," : "") << v[i];
  }
  s << "]";
  return s.str();
}

// ALiBi's usual slopes for H heads, 2^(-8 (i + 1) / H); at least one value, at most
// kMaxAlibiSlopes (a head count past it gets fewer slopes than heads, so the call is not backed).
constexpr int32_t kMaxAlibiSlopes = 4096;
std::vector<float> alibi_slopes_for(int32_t heads) {
  const int32_t n = std::clamp<int32_t>(heads, 1, kMaxAlibiSlopes);
  std::vector<float> slopes(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) slopes[static_cast<size_t>(i)] = std::exp2(-8.0f * float(i + 1) / float(n));
  return slopes;
}

// Sink logits for H heads, one per query head, of the size gpt-oss learns (a few units either
// side of 0); at least one value, at most kMaxAlibiSlopes, as the slopes.
std::vector<float> sink_values_for(int32_t heads, Rng& rng) {
  std::vector<float> sinks(static_cast<size_t>(std::clamp<int32_t>(heads, 1, kMaxAlibiSlopes)));
  for (float& x : sinks) x = static_cast<float>(rng.range(-4000, 4000)) / 1000.0f;
  return sinks;
}

// The sinks (and so their gradient, as many floats) sized for q's heads: a mutation that places
// either one places H of them, which no check could see it do otherwise.
void size_sinks_for_heads(CaseSpec& s, Rng& rng) {
  const int32_t heads = s.tensors[kQ].heads;
  if (s.sinks.size() < static_cast<size_t>(std::clamp<int32_t>(heads, 1, kMaxAlibiSlopes)))
    s.sinks = sink_values_for(heads, rng);
}

std::string placement_text(const Placement& p) {
  std::ostringstream s;
  switch (p.kind) {
    case Placement::kOwn:
      s << "own";
      if (p.byte_offset) s << "+" << p.byte_offset << "B";
      break;
    case Placement::kNull:
      s << "NULL";
      break;
    case Placement::kWild:
      s << "wild";
      break;
    case Placement::kInto:
      s << "into " << buffer_name(p.target) << "+" << p.byte_offset << "B";
      break;
  }
  return s.str();
}

std::string sink_gradient_text(const CaseSpec& s) {
  switch (s.sink_gradient_alias) {
    case SinkGradientAlias::kSinks:
      return "= problem.learnable_sink";
    case SinkGradientAlias::kSlopes:
      return "= problem.alibi_slopes";
    case SinkGradientAlias::kNone:
      break;
  }
  return placement_text(s.sink_gradient_place);
}

std::string tensor_text(const jf_tensor& t) {
  std::ostringstream s;
  s << "{rows " << t.rows << ", heads " << t.heads << ", head_dim " << t.head_dim << ", row_stride "
    << t.row_stride << ", head_stride " << t.head_stride << "}";
  return s.str();
}

// lse [H, rows]: rows = B * Lq for a pooled call, else q.rows.
int64_t lse_bytes(const CaseSpec& s) {
  const jf_tensor& q = s.tensors[kQ];
  const __int128 rows = s.pooled_q_rows > 0
                            ? static_cast<__int128>(std::max(s.batch_size, 0)) * s.pooled_q_rows
                            : static_cast<__int128>(q.rows);
  if (rows <= 0) return 0;
  if (q.heads <= 0) return -1;
  const __int128 bytes = static_cast<__int128>(q.heads) * rows * 4;
  return bytes > kI64Max ? -1 : static_cast<int64_t>(bytes);
}

int64_t buffer_bytes(const CaseSpec& s, int b) {
  return b == kLse ? lse_bytes(s) : view_bytes(s.tensors[b], element_bytes(s.dtype));
}

// Saturating conversions: the fuzzer's own arithmetic on mutated fields must not overflow.
int64_t clamp_i64(__int128 x) {
  return x > kI64Max ? kI64Max : x < kI64Min ? kI64Min : static_cast<int64_t>(x);
}
int32_t clamp_i32(int64_t x) {
  return x > kI32Max ? kI32Max : x < kI32Min ? kI32Min : static_cast<int32_t>(x);
}

// Rows of `heads` heads one after another, usually packed, sometimes with padding after each head
// or row (real memory the call must leave alone).
void lay_out(jf_tensor& t, int64_t rows, int32_t heads, int32_t head_dim, Rng& rng) {
  t.rows = rows;
  t.heads = heads;
  t.head_dim = head_dim;
  t.head_stride = head_dim + (rng.chance(70) ? 0 : rng.pick<int64_t>({1, 8, 64}));
  t.row_stride =
      (heads - 1) * t.head_stride + head_dim + (rng.chance(70) ? 0 : rng.pick<int64_t>({1, 8, 128}));
}

// --- mutations: each breaks (or legally varies) one thing and says what -----------------------

int pick_tensor(const CaseSpec& s, Rng& rng) { return rng.pick(used_buffers(s.direction, false)); }
int pick_buffer(const CaseSpec& s, Rng& rng, int other_than) {
  std::vector<int> b = used_buffers(s.direction, true);
  b.erase(std::remove(b.begin(), b.end(), other_than), b.end());
  return rng.pick(b);
}

// A byte offset into `target`'s region: its start, inside it, at its very end (adjacent, so not
// overlapping) or one element either side of that.
int64_t offset_into(const CaseSpec& s, int target, int align, Rng& rng) {
  // Past the largest region there is nothing to overlap: stay within it.
  const int64_t extent = std::clamp<int64_t>(buffer_bytes(s, target), 0, kMaxRegionBytes / 2) / align * align;
  switch (rng.range(0, 5)) {
    case 0:
      return 0;
    case 1:
      return extent > align ? rng.range(0, extent / align - 1) * align : 0;
    case 2:
      return std::max<int64_t>(extent - align, 0);
    case 3:
      return extent;
    case 4:
      return extent + align;
    default:
      return align;
  }
}

void mutate_enum(CaseSpec& s, Rng& rng) {
  struct Field {
    const char* name;
    int* value;
    std::vector<int> wrong;  // besides the out-of-range values every field gets
  } fields[] = {
      {"problem.dtype", &s.dtype, {JF_BF16, JF_FP16, JF_FP32}},
      {"problem.device", &s.device, {JF_DEVICE_CUDA}},
      {"problem.mask", &s.mask, {JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW}},
      {"launch.offsets_check", &s.offsets_check, {JF_CHECK_OFFSETS_DEVICE}},
      {"launch.backend", &s.backend, {JF_BACKEND_REFERENCE, JF_BACKEND_ORACLE, JF_BACKEND_HOPPER}},
  };
  Field& f = fields[rng.range(0, 4)];
  *f.value = rng.chance(40) ? rng.pick(f.wrong) : rng.pick({-1, 3, 4, 7, 100, kI32Min, kI32Max});
  s.mutations.push_back(std::string(f.name) + " = " + std::to_string(*f.value));
}

void mutate_window(CaseSpec& s, Rng& rng) {
  auto value = [&] { return rng.pick({-1, -1, -2, -100, kI32Min, 0, 1, 3, 1000, kI32Max - 1, kI32Max}); };
  s.mask = rng.pick({JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW, JF_MASK_WINDOW});
  s.window_left = value();
  s.window_right = value();
  s.mutations.push_back("mask " + std::to_string(s.mask) + ", window (" + std::to_string(s.window_left) +
                        ", " + std::to_string(s.window_right) + ")");
}

void mutate_scale(CaseSpec& s, Rng& rng) {
  const float inf = std::numeric_limits<float>::infinity();
  s.scale = rng.pick({std::numeric_limits<float>::quiet_NaN(), inf, -inf, -0.0f, 1e-45f, 3e38f, -1.5f, 0.0f});
  std::ostringstream m;
  m << "problem.scale = " << s.scale;
  s.mutations.push_back(m.str());
}

void mutate_batch_size(CaseSpec& s, Rng& rng) {
  const int32_t b = s.batch_size;
  switch (rng.range(0, 4)) {
    case 0:
      s.batch_size = rng.pick({-1, -2, kI32Min});
      break;
    case 1:  // the arrays are then longer than B + 1
      s.batch_size = b > 0 ? static_cast<int32_t>(rng.range(0, b - 1)) : -1;
      break;
    case 2:  // more sequences, empty ones: still valid
    case 3: {
      const int32_t extra = static_cast<int32_t>(rng.range(1, 3));
      for (int32_t i = 0; i < extra; ++i) {
        s.q_offsets.push_back(s.q_offsets.empty() ? 0 : s.q_offsets.back());
        s.kv_offsets.push_back(s.kv_offsets.empty() ? 0 : s.kv_offsets.back());
      }
      s.batch_size = b + extra;
      break;
    }
    default: {  // more sequences, random offsets
      const int32_t extra = static_cast<int32_t>(rng.range(1, 3));
      for (int32_t i = 0; i < extra; ++i) {
        s.q_offsets.push_back(static_cast<int32_t>(rng.range(-3, 50)));
        s.kv_offsets.push_back(static_cast<int32_t>(rng.range(-3, 50)));
      }
      s.batch_size = b + extra;
      break;
    }
  }
  s.mutations.push_back("problem.batch_size = " + std::to_string(s.batch_size));
}

void mutate_offsets_pointer(CaseSpec& s, Rng& rng) {
  const bool kv = rng.chance(50);
  Placement& p = kv ? s.kv_offsets_place : s.q_offsets_place;
  const char* name = kv ? "problem.kv_offsets" : "problem.q_offsets";
  switch (rng.range(0, 3)) {
    case 0:
      p = Placement{Placement::kNull};
      break;
    case 1:
      p = Placement{Placement::kOwn, -1, rng.pick<int64_t>({1, 2, 3})};
      break;
    case 2: {
      const int target = pick_buffer(s, rng, -1);
      p = Placement{Placement::kInto, target, offset_into(s, target, 4, rng)};
      break;
    }
    default:
      s.kv_offsets_alias_q = true;
      s.mutations.push_back("problem.kv_offsets = problem.q_offsets");
      return;
  }
  s.mutations.push_back(std::string(name) + " -> " + placement_text(p));
}

void mutate_offsets_values(CaseSpec& s, Rng& rng) {
  const bool kv = rng.chance(50);
  std::vector<int32_t>& o = kv ? s.kv_offsets : s.q_offsets;
  const char* name = kv ? "problem.kv_offsets" : "problem.q_offsets";
  const int64_t b = static_cast<int64_t>(o.size()) - 1;  // at least 0
  std::ostringstream m;
  switch (rng.range(0, 6)) {
    case 0:
      o[0] = rng.pick({1, -1, kI32Min, kI32Max});
      m << name << "[0] = " << o[0];
      break;
    case 1: {  // one step down
      if (b < 1) return mutate_offsets_values(s, rng);
      const int64_t i = rng.range(1, b);
      o[i] = clamp_i32(int64_t{o[i - 1]} - rng.pick<int64_t>({1, 7, kI32Max}));
      m << name << "[" << i << "] = " << o[i] << " (below [" << i - 1 << "])";
      break;
    }
    case 2:
      o[b] = rng.pick({clamp_i32(int64_t{o[b]} + 1), clamp_i32(int64_t{o[b]} - 1), kI32Max, kI32Min, 0});
      m << name << "[last] = " << o[b];
      break;
    case 3: {  // overshoot in the middle, then back to the total
      if (b < 2) return mutate_offsets_values(s, rng);
      const int64_t i = rng.range(1, b - 1);
      o[i] = clamp_i32(int64_t{o[b]} + rng.range(1, 9));
      m << name << "[" << i << "] = " << o[i] << " (past the total)";
      break;
    }
    case 4:
      std::fill(o.begin(), o.end(), 0);
      m << name << " all 0";
      break;
    case 5:
      for (int32_t& x : o) x = static_cast<int32_t>(rng.range(-5, 60));
      m << name << " = " << values_text(o);
      break;
    default:
      for (int32_t& x : o) x = clamp_i32(-int64_t{x});
      m << name << " negated";
      break;
  }
  s.mutations.push_back(m.str());
}

// Applies f to one tensor, or (consistently) to every used tensor of the q or kv side.
void for_tensors(CaseSpec& s, Rng& rng, const char* field, const std::function<void(jf_tensor&)>& f) {
  if (rng.chance(35)) {
    const bool q_side = rng.chance(50);
    for (int b : q_side ? kQSide : kKSide)
      if (is_used(s.direction, b)) f(s.tensors[b]);
    s.mutations.push_back(std::string("every ") + (q_side ? "q" : "kv") + "-side " + field);
  } else {
    const int b = pick_tensor(s, rng);
    f(s.tensors[b]);
    s.mutations.push_back(std::string(buffer_name(b)) + "." + field);
  }
}

void mutate_rows(CaseSpec& s, Rng& rng) {
  const int pick = static_cast<int>(rng.range(0, 8));
  int64_t value = 0;
  for_tensors(s, rng, "rows", [&](jf_tensor& t) {
    const int64_t options[] = {-1,
                               kI64Min,
                               int64_t{1} << 31,
                               kI32Max,
                               kI64Max,
                               clamp_i64(static_cast<__int128>(t.rows) + 1),
                               clamp_i64(static_cast<__int128>(t.rows) - 1),
                               0,
                               int64_t{1} << 40};
    t.rows = value = options[pick];
  });
  s.mutations.back() += " = " + std::to_string(value);
}

void mutate_heads(CaseSpec& s, Rng& rng) {
  const int pick = static_cast<int>(rng.range(0, 7));
  int32_t value = 0;
  for_tensors(s, rng, "heads", [&](jf_tensor& t) {
    const int32_t options[] = {
        0, -1,     kI32Min, kI32Max, clamp_i32(int64_t{t.heads} + 1), clamp_i32(int64_t{t.heads} * 2),
        1, 1 << 20};
    t.heads = value = options[pick];
  });
  s.mutations.back() += " = " + std::to_string(value);
}

void mutate_head_dim(CaseSpec& s, Rng& rng) {
  const int32_t value = rng.pick({0, -64, 32, 96, 512, kI32Max, kI32Min, 64, 128, 256});
  for_tensors(s, rng, "head_dim", [&](jf_tensor& t) { t.head_dim = value; });
  s.mutations.back() += " = " + std::to_string(value);
}

void mutate_head_stride(CaseSpec& s, Rng& rng) {
  const int b = pick_tensor(s, rng);
  jf_tensor& t = s.tensors[b];
  const int64_t d = t.head_dim;
  t.head_stride = rng.pick<int64_t>(
      {d - 1, 0, -1, kI64Min, kI64Max, kI64Max / 2, int64_t{1} << 40, int64_t{1} << 62, d + 8});
  std::ostringstream m;
  m << buffer_name(b) << ".head_stride = " << t.head_stride;
  if (rng.chance(50)) {  // the row stride follows, so only the head stride's own size matters
    t.row_stride = clamp_i64(static_cast<__int128>(t.heads - int64_t{1}) * t.head_stride + t.head_dim);
    m << ", row_stride = " << t.row_stride;
  }
  s.mutations.push_back(m.str());
}

void mutate_row_stride(CaseSpec& s, Rng& rng) {
  const int b = pick_tensor(s, rng);
  jf_tensor& t = s.tensors[b];
  const __int128 min = static_cast<__int128>(t.heads - int64_t{1}) * t.head_stride + t.head_dim;
  t.row_stride = rng.pick<int64_t>({clamp_i64(min - 1), 0, -1, kI64Min, kI64Max, int64_t{1} << 62,
                                    int64_t{1} << 40, clamp_i64(min + 8), kI64Max / 2, kI64Max / 3});
  s.mutations.push_back(std::string(buffer_name(b)) + ".row_stride = " + std::to_string(t.row_stride));
}

// A buffer's pointer: NULL, misaligned, wild (memory nobody allocated) or into another buffer.
void mutate_pointer(CaseSpec& s, Rng& rng, int b) {
  Placement& p = s.place[b];
  const int elem = b == kLse ? 4 : element_bytes(s.dtype);
  switch (rng.range(0, 4)) {
    case 0:
      p = Placement{Placement::kNull};
      break;
    case 1:
      p = Placement{Placement::kOwn, -1, rng.pick<int64_t>({1, elem / 2, 3})};
      break;
    case 2:
      p = Placement{Placement::kWild};
      break;
    default: {
      const int target = pick_buffer(s, rng, b);
      p = Placement{Placement::kInto, target, offset_into(s, target, elem, rng)};
      break;
    }
  }
  s.mutations.push_back(std::string(buffer_name(b)) + (b == kLse ? "" : ".data") + " -> " +
                        placement_text(p));
}

void mutate_data(CaseSpec& s, Rng& rng) { mutate_pointer(s, rng, pick_tensor(s, rng)); }
void mutate_lse(CaseSpec& s, Rng& rng) { mutate_pointer(s, rng, kLse); }

// Launch fields a CPU call ignores or checks.
void mutate_launch(CaseSpec& s, Rng& rng) {
  std::ostringstream m;
  switch (rng.range(0, 4)) {
    case 0:
      s.max_seqlen_hint = rng.pick({-1, kI32Min, kI32Max, 1});
      m << "launch.max_seqlen_hint = " << s.max_seqlen_hint;
      break;
    case 1:
      s.reuse_plan = rng.pick({1, -1, kI32Max});
      s.deterministic = rng.pick({1, -1, kI32Min});
      s.caller_checked_pointers = rng.pick({0, 1, -1, kI32Max});
      m << "launch.reuse_plan = " << s.reuse_plan << ", deterministic = " << s.deterministic
        << ", caller_checked_pointers = " << s.caller_checked_pointers;
      break;
    case 2:
      s.workspace = rng.pick({WorkspaceKind::kQueried, WorkspaceKind::kSmaller, WorkspaceKind::kGarbage,
                              WorkspaceKind::kMisaligned});
      s.workspace_garbage_bytes = rng.range(1, 512);
      m << "launch.workspace kind " << static_cast<int>(s.workspace) << " (" << s.workspace_garbage_bytes
        << " garbage bytes)";
      break;
    case 3:
      s.stream_garbage = true;
      m << "launch.stream -> a host object";
      break;
    default:
      s.offsets_check = JF_CHECK_OFFSETS_DEVICE;
      m << "launch.offsets_check = JF_CHECK_OFFSETS_DEVICE";
      break;
  }
  s.mutations.push_back(m.str());
}

// Pooled attention's field: negative, a length q does not have, or past int32 rows with B.
void mutate_pooled(CaseSpec& s, Rng& rng) {
  const int64_t q_rows = s.tensors[kQ].rows;
  s.pooled_q_rows =
      rng.pick<int32_t>({-1, kI32Min, 1, clamp_i32(q_rows),
                         clamp_i32(clamp_i64(static_cast<__int128>(q_rows) + 1)), kI32Max, int32_t{1} << 30});
  s.mutations.push_back("problem.pooled_q_rows = " + std::to_string(s.pooled_q_rows));
}

// The score modifier (jf_problem.score_mod, softcap, alibi_slopes): a kind out of range, a kind
// its parameters are not for, a cap that is not finite and positive, the slopes NULL, misaligned,
// wild or inside another buffer, slope values that are not finite (refused on the CPU), or
// (legally) a whole valid modifier.
void mutate_score_mod(CaseSpec& s, Rng& rng) {
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const int32_t heads = s.tensors[kQ].heads;
  if (s.alibi_slopes.size() < static_cast<size_t>(std::clamp<int32_t>(heads, 1, kMaxAlibiSlopes)))
    s.alibi_slopes = alibi_slopes_for(heads);
  std::ostringstream m;
  switch (rng.range(0, 5)) {
    case 0:
      s.score_mod = rng.pick({-1, 64, 1000, kI32Min, kI32Max});  // past any kind ScoreModTypes will list
      m << "problem.score_mod = " << s.score_mod;
      break;
    case 1:
      s.score_mod = rng.pick({JF_SCORE_MOD_NONE, JF_SCORE_MOD_SOFTCAP, JF_SCORE_MOD_ALIBI});
      m << "problem.score_mod = " << s.score_mod << " (softcap and slopes as they were)";
      break;
    case 2:
      s.softcap = rng.pick({0.0f, -0.0f, -1.0f, nan, inf, -inf, 1e-30f, 3e38f, 30.0f});
      m << "problem.softcap = " << s.softcap;
      break;
    case 3: {
      Placement& p = s.alibi_place;
      switch (rng.range(0, 4)) {
        case 0:
          p = Placement{Placement::kNull};
          break;
        case 1:
          p = Placement{Placement::kOwn, -1, rng.pick<int64_t>({0, 1, 2, 3})};
          break;
        case 2:
          p = Placement{Placement::kWild};
          break;
        default: {
          const int target = pick_buffer(s, rng, -1);
          p = Placement{Placement::kInto, target, offset_into(s, target, 4, rng)};
          break;
        }
      }
      m << "problem.alibi_slopes -> " << placement_text(p);
      break;
    }
    case 4:
      if (rng.chance(50)) {
        std::fill(s.alibi_slopes.begin(), s.alibi_slopes.end(),
                  rng.pick({nan, inf, -inf, -1.0f, 0.0f, 1e30f}));
      } else {
        for (float& x : s.alibi_slopes) x = static_cast<float>(rng.range(-4000, 4000)) / 1000.0f;
      }
      m << "problem.alibi_slopes values = " << floats_text(s.alibi_slopes)
        << " (read on the CPU: finite only)";
      break;
    default:
      if (rng.chance(50)) {
        s.score_mod = JF_SCORE_MOD_SOFTCAP;
        s.softcap = rng.pick({50.0f, 30.0f, 1.0f, 0.5f});
        s.alibi_place = Placement{Placement::kNull};
        m << "score modifier: softcap " << s.softcap << " (valid)";
      } else {
        s.score_mod = JF_SCORE_MOD_ALIBI;
        s.softcap = 0.0f;
        s.alibi_slopes = alibi_slopes_for(heads);
        s.alibi_place = Placement{Placement::kOwn};
        m << "score modifier: ALiBi, " << s.alibi_slopes.size() << " slopes (valid)";
      }
      break;
  }
  s.mutations.push_back(m.str());
}

// A per-head float array's pointer (the sinks, their gradient): NULL, misaligned (or, by 0,
// valid), wild or inside a buffer (its start, inside, or adjacent past its end).
Placement head_floats_placement(const CaseSpec& s, Rng& rng) {
  switch (rng.range(0, 3)) {
    case 0:
      return Placement{Placement::kNull};
    case 1:
      return Placement{Placement::kOwn, -1, rng.pick<int64_t>({0, 1, 2, 3})};
    case 2:
      return Placement{Placement::kWild};
    default: {
      const int target = pick_buffer(s, rng, -1);
      return Placement{Placement::kInto, target, offset_into(s, target, 4, rng)};
    }
  }
}

// Sink values: not finite (refused on the CPU), in one head or all, or finite extremes (accepted:
// a sink of -1e30 is no sink, one of 1e30 takes every row's whole softmax).
void break_sink_values(CaseSpec& s, Rng& rng) {
  const float inf = std::numeric_limits<float>::infinity();
  const float value = rng.pick({std::numeric_limits<float>::quiet_NaN(), inf, -inf, 1e30f, -1e30f, -0.0f});
  if (rng.chance(50))
    std::fill(s.sinks.begin(), s.sinks.end(), value);
  else
    s.sinks[static_cast<size_t>(rng.range(0, static_cast<int64_t>(s.sinks.size()) - 1))] = value;
}

// The learnable sinks (jf_problem.learnable_sink) and the backward's dlearnable_sink: the sinks
// NULL, misaligned, wild or inside another buffer, values that are not finite; their gradient
// asked for without sinks, misaligned, wild, inside a buffer or over an input array (an output
// over an input); or (legally) valid sinks, with or without their gradient.
void mutate_sinks(CaseSpec& s, Rng& rng) {
  size_sinks_for_heads(s, rng);
  const bool backward = s.direction == Direction::kBackward;
  std::ostringstream m;
  switch (rng.range(0, 4)) {
    case 0:
      s.sink_place = head_floats_placement(s, rng);
      m << "problem.learnable_sink -> " << placement_text(s.sink_place);
      break;
    case 1:
      // Placed, so that the values are read.
      if (s.sink_place.kind == Placement::kNull) s.sink_place = Placement{Placement::kOwn};
      break_sink_values(s, rng);
      m << "problem.learnable_sink values = " << floats_text(s.sinks) << " " << placement_text(s.sink_place)
        << " (read on the CPU: finite only)";
      break;
    case 2:
      if (!backward) return mutate_sinks(s, rng);  // a forward has no dlearnable_sink
      // With sinks, so that the gradient's own rules are what is tried (without: the last case).
      if (s.sink_place.kind == Placement::kNull) s.sink_place = Placement{Placement::kOwn};
      s.sink_gradient_alias = rng.chance(75)
                                  ? SinkGradientAlias::kNone
                                  : rng.pick({SinkGradientAlias::kSinks, SinkGradientAlias::kSlopes});
      s.sink_gradient_place = head_floats_placement(s, rng);
      m << "dlearnable_sink -> " << sink_gradient_text(s) << " (problem.learnable_sink "
        << placement_text(s.sink_place) << ")";
      break;
    case 3:
      s.sinks = sink_values_for(s.tensors[kQ].heads, rng);
      s.sink_place = Placement{Placement::kOwn};
      s.sink_gradient_alias = SinkGradientAlias::kNone;
      s.sink_gradient_place = Placement{backward && rng.chance(50) ? Placement::kOwn : Placement::kNull};
      m << "sinks: " << s.sinks.size() << " valid values"
        << (s.sink_gradient_place.kind == Placement::kOwn ? ", with their gradient" : "");
      break;
    default:
      s.sink_place = Placement{Placement::kNull};
      if (backward) {
        s.sink_gradient_alias = SinkGradientAlias::kNone;
        s.sink_gradient_place = Placement{Placement::kOwn};
      }
      m << "problem.learnable_sink = NULL"
        << (backward ? ", dlearnable_sink -> own (no sink to differentiate)" : "");
      break;
  }
  s.mutations.push_back(m.str());
}

void mutate_api(CaseSpec& s, Rng& rng) {
  if (rng.chance(50)) {
    s.args_null = true;
    s.mutations.push_back("args = NULL");
  } else {
    s.bytes_null = true;
    s.mutations.push_back("bytes = NULL (workspace query)");
  }
}

struct WeightedMutation {
  int weight;
  void (*apply)(CaseSpec&, Rng&);
};
const WeightedMutation kMutations[] = {
    {6, mutate_enum},        {5, mutate_window},          {3, mutate_scale},
    {5, mutate_batch_size},  {6, mutate_offsets_pointer}, {8, mutate_offsets_values},
    {7, mutate_rows},        {6, mutate_heads},           {5, mutate_head_dim},
    {7, mutate_head_stride}, {7, mutate_row_stride},      {10, mutate_data},
    {6, mutate_lse},         {5, mutate_launch},          {1, mutate_api},
    {3, mutate_pooled},      {4, mutate_score_mod},       {4, mutate_sinks},
};

void mutate(CaseSpec& s, Rng& rng) {
  int total = 0;
  for (const WeightedMutation& m : kMutations) total += m.weight;
  int64_t r = rng.range(0, total - 1);
  for (const WeightedMutation& m : kMutations) {
    if (r < m.weight) return m.apply(s, rng);
    r -= m.weight;
  }
}

}  // namespace

const char* buffer_name(int buffer) {
  static const char* const names[] = {"problem.q", "problem.k", "problem.v", "out", "dout",
                                      "dq",        "dk",        "dv",        "lse"};
  return names[buffer];
}

bool is_used(Direction direction, int buffer) {
  return direction == Direction::kBackward || buffer == kQ || buffer == kK || buffer == kV ||
         buffer == kOut || buffer == kLse;
}

bool is_output(Direction direction, int buffer) {
  if (direction == Direction::kForward) return buffer == kOut || buffer == kLse;
  return buffer == kDq || buffer == kDk || buffer == kDv;
}

int element_bytes(int dtype) { return dtype == JF_FP32 ? 4 : 2; }

int64_t view_bytes(const jf_tensor& t, int elem) {
  if (t.rows <= 0) return 0;
  if (t.heads <= 0 || t.head_dim <= 0 || t.row_stride < 0 || t.head_stride < 0) return -1;
  const __int128 last = static_cast<__int128>(t.rows - 1) * t.row_stride +
                        static_cast<__int128>(t.heads - 1) * t.head_stride + t.head_dim;
  if (last > kI64Max) return -1;  // (each product above fits in 127 bits; this one might not)
  const __int128 bytes = last * elem;
  return bytes > kI64Max ? -1 : static_cast<int64_t>(bytes);
}

CaseSpec generate_case(Rng& rng) {
  CaseSpec s;
  s.direction = rng.chance(50) ? Direction::kForward : Direction::kBackward;
  s.dtype = rng.pick({JF_BF16, JF_FP16, JF_FP32});
  const int elem = element_bytes(s.dtype);
  const int32_t d = rng.pick({64, 64, 128, 128, 256});
  const int32_t h_kv = rng.pick({1, 1, 2, 2, 3});
  const int32_t h = h_kv * rng.pick({1, 1, 2, 3});
  s.batch_size = rng.chance(5) ? 0 : static_cast<int32_t>(rng.range(1, 5));
  auto length = [&] {
    if (rng.chance(15)) return int32_t{0};
    return static_cast<int32_t>(rng.chance(8) ? rng.range(10, 40) : rng.range(1, 9));
  };
  std::vector<int32_t> q_lens, kv_lens;
  for (int32_t i = 0; i < s.batch_size; ++i) q_lens.push_back(length());
  const bool self_attention = rng.chance(40);
  for (int32_t i = 0; i < s.batch_size; ++i) kv_lens.push_back(self_attention ? q_lens[i] : length());
  // Rarely, one sequence long enough that the CPU reference splits its work over threads.
  if (s.batch_size > 0 && rng.range(0, 999) < 3)
    q_lens[0] = kv_lens[0] = static_cast<int32_t>(rng.range(160, 200));
  s.q_offsets = offsets_of(q_lens);
  s.kv_offsets = offsets_of(kv_lens);
  const int64_t tq = s.q_offsets.back(), tk = s.kv_offsets.back();

  for (int b : kQSide) lay_out(s.tensors[b], tq, h, d, rng);
  for (int b : kKSide) lay_out(s.tensors[b], tk, h_kv, d, rng);
  std::string layout = "separate";
  if (self_attention && rng.chance(25)) {  // slices of one fused QKV buffer, rows of (H + 2 H_kv) heads
    layout = "fused qkv";
    const int64_t row = int64_t{h + 2 * h_kv} * d;
    for (int b : {kQ, kK, kV}) {
      s.tensors[b].head_stride = d;
      s.tensors[b].row_stride = row;
    }
    s.place[kK] = Placement{Placement::kInto, kQ, int64_t{h} * d * elem};
    s.place[kV] = Placement{Placement::kInto, kQ, int64_t{h + h_kv} * d * elem};
  }
  if (s.direction == Direction::kBackward && rng.chance(15)) {  // dk right after dq: adjacent, disjoint
    layout += ", dk after dq";
    s.place[kDk] =
        Placement{Placement::kInto, kDq, view_bytes(s.tensors[kDq], elem) + rng.pick<int64_t>({0, 64})};
  }
  if (rng.chance(8)) {  // offsets inside an input: allowed (inputs may alias)
    layout += ", q_offsets in problem.k";
    s.q_offsets_place =
        Placement{Placement::kInto, kK,
                  std::clamp<int64_t>(view_bytes(s.tensors[kK], elem), 0, kMaxRegionBytes / 2) / 4 * 4};
  }
  if (self_attention && rng.chance(10)) {
    layout += ", kv_offsets = q_offsets";
    s.kv_offsets_alias_q = true;
  }
  if (s.direction == Direction::kForward && rng.chance(20)) s.place[kLse] = Placement{Placement::kNull};
  // Pooled attention (jf_problem.pooled_q_rows): one query set of Lq rows for every sequence; q
  // and dq [Lq], out and dout [B * Lq], no q_offsets.
  if (!s.kv_offsets_alias_q && rng.chance(15)) {
    s.pooled_q_rows = static_cast<int32_t>(rng.range(1, 9));
    for (int b : {kQ, kDq}) lay_out(s.tensors[b], s.pooled_q_rows, h, d, rng);
    for (int b : {kOut, kDout}) lay_out(s.tensors[b], int64_t{s.batch_size} * s.pooled_q_rows, h, d, rng);
    s.q_offsets_place = Placement{Placement::kNull};
    layout += ", pooled Lq " + std::to_string(s.pooled_q_rows) + " (q_offsets NULL)";
  }

  // A score modifier in a fifth of the calls: a tanh softcap, or ALiBi with one slope per query
  // head (its parameters' rules: jagflash.h, jf_problem.score_mod).
  const int64_t modifier = rng.range(0, 9);
  if (modifier == 0) {
    s.score_mod = JF_SCORE_MOD_SOFTCAP;
    s.softcap = rng.pick({50.0f, 30.0f, 1.0f, 0.5f});
    layout += ", softcap " + std::to_string(s.softcap);
  } else if (modifier == 1) {
    s.score_mod = JF_SCORE_MOD_ALIBI;
    s.alibi_slopes = alibi_slopes_for(h);
    s.alibi_place = Placement{Placement::kOwn};
    layout += ", ALiBi";
  }
  // Learnable sinks in a fifth of the calls, one logit per query head; a backward with them asks
  // for their gradient in two of three (jagflash.h, jf_problem.learnable_sink).
  if (rng.chance(20)) {
    s.sinks = sink_values_for(h, rng);
    s.sink_place = Placement{Placement::kOwn};
    layout += ", sinks";
    if (s.direction == Direction::kBackward && rng.chance(67)) {
      s.sink_gradient_place = Placement{Placement::kOwn};
      layout += " and their gradient";
    }
  }

  s.mask = rng.pick({JF_MASK_NONE, JF_MASK_NONE, JF_MASK_CAUSAL, JF_MASK_WINDOW});
  if (s.mask == JF_MASK_WINDOW) {
    s.window_left = rng.pick({-1, 0, 1, 2, 5, 100});
    s.window_right = rng.pick({-1, 0, 1, 2, 5, 100});
  }
  if (rng.chance(30)) s.scale = static_cast<float>(rng.range(-2000, 2000)) / 1000.0f;
  s.offsets_check = rng.pick({JF_CHECK_OFFSETS_HOST, JF_CHECK_OFFSETS_HOST, JF_CHECK_OFFSETS_DEVICE});
  s.backend = rng.pick({JF_BACKEND_AUTO, JF_BACKEND_AUTO, JF_BACKEND_AUTO, JF_BACKEND_REFERENCE});
  if (rng.chance(20)) s.max_seqlen_hint = static_cast<int32_t>(rng.range(0, 300));
  if (rng.chance(20)) s.reuse_plan = 1;
  if (rng.chance(20)) s.deterministic = 1;
  s.workspace = rng.chance(50) ? WorkspaceKind::kNone : WorkspaceKind::kQueried;

  std::ostringstream base;
  base << (s.direction == Direction::kForward ? "forward" : "backward") << " dtype " << s.dtype << " H " << h
       << " H_kv " << h_kv << " D " << d << " q lengths " << lengths_text(s.q_offsets) << " kv lengths "
       << lengths_text(s.kv_offsets) << " mask " << s.mask << " (" << s.window_left << ", " << s.window_right
       << ") scale " << s.scale << ", " << layout;
  s.base = base.str();

  const int64_t r = rng.range(0, 99);
  const int count = r < 10 ? 0 : r < 65 ? 1 : r < 90 ? 2 : static_cast<int>(rng.range(3, 5));
  for (int i = 0; i < count; ++i) mutate(s, rng);
  return s;
}

namespace {

// bf16, H 4, H_kv 2, D 64, q lengths [3, 5], kv lengths [4, 2], packed rows, no mask: valid.
CaseSpec simple_case(Direction direction, const char* what) {
  CaseSpec s;
  s.direction = direction;
  s.batch_size = 2;
  s.q_offsets = {0, 3, 8};
  s.kv_offsets = {0, 4, 6};
  for (int b : kQSide) s.tensors[b] = jf_tensor{nullptr, 8, 4, 64, 4 * 64, 64};
  for (int b : kKSide) s.tensors[b] = jf_tensor{nullptr, 6, 2, 64, 2 * 64, 64};
  s.base = std::string(direction == Direction::kForward ? "forward" : "backward") +
           " bf16 H 4 H_kv 2 D 64 q lengths [3,5] kv lengths [4,2] (regression case)";
  s.mutations.push_back(what);
  return s;
}

// H 4 sinks at `place` (of these values): the simple case's learnable_sink.
CaseSpec sink_case(Direction direction, const char* what, Placement place,
                   std::vector<float> values = {0.5f, -1.0f, 2.0f, 0.0f}) {
  CaseSpec s = simple_case(direction, what);
  s.sinks = std::move(values);
  s.sink_place = place;
  return s;
}

// The sinks' rules, one case each (jagflash.h: learnable_sink, H float32 read like an input and
// finite on the CPU; the backward's dlearnable_sink, H float32 written like an output, only with
// sinks), valid and broken.
void add_sink_cases(std::vector<CaseSpec>& cases) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const Placement own{Placement::kOwn};
  for (Direction d : {Direction::kForward, Direction::kBackward}) {
    const int output = d == Direction::kForward ? kOut : kDq;
    cases.push_back(sink_case(d, "sinks (valid)", own));
    cases.push_back(sink_case(d, "problem.learnable_sink -> own+2B", Placement{Placement::kOwn, -1, 2}));
    cases.push_back(
        sink_case(d, "problem.learnable_sink -> wild (views not backed)", Placement{Placement::kWild}));
    cases.push_back(sink_case(d, "problem.learnable_sink[1] = NaN", own, {0.5f, nan, 2.0f, 0.0f}));
    cases.push_back(sink_case(d, "problem.learnable_sink = +inf", own, {inf, inf, inf, inf}));
    cases.push_back(sink_case(d, "problem.learnable_sink[3] = -inf", own, {0.5f, -1.0f, 2.0f, -inf}));
    cases.push_back(
        sink_case(d, "problem.learnable_sink = -1e30 (valid: no sink)", own, std::vector<float>(4, -1e30f)));
    cases.push_back(sink_case(d, "problem.learnable_sink -> into an output (overlap)",
                              Placement{Placement::kInto, output, 0}));
    cases.push_back(sink_case(d, "problem.learnable_sink -> into problem.q (inputs may alias)",
                              Placement{Placement::kInto, kQ, 64}));
    cases.push_back(
        sink_case(d, "problem.learnable_sink -> into lse (the forward's output, the backward's input)",
                  Placement{Placement::kInto, kLse, 4}));
    CaseSpec c = sink_case(d, "sinks with ALiBi (valid)", own);
    c.score_mod = JF_SCORE_MOD_ALIBI;
    c.alibi_slopes = alibi_slopes_for(4);
    c.alibi_place = own;
    cases.push_back(c);
  }
  const Direction bwd = Direction::kBackward;
  auto gradient = [&](const char* what, Placement sinks, Placement place,
                      SinkGradientAlias alias = SinkGradientAlias::kNone) {
    CaseSpec c = sink_case(bwd, what, sinks);
    c.sink_gradient_place = place;
    c.sink_gradient_alias = alias;
    return c;
  };
  const Placement none{Placement::kNull};
  cases.push_back(gradient("sinks and dlearnable_sink (valid)", own, own));
  cases.push_back(gradient("dlearnable_sink without sinks", none, own));
  cases.push_back(gradient("dlearnable_sink -> own+2B", own, Placement{Placement::kOwn, -1, 2}));
  cases.push_back(gradient("dlearnable_sink -> wild (views not backed)", own, Placement{Placement::kWild}));
  cases.push_back(gradient("dlearnable_sink = problem.learnable_sink", own, none, SinkGradientAlias::kSinks));
  cases.push_back(gradient("dlearnable_sink -> into lse", own, Placement{Placement::kInto, kLse, 0}));
  cases.push_back(gradient("dlearnable_sink -> into out", own, Placement{Placement::kInto, kOut, 8}));
  cases.push_back(gradient("dlearnable_sink -> into problem.q", own, Placement{Placement::kInto, kQ, 0}));
  cases.push_back(gradient("dlearnable_sink -> into dq", own, Placement{Placement::kInto, kDq, 64}));
  // dq [8, 4, 64] bf16 packed: 4096 bytes; just past them, disjoint.
  cases.push_back(
      gradient("dlearnable_sink -> right after dq (valid)", own, Placement{Placement::kInto, kDq, 4096}));
  CaseSpec c = gradient("dlearnable_sink = problem.alibi_slopes", own, none, SinkGradientAlias::kSlopes);
  c.score_mod = JF_SCORE_MOD_ALIBI;
  c.alibi_slopes = alibi_slopes_for(4);
  c.alibi_place = own;
  cases.push_back(c);
  c = gradient("sinks and dlearnable_sink, pooled Lq 2 (valid)", own, own);
  c.pooled_q_rows = 2;
  c.q_offsets_place = none;
  for (int b : {kQ, kDq}) c.tensors[b].rows = 2;
  for (int b : {kOut, kDout}) c.tensors[b].rows = 4;
  cases.push_back(c);
}

}  // namespace

std::vector<CaseSpec> regression_cases() {
  std::vector<CaseSpec> cases;
  for (Direction d : {Direction::kForward, Direction::kBackward}) {
    // The validator loaded enum fields through their enum type before checking them.
    CaseSpec c = simple_case(d, "problem.dtype = 7 (any int is a valid C enum value)");
    c.dtype = 7;
    cases.push_back(c);
    c = simple_case(d, "launch.backend = -1");
    c.backend = -1;
    cases.push_back(c);
    // The span of the view overflowed int64 in the overlap check.
    c = simple_case(d, "problem.k.row_stride = 2^62");
    c.tensors[kK].row_stride = int64_t{1} << 62;
    cases.push_back(c);
    c = simple_case(d, "problem.q.head_stride = 2^62 (4 heads)");
    c.tensors[kQ].head_stride = int64_t{1} << 62;
    cases.push_back(c);
    // Accepted, then used as an int32 / float pointer.
    c = simple_case(d, "problem.q_offsets -> own+2B");
    c.q_offsets_place = Placement{Placement::kOwn, -1, 2};
    cases.push_back(c);
    c = simple_case(d, "lse -> own+2B");
    c.place[kLse] = Placement{Placement::kOwn, -1, 2};
    cases.push_back(c);
    // Valid: an empty k may have any strides, but the reference formed data + head * head_stride.
    c = simple_case(d, "kv lengths [0, 0], problem.k.head_stride = 2^62 (valid)");
    c.kv_offsets = {0, 0, 0};
    for (int b : kKSide) c.tensors[b].rows = 0;
    c.tensors[kK].head_stride = int64_t{1} << 62;
    c.tensors[kK].row_stride = (int64_t{1} << 62) + 64;
    cases.push_back(c);
  }
  // An output over the offsets, which the reference reads while it writes.
  CaseSpec c = simple_case(Direction::kForward, "problem.q_offsets -> into lse+0B");
  c.q_offsets_place = Placement{Placement::kInto, kLse, 0};
  cases.push_back(c);
  c = simple_case(Direction::kBackward, "problem.kv_offsets -> into dq+64B");
  c.kv_offsets_place = Placement{Placement::kInto, kDq, 64};
  cases.push_back(c);

  // The score modifier's rules, one case each: the two valid modifiers, then each parameter
  // broken (jagflash.h: a cap only with SOFTCAP, finite and > 0; slopes only with ALIBI, H
  // float32, not overlapping an output).
  for (Direction d : {Direction::kForward, Direction::kBackward}) {
    const int output = d == Direction::kForward ? kOut : kDq;
    auto softcap = [&](const char* what, int kind, float cap) {
      CaseSpec m = simple_case(d, what);
      m.score_mod = kind;
      m.softcap = cap;
      return m;
    };
    auto alibi = [&](const char* what, int kind, Placement place) {
      CaseSpec m = simple_case(d, what);
      m.score_mod = kind;
      m.alibi_slopes = alibi_slopes_for(4);
      m.alibi_place = place;
      return m;
    };
    cases.push_back(softcap("softcap 30 (valid)", JF_SCORE_MOD_SOFTCAP, 30.0f));
    cases.push_back(alibi("ALiBi, 4 slopes (valid)", JF_SCORE_MOD_ALIBI, Placement{Placement::kOwn}));
    cases.push_back(softcap("problem.score_mod = 64", 64, 0.0f));
    cases.push_back(softcap("problem.softcap = NaN with SOFTCAP", JF_SCORE_MOD_SOFTCAP,
                            std::numeric_limits<float>::quiet_NaN()));
    cases.push_back(softcap("problem.softcap = -0 with SOFTCAP", JF_SCORE_MOD_SOFTCAP, -0.0f));
    cases.push_back(softcap("problem.softcap = 30 without a modifier", JF_SCORE_MOD_NONE, 30.0f));
    cases.push_back(softcap("problem.softcap = 30 with ALIBI (slopes NULL)", JF_SCORE_MOD_ALIBI, 30.0f));
    cases.push_back(
        alibi("problem.alibi_slopes = NULL with ALIBI", JF_SCORE_MOD_ALIBI, Placement{Placement::kNull}));
    cases.push_back(
        alibi("problem.alibi_slopes -> own+2B", JF_SCORE_MOD_ALIBI, Placement{Placement::kOwn, -1, 2}));
    cases.push_back(
        alibi("problem.alibi_slopes set without a modifier", JF_SCORE_MOD_NONE, Placement{Placement::kOwn}));
    c = alibi("problem.alibi_slopes set with SOFTCAP (cap 30)", JF_SCORE_MOD_SOFTCAP,
              Placement{Placement::kOwn});
    c.softcap = 30.0f;
    cases.push_back(c);
    cases.push_back(alibi("problem.alibi_slopes -> wild without a modifier (never read)", JF_SCORE_MOD_NONE,
                          Placement{Placement::kWild}));
    cases.push_back(alibi("problem.alibi_slopes -> into an output (overlap)", JF_SCORE_MOD_ALIBI,
                          Placement{Placement::kInto, output, 0}));
    cases.push_back(alibi("problem.alibi_slopes -> into problem.q (inputs may alias)", JF_SCORE_MOD_ALIBI,
                          Placement{Placement::kInto, kQ, 64}));
  }
  add_sink_cases(cases);
  return cases;
}

// Both arrays: a pooled call reads kv_offsets alone.
void break_offsets_for_unbacked_views(CaseSpec& s) {
  s.q_offsets[0] = 1;
  s.kv_offsets[0] = 1;
  s.mutations.push_back("problem.q_offsets[0] = problem.kv_offsets[0] = 1 (views not backed by memory)");
}

std::string CaseSpec::describe() const {
  std::ostringstream m;
  m << "  base: " << base << "\n  mutations:";
  if (mutations.empty()) m << " none";
  for (const std::string& x : mutations) m << "\n    " << x;
  m << "\n  final: dtype " << dtype << " device " << device << " mask " << mask << " window (" << window_left
    << ", " << window_right << ") scale " << scale << " batch_size " << batch_size << " pooled_q_rows "
    << pooled_q_rows << "\n    score_mod " << score_mod << " softcap " << softcap << " alibi_slopes "
    << floats_text(alibi_slopes) << " " << placement_text(alibi_place) << "\n    learnable_sink "
    << floats_text(sinks) << " " << placement_text(sink_place) << ", dlearnable_sink "
    << (direction == Direction::kBackward ? sink_gradient_text(*this) : "(forward: none)")
    << "\n    q_offsets " << values_text(q_offsets) << " " << placement_text(q_offsets_place)
    << "\n    kv_offsets "
    << (kv_offsets_alias_q ? "= q_offsets"
                           : values_text(kv_offsets) + " " + placement_text(kv_offsets_place));
  for (int b = 0; b < kTensorCount; ++b)
    if (is_used(direction, b))
      m << "\n    " << buffer_name(b) << " " << tensor_text(tensors[b]) << " " << placement_text(place[b]);
  m << "\n    lse " << placement_text(place[kLse]) << "\n    launch: offsets_check " << offsets_check
    << " backend " << backend << " reuse_plan " << reuse_plan << " max_seqlen_hint " << max_seqlen_hint
    << " deterministic " << deterministic << " caller_checked_pointers " << caller_checked_pointers
    << " workspace kind " << static_cast<int>(workspace) << " stream "
    << (stream_garbage ? "host object" : "NULL");
  return m.str();
}

// --- CallMemory -----------------------------------------------------------------------------

namespace {

void fill_pattern(unsigned char* p, size_t n, uint64_t seed) {
  Rng rng(seed);
  for (size_t i = 0; i < n; i += 8) {
    const uint64_t x = rng.next();
    std::memcpy(p + i, &x, std::min<size_t>(8, n - i));
  }
}

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

}  // namespace

CallMemory::CallMemory(const CaseSpec& spec, uint64_t pattern_seed) : pattern_seed_(pattern_seed) {
  const Direction dir = spec.direction;
  // Region sizes: each buffer's own view (plus its misalignment), grown to hold what points into it.
  int64_t need[kBufferCount];
  for (int b = 0; b < kBufferCount; ++b) {
    need[b] = is_used(dir, b) ? buffer_bytes(spec, b) : 0;
    region_bytes_[b] = kGuard;
  }
  auto fits = [](int64_t bytes) { return bytes >= 0 && bytes <= kMaxRegionBytes; };
  auto grow = [&](int region, int64_t offset, int64_t bytes) {
    if (fits(bytes) && offset >= 0 && offset <= kMaxRegionBytes)
      region_bytes_[region] = std::max(region_bytes_[region], static_cast<size_t>(offset + bytes));
  };
  for (int b = 0; b < kBufferCount; ++b) {
    if (!is_used(dir, b)) continue;
    const Placement& p = spec.place[b];
    if (p.kind == Placement::kOwn) grow(b, p.byte_offset, need[b]);
    if (p.kind == Placement::kInto) grow(p.target, p.byte_offset, need[b]);
    // A view with elements is backed when it lies in a region (its own or the one it points into).
    const bool has_elements = need[b] != 0 && !(b == kLse && p.kind == Placement::kNull);
    if (has_elements && (p.kind == Placement::kWild || p.kind == Placement::kNull || !fits(need[b])))
      backed_ = false;
  }
  const Placement* offsets_places[] = {&spec.q_offsets_place, &spec.kv_offsets_place};
  const std::vector<int32_t>* offsets_values[] = {&spec.q_offsets, &spec.kv_offsets};
  for (int i = 0; i < 2; ++i) {
    if (offsets_places[i]->kind == Placement::kInto)
      grow(offsets_places[i]->target, offsets_places[i]->byte_offset,
           static_cast<int64_t>(offsets_values[i]->size() * sizeof(int32_t)));
    if (spec.batch_size >= 0 && offsets_values[i]->size() < static_cast<size_t>(spec.batch_size) + 1)
      backed_ = false;
  }
  // The per-head float arrays: a region that one points into grows to hold it; the call is not
  // backed when one it accesses (reads or writes H floats at) is wild or holds fewer than H.
  const int32_t heads = spec.tensors[kQ].heads;
  auto head_floats = [&](const Placement& p, size_t bytes, bool accessed) {
    if (p.kind == Placement::kInto) grow(p.target, p.byte_offset, static_cast<int64_t>(bytes));
    if (accessed && p.kind != Placement::kNull &&
        (p.kind == Placement::kWild || (heads > 0 && bytes < static_cast<size_t>(heads) * sizeof(float))))
      backed_ = false;
  };
  // The slopes: read when the modifier is ALiBi (and never otherwise); the sinks: read whenever
  // set; their gradient: written by a backward, as many floats as the sinks have (an alias of an
  // input array is never a valid call, so never written).
  const size_t slope_bytes = spec.alibi_slopes.size() * sizeof(float);
  const size_t sink_bytes = spec.sinks.size() * sizeof(float);
  const bool own_sink_gradient =
      dir == Direction::kBackward && spec.sink_gradient_alias == SinkGradientAlias::kNone;
  head_floats(spec.alibi_place, slope_bytes, spec.score_mod == JF_SCORE_MOD_ALIBI);
  head_floats(spec.sink_place, sink_bytes, true);
  if (own_sink_gradient) head_floats(spec.sink_gradient_place, sink_bytes, true);

  size_t cursor = 0;
  for (int b = 0; b < kBufferCount; ++b) {
    cursor = align_up(cursor, kRegionAlign);
    region_offset_[b] = cursor;
    cursor += region_bytes_[b] + kGuard;
  }
  arena_bytes_ = cursor;
  arena_storage_.resize(arena_bytes_ + kRegionAlign);
  fill_pattern(arena_storage_.data(), arena_storage_.size(), pattern_seed);
  const auto base = reinterpret_cast<uintptr_t>(arena_storage_.data());
  arena_ = arena_storage_.data() + (align_up(base, kRegionAlign) - base);

  // The offsets arrays: exact-size blocks, or inside a region.
  Block* blocks[] = {&q_offsets_block_, &kv_offsets_block_};
  const int32_t* offsets_pointers[2] = {nullptr, nullptr};
  for (int i = 0; i < 2; ++i) {
    const Placement& p = *offsets_places[i];
    const size_t bytes = offsets_values[i]->size() * sizeof(int32_t);
    unsigned char* at = nullptr;
    if (p.kind == Placement::kOwn) {
      Block& blk = *blocks[i];
      blk.name = i == 0 ? "problem.q_offsets array" : "problem.kv_offsets array";
      blk.size = bytes + static_cast<size_t>(p.byte_offset);
      blk.data.reset(new unsigned char[blk.size]);
      fill_pattern(blk.data.get(), blk.size, pattern_seed + 1 + i);
      at = blk.data.get() + p.byte_offset;
    } else if (p.kind == Placement::kInto) {
      at = region_start(p.target) + p.byte_offset;
    }
    if (p.kind == Placement::kInto && static_cast<size_t>(p.byte_offset) + bytes > region_bytes_[p.target])
      std::abort();  // offset_into keeps offsets within kMaxRegionBytes, which grow() always admits
    if (at != nullptr) std::memcpy(at, offsets_values[i]->data(), bytes);
    offsets_pointers[i] = reinterpret_cast<const int32_t*>(at);
  }
  if (spec.kv_offsets_alias_q) offsets_pointers[1] = offsets_pointers[0];

  // The slopes, the sinks and the sinks' gradient (its bytes left as the pattern made them).
  alibi_block_.name = "problem.alibi_slopes array";
  sink_block_.name = "problem.learnable_sink array";
  sink_gradient_block_.name = "dlearnable_sink array";
  const auto* slopes = reinterpret_cast<const float*>(place_array(
      alibi_block_, spec.alibi_place, slope_bytes, spec.alibi_slopes.data(), pattern_seed + 6, kBufferCount));
  const auto* sinks = reinterpret_cast<const float*>(place_array(
      sink_block_, spec.sink_place, sink_bytes, spec.sinks.data(), pattern_seed + 7, kBufferCount + 1));
  float* sink_gradient = nullptr;
  if (own_sink_gradient)
    sink_gradient =
        reinterpret_cast<float*>(place_array(sink_gradient_block_, spec.sink_gradient_place, sink_bytes,
                                             nullptr, pattern_seed + 8, kBufferCount + 2));
  else if (dir == Direction::kBackward)
    sink_gradient =
        const_cast<float*>(spec.sink_gradient_alias == SinkGradientAlias::kSinks ? sinks : slopes);

  stream_block_.name = "launch.stream object";
  if (spec.stream_garbage) {
    stream_block_.size = 64;
    stream_block_.data.reset(new unsigned char[stream_block_.size]);
    fill_pattern(stream_block_.data.get(), stream_block_.size, pattern_seed + 3);
  }
  bytes_block_.reset(new unsigned char[sizeof bytes_saved_]);
  fill_pattern(bytes_block_.get(), sizeof bytes_saved_, pattern_seed + 4);

  jf_problem p{};
  set_enum(p.dtype, spec.dtype);
  set_enum(p.device, spec.device);
  set_enum(p.mask, spec.mask);
  p.batch_size = spec.batch_size;
  p.q_offsets = offsets_pointers[0];
  p.kv_offsets = offsets_pointers[1];
  jf_tensor t[kTensorCount];
  for (int b = 0; b < kTensorCount; ++b) {
    t[b] = spec.tensors[b];
    t[b].data = is_used(dir, b) ? place_pointer(spec.place[b], b) : nullptr;
  }
  p.q = t[kQ];
  p.k = t[kK];
  p.v = t[kV];
  p.window_left = spec.window_left;
  p.window_right = spec.window_right;
  p.scale = spec.scale;
  p.pooled_q_rows = spec.pooled_q_rows;
  set_enum(p.score_mod, spec.score_mod);
  p.softcap = spec.softcap;
  p.alibi_slopes = slopes;
  p.learnable_sink = sinks;
  jf_launch l{};
  l.stream = spec.stream_garbage ? stream_block_.data.get() : nullptr;
  set_enum(l.offsets_check, spec.offsets_check);
  set_enum(l.backend, spec.backend);
  l.reuse_plan = spec.reuse_plan;
  l.max_seqlen_hint = spec.max_seqlen_hint;
  l.deterministic = spec.deterministic;
  l.caller_checked_pointers = spec.caller_checked_pointers;
  void* lse = place_pointer(spec.place[kLse], kLse);

  fwd_.problem = p;
  fwd_.out = t[kOut];
  fwd_.lse = static_cast<float*>(lse);
  fwd_.launch = l;
  bwd_.problem = p;
  bwd_.out = t[kOut];
  bwd_.dout = t[kDout];
  bwd_.lse = static_cast<const float*>(lse);
  bwd_.dq = t[kDq];
  bwd_.dk = t[kDk];
  bwd_.dv = t[kDv];
  bwd_.dlearnable_sink = sink_gradient;
  bwd_.launch = l;
}

// An array of `bytes` bytes where `p` puts it: an exact-size block of its own (misaligned by the
// placement's offset), inside a region (grown to hold it), at a wild address of its own
// (`wild_slot`) or NULL; `values`, when given, copied in.
unsigned char* CallMemory::place_array(Block& block, const Placement& p, size_t bytes, const void* values,
                                       uint64_t pattern_seed, int wild_slot) {
  unsigned char* at = nullptr;
  switch (p.kind) {
    case Placement::kOwn:
      block.size = bytes + static_cast<size_t>(p.byte_offset);
      block.data.reset(new unsigned char[block.size]);
      fill_pattern(block.data.get(), block.size, pattern_seed);
      at = block.data.get() + p.byte_offset;
      break;
    case Placement::kInto:
      if (static_cast<size_t>(p.byte_offset) + bytes > region_bytes_[p.target]) std::abort();
      at = region_start(p.target) + p.byte_offset;
      break;
    case Placement::kWild:
      return static_cast<unsigned char*>(place_pointer(p, wild_slot));
    case Placement::kNull:
      return nullptr;
  }
  if (values != nullptr && bytes > 0) std::memcpy(at, values, bytes);
  return at;
}

// Computed as integers: a pointer that is meant to lie outside any allocation (a view too large to
// back) must not be formed by out-of-bounds pointer arithmetic, which is undefined.
void* CallMemory::place_pointer(const Placement& p, int self) {
  auto at = [&](int region) {
    return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(region_start(region)) +
                                   static_cast<uintptr_t>(p.byte_offset));
  };
  switch (p.kind) {
    case Placement::kOwn:
      return at(self);
    case Placement::kNull:
      return nullptr;
    case Placement::kWild:  // 256-byte aligned, never mapped by this process
      return reinterpret_cast<void*>(uintptr_t{0x10000} + static_cast<uintptr_t>(self) * 0x100);
    case Placement::kInto:
      return at(p.target);
  }
  return nullptr;
}

void CallMemory::attach_workspace(const CaseSpec& spec, size_t queried) {
  size_t bytes = 0, shift = 0;
  switch (spec.workspace) {
    case WorkspaceKind::kNone:
      break;
    case WorkspaceKind::kQueried:
      bytes = queried;
      break;
    case WorkspaceKind::kSmaller:
      bytes = queried / 2;
      break;
    case WorkspaceKind::kGarbage:
      bytes = static_cast<size_t>(spec.workspace_garbage_bytes);
      break;
    case WorkspaceKind::kMisaligned:
      bytes = static_cast<size_t>(spec.workspace_garbage_bytes);
      shift = 1;
      break;
  }
  void* ws = nullptr;
  workspace_block_.name = "launch.workspace";
  if (spec.workspace != WorkspaceKind::kNone && bytes <= (size_t{1} << 24)) {
    workspace_block_.size = bytes + shift + kGuard;
    workspace_block_.data.reset(new unsigned char[workspace_block_.size]);
    fill_pattern(workspace_block_.data.get(), workspace_block_.size, pattern_seed_ + 5);
    ws = workspace_block_.data.get() + shift;
  }
  for (jf_launch* l : {&fwd_.launch, &bwd_.launch}) {
    l->workspace = ws;
    l->workspace_bytes = bytes;
  }
}

void CallMemory::snapshot() {
  arena_saved_ = arena_storage_;
  for (Block* b : blocks(*this)) b->saved.assign(b->data.get(), b->data.get() + b->size);
  std::memcpy(bytes_saved_, bytes_block_.get(), sizeof bytes_saved_);
}

void CallMemory::mark_outputs(Direction direction, std::vector<unsigned char>& writable) const {
  const jf_problem& p = fwd_.problem;
  const size_t elem = static_cast<size_t>(element_bytes(enum_value(p.dtype)));
  const auto storage = reinterpret_cast<uintptr_t>(arena_storage_.data());
  auto mark = [&](const unsigned char* at, size_t n) {
    const auto address = reinterpret_cast<uintptr_t>(at);
    if (address < storage) return;
    const size_t begin = address - storage;
    for (size_t i = begin; i < begin + n && i < writable.size(); ++i) writable[i] = 1;
  };
  auto mark_view = [&](const jf_tensor& t) {
    if (t.data == nullptr) return;
    for (int64_t r = 0; r < t.rows; ++r)
      for (int32_t h = 0; h < t.heads; ++h)
        mark(static_cast<const unsigned char*>(t.data) + (r * t.row_stride + h * t.head_stride) * elem,
             static_cast<size_t>(t.head_dim) * elem);
  };
  if (direction == Direction::kForward) {
    mark_view(fwd_.out);
    // lse [H, rows]: B * Lq rows for a pooled call (as the accepted call's out has).
    const int64_t rows = p.pooled_q_rows > 0 ? int64_t{p.batch_size} * p.pooled_q_rows : p.q.rows;
    if (fwd_.lse != nullptr)
      mark(reinterpret_cast<const unsigned char*>(fwd_.lse),
           static_cast<size_t>(p.q.heads) * static_cast<size_t>(rows) * sizeof(float));
  } else {
    mark_view(bwd_.dq);
    mark_view(bwd_.dk);
    mark_view(bwd_.dv);
    if (bwd_.dlearnable_sink != nullptr)
      mark(reinterpret_cast<const unsigned char*>(bwd_.dlearnable_sink), sink_gradient_bytes());
  }
}

// What a backward that asks for the sinks' gradient writes there: one float per query head.
size_t CallMemory::sink_gradient_bytes() const {
  return static_cast<size_t>(std::max(bwd_.problem.q.heads, 0)) * sizeof(float);
}

// [begin, end) of the bytes of block `b` that a successful call may write: the workspace's
// (`workspace`), the backward's sink gradient where that block holds it (`outputs`).
std::pair<size_t, size_t> CallMemory::writable_bytes(const Block& b, Direction direction, bool outputs,
                                                     bool workspace) const {
  if (b.size == 0) return {0, 0};
  const auto begin = reinterpret_cast<uintptr_t>(b.data.get());
  auto offset_in_block = [&](const void* p) {
    return static_cast<size_t>(reinterpret_cast<uintptr_t>(p) - begin);
  };
  if (workspace && &b == &workspace_block_ && fwd_.launch.workspace != nullptr) {
    const size_t at = offset_in_block(fwd_.launch.workspace);
    return {at, at + fwd_.launch.workspace_bytes};
  }
  const auto gradient = reinterpret_cast<uintptr_t>(bwd_.dlearnable_sink);
  if (outputs && direction == Direction::kBackward && &b == &sink_gradient_block_ && gradient >= begin &&
      gradient < begin + b.size) {
    const size_t at = offset_in_block(bwd_.dlearnable_sink);
    return {at, at + sink_gradient_bytes()};
  }
  return {0, 0};
}

std::string CallMemory::region_of(size_t storage_offset) const {
  const size_t arena_start = static_cast<size_t>(arena_ - arena_storage_.data());
  std::ostringstream s;
  if (storage_offset < arena_start) return "the arena's leading padding";
  const size_t at = storage_offset - arena_start;
  for (int b = 0; b < kBufferCount; ++b) {
    const size_t begin = region_offset_[b], end = begin + region_bytes_[b];
    if (at >= begin && at < end) {
      s << "byte " << at - begin << " of the region of " << buffer_name(b);
      return s.str();
    }
    if (at >= end && at < end + kGuard) {
      s << "byte " << at - end << " of the guard after " << buffer_name(b) << "'s region";
      return s.str();
    }
  }
  return "the arena's padding";
}

std::string CallMemory::changed(Direction direction, bool outputs, bool query_result, bool workspace) const {
  if (arena_storage_ != arena_saved_) {  // else (every failed call) no byte-wise walk
    std::vector<unsigned char> writable(arena_storage_.size(), 0);
    if (outputs) mark_outputs(direction, writable);
    for (size_t i = 0; i < arena_storage_.size(); ++i)
      if (arena_storage_[i] != arena_saved_[i] && !writable[i]) return region_of(i);
  }
  for (const Block* b : blocks(*this)) {
    const auto [allowed_begin, allowed_end] = writable_bytes(*b, direction, outputs, workspace);
    for (size_t i = 0; i < b->size; ++i)
      if (b->data[i] != b->saved[i] && !(i >= allowed_begin && i < allowed_end))
        return "byte " + std::to_string(i) + " of the " + b->name;
  }
  for (size_t i = 0; i < sizeof bytes_saved_; ++i) {
    const bool result_byte = i >= kGuard && i < kGuard + sizeof(size_t);
    if (bytes_block_[i] != bytes_saved_[i] && !(query_result && result_byte))
      return result_byte ? "*bytes of the workspace query" : "the guard around *bytes";
  }
  return "";
}

}  // namespace jagflash::fuzz
