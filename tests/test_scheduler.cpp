// Scheduler tests: the tiles and costs of build_tiles against a brute force over every (query,
// key) pair, the plans' orders and how the kernels decode them, the zigzag schedule's snake, and
// the makespans of the kernels' orders on the benchmark batches.
#include "core/mask.hpp"
#include "gen/distributions.hpp"
#include "schedule/plan.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <iomanip>
#include <iostream>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace jagflash::schedule {
namespace {

struct NamedMask {
  std::string name;
  MaskPolicy policy;
};

MaskPolicy window(int32_t left, int32_t right) {
  MaskPolicy m;
  m.left = left;
  m.right = right;
  return m;
}

// none, causal, and windows on both sides of the tile sizes: (0,0) is one key wide, (3,5) and
// (16,16) are narrower than every tile used here, (64,0) than the 128 tiles.
std::vector<NamedMask> all_masks() {
  return {{"none", window(-1, -1)},         {"causal", window(-1, 0)},
          {"window(64,0)", window(64, 0)},  {"window(200,200)", window(200, 200)},
          {"window(0,-1)", window(0, -1)},  {"window(0,0)", window(0, 0)},
          {"window(3,5)", window(3, 5)},    {"window(16,16)", window(16, 16)},
          {"window(-1,7)", window(-1, 7)},  {"window(5,-1)", window(5, -1)},
          {"window(0,100)", window(0, 100)}};
}

std::vector<TileShape> all_shapes() { return {{128, 128}, {64, 128}, {128, 64}, {32, 16}}; }

const char* direction_name(Direction d) { return d == Direction::kForward ? "forward" : "backward"; }

std::string describe(const NamedMask& mask, TileShape shape, Direction d) {
  std::ostringstream s;
  s << direction_name(d) << ", mask " << mask.name << ", tile " << shape.tile_m << "x" << shape.tile_n;
  return s.str();
}

struct Batch {
  std::vector<int32_t> len_q;
  std::vector<int32_t> len_kv;
  std::vector<int32_t> q_offsets;
  std::vector<int32_t> kv_offsets;
  int size() const { return static_cast<int>(len_q.size()); }
};

std::vector<int32_t> offsets_of(const std::vector<int32_t>& lengths) {
  std::vector<int32_t> offsets(lengths.size() + 1, 0);
  for (size_t b = 0; b < lengths.size(); ++b) offsets[b + 1] = offsets[b] + lengths[b];
  return offsets;
}

Batch make_batch(std::vector<int32_t> len_q, std::vector<int32_t> len_kv) {
  Batch batch;
  batch.q_offsets = offsets_of(len_q);
  batch.kv_offsets = offsets_of(len_kv);
  batch.len_q = std::move(len_q);
  batch.len_kv = std::move(len_kv);
  return batch;
}

// Fixed pairs that cover every awkward case at least once: empty sides, 1, both sides of 64 and
// 128, Lq > Lk and Lq < Lk.
Batch awkward_batch() {
  return make_batch({0, 5, 0, 1, 63, 64, 65, 127, 129, 64, 129, 65, 300, 127, 1, 200, 128, 257},
                    {5, 0, 0, 1, 63, 63, 129, 128, 129, 64, 65, 300, 127, 300, 200, 1, 128, 17});
}

// Random jagged batch: lengths mostly from the awkward set, some uniform in [0, 300]; kv equal to
// q in a third of the sequences. mt19937_64's raw output is specified by the standard, so a seed
// names the same batch with every standard library.
Batch random_batch(uint64_t seed) {
  static const int32_t kAwkward[] = {0, 1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 191, 255, 257};
  const int32_t num_awkward = static_cast<int32_t>(sizeof(kAwkward) / sizeof(kAwkward[0]));
  std::mt19937_64 rng(seed);
  auto pick = [&](int32_t n) { return static_cast<int32_t>(rng() % static_cast<uint64_t>(n)); };
  auto length = [&]() { return pick(2) == 0 ? kAwkward[pick(num_awkward)] : pick(301); };
  const int batch_size = 1 + pick(12);
  std::vector<int32_t> len_q, len_kv;
  for (int b = 0; b < batch_size; ++b) {
    const int32_t lq = length();
    len_q.push_back(lq);
    len_kv.push_back(pick(3) == 0 ? lq : length());
  }
  return make_batch(len_q, len_kv);
}

std::vector<Batch> test_batches(std::vector<uint64_t>* seeds) {
  std::vector<Batch> batches{awkward_batch()};
  seeds->assign(1, 0);  // 0 marks the fixed awkward batch
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    batches.push_back(random_batch(seed));
    seeds->push_back(seed);
  }
  return batches;
}

int64_t blocks_of(int64_t length, int tile) { return (length + tile - 1) / tile; }

// The tiles build_tiles must return, enumerated from the definition: a block belongs to the
// sequence when at least one of its rows is inside the sequence.
std::vector<std::tuple<int, int, int>> enumerate_tiles(const Batch& batch, int num_heads, TileShape shape,
                                                       Direction d) {
  std::vector<std::tuple<int, int, int>> tiles;
  const int own_tile = d == Direction::kForward ? shape.tile_m : shape.tile_n;
  for (int b = 0; b < batch.size(); ++b) {
    const int64_t own_len = d == Direction::kForward ? batch.len_q[b] : batch.len_kv[b];
    for (int h = 0; h < num_heads; ++h) {
      for (int blk = 0; static_cast<int64_t>(blk) * own_tile < own_len + 2 * own_tile; ++blk) {
        bool has_row = false;
        for (int r = 0; r < own_tile; ++r) has_row |= static_cast<int64_t>(blk) * own_tile + r < own_len;
        if (has_row) tiles.emplace_back(b, h, blk);
      }
    }
  }
  return tiles;
}

// Brute-force block visibility of one sequence: touched[m][n] is true when q block m and kv block
// n hold at least one visible pair, from MaskPolicy::visible over every pair.
std::vector<std::vector<bool>> touched_blocks(const MaskPolicy& mask, int64_t lq, int64_t lk,
                                              TileShape shape) {
  std::vector<std::vector<bool>> touched(
      static_cast<size_t>(blocks_of(lq, shape.tile_m)),
      std::vector<bool>(static_cast<size_t>(blocks_of(lk, shape.tile_n)), false));
  for (int64_t i = 0; i < lq; ++i) {
    for (int64_t j = 0; j < lk; ++j) {
      if (mask.visible(i, j, lq, lk))
        touched[static_cast<size_t>(i / shape.tile_m)][static_cast<size_t>(j / shape.tile_n)] = true;
    }
  }
  return touched;
}

int32_t brute_cost(const std::vector<std::vector<bool>>& touched, int block, Direction d) {
  int32_t cost = 0;
  if (d == Direction::kForward) {
    for (const bool t : touched[static_cast<size_t>(block)]) cost += t ? 1 : 0;
  } else {
    for (const auto& row : touched) cost += row[static_cast<size_t>(block)] ? 1 : 0;
  }
  return cost;
}

constexpr int kHeads = 3;
constexpr Direction kDirections[] = {Direction::kForward, Direction::kBackward};

// (a) Exactly the tiles with rows, each once, in (batch, head, block) order.
TEST(Scheduler, TilesMatchEnumeration) {
  std::vector<uint64_t> seeds;
  const std::vector<Batch> batches = test_batches(&seeds);
  for (size_t k = 0; k < batches.size(); ++k) {
    const Batch& batch = batches[k];
    for (const NamedMask& mask : all_masks()) {
      for (const TileShape shape : all_shapes()) {
        for (const Direction d : kDirections) {
          SCOPED_TRACE("seed " + std::to_string(seeds[k]) + ", " + describe(mask, shape, d));
          const std::vector<Tile> tiles = build_tiles(batch.q_offsets.data(), batch.kv_offsets.data(),
                                                      batch.size(), kHeads, mask.policy, shape, d);
          const auto expected = enumerate_tiles(batch, kHeads, shape, d);
          ASSERT_EQ(tiles.size(), expected.size());
          for (size_t t = 0; t < tiles.size(); ++t) {
            ASSERT_EQ(std::make_tuple(tiles[t].batch, tiles[t].head, tiles[t].block), expected[t])
                << "tile " << t;
          }
        }
      }
    }
  }
}

// (b) Every tile's cost equals the brute-force count of blocks of the other side that hold at
// least one visible pair, for every tile shape (square and not).
TEST(Scheduler, CostsMatchBruteForce) {
  std::vector<uint64_t> seeds;
  const std::vector<Batch> batches = test_batches(&seeds);
  for (size_t k = 0; k < batches.size(); ++k) {
    const Batch& batch = batches[k];
    for (const NamedMask& mask : all_masks()) {
      for (const TileShape shape : all_shapes()) {
        std::vector<std::vector<std::vector<bool>>> touched;
        for (int b = 0; b < batch.size(); ++b) {
          touched.push_back(touched_blocks(mask.policy, batch.len_q[b], batch.len_kv[b], shape));
        }
        for (const Direction d : kDirections) {
          SCOPED_TRACE("seed " + std::to_string(seeds[k]) + ", " + describe(mask, shape, d));
          const std::vector<Tile> tiles = build_tiles(batch.q_offsets.data(), batch.kv_offsets.data(),
                                                      batch.size(), kHeads, mask.policy, shape, d);
          for (const Tile& tile : tiles) {
            ASSERT_EQ(tile.cost, brute_cost(touched[static_cast<size_t>(tile.batch)], tile.block, d))
                << "tile (batch " << tile.batch << ", head " << tile.head << ", block " << tile.block
                << "), Lq " << batch.len_q[tile.batch] << ", Lk " << batch.len_kv[tile.batch];
          }
        }
      }
    }
  }
}

// Tiles that see nothing stay in the list with cost 0 (they write zeros); sides with no rows give
// no tile at all.
TEST(Scheduler, EmptySidesAndZeroCostTiles) {
  const Batch batch = make_batch({130, 0, 64}, {0, 70, 64});
  const MaskPolicy causal = window(-1, 0);
  const TileShape shape{64, 64};
  const std::vector<Tile> fwd = build_tiles(batch.q_offsets.data(), batch.kv_offsets.data(), batch.size(), 1,
                                            causal, shape, Direction::kForward);
  // Sequence 0: 3 q blocks, no keys; sequence 1: no queries; sequence 2: one block, one kv block.
  ASSERT_EQ(fwd.size(), 4u);
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(fwd[t].batch, 0);
    EXPECT_EQ(fwd[t].block, t);
    EXPECT_EQ(fwd[t].cost, 0);
  }
  EXPECT_EQ(fwd[3].batch, 2);
  EXPECT_EQ(fwd[3].cost, 1);

  const std::vector<Tile> bwd = build_tiles(batch.q_offsets.data(), batch.kv_offsets.data(), batch.size(), 1,
                                            causal, shape, Direction::kBackward);
  ASSERT_EQ(bwd.size(), 3u);  // sequence 1: 2 kv blocks no query sees; sequence 2: 1
  EXPECT_EQ(bwd[0].batch, 1);
  EXPECT_EQ(bwd[0].cost, 0);
  EXPECT_EQ(bwd[1].batch, 1);
  EXPECT_EQ(bwd[1].cost, 0);
  EXPECT_EQ(bwd[2].batch, 2);
  EXPECT_EQ(bwd[2].cost, 1);

  // Lq > Lk with a one-key window: the top 60 queries see nothing (i + shift < 0).
  const Batch tall = make_batch({128}, {68});
  const std::vector<Tile> tall_fwd = build_tiles(tall.q_offsets.data(), tall.kv_offsets.data(), 1, 1,
                                                 window(0, 0), {32, 32}, Direction::kForward);
  ASSERT_EQ(tall_fwd.size(), 4u);
  EXPECT_EQ(tall_fwd[0].cost, 0);
  EXPECT_EQ(tall_fwd[1].cost, 1);  // rows 32..63 see keys 0..3
  EXPECT_EQ(tall_fwd[2].cost, 2);  // rows 64..95 see keys 4..35
  EXPECT_EQ(tall_fwd[3].cost, 2);  // rows 96..127 see keys 36..67

  const Batch none = make_batch({}, {});
  EXPECT_TRUE(
      build_tiles(none.q_offsets.data(), none.kv_offsets.data(), 0, 4, causal, shape, Direction::kForward)
          .empty());
}

TEST(Scheduler, RejectsDecreasingOffsets) {
  const std::vector<int32_t> q_offsets{0, 10, 5};
  const std::vector<int32_t> kv_offsets{0, 10, 20};
  EXPECT_THROW(build_tiles(q_offsets.data(), kv_offsets.data(), 2, 1, MaskPolicy{}, {}, Direction::kForward),
               std::invalid_argument);
  EXPECT_THROW(zigzag_assign({}, 0), std::invalid_argument);
  EXPECT_THROW(makespan_dynamic({}, 0), std::invalid_argument);
}

// (c) The tile-by-tile LPT order (no kernel runs it; the makespan table prints it beside the
// plans): non-increasing cost, a permutation of the input, ties in (batch, head, block) order.
TEST(Scheduler, SortLongestFirst) {
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const Batch batch = random_batch(seed);
    for (const Direction d : kDirections) {
      std::vector<Tile> tiles = build_tiles(batch.q_offsets.data(), batch.kv_offsets.data(), batch.size(),
                                            kHeads, window(-1, 0), {64, 64}, d);
      const std::vector<Tile> original = tiles;
      // Start from a scrambled order: the result must not depend on the input's order.
      std::shuffle(tiles.begin(), tiles.end(), std::mt19937_64(seed));
      sort_longest_first(tiles);
      ASSERT_EQ(tiles.size(), original.size());
      auto key = [](const Tile& t) { return std::make_tuple(t.batch, t.head, t.block); };
      for (size_t t = 1; t < tiles.size(); ++t) {
        ASSERT_GE(tiles[t - 1].cost, tiles[t].cost) << "position " << t;
        if (tiles[t - 1].cost == tiles[t].cost) {
          ASSERT_LT(key(tiles[t - 1]), key(tiles[t])) << "tie order at position " << t;
        }
      }
      std::vector<Tile> back = tiles;
      std::sort(back.begin(), back.end(), [&](const Tile& a, const Tile& b) { return key(a) < key(b); });
      for (size_t t = 0; t < back.size(); ++t) {
        ASSERT_EQ(key(back[t]), key(original[t]));
        ASSERT_EQ(back[t].cost, original[t].cost);
      }
    }
  }
}

// (c') The forward plan's order: a permutation; each sequence's tiles contiguous; sequences by
// weight non-increasing, ties by lower batch; inside a sequence the heads in groups of
// forward_head_group's size one after another, q blocks last to first inside a group and the
// group's heads innermost (one group of all: heads innermost; one head a group: head by head).
// The orders below: heads innermost, head by head, and L2 groups of 300 and 2000 KV rows (a
// KV head of 1 or 2 query heads), which the random batches' lengths cut into 1 to all heads.
const std::vector<HeadOrder>& head_orders() {
  static const std::vector<HeadOrder> orders = {kHeadsInnermost, kHeadByHead, {300, 1}, {300, 2}, {2000, 1}};
  return orders;
}
std::string describe(HeadOrder o) {
  return "l2_group_rows " + std::to_string(o.l2_group_rows) + " heads/kv " +
         std::to_string(o.heads_per_kv_head);
}

TEST(Scheduler, SortSequencesHeaviestFirst) {
  const TileShape shape{64, 64};
  for (uint64_t seed = 1; seed <= 24; ++seed)
    for (const HeadOrder& order : head_orders()) {
      SCOPED_TRACE("seed " + std::to_string(seed) + ", " + describe(order));
      const Batch batch = random_batch(seed);
      std::vector<Tile> tiles = build_tiles(batch.q_offsets.data(), batch.kv_offsets.data(), batch.size(),
                                            kHeads, window(-1, 0), shape, Direction::kForward);
      const std::vector<Tile> original = tiles;
      std::shuffle(tiles.begin(), tiles.end(), std::mt19937_64(seed));
      sort_sequences_heaviest_first(tiles, batch.q_offsets.data(), batch.kv_offsets.data(), shape, order);
      ASSERT_EQ(tiles.size(), original.size());
      auto weight = [&](int32_t b) {
        return sequence_weight(batch.q_offsets[b + 1] - batch.q_offsets[b],
                               batch.kv_offsets[b + 1] - batch.kv_offsets[b], shape);
      };
      std::set<int32_t> finished;  // sequences whose tiles have all gone by
      for (size_t t = 1; t < tiles.size(); ++t) {
        const Tile& a = tiles[t - 1];
        const Tile& b = tiles[t];
        if (a.batch != b.batch) {
          ASSERT_TRUE(finished.insert(a.batch).second)
              << "sequence " << a.batch << " split at position " << t;
          ASSERT_EQ(finished.count(b.batch), 0u) << "sequence " << b.batch << " split at position " << t;
          ASSERT_GE(weight(a.batch), weight(b.batch)) << "position " << t;
          if (weight(a.batch) == weight(b.batch)) {
            ASSERT_LT(a.batch, b.batch) << "position " << t;
          }
        } else {
          const int32_t g =
              forward_head_group(order, batch.kv_offsets[a.batch + 1] - batch.kv_offsets[a.batch], kHeads);
          if (order.l2_group_rows == 0) {
            ASSERT_EQ(g, kHeads);
          }
          if (order.l2_group_rows < 0) {
            ASSERT_EQ(g, 1);
          }
          ASSERT_LE(a.head / g, b.head / g) << "groups one after another, position " << t;
          if (a.head / g == b.head / g) {
            ASSERT_TRUE(a.block > b.block || (a.block == b.block && a.head < b.head)) << "position " << t;
          }
        }
      }
      auto key = [](const Tile& t) { return std::make_tuple(t.batch, t.head, t.block); };
      std::vector<Tile> back = tiles;
      std::sort(back.begin(), back.end(), [&](const Tile& x, const Tile& y) { return key(x) < key(y); });
      for (size_t t = 0; t < back.size(); ++t) {
        ASSERT_EQ(key(back[t]), key(original[t]));
        ASSERT_EQ(back[t].cost, original[t].cost);
      }
    }
  // Saturation: a weight never reaches 2^32 - 1, so weight + 1 fits the key's 32 bits.
  // (Below: tile_in_sequence, the kernels' decoding of this order from the pair-only plan.)
  EXPECT_EQ(sequence_weight(int64_t(1) << 40, int64_t(1) << 40, {1, 1}), 0xFFFFFFFEull);
  EXPECT_EQ(sequence_weight(0, 100, {64, 64}), 0u);
  EXPECT_EQ(sequence_weight(129, 65, {64, 64}), 3u * 2u);
}

// The size of a group: whole KV heads of the sequence's K and V within the budget, at least one,
// at most every head; 0 one group of all, < 0 one head.
TEST(Scheduler, ForwardHeadGroupSize) {
  EXPECT_EQ(forward_head_group(kHeadsInnermost, 16384, 16), 16);
  EXPECT_EQ(forward_head_group(kHeadByHead, 16, 16), 1);
  constexpr int32_t kRows32MbAt128 = (32 << 20) / ((128 + 128) * 2);  // 65536 rows of K and V
  EXPECT_EQ(forward_head_group({kRows32MbAt128, 1}, 16384, 16), 4);
  EXPECT_EQ(forward_head_group({kRows32MbAt128, 1}, 8192, 16), 8);
  EXPECT_EQ(forward_head_group({kRows32MbAt128, 1}, 4096, 16), 16);    // all fit: heads innermost
  EXPECT_EQ(forward_head_group({kRows32MbAt128, 1}, 1 << 20, 16), 1);  // one head past the budget
  EXPECT_EQ(forward_head_group({kRows32MbAt128, 4}, 1 << 20, 16), 4);  // GQA: one KV head's 4 query heads
  EXPECT_EQ(forward_head_group({kRows32MbAt128, 4}, 16384, 16), 16);   // 4 KV heads of 4
  EXPECT_EQ(forward_head_group({kRows32MbAt128, 1}, 0, 16), 16);       // no keys: nothing to share
  EXPECT_EQ(forward_head_group({INT32_MAX, 8}, 1, 16), 16);            // no 32-bit overflow
}

// (c'') The kernels see the plan as (batch, q block) pairs in this order (one head) and decode
// tile t of pairs x heads with tile_in_sequence: that must give the order with heads exactly.
TEST(Scheduler, TileInSequenceDecodesThePlanOrder) {
  const TileShape shape{64, 64};
  for (uint64_t seed = 1; seed <= 12; ++seed) {
    SCOPED_TRACE("seed " + std::to_string(seed));
    const Batch batch = random_batch(seed);
    for (const int heads : {1, 3, kHeads})
      for (const HeadOrder& order : head_orders()) {
        std::vector<Tile> pairs = build_tiles(batch.q_offsets.data(), batch.kv_offsets.data(), batch.size(),
                                              1, window(-1, 0), shape, Direction::kForward);
        std::vector<Tile> want = build_tiles(batch.q_offsets.data(), batch.kv_offsets.data(), batch.size(),
                                             heads, window(-1, 0), shape, Direction::kForward);
        sort_sequences_heaviest_first(pairs, batch.q_offsets.data(), batch.kv_offsets.data(), shape, order);
        sort_sequences_heaviest_first(want, batch.q_offsets.data(), batch.kv_offsets.data(), shape, order);
        ASSERT_EQ(want.size(), pairs.size() * static_cast<size_t>(heads));
        for (size_t t = 0; t < want.size(); ++t) {
          const Tile& pair = pairs[t / static_cast<size_t>(heads)];
          const int32_t len_q = batch.q_offsets[pair.batch + 1] - batch.q_offsets[pair.batch];
          const int32_t len_kv = batch.kv_offsets[pair.batch + 1] - batch.kv_offsets[pair.batch];
          const TileInSequence at = tile_in_sequence(static_cast<int32_t>(t), heads, pair.block,
                                                     (len_q + shape.tile_m - 1) / shape.tile_m,
                                                     forward_head_group(order, len_kv, heads));
          const std::string where =
              "tile " + std::to_string(t) + " heads " + std::to_string(heads) + ", " + describe(order);
          ASSERT_EQ(pair.batch, want[t].batch) << where;
          ASSERT_EQ(at.head, want[t].head) << where;
          ASSERT_EQ(at.block, want[t].block) << where;
        }
      }
  }
}

// (c''') The backward's L2-grouped order of one sequence's tiles: every (block, pair) exactly
// once; (pair) groups of `group` one after another, the last possibly smaller; inside a group
// the blocks first to last with the group's pairs innermost. group = all pairs is the plain
// order (local = block x pairs + pair), group = 1 every block of a pair before the next pair.
TEST(Scheduler, BackwardTileInSequenceGroupsPairs) {
  for (const int32_t blocks : {1, 2, 7, 128})
    for (const int32_t pairs : {1, 3, 16})
      for (const int32_t group : {0, 1, 2, 5, 16, 40}) {
        SCOPED_TRACE("blocks " + std::to_string(blocks) + " pairs " + std::to_string(pairs) + " group " +
                     std::to_string(group));
        const int32_t g = group < 1 ? 1 : std::min(group, pairs);
        std::set<std::pair<int32_t, int32_t>> seen;
        BackwardTileInSequence prev{-1, -1};
        for (int32_t local = 0; local < blocks * pairs; ++local) {
          const BackwardTileInSequence at = backward_tile_in_sequence(local, blocks, pairs, group);
          ASSERT_GE(at.block, 0);
          ASSERT_LT(at.block, blocks);
          ASSERT_GE(at.head_split, 0);
          ASSERT_LT(at.head_split, pairs);
          ASSERT_TRUE(seen.insert({at.block, at.head_split}).second) << "tile " << local << " twice";
          if (g == pairs) {
            ASSERT_EQ(at.block, local / pairs);
            ASSERT_EQ(at.head_split, local % pairs);
          }
          if (g == 1) {
            ASSERT_EQ(at.head_split, local / blocks);
            ASSERT_EQ(at.block, local % blocks);
          }
          if (local > 0) {
            const int32_t group_now = at.head_split / g, group_prev = prev.head_split / g;
            ASSERT_GE(group_now, group_prev) << "groups run one after another";
            if (group_now == group_prev) {
              ASSERT_TRUE(at.block > prev.block ||
                          (at.block == prev.block && at.head_split == prev.head_split + 1))
                  << "inside a group: blocks in order, pairs innermost";
            }
          }
          prev = at;
        }
        ASSERT_EQ(seen.size(), static_cast<size_t>(blocks * pairs));
      }
}

TEST(Scheduler, BackwardL2GroupSize) {
  EXPECT_EQ(backward_l2_group(0, 16384, 1, 16), 16);               // off: one group of all
  EXPECT_EQ(backward_l2_group(24576, 16384, 1, 16), 1);            // one head's rows already fill it
  EXPECT_EQ(backward_l2_group(24576, 2048, 1, 16), 12);            // 12 heads of 2048 rows
  EXPECT_EQ(backward_l2_group(24576, 1024, 1, 16), 16);            // capped at the pairs there are
  EXPECT_EQ(backward_l2_group(24576, 2048, 4, 4), 3);              // GQA: a pair holds 4 query heads
  EXPECT_EQ(backward_l2_group(24576, 0, 1, 16), 16);               // no queries: nothing to group
  EXPECT_EQ(backward_l2_group(24576, int64_t(1) << 40, 8, 2), 1);  // no 32-bit overflow
}

// The forward kernels' order of a batch's tiles: the plan's (sort_sequences_heaviest_first),
// head by head inside a sequence without a mask, heads innermost with one by default, or in L2
// groups of heads (JAGFLASH_FWD_L2_GROUP_KB; the plan lists (batch, q block) pairs;
// kernels/fwd/scheduler_fwd.cuh decodes the heads so, and TileInSequenceDecodesThePlanOrder holds
// that decoding to this order). l2_group_rows: 0, the default, or the candidate 32 MB over a K
// and a V row at D = 128 bf16 (kernels/fwd/fwd_launch.cuh).
constexpr int32_t kFwdL2GroupRows = (32 << 20) / ((128 + 128) * 2);
std::vector<Tile> forward_plan_order(const std::vector<int32_t>& q_offsets,
                                     const std::vector<int32_t>& kv_offsets, int num_heads,
                                     const MaskPolicy& mask, TileShape shape, int32_t l2_group_rows = 0) {
  const int batch_size = static_cast<int>(q_offsets.size()) - 1;
  std::vector<Tile> tiles = build_tiles(q_offsets.data(), kv_offsets.data(), batch_size, num_heads, mask,
                                        shape, Direction::kForward);
  sort_sequences_heaviest_first(tiles, q_offsets.data(), kv_offsets.data(), shape,
                                mask.is_full() ? kHeadByHead : HeadOrder{l2_group_rows, 1});
  return tiles;
}

// The backward kernels' order (one split per KV head, outside pooled attention): the plan, built
// by the forward's plan builder with the sides swapped (kernels/bwd/bwd_launch.cuh), lists
// (batch, KV block) pairs, sequences heaviest first and a sequence's KV blocks first to last;
// the kernels (kernels/bwd/scheduler_bwd.cuh) then take a sequence's (KV block, KV head) tiles in
// the L2 groups of heads that backward_l2_group sizes from `l2_group_rows` and
// backward_tile_in_sequence orders.
std::vector<Tile> backward_plan_order(const std::vector<int32_t>& q_offsets,
                                      const std::vector<int32_t>& kv_offsets, int num_heads_kv,
                                      const MaskPolicy& mask, TileShape shape, int32_t l2_group_rows) {
  const int batch_size = static_cast<int>(q_offsets.size()) - 1;
  // One head: the plan's pairs, each with its cost; a sequence's pairs come last block first.
  std::vector<Tile> pairs =
      build_tiles(q_offsets.data(), kv_offsets.data(), batch_size, 1, mask, shape, Direction::kBackward);
  sort_sequences_heaviest_first(pairs, q_offsets.data(), kv_offsets.data(), shape, kHeadsInnermost);
  std::vector<Tile> order;
  for (size_t first = 0; first < pairs.size();) {
    const int32_t b = pairs[first].batch;
    size_t end = first;
    while (end < pairs.size() && pairs[end].batch == b) ++end;
    const auto blocks = static_cast<int32_t>(end - first);
    const int32_t group = backward_l2_group(l2_group_rows, q_offsets[b + 1] - q_offsets[b], 1, num_heads_kv);
    for (int32_t local = 0; local < blocks * num_heads_kv; ++local) {
      const BackwardTileInSequence at = backward_tile_in_sequence(local, blocks, num_heads_kv, group);
      const Tile& pair = pairs[first + static_cast<size_t>(blocks - 1 - at.block)];
      order.push_back(Tile{b, at.head_split, at.block, pair.cost});
    }
    first = end;
  }
  return order;
}

// (d) The snake the kernels run under JAGFLASH_FWD_SCHEDULE / JAGFLASH_BWD_SCHEDULE = zigzag:
// kernels/common/schedule.hpp's next_tile_index gives CTA c of N, in round r, plan tile
// r x N + (r odd ? N - 1 - c : c). That rule is device code; zigzag_assign is its host form (the
// makespans below use it), held here to the rule as written there: every tile once, one a round.
TEST(Scheduler, ZigzagAssign) {
  // A literal case: 8 tiles on 3 SMs -> rounds [0 1 2], [5 4 3] reversed, [6 7].
  std::vector<Tile> eight(8, Tile{0, 0, 0, 1});
  for (int t = 0; t < 8; ++t) eight[t].cost = 10 - t;
  const auto small = zigzag_assign(eight, 3);
  ASSERT_EQ(small.size(), 3u);
  EXPECT_EQ(small[0], (std::vector<int32_t>{0, 5, 6}));
  EXPECT_EQ(small[1], (std::vector<int32_t>{1, 4, 7}));
  EXPECT_EQ(small[2], (std::vector<int32_t>{2, 3}));
  EXPECT_EQ(makespan(eight, small), 10 + 5 + 4);

  const Batch batch = random_batch(7);
  const std::vector<Tile> tiles =
      forward_plan_order(batch.q_offsets, batch.kv_offsets, kHeads, MaskPolicy{}, {32, 32});
  const int n_tiles = static_cast<int>(tiles.size());
  for (const int num_sms : {1, 2, 3, 7, 132, n_tiles, n_tiles + 5}) {
    SCOPED_TRACE("num_sms " + std::to_string(num_sms) + ", tiles " + std::to_string(n_tiles));
    const auto assignment = zigzag_assign(tiles, num_sms);
    ASSERT_EQ(assignment.size(), static_cast<size_t>(num_sms));
    std::vector<int> seen(tiles.size(), 0);
    int64_t total = 0;
    for (int sm = 0; sm < num_sms; ++sm) {
      const auto& list = assignment[static_cast<size_t>(sm)];
      for (size_t k = 0; k < list.size(); ++k) {
        const int32_t t = list[k];
        ASSERT_GE(t, 0);
        ASSERT_LT(t, n_tiles);
        ++seen[static_cast<size_t>(t)];
        total += tiles[static_cast<size_t>(t)].cost;
        const int round = static_cast<int>(k);
        EXPECT_EQ(t, round * num_sms + ((round & 1) ? num_sms - 1 - sm : sm))
            << "SM " << sm << ", round " << round;
      }
    }
    for (int t = 0; t < n_tiles; ++t) ASSERT_EQ(seen[static_cast<size_t>(t)], 1) << "tile " << t;
    const int64_t span = makespan(tiles, assignment);
    EXPECT_GE(static_cast<double>(span), makespan_lower_bound(tiles, num_sms));
    EXPECT_LE(span, total);
  }
  EXPECT_EQ(zigzag_assign({}, 4).size(), 4u);
}

// Greedy list scheduling on a case worked by hand.
TEST(Scheduler, DynamicMakespanAndLowerBound) {
  std::vector<Tile> tiles;
  for (const int32_t cost : {5, 4, 3, 3, 2, 2}) tiles.push_back(Tile{0, 0, 0, cost});
  // SM A takes 5, B takes 4 and then 3 (free at 4), A takes 3 (free at 5): A = 8, B = 7;
  // B takes 2 -> 9, A takes the last 2 -> 10.
  EXPECT_EQ(makespan_dynamic(tiles, 2), 10);
  EXPECT_DOUBLE_EQ(makespan_lower_bound(tiles, 2), 9.5);
  EXPECT_DOUBLE_EQ(makespan_lower_bound(tiles, 10), 5.0);
  EXPECT_EQ(makespan_dynamic(tiles, 10), 5);
  EXPECT_EQ(makespan_dynamic(tiles, 1), 19);
  EXPECT_EQ(makespan_dynamic({}, 3), 0);
  EXPECT_DOUBLE_EQ(makespan_lower_bound({}, 3), 0.0);
}

// (e) On the benchmark batches (H = 16, 132 SMs, D = 128's default tiles: 128 x 128 forward,
// 64-row Q blocks and 128-key KV blocks backward), the orders the kernels run (the plans above)
// under the default dynamic schedule stay within 2% of the lower bound. The order is what keeps
// them there: the same tiles in batch order (unsorted) give 1.043 on onegiant causal and 1.024 on
// pareto causal (forward). The zigzag schedule (a benchmark knob) and the tile-by-tile LPT order
// (sort_longest_first, which no kernel runs) are printed beside them, not bounded: a static snake
// cannot even out a sequence's unequal tiles in the plan's order (the backward's onegiant causal,
// whose one long sequence runs head by head in its L2 groups, gives 1.53).
TEST(Scheduler, MakespanOnBenchmarkDistributions) {
  constexpr int kNumHeads = 16;
  constexpr int kNumSms = 132;
  const TileShape forward_shape{128, 128};
  const TileShape backward_shape{64, 128};
  // The backward's default L2 group at D = 128 (kernels/bwd/bwd_launch.cuh): 24 MB over the bytes
  // a Q row keeps in flight, Q and dO in bf16 and the fp32 dQ row.
  constexpr int32_t kL2GroupRows = (24 << 20) / (128 * (2 + 2 + 4));
  const std::vector<NamedMask> masks = {{"none", window(-1, -1)}, {"causal", window(-1, 0)}};
  std::cout << std::left << std::setw(10) << "dist" << std::setw(9) << "dir" << std::setw(8) << "mask"
            << std::right << std::setw(8) << "tiles" << std::setw(10) << "bound" << std::setw(10) << "dynamic"
            << std::setw(10) << "zigzag" << std::setw(10) << "lpt"
            << "\n";
  for (const std::string& name : gen::distribution_names()) {
    const std::vector<int32_t> lengths = gen::generate_lengths(name, gen::kDefaultSeed);
    const std::vector<int32_t> offsets = offsets_of(lengths);
    for (const Direction d : kDirections) {
      const TileShape shape = d == Direction::kForward ? forward_shape : backward_shape;
      for (const NamedMask& mask : masks) {
        SCOPED_TRACE(name + ", " + describe(mask, shape, d));
        const std::vector<Tile> plan =
            d == Direction::kForward
                ? forward_plan_order(offsets, offsets, kNumHeads, mask.policy, shape)
                : backward_plan_order(offsets, offsets, kNumHeads, mask.policy, shape, kL2GroupRows);
        std::vector<Tile> lpt = plan;
        sort_longest_first(lpt);
        const double bound = makespan_lower_bound(plan, kNumSms);
        const double dynamic = static_cast<double>(makespan_dynamic(plan, kNumSms)) / bound;
        const double zigzag = static_cast<double>(makespan(plan, zigzag_assign(plan, kNumSms))) / bound;
        const double lpt_dynamic = static_cast<double>(makespan_dynamic(lpt, kNumSms)) / bound;
        std::cout << std::left << std::setw(10) << name << std::setw(9) << direction_name(d) << std::setw(8)
                  << mask.name << std::right << std::setw(8) << plan.size() << std::setw(10) << std::fixed
                  << std::setprecision(1) << bound << std::setw(10) << std::setprecision(4) << dynamic
                  << std::setw(10) << zigzag << std::setw(10) << lpt_dynamic << "\n";
        EXPECT_LE(dynamic, 1.02);
        if (d == Direction::kForward) {  // the candidate L2 groups of heads (JAGFLASH_FWD_L2_GROUP_KB)
          const std::vector<Tile> grouped =
              forward_plan_order(offsets, offsets, kNumHeads, mask.policy, shape, kFwdL2GroupRows);
          EXPECT_LE(static_cast<double>(makespan_dynamic(grouped, kNumSms)) / bound, 1.02) << "L2 groups";
        }
      }
    }
  }
  std::cout.unsetf(std::ios::floatfield);
}

// (f) The mask policy the scheduler's costs stand on.
TEST(SchedulerMaskPolicy, CausalPairsAndBottomRightAlignment) {
  const MaskPolicy causal = MaskPolicy::from(JF_MASK_CAUSAL, -1, -1);
  for (const int64_t n : {0, 1, 2, 63, 64, 129, 1000}) {
    EXPECT_EQ(causal.visible_pairs(n, n), n * (n + 1) / 2) << "n " << n;
  }
  // Lq = 3, Lk = 5: shift 2, row 0 sees keys 0..2, row 2 sees all five.
  const IndexRange row0 = causal.key_range(0, 3, 5);
  EXPECT_EQ(row0.lo, 0);
  EXPECT_EQ(row0.hi, 2);
  for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(causal.visible(0, j, 3, 5), j <= 2) << "key " << j;
  EXPECT_EQ(causal.key_range(2, 3, 5).size(), 5);
  EXPECT_EQ(causal.visible_pairs(3, 5), 3 + 4 + 5);
  // Lq = 5, Lk = 3: shift -2, rows 0 and 1 see nothing.
  EXPECT_TRUE(causal.key_range(1, 5, 3).empty());
  EXPECT_EQ(causal.visible_pairs(5, 3), 1 + 2 + 3);
  EXPECT_EQ(MaskPolicy::from(JF_MASK_NONE, -1, -1).visible_pairs(7, 11), 77);
}

TEST(SchedulerMaskPolicy, RangesMatchVisible) {
  for (const NamedMask& mask : all_masks()) {
    for (const auto& [lq, lk] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 9}, {9, 0}, {1, 1}, {13, 13}, {7, 40}, {40, 7}, {70, 3}, {3, 70}}) {
      SCOPED_TRACE(mask.name + ", Lq " + std::to_string(lq) + ", Lk " + std::to_string(lk));
      int64_t pairs = 0;
      for (int64_t i = 0; i < lq; ++i) {
        for (int64_t j = 0; j < lk; ++j) {
          const bool v = mask.policy.visible(i, j, lq, lk);
          pairs += v ? 1 : 0;
          const IndexRange q = mask.policy.query_range(j, lq, lk);
          ASSERT_EQ(v, i >= q.lo && i <= q.hi) << "query_range is not the transpose at " << i << "," << j;
        }
      }
      EXPECT_EQ(mask.policy.visible_pairs(lq, lk), pairs);
    }
  }
}

// unmasked_q_blocks_of_kv_block (the backward's mask-free steps) against a brute force over the
// pairs: a Q block is in the range exactly when its rows are inside the sequence, the KV block's
// keys are, and every (row, key) pair is visible.
TEST(SchedulerMaskPolicy, UnmaskedQBlocksMatchBruteForce) {
  std::vector<NamedMask> masks = all_masks();
  masks.push_back({"window 5,0", MaskPolicy::from(JF_MASK_WINDOW, 5, 0)});
  masks.push_back({"window 70,3", MaskPolicy::from(JF_MASK_WINDOW, 70, 3)});
  masks.push_back({"window 0,9", MaskPolicy::from(JF_MASK_WINDOW, 0, 9)});
  int64_t full_blocks = 0;
  for (const NamedMask& mask : masks) {
    for (const auto& [lq, lk] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 16}, {16, 0}, {1, 1}, {8, 8}, {13, 13}, {64, 64}, {7, 40}, {40, 7}, {70, 33}, {33, 70}}) {
      for (const auto& [tile_m, tile_n] :
           std::vector<std::pair<int, int>>{{4, 8}, {8, 4}, {2, 2}, {64, 128}}) {
        SCOPED_TRACE(mask.name + ", Lq " + std::to_string(lq) + ", Lk " + std::to_string(lk) + ", tiles " +
                     std::to_string(tile_m) + "x" + std::to_string(tile_n));
        for (int64_t n = 0; n * tile_n < lk + tile_n; ++n) {
          const IndexRange got = mask.policy.unmasked_q_blocks_of_kv_block(n, tile_m, tile_n, lq, lk);
          for (int64_t m = -1; m * tile_m < lq + tile_m; ++m) {
            bool full = m >= 0 && (m + 1) * tile_m <= lq && (n + 1) * tile_n <= lk;
            for (int64_t i = m * tile_m; full && i < (m + 1) * tile_m; ++i)
              for (int64_t j = n * tile_n; full && j < (n + 1) * tile_n; ++j)
                full = mask.policy.visible(i, j, lq, lk);
            full_blocks += full ? 1 : 0;
            ASSERT_EQ(full, m >= got.lo && m <= got.hi) << "KV block " << n << ", Q block " << m;
          }
        }
      }
    }
  }
  EXPECT_GT(full_blocks, 100);  // the cases hold full blocks, not only empty ranges
}

}  // namespace
}  // namespace jagflash::schedule

namespace jagflash::schedule {
namespace {

// The key a reused forward plan is checked by: any field that changes the plan's tiles or size
// changes it, and zeroed memory (a workspace no build wrote) never passes for one.
TEST(PlanKey, TellsApartEveryFieldAndZeroedMemory) {
  const PlanKey base = plan_key({128, 128}, 256, 115909, 115909);
  EXPECT_TRUE(same_plan_key(base, plan_key({128, 128}, 256, 115909, 115909)));
  EXPECT_FALSE(same_plan_key(base, plan_key({64, 128}, 256, 115909, 115909)));
  EXPECT_FALSE(same_plan_key(base, plan_key({128, 64}, 256, 115909, 115909)));
  EXPECT_FALSE(same_plan_key(base, plan_key({128, 128}, 255, 115909, 115909)));
  EXPECT_FALSE(same_plan_key(base, plan_key({128, 128}, 256, 115908, 115909)));
  EXPECT_FALSE(same_plan_key(base, plan_key({128, 128}, 256, 115909, 115910)));
  EXPECT_FALSE(same_plan_key(PlanKey{}, plan_key({0, 0}, 0, 0, 0)));
  EXPECT_FALSE(same_plan_key(PlanKey{}, base));
}

}  // namespace
}  // namespace jagflash::schedule
