// Host-side scheduling. The GPU plan builder must produce the same tiles and costs; this file is
// the definition the tests hold it to.
#include "schedule/plan.hpp"

#include <algorithm>
#include <functional>
#include <queue>
#include <stdexcept>
#include <string>
#include <utility>

namespace jagflash::schedule {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t length_of(const int32_t* offsets, int b, const char* name) {
  const int64_t len = static_cast<int64_t>(offsets[b + 1]) - offsets[b];
  if (len < 0) {
    throw std::invalid_argument(std::string("build_tiles: ") + name + " must be non-decreasing, got " + name +
                                "[" + std::to_string(b) + "] = " + std::to_string(offsets[b]) + " > " + name +
                                "[" + std::to_string(b + 1) + "] = " + std::to_string(offsets[b + 1]));
  }
  return len;
}

void check_num_sms(int num_sms, const char* function) {
  if (num_sms < 1) {
    throw std::invalid_argument(std::string(function) + ": num_sms must be >= 1, got " +
                                std::to_string(num_sms));
  }
}

}  // namespace

std::vector<Tile> build_tiles(const int32_t* q_offsets, const int32_t* kv_offsets, int batch_size,
                              int num_heads, const MaskPolicy& mask, TileShape shape, Direction direction) {
  if (batch_size < 0 || num_heads < 0) {
    throw std::invalid_argument("build_tiles: batch_size and num_heads must be >= 0, got " +
                                std::to_string(batch_size) + " and " + std::to_string(num_heads));
  }
  if (shape.tile_m < 1 || shape.tile_n < 1) {
    throw std::invalid_argument("build_tiles: tile sizes must be >= 1, got " + std::to_string(shape.tile_m) +
                                " x " + std::to_string(shape.tile_n));
  }
  if (batch_size > 0 && (q_offsets == nullptr || kv_offsets == nullptr)) {
    throw std::invalid_argument("build_tiles: q_offsets and kv_offsets must be non-null");
  }
  const bool forward = direction == Direction::kForward;
  // The tile's own side: query rows (forward) or key rows (backward).
  const int own_tile = forward ? shape.tile_m : shape.tile_n;

  // The per-head cost of a sequence's blocks does not depend on the head: compute it once per
  // sequence, then repeat it for every head.
  std::vector<int32_t> costs;
  std::vector<Tile> tiles;
  for (int b = 0; b < batch_size; ++b) {
    const int64_t lq = length_of(q_offsets, b, "q_offsets");
    const int64_t lk = length_of(kv_offsets, b, "kv_offsets");
    const int64_t own_len = forward ? lq : lk;
    const int64_t num_blocks = ceil_div(own_len, own_tile);
    costs.resize(static_cast<size_t>(num_blocks));
    for (int64_t blk = 0; blk < num_blocks; ++blk) {
      const IndexRange visited = forward ? mask.kv_blocks_of_q_block(blk, shape.tile_m, shape.tile_n, lq, lk)
                                         : mask.q_blocks_of_kv_block(blk, shape.tile_m, shape.tile_n, lq, lk);
      costs[static_cast<size_t>(blk)] = static_cast<int32_t>(visited.size());
    }
    for (int h = 0; h < num_heads; ++h) {
      for (int64_t blk = 0; blk < num_blocks; ++blk) {
        tiles.push_back(Tile{b, h, static_cast<int32_t>(blk), costs[static_cast<size_t>(blk)]});
      }
    }
  }
  return tiles;
}

void sort_longest_first(std::vector<Tile>& tiles) {
  // A full key rather than stable_sort, so the result does not depend on the input's order.
  std::sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) {
    if (a.cost != b.cost) return a.cost > b.cost;
    if (a.batch != b.batch) return a.batch < b.batch;
    if (a.head != b.head) return a.head < b.head;
    return a.block < b.block;
  });
}

void sort_sequences_heaviest_first(std::vector<Tile>& tiles, const int32_t* q_offsets,
                                   const int32_t* kv_offsets, TileShape shape, HeadOrder order) {
  auto weight = [&](int32_t b) {
    return sequence_weight(int64_t(q_offsets[b + 1]) - q_offsets[b],
                           int64_t(kv_offsets[b + 1]) - kv_offsets[b], shape);
  };
  int32_t heads = 0;  // the tiles hold every head of their sequences (build_tiles)
  for (const Tile& t : tiles) heads = t.head >= heads ? t.head + 1 : heads;
  auto group = [&](int32_t b) {
    return forward_head_group(order, int64_t(kv_offsets[b + 1]) - kv_offsets[b], heads);
  };
  std::sort(tiles.begin(), tiles.end(), [&](const Tile& a, const Tile& b) {
    if (a.batch != b.batch) {
      const uint64_t wa = weight(a.batch), wb = weight(b.batch);
      if (wa != wb) return wa > wb;
      return a.batch < b.batch;
    }
    const int32_t g = group(a.batch);
    if (a.head / g != b.head / g) return a.head < b.head;
    if (a.block != b.block) return a.block > b.block;
    return a.head < b.head;
  });
}

std::vector<std::vector<int32_t>> zigzag_assign(const std::vector<Tile>& tiles, int num_sms) {
  check_num_sms(num_sms, "zigzag_assign");
  std::vector<std::vector<int32_t>> assignment(static_cast<size_t>(num_sms));
  const int64_t rounds = ceil_div(static_cast<int64_t>(tiles.size()), num_sms);
  for (auto& sm_tiles : assignment) sm_tiles.reserve(static_cast<size_t>(rounds));
  for (size_t t = 0; t < tiles.size(); ++t) {
    const int64_t round = static_cast<int64_t>(t) / num_sms;
    const int64_t pos = static_cast<int64_t>(t) % num_sms;
    const int64_t sm = (round % 2 == 0) ? pos : num_sms - 1 - pos;
    assignment[static_cast<size_t>(sm)].push_back(static_cast<int32_t>(t));
  }
  return assignment;
}

int64_t makespan(const std::vector<Tile>& tiles, const std::vector<std::vector<int32_t>>& assignment) {
  int64_t longest = 0;
  for (const auto& sm_tiles : assignment) {
    int64_t load = 0;
    for (const int32_t t : sm_tiles) load += tiles.at(static_cast<size_t>(t)).cost;
    longest = std::max(longest, load);
  }
  return longest;
}

int64_t makespan_dynamic(const std::vector<Tile>& tiles, int num_sms) {
  check_num_sms(num_sms, "makespan_dynamic");
  // (time the SM becomes free, SM index): the earliest-free SM takes the next tile, lowest index
  // first on ties, as with an atomic counter where SMs that finish together race.
  using Slot = std::pair<int64_t, int>;
  std::priority_queue<Slot, std::vector<Slot>, std::greater<Slot>> free_at;
  for (int sm = 0; sm < num_sms; ++sm) free_at.push({0, sm});
  int64_t longest = 0;
  for (const Tile& tile : tiles) {
    Slot slot = free_at.top();
    free_at.pop();
    slot.first += tile.cost;
    longest = std::max(longest, slot.first);
    free_at.push(slot);
  }
  return longest;
}

double makespan_lower_bound(const std::vector<Tile>& tiles, int num_sms) {
  check_num_sms(num_sms, "makespan_lower_bound");
  int64_t total = 0;
  int64_t longest = 0;
  for (const Tile& tile : tiles) {
    total += tile.cost;
    longest = std::max<int64_t>(longest, tile.cost);
  }
  return std::max(static_cast<double>(total) / num_sms, static_cast<double>(longest));
}

}  // namespace jagflash::schedule
