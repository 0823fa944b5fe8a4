// Which instantiation of the Hopper forward serves a call: host-only, shared by the launcher
// and the dispatcher (which sizes the workspace's plan for the same tile shape).
#pragma once

#include "core/bench_knobs.hpp"
#include "kernels/common/schedule.hpp"
#include "kernels/hopper_forward.hpp"

#include <jagflash/jagflash.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace jagflash::kernels::fwd {

// How CTAs get their tiles (kernels/common/schedule.hpp; the plain grid takes the forward's
// tiles in (batch, block, head) order, unsorted).
using common::Schedule;

// Benchmark knobs, read from the environment at every launch in a build with them
// (core/bench_knobs.hpp; none elsewhere: every field keeps its default), so that one process can
// time them side by side (bench/sweep.py --variant); each forces one choice
// and every combination is tested (scripts/gpu-check.sh). bench/NOTES.md has the measurements
// behind the defaults. A reused plan built under other knobs is refused on the device (its key).
//   JAGFLASH_FWD_SCHEDULE   = dynamic | zigzag | grid
//   JAGFLASH_FWD_PINGPONG   = 0 | 1          (two consumer warpgroups only)
//   JAGFLASH_FWD_BLOCK_N    = 64 | 128 | 160 | 176 (head dim 128 only; 160, 176: one Q buffer,
//                             176: O staged in halves, tile_config.hpp)
//   JAGFLASH_FWD_WARPGROUPS = 2 | 3          (head dim 64 only)
//   JAGFLASH_FWD_PAIRS      = 1 | 2          (2: one warpgroup per 64-row tile, two per CTA)
struct ForwardKnobs {
  Schedule schedule = Schedule::kDynamic;
  int ping_pong = -1;  // -1: not forced
  int block_n = 0;     // 0: not forced
  int warpgroups = 0;  // 0: not forced
  int pairs = 0;       // 0: not forced

  // bench_knob is nullptr for every name in a build without knobs: all fields keep their defaults.
  static ForwardKnobs get() {
    ForwardKnobs k;
    if (const char* s = bench_knob("JAGFLASH_FWD_SCHEDULE")) {
      if (std::strcmp(s, "zigzag") == 0) k.schedule = Schedule::kZigzag;
      if (std::strcmp(s, "grid") == 0) k.schedule = Schedule::kGrid;
    }
    if (const char* s = bench_knob("JAGFLASH_FWD_PINGPONG")) k.ping_pong = std::strcmp(s, "1") == 0 ? 1 : 0;
    if (const char* s = bench_knob("JAGFLASH_FWD_BLOCK_N")) {
      const int n = std::atoi(s);
      k.block_n = n == 64 || n == 160 || n == 176 ? n : 128;
    }
    if (const char* s = bench_knob("JAGFLASH_FWD_WARPGROUPS")) k.warpgroups = std::atoi(s) == 3 ? 3 : 2;
    if (const char* s = bench_knob("JAGFLASH_FWD_PAIRS")) k.pairs = std::atoi(s) == 2 ? 2 : 1;
    return k;
  }
};

// The default choice, then the knobs. Depends only on the call's shapes, mask and
// max_seqlen_hint (never on offsets values, which live on the device), so calls that reuse a
// plan with the same ones get the same variant (jf_launch.reuse_plan's contract).
// Defaults, each the faster side of an A/B measurement (the figures: bench/NOTES.md, "The
// measurements behind the code's defaults"):
//  - D = 64 without a mask: three consumer warpgroups (192-row tiles), faster on every
//    distribution; with a causal or window mask they lose on short sequences, so masks keep two,
//    except
//  - D = 64 causal where the mean sequence (rows / batch size, of q and of kv) is at least
//    kCausalThreeWarpgroupsMeanLength, where three win again (and lose below it). The mean is a
//    shape (total rows and batch size), so the choice stays independent of the offsets.
//  - everything else: two warpgroups, 128-key blocks, no ping-pong (64-key blocks tie at best).
//  - D = 256: two warpgroups, 32-key blocks, whatever the hint and the knobs (but the schedule).
//  - a score modifier (softcap, ALiBi) or a block-sparse map: two warpgroups and 128-key blocks (32
//    at D = 256), likewise (a map's 128 x 128 blocks then hold whole tiles).
//  - a max_seqlen hint of at most kPairsMaxSeqlen (every sequence that short): two independent
//    single-warpgroup pairs with 64-row tiles, faster on short sequences and slower on longer
//    ones; without the hint the host cannot tell a batch of short sequences from one with a long
//    tail. At every kernel head dim up to 128 (64, 96, 128), its own or padded below it (a
//    narrower v too): the padded and D = 96 kernels have this tile beside their default one.
//  - pooled attention with a query set of at most 64 rows (every tile's rows are that set): the
//    two pairs too, so that two sequences share a CTA's 128 rows, each warpgroup's 64 rows with
//    their own K/V range (the M of one wgmma is a warpgroup's 64 rows: the smallest row group that
//    can have its own keys).
inline constexpr int32_t kPairsMaxSeqlen = 256;
inline constexpr int32_t kPooledPairsMaxRows = 64;
inline constexpr int64_t kCausalThreeWarpgroupsMeanLength = 2048;
// Whether both sides' mean sequence is at least `length` rows long (a batch of none is not).
// Pooled, every sequence has the query set's pooled_q_rows (whether q.rows holds the set or, in
// the dispatcher's view, the output rows).
inline bool mean_length_at_least(const jf_problem& p, int64_t length) {
  if (p.batch_size <= 0) return false;
  const bool q_long = p.pooled_q_rows > 0 ? p.pooled_q_rows >= length : p.q.rows >= length * p.batch_size;
  return q_long && p.k.rows >= length * p.batch_size;
}
// e: the entry that serves the call, as the registry names it (the head dim's own or the next up
// that has the call's variant; null when this build has none, and the call is refused: then
// kernel_head_dim's shape). The dispatcher passes the entry it found (one lookup a call).
inline ForwardVariant choose_forward_variant(const jf_fwd_args& a, const HopperForwardEntry* e,
                                             const ForwardKnobs& k = ForwardKnobs::get()) {
  ForwardVariant v;
  v.schedule = k.schedule;
  const int32_t d = a.problem.q.head_dim;
  const int kernel_d = e != nullptr ? e->head_dim : kernel_head_dim(d);
  // Past 128, one shape per kernel (tile_config.hpp: shared memory): 64-key blocks at 192, 32 at
  // 256; only the schedule knob applies.
  if (kernel_d > 128) {
    v.block_n = forward_block_n_past_128(kernel_d);
    return v;
  }
  // A score modifier or a block-sparse map: the default tile (their kernels have that one alone).
  if (a.problem.score_mod != JF_SCORE_MOD_NONE || a.problem.block_mask.blocks != nullptr) return v;
  // The kernel's own head dim at 64 and 128: the shape knobs' tiles (and D = 64's three
  // warpgroups); padded (below the kernel's head dim, or a narrower v) and D = 96 have the default
  // tile and the two pairs only.
  const bool own_64_or_128 =
      (kernel_d == 64 || kernel_d == 128) && d == kernel_d && a.problem.v.head_dim == d;
  if (own_64_or_128) {
    if (kernel_d == 64 && (a.problem.mask == JF_MASK_NONE ||
                           (a.problem.mask == JF_MASK_CAUSAL &&
                            mean_length_at_least(a.problem, kCausalThreeWarpgroupsMeanLength))))
      v.warpgroups = 3;
    if (kernel_d == 128 && k.block_n != 0) v.block_n = k.block_n;
    if (kernel_d == 64 && k.warpgroups != 0) v.warpgroups = k.warpgroups;
    if (v.warpgroups == 2 && k.ping_pong >= 0) v.ping_pong = k.ping_pong == 1;
  }
  const int32_t hint = a.launch.max_seqlen_hint;
  if (hint > 0 && hint <= kPairsMaxSeqlen) v.pairs = 2;
  const int32_t pooled_rows = a.problem.pooled_q_rows;
  if (pooled_rows > 0 && pooled_rows <= kPooledPairsMaxRows) v.pairs = 2;
  if (k.pairs != 0) v.pairs = k.pairs;
  if (v.pairs == 2) {  // one warpgroup per tile; the key block that leaves two K/V stages a pair
    v.warpgroups = 1;
    v.block_n = forward_pairs_block_n(kernel_d);
    v.ping_pong = false;
  }
  return v;
}

// The same, looking the entry up (tests and tools that have none at hand).
inline ForwardVariant choose_forward_variant(const jf_fwd_args& a,
                                             const ForwardKnobs& k = ForwardKnobs::get()) {
  return choose_forward_variant(
      a,
      find_hopper_forward(a.problem.dtype, a.problem.q.head_dim, a.problem.score_mod,
                          a.problem.block_mask.blocks != nullptr, a.problem.v.head_dim),
      k);
}

}  // namespace jagflash::kernels::fwd
