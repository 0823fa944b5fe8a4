#include "schedule/plan_device.hpp"

#include "core/bench_knobs.hpp"
#include "schedule/plan.hpp"

#include <cub/block/block_radix_sort.cuh>
#include <cub/block/block_scan.cuh>
#include <cub/device/device_radix_sort.cuh>

#include <cstdlib>
#include <cstring>

namespace jagflash::schedule {
namespace {

constexpr size_t kAlign = 256;
constexpr int kScanThreads = 1024;

size_t align_up(size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

template <typename T>
T* at(void* workspace, size_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(workspace) + offset);
}

__device__ __forceinline__ int32_t q_blocks(const int32_t* q_offsets, int32_t b, int tile_m) {
  const int32_t lq = q_offsets[b + 1] - q_offsets[b];
  return (lq + tile_m - 1) / tile_m;
}

// pair_offset[b] = the q blocks of the sequences before b, by one CTA of kThreads (a block scan
// over chunks of kThreads sequences); returns the pair count. Every thread calls it.
template <int kThreads>
__device__ __forceinline__ int32_t
scan_pair_offsets(const int32_t* q_offsets, int32_t batch_size, int tile_m, int32_t* pair_offset,
                  typename cub::BlockScan<int32_t, kThreads>::TempStorage& storage) {
  using Scan = cub::BlockScan<int32_t, kThreads>;
  int32_t carry = 0;
  for (int32_t base = 0; base < batch_size; base += kThreads) {
    const int32_t b = base + threadIdx.x;
    const int32_t count = b < batch_size ? q_blocks(q_offsets, b, tile_m) : 0;
    int32_t offset, chunk_total;
    Scan(storage).ExclusiveSum(count, offset, chunk_total);
    if (b < batch_size) pair_offset[b] = carry + offset;
    carry += chunk_total;
    __syncthreads();  // the scan storage is reused by the next chunk
  }
  return carry;
}

// One block scans the per-sequence q-block counts: pair_offset[b] and the pair count.
__global__ void __launch_bounds__(kScanThreads)
    count_pairs_kernel(const int32_t* q_offsets, int32_t batch_size, int tile_m, const int32_t* error_flag,
                       PlanKey* stored_key, PlanKey key, int32_t* pair_offset, int32_t* num_pairs) {
  if (threadIdx.x == 0) *stored_key = *error_flag ? PlanKey{} : key;
  if (*error_flag) return;
  __shared__ typename cub::BlockScan<int32_t, kScanThreads>::TempStorage scan_storage;
  const int32_t pairs =
      scan_pair_offsets<kScanThreads>(q_offsets, batch_size, tile_m, pair_offset, scan_storage);
  if (threadIdx.x == 0) *num_pairs = pairs;
}

// The sequence that owns pair i: the last b with pair_offset[b] <= i (sequences without q rows
// share their offset with the next one and own nothing, so "last" skips them).
__device__ __forceinline__ int32_t owner_of_pair(const int32_t* pair_offset, int32_t batch_size, int32_t i) {
  int32_t lo = 0, hi = batch_size;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (pair_offset[mid] <= i)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// The visible blocks of a block-sparse map in plan pair (b, block)'s map row (the forward) or
// column (the backward: its plan's "q" side is the keys); lq, lk are the plan's sides.
__device__ __forceinline__ uint32_t visible_blocks_of_pair(const SequenceMap& m, int32_t b, int32_t block,
                                                           int32_t lq, int32_t lk) {
  const int64_t real_lq = m.by_column ? lk : lq, real_lk = m.by_column ? lq : lk;
  const int64_t nk = BlockMask::blocks_of(real_lk);
  const int64_t count = m.by_column ? BlockMask::blocks_of(real_lq) : nk;
  const int64_t stride = m.by_column ? nk : 1;
  const uint8_t* first = m.block_mask.blocks + m.block_mask.offsets[b] + (m.by_column ? block : block * nk);
  uint32_t visible = 0;
  for (int64_t e = 0; e < count; ++e) visible += first[e * stride] != 0 ? 1u : 0u;
  return visible;
}

// Adds each pair's visible map blocks to its sequence's weight (zeroed before): one thread a
// pair, as fill_pairs_kernel.
__global__ void map_weights_kernel(const int32_t* q_offsets, const int32_t* kv_offsets, int32_t batch_size,
                                   int64_t max_pairs, SequenceMap map, const int32_t* error_flag,
                                   const int32_t* pair_offset, const int32_t* num_pairs, uint32_t* weights) {
  if (*error_flag) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int32_t pairs = *num_pairs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < max_pairs && i < pairs; i += stride) {
    const int32_t b = owner_of_pair(pair_offset, batch_size, static_cast<int32_t>(i));
    const int32_t lq = q_offsets[b + 1] - q_offsets[b], lk = kv_offsets[b + 1] - kv_offsets[b];
    const uint32_t visible = visible_blocks_of_pair(map, b, static_cast<int32_t>(i) - pair_offset[b], lq, lk);
    if (visible != 0) atomicAdd(weights + b, visible);
  }
}

// Pair i (< the pair count): its (batch, block) into pair_batch[i], pair_block[i], and its sort key
// returned (the comment below says what the key orders).
// weights: the sequences' weights from their block-sparse maps (null: q blocks x kv blocks).
__device__ __forceinline__ uint64_t fill_pair(const int32_t* q_offsets, const int32_t* kv_offsets,
                                              int32_t batch_size, int tile_m, int tile_n, int batch_bits,
                                              bool first_block_first, const int32_t* pair_offset, int32_t i,
                                              int32_t* pair_batch, int32_t* pair_block,
                                              const uint32_t* weights) {
  const int32_t b = owner_of_pair(pair_offset, batch_size, i);
  const int32_t lq = q_offsets[b + 1] - q_offsets[b], lk = kv_offsets[b + 1] - kv_offsets[b];
  const int32_t blocks = (lq + tile_m - 1) / tile_m;
  pair_batch[i] = b;
  const int32_t pos = i - pair_offset[b];
  pair_block[i] = first_block_first ? pos : blocks - 1 - pos;
  const uint64_t weight =
      weights != nullptr ? weights[b] : sequence_weight(lq, lk, TileShape{tile_m, tile_n});
  return ((weight + 1u) << batch_bits) | static_cast<uint64_t>(batch_size - 1 - b);
}

// Each pair gets its (batch, block) and its sort key: (sequence weight + 1) above the batch
// index counted from the end, so the descending sort puts the heaviest sequence first, ties by
// lower batch, and keeps each sequence's pairs together in fill order: q blocks last to first
// (schedule::sort_sequences_heaviest_first is the definition). The unused tail of the arrays
// gets key 0 so it stays after every real pair. One thread per pair (not per sequence): a
// single long sequence would otherwise fill its hundreds of pairs serially, tens of
// microseconds on one thread (figures: bench/NOTES.md, "Figures moved out of code comments").
__global__ void fill_pairs_kernel(const int32_t* q_offsets, const int32_t* kv_offsets, int32_t batch_size,
                                  int tile_m, int tile_n, int batch_bits, int64_t max_pairs,
                                  bool first_block_first, const int32_t* error_flag,
                                  const int32_t* pair_offset, const int32_t* num_pairs, int32_t* pair_batch,
                                  int32_t* pair_block, uint64_t* keys, int32_t* vals,
                                  const uint32_t* weights) {
  if (*error_flag) return;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int32_t pairs = *num_pairs;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < max_pairs; i += stride) {
    vals[i] = static_cast<int32_t>(i);
    if (i >= pairs) {
      keys[i] = 0u;
      continue;
    }
    keys[i] = fill_pair(q_offsets, kv_offsets, batch_size, tile_m, tile_n, batch_bits, first_block_first,
                        pair_offset, static_cast<int32_t>(i), pair_batch, pair_block, weights);
  }
}

// The whole plan in one CTA, for at most kSmallPlanMaxPairs pairs: the same scan, the same keys
// and the same stable descending sort as the large path (CUB's BlockRadixSort is stable, like
// its DeviceRadixSort), in shared memory; then the sorted pair indices and keys, and the tile
// counter reset. Items in the blocked arrangement the sort takes: thread t holds pairs
// [kItems t, kItems t + kItems).
constexpr int kSmallThreads = 512;
constexpr int kSmallItems = static_cast<int>(kSmallPlanMaxPairs / kSmallThreads);

__global__ void __launch_bounds__(kSmallThreads)
    small_plan_kernel(const int32_t* q_offsets, const int32_t* kv_offsets, int32_t batch_size, int tile_m,
                      int tile_n, int batch_bits, int sort_end_bit, int64_t max_pairs, bool first_block_first,
                      const int32_t* error_flag, PlanKey* stored_key, PlanKey key, int32_t* num_pairs_out,
                      int32_t* tile_counter, int32_t* pair_batch, int32_t* pair_block, uint64_t* keys_out,
                      int32_t* vals_out, SequenceMap map) {
  if (threadIdx.x == 0) *stored_key = *error_flag ? PlanKey{} : key;
  if (*error_flag) return;
  using Scan = cub::BlockScan<int32_t, kSmallThreads>;  // scan_pair_offsets' scan
  using Sort = cub::BlockRadixSort<uint64_t, kSmallThreads, kSmallItems, int32_t>;
  __shared__ union {
    typename Scan::TempStorage scan;
    typename Sort::TempStorage sort;
  } storage;
  // max_pairs = total_q / tile_m + B + 1 bounds B: every sequence's pair offset fits here.
  __shared__ int32_t pair_offset[kSmallPlanMaxPairs];
  // Every thread gets the total; the scan's last __syncthreads published pair_offset.
  const int32_t pairs =
      scan_pair_offsets<kSmallThreads>(q_offsets, batch_size, tile_m, pair_offset, storage.scan);
  // With a block-sparse map the sequences' weights first (map_weights_kernel's sums, here in
  // shared memory: B <= max_pairs <= kSmallPlanMaxPairs).
  __shared__ uint32_t weights[kSmallPlanMaxPairs];
  const bool mapped = map.block_mask.present();
  if (mapped) {
    for (int32_t b = threadIdx.x; b < batch_size; b += kSmallThreads) weights[b] = 0u;
    __syncthreads();
    for (int32_t i = threadIdx.x; i < pairs; i += kSmallThreads) {
      const int32_t b = owner_of_pair(pair_offset, batch_size, i);
      const int32_t lq = q_offsets[b + 1] - q_offsets[b], lk = kv_offsets[b + 1] - kv_offsets[b];
      const uint32_t visible = visible_blocks_of_pair(map, b, i - pair_offset[b], lq, lk);
      if (visible != 0) atomicAdd(weights + b, visible);
    }
    __syncthreads();
  }
  uint64_t keys[kSmallItems];
  int32_t vals[kSmallItems];
#pragma unroll
  for (int j = 0; j < kSmallItems; ++j) {
    const int32_t i = static_cast<int32_t>(threadIdx.x) * kSmallItems + j;
    vals[j] = i;
    keys[j] = i < pairs ? fill_pair(q_offsets, kv_offsets, batch_size, tile_m, tile_n, batch_bits,
                                    first_block_first, pair_offset, i, pair_batch, pair_block,
                                    mapped ? weights : nullptr)
                        : 0u;
  }
  // The sort's storage aliases the scan's, whose last use the loop's __syncthreads closed.
  Sort(storage.sort).SortDescending(keys, vals, 0, sort_end_bit);
#pragma unroll
  for (int j = 0; j < kSmallItems; ++j) {
    const int64_t i = int64_t(threadIdx.x) * kSmallItems + j;
    if (i < max_pairs) {
      keys_out[i] = keys[j];
      vals_out[i] = vals[j];
    }
  }
  if (threadIdx.x == 0) {
    *num_pairs_out = pairs;
    *tile_counter = 0;
  }
}

__global__ void fill_uniform_offsets_kernel(int32_t* offsets, int32_t batch_size, int32_t rows) {
  for (int64_t b = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; b <= batch_size;
       b += int64_t(gridDim.x) * blockDim.x)
    offsets[b] = static_cast<int32_t>(b * rows);
}

// Benchmark and test knob, read at every build: JAGFLASH_PLAN_BUILDER = small | large overrides
// kAuto (small where the plan fits).
PlanBuilder builder_knob(PlanBuilder requested) {
  if (requested != PlanBuilder::kAuto) return requested;
  const char* v = bench_knob("JAGFLASH_PLAN_BUILDER");
  if (v != nullptr && std::strcmp(v, "large") == 0) return PlanBuilder::kLarge;
  if (v != nullptr && std::strcmp(v, "small") == 0) return PlanBuilder::kSmall;
  return PlanBuilder::kAuto;
}

}  // namespace

DevicePlanLayout DevicePlanLayout::make(size_t base, int32_t batch_size, int64_t total_q, int64_t total_kv,
                                        int tile_m, int tile_n, bool block_mask) {
  DevicePlanLayout l;
  l.max_pairs = total_q / tile_m + batch_size + 1;
  // Key bits: the batch index, and above it the weight + 1 of the heaviest possible sequence
  // (all rows in one): no more bits than that, so no more radix passes.
  auto bits_of = [](uint64_t v) {
    int bits = 1;
    while (bits < 64 && (v >> bits) != 0) ++bits;
    return bits;
  };
  l.batch_bits = bits_of(static_cast<uint64_t>(batch_size));
  const uint64_t max_weight = sequence_weight(total_q, total_kv, TileShape{tile_m, tile_n});
  l.sort_end_bit = l.batch_bits + bits_of(max_weight + 1);
  const size_t ints = static_cast<size_t>(l.max_pairs) * sizeof(int32_t);
  const size_t keys = static_cast<size_t>(l.max_pairs) * sizeof(uint64_t);
  size_t cursor = align_up(base);
  auto take = [&](size_t bytes) {
    const size_t at = cursor;
    cursor = align_up(cursor + bytes);
    return at;
  };
  l.pair_offset = take((static_cast<size_t>(batch_size) + 1) * sizeof(int32_t));
  l.num_pairs = take(sizeof(int32_t));
  l.tile_counter = take(sizeof(int32_t));
  l.pair_batch = take(ints);
  l.pair_block = take(ints);
  l.keys_in = take(keys);
  l.keys_out = take(keys);
  l.vals_in = take(ints);
  l.vals_out = take(ints);
  // Host-side size query only: CUB reads nothing from the (null) arrays here.
  cub::DeviceRadixSort::SortPairsDescending(
      nullptr, l.sort_temp_bytes, static_cast<const uint64_t*>(nullptr), static_cast<uint64_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), static_cast<int>(l.max_pairs), 0,
      l.sort_end_bit);
  l.sort_temp = take(l.sort_temp_bytes);
  if (block_mask) l.map_weights = take(static_cast<size_t>(batch_size) * sizeof(uint32_t));
  l.total_bytes = cursor;
  return l;
}

DevicePlan device_plan_at(void* workspace, const DevicePlanLayout& l) {
  return {at<int32_t>(workspace, l.vals_out), at<int32_t>(workspace, l.pair_batch),
          at<int32_t>(workspace, l.pair_block), at<int32_t>(workspace, l.num_pairs),
          at<int32_t>(workspace, l.tile_counter)};
}

cudaError_t build_device_plan(const int32_t* q_offsets, const int32_t* kv_offsets, int32_t batch_size,
                              int tile_m, int tile_n, const int32_t* error_flag, PlanKey* stored_key,
                              PlanKey key, void* workspace, const DevicePlanLayout& l, cudaStream_t stream,
                              bool first_block_first, PlanBuilder builder, SequenceMap map) {
  builder = builder_knob(builder);
  const bool mapped = map.block_mask.present();
  if (mapped && (tile_m != BlockMask::kBlock || l.map_weights == 0)) return cudaErrorInvalidValue;
  const bool fits = l.max_pairs <= kSmallPlanMaxPairs;
  if (builder == PlanBuilder::kSmall && !fits) return cudaErrorInvalidValue;
  if (builder != PlanBuilder::kLarge && fits) {
    small_plan_kernel<<<1, kSmallThreads, 0, stream>>>(
        q_offsets, kv_offsets, batch_size, tile_m, tile_n, l.batch_bits, l.sort_end_bit, l.max_pairs,
        first_block_first, error_flag, stored_key, key, at<int32_t>(workspace, l.num_pairs),
        at<int32_t>(workspace, l.tile_counter), at<int32_t>(workspace, l.pair_batch),
        at<int32_t>(workspace, l.pair_block), at<uint64_t>(workspace, l.keys_out),
        at<int32_t>(workspace, l.vals_out), map);
    return cudaGetLastError();
  }
  count_pairs_kernel<<<1, kScanThreads, 0, stream>>>(q_offsets, batch_size, tile_m, error_flag, stored_key,
                                                     key, at<int32_t>(workspace, l.pair_offset),
                                                     at<int32_t>(workspace, l.num_pairs));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int fill_blocks =
      static_cast<int>((l.max_pairs + 255) / 256 > 1024 ? 1024 : (l.max_pairs + 255) / 256);
  uint32_t* weights = mapped ? at<uint32_t>(workspace, l.map_weights) : nullptr;
  if (mapped) {
    err = cudaMemsetAsync(weights, 0, static_cast<size_t>(batch_size) * sizeof(uint32_t), stream);
    if (err != cudaSuccess) return err;
    map_weights_kernel<<<fill_blocks, 256, 0, stream>>>(q_offsets, kv_offsets, batch_size, l.max_pairs, map,
                                                        error_flag, at<int32_t>(workspace, l.pair_offset),
                                                        at<int32_t>(workspace, l.num_pairs), weights);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  fill_pairs_kernel<<<fill_blocks, 256, 0, stream>>>(
      q_offsets, kv_offsets, batch_size, tile_m, tile_n, l.batch_bits, l.max_pairs, first_block_first,
      error_flag, at<int32_t>(workspace, l.pair_offset), at<int32_t>(workspace, l.num_pairs),
      at<int32_t>(workspace, l.pair_batch), at<int32_t>(workspace, l.pair_block),
      at<uint64_t>(workspace, l.keys_in), at<int32_t>(workspace, l.vals_in), weights);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  // Radix sort is stable: a sequence's pairs (equal keys) keep their fill order, so the plan is
  // deterministic.
  size_t temp_bytes = l.sort_temp_bytes;
  err = cub::DeviceRadixSort::SortPairsDescending(
      at<void>(workspace, l.sort_temp), temp_bytes, at<uint64_t>(workspace, l.keys_in),
      at<uint64_t>(workspace, l.keys_out), at<int32_t>(workspace, l.vals_in),
      at<int32_t>(workspace, l.vals_out), static_cast<int>(l.max_pairs), 0, l.sort_end_bit, stream);
  if (err != cudaSuccess) return err;
  return reset_tile_counter(workspace, l, stream);
}

cudaError_t fill_uniform_offsets(int32_t* offsets, int32_t batch_size, int32_t rows_per_sequence,
                                 cudaStream_t stream) {
  const int64_t n = int64_t(batch_size) + 1;
  const int blocks = static_cast<int>((n + 255) / 256 > 1024 ? 1024 : (n + 255) / 256);
  fill_uniform_offsets_kernel<<<blocks, 256, 0, stream>>>(offsets, batch_size, rows_per_sequence);
  return cudaGetLastError();
}

cudaError_t reset_tile_counter(void* workspace, const DevicePlanLayout& l, cudaStream_t stream) {
  return cudaMemsetAsync(at<int32_t>(workspace, l.tile_counter), 0, sizeof(int32_t), stream);
}

}  // namespace jagflash::schedule
