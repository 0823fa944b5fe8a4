// Host-side scheduling: from the offsets, the valid tiles of a jagged batch with their cost,
// a longest-first (LPT) order, and the assignments to SMs that the kernels can use.
#pragma once

#include "core/mask.hpp"

#include <cstdint>
#include <vector>

namespace jagflash::schedule {

enum class Direction {
  kForward,  // tile = (batch, head, q block); cost = KV blocks the q block visits
  kBackward  // tile = (batch, head, kv block); cost = Q blocks that see the kv block
};

struct TileShape {
  int tile_m = 128;  // query rows per block
  int tile_n = 128;  // keys per block
};

struct Tile {
  int32_t batch;
  int32_t head;
  int32_t block;  // q block (forward) or kv block (backward) inside the sequence
  int32_t cost;   // exact count of blocks of the other side it visits (0: only an epilogue)
};

// Every tile with at least one row (forward: a query row; backward: a key row), in
// (batch, head, block) order. Tiles whose rows see nothing (cost 0) are kept: they must still
// write zeros. Sequences with no rows on the tile's side produce no tile.
std::vector<Tile> build_tiles(const int32_t* q_offsets, const int32_t* kv_offsets, int batch_size,
                              int num_heads, const MaskPolicy& mask, TileShape shape, Direction direction);

// Longest first; ties keep (batch, head, block) order, so the order is deterministic.
void sort_longest_first(std::vector<Tile>& tiles);

// A sequence's weight in the forward plan: its q blocks times its kv blocks (the work of its
// tiles before the mask), saturated at 2^32 - 2 so that weight + 1 fits 32 bits. Host and
// device (the GPU plan builder computes the same).
JF_HD uint64_t sequence_weight(int64_t lq, int64_t lk, TileShape shape) {
  const uint64_t q_blocks = static_cast<uint64_t>((lq + shape.tile_m - 1) / shape.tile_m);
  const uint64_t kv_blocks = static_cast<uint64_t>((lk + shape.tile_n - 1) / shape.tile_n);
  constexpr uint64_t kMax = 0xFFFFFFFEull;
  if (q_blocks != 0 && kv_blocks > kMax / q_blocks) return kMax;  // the product would pass kMax (or wrap)
  return q_blocks * kv_blocks;
}

// The forward plan's order: sequences by weight, heaviest first (ties: lower batch first); the
// tiles of one sequence together, q blocks last to first (the costliest first under causal and
// bottom-right windows). A sequence's tiles then run at the same time, so its K and V come from
// DRAM once and from L2 for the other tiles; ordering every tile by its own cost spreads a
// causal sequence's tiles over the whole run, and its K and V are then read from DRAM many times.
// Inside a sequence the heads come in groups (forward_head_group), one group after another, q
// blocks last to first inside a group and the group's heads innermost. One head a group (without
// a mask) is head by head, so a long sequence's CTAs share one head's K and V at a time (faster,
// and at a higher clock under the power cap); all heads one group is heads innermost, so
// the costliest q blocks of every head go first (under causal, head by head would start the last
// head's costliest tiles late). Between the two, a group is as many KV heads as an L2 budget holds
// of the sequence's K and V: heads innermost where they fit, and at L = 16k causal the 16 heads'
// 128 MB of K and V do not stream from DRAM once per q block, as they do with all heads one group
// (figures: bench/NOTES.md, "Figures moved out of code comments").
struct HeadOrder {
  // L2 budget of a group in rows of K and V (one KV head's row of both): > 0 sizes the groups by
  // the sequence's kv length, 0 puts all heads in one group, < 0 one head a group.
  int32_t l2_group_rows = 0;
  int32_t heads_per_kv_head = 1;  // GQA: a group holds whole KV heads' query heads
};
constexpr HeadOrder kHeadsInnermost{0, 1};
constexpr HeadOrder kHeadByHead{-1, 1};

// How many query heads of a sequence with len_kv keys form one group of `order` (of `heads`).
JF_HD int32_t forward_head_group(HeadOrder order, int64_t len_kv, int32_t heads) {
  if (order.l2_group_rows < 0) return 1;
  if (order.l2_group_rows == 0 || len_kv <= 0) return heads;
  const int64_t kv_heads = order.l2_group_rows / len_kv;  // whole KV heads that fit, at least one
  const int64_t group = (kv_heads < 1 ? 1 : kv_heads) * order.heads_per_kv_head;
  return group >= heads ? heads : static_cast<int32_t>(group);
}

void sort_sequences_heaviest_first(std::vector<Tile>& tiles, const int32_t* q_offsets,
                                   const int32_t* kv_offsets, TileShape shape, HeadOrder order);

// Where plan tile `tile` (of pairs x heads) lies inside its sequence, in the order above with
// `group` heads a group (forward_head_group). The device plan lists (batch, q block) pairs only,
// a sequence's pairs adjacent and last q block first; tile / heads is then a position inside the
// tile's own sequence, and from the q block of the pair at that position (block_at_pos) and the
// sequence's q block count the sequence's first position follows, and with it the tile's head
// and q block. Host and device.
struct TileInSequence {
  int32_t head;
  int32_t block;
};
// 32-bit, as the kernels' tile index: pairs x heads is about total_q x heads / 64, far below 2^31
// for any Q that fits in GPU memory; 64-bit division added ~530 SASS instructions to every
// forward kernel.
JF_HD TileInSequence tile_in_sequence(int32_t tile, int32_t heads, int32_t block_at_pos, int32_t q_blocks,
                                      int32_t group) {
  if (group >= heads) return {tile % heads, block_at_pos};  // heads innermost: the plan's own order
  group = group < 1 ? 1 : group;
  const int32_t first = tile / heads - (q_blocks - 1 - block_at_pos);  // the sequence's first position
  const int32_t local = tile - first * heads;                          // in [0, q_blocks x heads)
  const int32_t base = local / (q_blocks * group) * group;             // the group's first head
  const int32_t size = heads - base < group ? heads - base : group;    // the last group may be smaller
  const int32_t inside = local - base * q_blocks;
  return {base + inside % size, q_blocks - 1 - inside / size};
}

// The backward's order of one sequence's tiles when its (KV head, split) pairs come in L2-sized
// groups: tile `local` in [0, blocks x tiles_per_block) of a sequence with `blocks` KV blocks and
// tiles_per_block (KV head, split) pairs each. Groups of `group` pairs (the last may be smaller),
// one group after another; inside a group the KV blocks first to last, the group's pairs
// innermost. group = tiles_per_block is the plain order (block outer, pairs inner); group = 1 runs
// every KV block of one pair before the next pair (FA3's non-causal grid order). 32-bit, as
// tile_in_sequence. Host and device.
struct BackwardTileInSequence {
  int32_t block;       // KV block in the sequence
  int32_t head_split;  // (KV head, split) pair: kv_head x splits + split
};
JF_HD BackwardTileInSequence backward_tile_in_sequence(int32_t local, int32_t blocks, int32_t tiles_per_block,
                                                       int32_t group) {
  group = group < 1 ? 1 : (group > tiles_per_block ? tiles_per_block : group);
  const int32_t g = local / (blocks * group);
  const int32_t base = g * group;  // the group's first pair; the groups before it are full
  const int32_t size = tiles_per_block - base < group ? tiles_per_block - base : group;
  const int32_t inside = local - base * blocks;
  return {inside / size, base + inside % size};
}

// How many (KV head, split) pairs of a sequence form one L2 group: as many as keep at most
// `group_rows` rows of Q x heads (each pair's Q, dO and fp32 dQ rows of the sequence) in flight,
// at least one. 0 (or a single sequence's rows too many to count) leaves one group of all.
JF_HD int32_t backward_l2_group(int32_t group_rows, int64_t len_q, int32_t heads_per_pair,
                                int32_t tiles_per_block) {
  if (group_rows <= 0) return tiles_per_block;
  const int64_t rows = len_q * heads_per_pair;
  if (rows <= 0) return tiles_per_block;
  if (rows > group_rows) return 1;
  const int32_t fit = group_rows / static_cast<int32_t>(rows);  // 32-bit: rows <= group_rows here
  return fit > tiles_per_block ? tiles_per_block : fit;
}

// What a device plan was built for. The build stores it next to the plan (at a place that does
// not depend on the variant), and every forward launch compares it with its own before reading
// the plan: a plan reused (jf_launch.reuse_plan) under another kernel variant (tile shape) or
// for another batch (B, total q or kv rows) becomes a device error instead of wrong results.
// Offsets changed in place with the same B and totals are not caught (the reuse contract).
// The tag tells a written key from zeroed or foreign memory.
struct PlanKey {
  int64_t tag_and_tiles;
  int64_t batch_size;
  int64_t total_q;
  int64_t total_kv;
};
JF_HD PlanKey plan_key(TileShape shape, int32_t batch_size, int64_t total_q, int64_t total_kv) {
  constexpr int64_t kTag = int64_t(0x4A46504C) << 32;  // "JFPL"
  return {kTag | (int64_t(shape.tile_m) << 16) | int64_t(shape.tile_n), batch_size, total_q, total_kv};
}
JF_HD bool same_plan_key(const PlanKey& a, const PlanKey& b) {
  return a.tag_and_tiles == b.tag_and_tiles && a.batch_size == b.batch_size && a.total_q == b.total_q &&
         a.total_kv == b.total_kv;
}
// The backward's plans list a sequence's KV blocks in either order and say which in this bit
// of the stored key: set, first to last (the default); clear, last to first (its deterministic
// mode, whose dQ turns follow the plan's order so a tile only ever waits for tiles handed out
// before it). A plan serves either mode: the check of a reused plan ignores the bit.
constexpr int64_t kPlanFirstBlockFirst = int64_t(1) << 31;
JF_HD PlanKey with_block_order(PlanKey key, bool first_block_first) {
  if (first_block_first) key.tag_and_tiles |= kPlanFirstBlockFirst;
  return key;
}
JF_HD bool same_plan_key_either_order(PlanKey a, PlanKey b) {
  a.tag_and_tiles &= ~kPlanFirstBlockFirst;
  b.tag_and_tiles &= ~kPlanFirstBlockFirst;
  return same_plan_key(a, b);
}
// The device error flag's bit for a mismatched plan (the offsets check owns bits 0..5,
// detail::OffsetsError in api/offsets_check_device.hpp).
constexpr int32_t kPlanMismatchFlag = 1 << 6;

// Static snake assignment: round r hands tiles [r*N, r*N+N) to SMs 0..N-1 (r even) or N-1..0
// (r odd). Returns, per SM, the indices into `tiles` in the order that SM runs them.
std::vector<std::vector<int32_t>> zigzag_assign(const std::vector<Tile>& tiles, int num_sms);

// Makespan (max over SMs of summed cost) of an assignment.
int64_t makespan(const std::vector<Tile>& tiles, const std::vector<std::vector<int32_t>>& assignment);

// Makespan of dynamic scheduling through an atomic counter: each SM, when free, takes the next
// tile in list order (greedy list scheduling; with LPT order this is Graham's LPT).
int64_t makespan_dynamic(const std::vector<Tile>& tiles, int num_sms);

// max(total cost / N, longest tile): no schedule can beat it.
double makespan_lower_bound(const std::vector<Tile>& tiles, int num_sms);

}  // namespace jagflash::schedule
