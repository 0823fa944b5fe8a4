// Host-side scheduling: from the offsets, the valid tiles of a jagged batch with their cost,
// a longest-first (LPT) order, and the assignments to SMs that the kernels can use.
#pragma once

#include "core/mask.hpp"

#include <cstdint>
#include <vector>

namespace jagflash::schedule {

enum class Direction {
  kForward,   // tile = (batch, head, q block); cost = KV blocks the q block visits
  kBackward   // tile = (batch, head, kv block); cost = Q blocks that see the kv block
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
                              int num_heads, const MaskPolicy& mask, TileShape shape,
                              Direction direction);

// Longest first; ties keep (batch, head, block) order, so the order is deterministic.
void sort_longest_first(std::vector<Tile>& tiles);

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
