// One case of the C API fuzzer: a call that starts valid and has some of its fields broken
// (CaseSpec), and the host memory it points into (CallMemory), laid out after the mutations so
// that every view the arguments describe is real memory wherever that is possible.
#pragma once

#include "fuzz_rng.hpp"

#include <jagflash/jagflash.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace jagflash::fuzz {

enum class Direction { kForward, kBackward };

// The caller-owned buffers of a call; each gets a region of one arena. The forward uses q, k, v,
// out and lse; the backward all of them.
enum Buffer : int { kQ, kK, kV, kOut, kDout, kDq, kDk, kDv, kLse, kBufferCount };
constexpr int kTensorCount = kLse;  // q .. dv are jf_tensor views

// The argument's name as the API spells it in messages ("problem.q", "out", "lse").
const char* buffer_name(int buffer);
bool is_output(Direction direction, int buffer);
bool is_used(Direction direction, int buffer);

// Where a pointer argument points.
struct Placement {
  enum Kind { kOwn, kNull, kWild, kInto };
  Kind kind = kOwn;
  int target = -1;          // kInto: the buffer whose region it points into
  int64_t byte_offset = 0;  // from the start of the region (kOwn: a misalignment)
};

// A C caller can store any int in an enum field: the case keeps them as ints and writes them
// into the arguments with memcpy, and reads them back the same way (loading an out-of-range
// value through the enum type would be undefined behaviour in C++).
template <typename E>
int enum_value(const E& field) {
  static_assert(sizeof(E) == sizeof(int), "jf_* enums are int-sized");
  int v;
  std::memcpy(&v, &field, sizeof v);
  return v;
}
template <typename E>
void set_enum(E& field, int value) {
  static_assert(sizeof(E) == sizeof(int), "jf_* enums are int-sized");
  std::memcpy(&field, &value, sizeof value);
}

enum class WorkspaceKind { kNone, kQueried, kSmaller, kGarbage, kMisaligned };

// dlearnable_sink at the very address of an input array (an output over an input), instead of
// where its own placement puts it.
enum class SinkGradientAlias { kNone, kSinks, kSlopes };

struct CaseSpec {
  Direction direction = Direction::kForward;
  int dtype = JF_BF16, device = JF_DEVICE_CPU, mask = JF_MASK_NONE;
  int offsets_check = JF_CHECK_OFFSETS_HOST, backend = JF_BACKEND_AUTO;
  int32_t batch_size = 0, window_left = -1, window_right = -1;
  float scale = 0.0f;
  int32_t pooled_q_rows = 0;  // jf_problem.pooled_q_rows: Lq > 0 makes a pooled call
  // The score modifier: jf_problem.score_mod as an int, softcap, and the ALiBi slopes as the
  // caller holds them (`alibi_slopes` is what is allocated: never fewer than H values when
  // `alibi_place` points at them, which no check could see), NULL unless placed.
  int score_mod = JF_SCORE_MOD_NONE;
  float softcap = 0.0f;
  std::vector<float> alibi_slopes;
  Placement alibi_place{Placement::kNull};
  // The learnable sinks (jf_problem.learnable_sink), one logit per query head, held as the slopes
  // are (`sinks` is what is allocated), NULL unless placed; and the backward's dlearnable_sink, as
  // many floats as `sinks` where its placement puts them, or at an input's address (`alias`).
  std::vector<float> sinks;
  Placement sink_place{Placement::kNull};
  Placement sink_gradient_place{Placement::kNull};
  SinkGradientAlias sink_gradient_alias = SinkGradientAlias::kNone;
  // The offsets arrays as the caller holds them: `values` is what is allocated (its length may
  // differ from batch_size + 1, but is never shorter, which no check could see).
  std::vector<int32_t> q_offsets, kv_offsets;
  Placement q_offsets_place, kv_offsets_place;
  bool kv_offsets_alias_q = false;
  jf_tensor tensors[kTensorCount] = {};  // data is set by CallMemory from `place`
  Placement place[kBufferCount];
  int32_t reuse_plan = 0, max_seqlen_hint = 0, deterministic = 0, caller_checked_pointers = 0;
  WorkspaceKind workspace = WorkspaceKind::kNone;
  int64_t workspace_garbage_bytes = 0;
  bool stream_garbage = false;
  bool args_null = false, bytes_null = false;

  std::string base;                    // the valid call it started as
  std::vector<std::string> mutations;  // what was broken, in order
  std::string describe() const;
};

// A mostly valid call, then zero or more mutations.
CaseSpec generate_case(Rng& rng);
// Hand-written cases, run before the random ones in every run: each bug the fuzzer found, some of
// which only a sanitizer sees (so no ordinary test could hold them), and one case per rule of the
// score modifier (jf_problem.score_mod, softcap, alibi_slopes), valid and broken.
std::vector<CaseSpec> regression_cases();
// For a call that the contract accepts but whose views CallMemory cannot back (huge strides, a
// wild pointer): breaks q_offsets[0] as well, so that a correct library rejects it after its
// shape checks (which therefore still run) and before it reads any tensor.
void break_offsets_for_unbacked_views(CaseSpec& spec);

// Bytes from a view's first element to one past its last, for `elem`-byte elements: 0 when it has
// no rows, -1 when it has rows but its fields place no element sensibly (non-positive heads or
// head dim, negative strides) or the span does not fit in int64.
int64_t view_bytes(const jf_tensor& t, int elem);
int element_bytes(int dtype);  // 4 for JF_FP32, else 2 (the library's rule for every other value)

// The host memory of one case: an arena with a region per buffer, each followed by a guard, all
// filled with a pattern from the case's seed; the offsets arrays, the ALiBi slopes, the sinks and
// their gradient, workspace, stream object and the size query's output in exact-size heap blocks
// of their own (AddressSanitizer sees any access past them). Every byte is compared with a
// snapshot after each call.
class CallMemory {
 public:
  CallMemory(const CaseSpec& spec, uint64_t pattern_seed);
  CallMemory(const CallMemory&) = delete;
  CallMemory& operator=(const CallMemory&) = delete;

  jf_fwd_args* fwd() { return &fwd_; }
  jf_bwd_args* bwd() { return &bwd_; }
  size_t* bytes_slot() { return reinterpret_cast<size_t*>(bytes_block_.get() + kGuard); }
  // Whether every view and array the arguments describe lies in memory allocated for it.
  bool backed() const { return backed_; }

  // Sets launch.workspace / workspace_bytes from the spec and the size the query returned.
  void attach_workspace(const CaseSpec& spec, size_t queried);
  void snapshot();
  bool bytes_written() const {
    return std::memcmp(bytes_block_.get(), bytes_saved_, sizeof bytes_saved_) != 0;
  }
  // "" when no byte changed since snapshot() but those a successful call may write (the output
  // views' elements, the forward's lse and the backward's dlearnable_sink when `outputs`, *bytes
  // when `query_result`, the workspace's bytes when `workspace`); else the first changed byte's
  // place.
  std::string changed(Direction direction, bool outputs, bool query_result, bool workspace) const;

 private:
  static constexpr size_t kGuard = 64;
  struct Block {
    std::string name;
    std::unique_ptr<unsigned char[]> data;
    size_t size = 0;
    std::vector<unsigned char> saved;
  };

  unsigned char* region_start(int buffer) { return arena_ + region_offset_[buffer]; }
  void* place_pointer(const Placement& p, int self);
  unsigned char* place_array(Block& block, const Placement& p, size_t bytes, const void* values,
                             uint64_t pattern_seed, int wild_slot);
  void mark_outputs(Direction direction, std::vector<unsigned char>& writable) const;
  size_t sink_gradient_bytes() const;
  std::pair<size_t, size_t> writable_bytes(const Block& b, Direction direction, bool outputs,
                                           bool workspace) const;
  // Every heap block, const or not as `memory` is.
  template <typename Memory>
  static auto blocks(Memory& memory) -> std::vector<decltype(&memory.q_offsets_block_)> {
    return {&memory.q_offsets_block_, &memory.kv_offsets_block_,    &memory.alibi_block_,
            &memory.sink_block_,      &memory.sink_gradient_block_, &memory.workspace_block_,
            &memory.stream_block_};
  }
  std::string region_of(size_t arena_offset) const;

  std::vector<unsigned char> arena_storage_, arena_saved_;
  unsigned char* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  size_t region_offset_[kBufferCount] = {};
  size_t region_bytes_[kBufferCount] = {};
  Block q_offsets_block_, kv_offsets_block_, alibi_block_, sink_block_, sink_gradient_block_,
      workspace_block_, stream_block_;
  std::unique_ptr<unsigned char[]> bytes_block_;  // guard, size_t, guard
  unsigned char bytes_saved_[2 * kGuard + sizeof(size_t)] = {};
  uint64_t pattern_seed_ = 0;
  bool backed_ = true;
  jf_fwd_args fwd_{};
  jf_bwd_args bwd_{};
};

}  // namespace jagflash::fuzz
