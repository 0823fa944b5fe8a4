// The consumers' two shared-memory stores per Q block, written as explicit shared-memory
// instructions: dS (bf16/fp16, for dQ = dS K) by stmatrix and the fp32 dQ partial by 64-bit
// st.shared. CuTe's swizzled partitions of the same layouts compiled to generic 32-bit stores
// (ST.E, the swizzle computed through integers loses the address space) with about 250 integer
// instructions of address arithmetic a warp per block: more than the block's
// exp2, FMA and conversion work together. The offsets are plain functions of the thread index
// so that tests/test_bwd_smem_stores.cu can check them against CuTe's layouts on the host.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

namespace jagflash::kernels::bwd {

// Byte offsets for the shapes of TileConfig: kBlockM = 64 or 128 query rows, kKeysPerWarpgroup = 64
// keys a consumer warpgroup, thread = index among the consumer threads (0-255). kDqRowsSplit: the
// warpgroups' dQ partials are rows 0-63 and 64-127 of all kHeadDim columns (128-row blocks), else
// all rows of one half of the head dim each.
template <int kBlockM, int kHeadDim, int kKeysPerWarpgroup, bool kDqRowsSplit = false>
struct SmemStoreOffsets {
  static_assert(kBlockM == 64 || kBlockM == 128, "whole 128-byte MN-major swizzle atoms of dS rows");
  static_assert(!kDqRowsSplit || kBlockM == 128, "a warpgroup's 64 rows of a 128-row dQ partial");

  // dS (rows, keys), MN-major with the 128-byte swizzle: an atom is 64 rows (128 bytes) of each of
  // 8 keys, 1 KB; the atoms of a key group of 8 follow each other along the rows (kAtomsM of
  // them), then the next key group. In an atom key k's rows are 128 bytes at (k % 8) * 128, their
  // 16-byte chunks (8 rows each) XOR-ed with k % 8. A warp's stmatrix.x4 writes four 8 x 8
  // matrices whose rows are keys and whose columns are 8 query rows: exactly the accumulator
  // fragment of S^T (thread l holds keys l/4 (+8) and rows 2 (l%4) (+1) of each 8).
  // Lane l gives the address of row l % 8 of matrix l / 8; matrix q of instruction i is the
  // fragment's 32-bit register 4 i + q: keys +8 (q % 2), row group 2 i + q / 2.
  // Written as (per-thread base) + (atom of i) + ((2 i % 8) XOR per-thread term) << 4: with i a
  // constant, each address is one XOR and one add from two registers.
  static constexpr int kAtomsM = kBlockM / 64;
  static __host__ __device__ uint32_t ds_lane(int thread, int i) {
    const int warpgroup = thread / 128, warp = (thread % 128) / 32, lane = thread % 32;
    const int key = warpgroup * kKeysPerWarpgroup + warp * 16 + ((lane >> 3) & 1) * 8 + (lane & 7);
    // row group 2 i + (lane / 16): atom (2 i) / 8, chunk (2 i) % 8 + lane / 16, XOR-ed with
    // key % 8 = lane % 8
    const int chunk_term = ((lane >> 4) & 1) ^ (lane & 7);
    return static_cast<uint32_t>((key / 8) * kAtomsM * 1024 + (key % 8) * 128 + ((2 * i) / 8) * 1024 +
                                 ((((2 * i) % 8) ^ chunk_term) << 4));
  }
  static constexpr int kDsStores = kBlockM / 16;  // stmatrix.x4 a thread (kBlockM / 8 row groups / 2)

  // dQ partial (rows, head dim) fp32, 128-byte swizzled boxes of 32 floats x kBlockM rows (the
  // TMA reduce's). Thread l of warp w holds rows 16 w + l/4 (+8 h) (plus 64 for warpgroup 1 with
  // kDqRowsSplit) and, for each group j of 8 of the warpgroup's columns, columns 8 j + 2 (l%4)
  // (+1): one 8-byte store per (j, h); a warp's 32 stores cover every bank twice (two wavefronts,
  // the minimum for 256 bytes).
  static constexpr int kDqCols = kDqRowsSplit ? kHeadDim : kHeadDim / 2;  // a warpgroup's columns
  static constexpr int kDqGroups = kDqCols / 8;
  static constexpr int kBoxBytes = kBlockM * 128;  // 32 floats x kBlockM rows
  // At D = 96 a warpgroup's 48 columns are one box and a half: warpgroup 1 starts in the middle
  // of box 1.
  static constexpr bool kWholeBoxes = kDqCols % 32 == 0;
  static_assert(kWholeBoxes || !kDqRowsSplit, "a rows-split partial has every column: whole boxes");
  // Column 8 j + 2 (l%4) is in box j / 4 (plus the warpgroup's boxes), chunk 2 (j%4) + (l%4)/2 of
  // its row, XOR-ed with row % 8 = l / 4: (2 (j%4)) XOR a per-thread term, as for dS. Without
  // whole boxes, j counts from the stage's first column (g below) instead.
  static __host__ __device__ uint32_t dq_pair(int thread, int j, int h) {
    const int warpgroup = thread / 128, warp = (thread % 128) / 32, lane = thread % 32;
    const int row = (kDqRowsSplit ? warpgroup * 64 : 0) + warp * 16 + h * 8 + (lane >> 2);
    const int chunk_term = ((lane >> 1) & 1) ^ (lane >> 2);
    if constexpr (kWholeBoxes) {
      // Rows split: each warpgroup's columns start at box 0; else warpgroup 1's after warpgroup 0's.
      const int first_box = kDqRowsSplit ? 0 : warpgroup * (kDqCols / 32);
      return static_cast<uint32_t>((first_box + j / 4) * kBoxBytes + row * 128 +
                                   (((2 * (j % 4)) ^ chunk_term) << 4) + (lane & 1) * 8);
    } else {
      const int g = warpgroup * kDqGroups + j;
      return static_cast<uint32_t>((g / 4) * kBoxBytes + row * 128 + (((2 * (g % 4)) ^ chunk_term) << 4) +
                                   (lane & 1) * 8);
    }
  }
};

// The offsets of a backward kernel's traits (KernelTraits: the mainloop, the dQ hand-over and the
// host test use the same).
template <class Traits>
using StoreOffsetsOf =
    SmemStoreOffsets<Traits::kBlockM, Traits::kHeadDim, Traits::WgKeys::value, Traits::kDqRowsSplit>;

__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2,
                                            uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void st_shared_v2(uint32_t addr, float a, float b) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}

// dS^T fragment (Element, the S^T accumulator's layout: value (col, row half, 8-row group)) to
// the dS buffer at shared address `ds_buffer`. A fragment of fewer query rows than the buffer's
// (the wide kernel's warpgroups each hold 32 of the 64 rows: mainloop_bwd_wide.cuh) takes the
// stores from first_store on, 16 rows a store.
template <class Offsets, class Fragment>
__device__ __forceinline__ void store_ds_smem(const Fragment& ds_frag, uint32_t ds_buffer, int thread,
                                              int first_store = 0) {
  constexpr int kStores = int(decltype(cute::size(ds_frag))::value) / 8;  // 8 16-bit values a stmatrix.x4
  static_assert(kStores <= Offsets::kDsStores, "the fragment's rows fit the buffer");
  const uint32_t* regs = reinterpret_cast<const uint32_t*>(ds_frag.data());
#pragma unroll
  for (int i = 0; i < kStores; ++i)
    stmatrix_x4(ds_buffer + Offsets::ds_lane(thread, first_store + i), regs[4 * i], regs[4 * i + 1],
                regs[4 * i + 2], regs[4 * i + 3]);
}

__device__ __forceinline__ void add_shared_v2(uint32_t addr, float a, float b) {
  float x, y;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(x), "=f"(y) : "r"(addr) : "memory");
  st_shared_v2(addr, x + a, y + b);
}

// op(shared address, value, next value) for each column pair of a dQ partial fragment (fp32,
// value (col, row half, 8-column group)) in the dQ stage at shared address `dq_stage`.
template <class Offsets, class Fragment, class PairOp>
__device__ __forceinline__ void for_each_dq_pair(const Fragment& dq_frag, uint32_t dq_stage, int thread,
                                                 PairOp op) {
#pragma unroll
  for (int j = 0; j < Offsets::kDqGroups; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      op(dq_stage + Offsets::dq_pair(thread, j, h), dq_frag(4 * j + 2 * h), dq_frag(4 * j + 2 * h + 1));
}

// The fragment stored into the dQ stage.
template <class Offsets, class Fragment>
__device__ __forceinline__ void store_dq_smem(const Fragment& dq_frag, uint32_t dq_stage, int thread) {
  for_each_dq_pair<Offsets>(dq_frag, dq_stage, thread,
                            [](uint32_t a, float x, float y) { st_shared_v2(a, x, y); });
}
// The fragment added into the dQ stage (pooled_dq_sum: a CTA's partials of one query head summed
// in its open stage). A thread reads and writes only its own fragment's addresses, the ones it
// stored at the stage's first use: no barrier between the additions.
template <class Offsets, class Fragment>
__device__ __forceinline__ void add_dq_smem(const Fragment& dq_frag, uint32_t dq_stage, int thread) {
  for_each_dq_pair<Offsets>(dq_frag, dq_stage, thread,
                            [](uint32_t a, float x, float y) { add_shared_v2(a, x, y); });
}

// The consumer thread index (0-255), read with an asm volatile the compiler cannot hoist out
// of a loop: addresses derived from it are recomputed where they are used, not kept live.
__device__ __forceinline__ int fresh_consumer_thread() {
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return static_cast<int>(tid) - 128;
}

}  // namespace jagflash::kernels::bwd
