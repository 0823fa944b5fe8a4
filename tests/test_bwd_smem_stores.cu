// The backward's hand-written shared-memory stores (kernels/bwd/smem_stores_bwd.cuh) put every
// element where CuTe's layouts of the same buffers say it is: dS for the dQ GEMM's A operand
// (stmatrix, emulated here lane by lane) and the fp32 dQ partial for the TMA reduce-add. And the
// epilogue's dK/dV staging (kernels/bwd/epilogue_bwd.cuh) stays inside each warpgroup's own keys'
// dS bytes, one slot per element, without bank conflicts. At D = 64, 96 and 128; the wide kernel's
// half-row stores of P^T and dS^T at 192 and 256.
#include "kernels/bwd/epilogue_bwd.cuh"
#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/bwd/smem_stores_bwd.cuh"
#include "kernels/common/accumulator.cuh"

#include <gtest/gtest.h>

#include <set>

namespace {

using namespace cute;

// The byte offset CuTe's tensor over a 1024-byte aligned shared buffer gives an element. The
// layouts' swizzles act on the address bits once bound to a typed shared-memory pointer (as in
// the kernels and the TMA), not on the layout's own element offsets, so this is the reference.
template <class T, class Layout, class... Coord>
uint32_t smem_byte_offset(Layout layout, Coord... coord) {
  T* const base = reinterpret_cast<T*>(uintptr_t{1} << 20);
  Tensor t = make_tensor(make_smem_ptr(base), layout);
  return static_cast<uint32_t>(reinterpret_cast<uintptr_t>(&t(coord...)) - reinterpret_cast<uintptr_t>(base));
}

template <class Config>
void expect_ds_stores_match_cute() {
  using Traits = jagflash::kernels::bwd::KernelTraits<Config>;
  using Offsets = jagflash::kernels::bwd::StoreOffsetsOf<Traits>;
  using Element = typename Config::Element;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN;
  typename Traits::TiledMmaSdP mma;
  typename Traits::SmemLayoutDs ds_layout;
  const auto frag_layout = partition_fragment_C(mma, Shape<Int<kBlockN>, Int<kBlockM>>{}).layout();
  ASSERT_EQ(int(size(frag_layout)), Offsets::kDsStores * 8);  // 4 registers x 2 values a store
  for (int t = 0; t < 256; ++t) {
    Tensor coords =
        mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    for (int e = 0; e < size(frag_layout); ++e) {
      const int raw = frag_layout(e);  // the element's place in the thread's registers
      const int reg = raw / 2, half = raw % 2;
      const int store = reg / 4, matrix = reg % 4;
      // stmatrix: register `matrix` of thread t goes to row (t%32)/4 of that matrix, whose
      // address comes from lane 8 matrix + (t%32)/4 of the same warp; columns 2 (t%4) (+1).
      const int addressing = (t / 32) * 32 + matrix * 8 + (t % 32) / 4;
      const uint32_t byte = Offsets::ds_lane(addressing, store) + (t % 4) * 4 + half * 2;
      const int key = get<0>(coords(e)), row = get<1>(coords(e));
      ASSERT_EQ(byte, smem_byte_offset<Element>(ds_layout, row, key, 0))
          << "thread " << t << " element " << e << " key " << key << " row " << row;
    }
  }
  for (int b = 0; b < Config::kDsBuffers; ++b)
    EXPECT_EQ(smem_byte_offset<Element>(ds_layout, 5, 77, b),
              b * kBlockM * kBlockN * sizeof(Element) + smem_byte_offset<Element>(ds_layout, 5, 77, 0));
}

// The wide kernel (D = 192, 256; mainloop_bwd_wide.cuh): each warpgroup's S^T fragment holds its
// 32 of the 64 rows; its P^T and dS^T go to a 64-row buffer by the 64-row offsets from store
// 2 wg on (thread index in the warpgroup). And the transposed view its dV/dK GEMMs read is the
// same bytes.
template <class Config>
void expect_wide_half_stores_match_cute() {
  using Traits = jagflash::kernels::bwd::KernelTraits<Config>;
  using Offsets = jagflash::kernels::bwd::SmemStoreOffsets<Config::kBlockM, Config::kHeadDim, 64>;
  using Element = typename Config::Element;
  constexpr int kBlockM = Config::kBlockM, kBlockN = Config::kBlockN, kWgRows = Traits::kStepRows;
  static_assert(Traits::kWide && kBlockM == 64 && kBlockN == 64 && kWgRows == 32, "the wide tile");
  typename Traits::TiledMmaSdP mma;
  typename Traits::SmemLayoutDs ds_layout;
  typename Traits::SmemLayoutDst dst_layout;
  const auto frag_layout = partition_fragment_C(mma, Shape<Int<kBlockN>, Int<kBlockM>>{}).layout();
  ASSERT_EQ(int(size(frag_layout)), kWgRows / 16 * 8);  // two stmatrix.x4 a thread
  std::set<uint32_t> written;
  for (int t = 0; t < 256; ++t) {
    const int wg = t / 128, wg_thread = t % 128;
    Tensor coords =
        mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<kBlockN>, Int<kBlockM>>{}));
    for (int e = 0; e < size(frag_layout); ++e) {
      const int raw = frag_layout(e);
      const int reg = raw / 2, half = raw % 2;
      const int store = reg / 4, matrix = reg % 4;
      const int addressing = (wg_thread / 32) * 32 + matrix * 8 + (wg_thread % 32) / 4;
      const uint32_t byte =
          Offsets::ds_lane(addressing, wg * (kWgRows / 16) + store) + (t % 4) * 4 + half * 2;
      const int key = get<0>(coords(e)), row = get<1>(coords(e));
      ASSERT_EQ(row / kWgRows, wg) << "warpgroup " << wg << " holds its own rows";
      ASSERT_EQ(byte, smem_byte_offset<Element>(ds_layout, row, key, 0))
          << "thread " << t << " element " << e << " key " << key << " row " << row;
      written.insert(byte);
    }
  }
  EXPECT_EQ(written.size(), size_t(kBlockM * kBlockN));  // every element of the buffer, once
  for (int b = 0; b < Config::kDsBuffers; ++b)
    for (int key = 0; key < kBlockN; ++key)
      for (int row = 0; row < kBlockM; ++row)
        ASSERT_EQ(smem_byte_offset<Element>(dst_layout, key, row, b),
                  smem_byte_offset<Element>(ds_layout, row, key, b))
            << "buffer " << b << " key " << key << " row " << row;
}

template <class Config>
void expect_dq_stores_match_cute() {
  using Traits = jagflash::kernels::bwd::KernelTraits<Config>;
  using Offsets = jagflash::kernels::bwd::StoreOffsetsOf<Traits>;
  constexpr int kBlockM = Config::kBlockM, kHeadDim = Config::kHeadDim;
  typename Traits::TiledMmaDq mma;
  typename Traits::SmemLayoutDq dq_layout;
  for (int t = 0; t < 256; ++t) {
    Tensor coords =
        mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    ASSERT_EQ(int(size(coords)), Offsets::kDqGroups * 4);
    for (int j = 0; j < Offsets::kDqGroups; ++j)
      for (int h = 0; h < 2; ++h)
        for (int c = 0; c < 2; ++c) {
          const int e = 4 * j + 2 * h + c;  // the index store_dq reads the fragment at
          const int row = get<0>(coords(e)), col = get<1>(coords(e));
          ASSERT_EQ(Offsets::dq_pair(t, j, h) + 4 * c, smem_byte_offset<float>(dq_layout, row, col, 0))
              << "thread " << t << " j " << j << " h " << h << " c " << c << " row " << row << " col " << col;
        }
  }
  for (int s = 0; s < Config::kDqStages; ++s)
    EXPECT_EQ(smem_byte_offset<float>(dq_layout, 3, 9, s),
              s * kBlockM * kHeadDim * sizeof(float) + smem_byte_offset<float>(dq_layout, 3, 9, 0));
}

// The dK/dV staging of a warpgroup: every (key, 16-byte chunk) of its 64 keys x D has its own
// slot, inside the bytes the dS layout gives that warpgroup's keys in the two buffers (which only
// it writes, so a warpgroup barrier suffices between the staging and the next tile's dS); a
// warp's accumulator store (8 keys x 4 lanes x 4 bytes) hits 32 distinct banks, and each quarter
// warp's 16-byte row reads hit 8 distinct 16-byte bank groups.
template <class Config>
void expect_dkv_staging_conflict_free() {
  using Traits = jagflash::kernels::bwd::KernelTraits<Config>;
  using Element = typename Config::Element;
  using Staging = jagflash::kernels::bwd::DkvStaging<Config::kHeadDim, int(sizeof(Element)),
                                                     Config::kBlockM * Config::kBlockN * sizeof(Element)>;
  constexpr int kBlockM = Config::kBlockM;
  typename Traits::SmemLayoutDs ds_layout;
  for (int wg = 0; wg < 2; ++wg) {
    std::set<uint32_t> own;  // the dS bytes of the warpgroup's keys, both buffers
    for (int b = 0; b < Config::kDsBuffers; ++b)
      for (int key = 64 * wg; key < 64 * wg + 64; ++key)
        for (int row = 0; row < kBlockM; ++row)
          for (int byte = 0; byte < int(sizeof(Element)); ++byte)
            own.insert(smem_byte_offset<Element>(ds_layout, row, key, b) + byte);
    std::set<uint32_t> slots;
    for (int key = 0; key < 64; ++key)
      for (int chunk = 0; chunk < Staging::kChunks; ++chunk) {
        const uint32_t at = Staging::offset(wg, key, chunk);
        ASSERT_EQ(at % 16, 0u);
        ASSERT_TRUE(slots.insert(at).second) << "wg " << wg << " key " << key << " chunk " << chunk;
        for (uint32_t byte = 0; byte < 16; ++byte)
          ASSERT_TRUE(own.count(at + byte)) << "wg " << wg << " key " << key << " chunk " << chunk;
      }
    // D = 128 (64-row dS buffers) fills both buffers' bytes of its keys; D = 64 (64 keys x 128
    // bytes, 128-row buffers) a quarter of them; D = 96 (192-byte rows, 42 in the first buffer)
    // three quarters.
    if (Staging::kPowerOfTwoRows) {
      ASSERT_EQ(own.size(), size_t{Config::kDsBuffers} * Staging::kStageHalf);
      ASSERT_EQ(slots.size() * 16 * (Config::kDsBuffers * Staging::kStageHalf / (64 * Staging::kRowBytes)),
                own.size());
    } else {
      ASSERT_EQ(slots.size() * 16 * 4, own.size() * 3);
    }
    // Stores: warp w of the warpgroup, accumulator row r (keys l/4 and l/4 + 8), column pair c.
    for (int warp = 0; warp < 4; ++warp)
      for (int r = 0; r < 2; ++r)
        for (int c = 0; c < Config::kHeadDim / 4; c += 2) {
          std::set<uint32_t> banks;
          for (int lane = 0; lane < 32; ++lane) {
            const jagflash::kernels::common::AccumulatorCoords coords(128 * wg + 32 * warp + lane);
            const int key = coords.row(r) - 64 * wg, col = coords.col(c);
            const uint32_t at = Staging::offset(wg, key, col / 8) + (col % 8) * sizeof(Element);
            banks.insert(at / 4 % 32);
          }
          EXPECT_EQ(banks.size(), 32u) << "wg " << wg << " warp " << warp << " r " << r << " c " << c;
        }
    // Reads: thread idx of the warpgroup takes (key, chunk) = divmod(idx, kChunks).
    for (int idx0 = 0; idx0 < 64 * Staging::kChunks; idx0 += 8) {
      std::set<uint32_t> groups;
      for (int idx = idx0; idx < idx0 + 8; ++idx)
        groups.insert(Staging::offset(wg, idx / Staging::kChunks, idx % Staging::kChunks) / 16 % 8);
      EXPECT_EQ(groups.size(), 8u) << "wg " << wg << " first thread " << idx0;
    }
  }
}

TEST(BackwardSmemStores, DkvStagingStaysInOwnKeysWithoutConflicts) {
  expect_dkv_staging_conflict_free<jagflash::kernels::bwd::TileConfig<cutlass::bfloat16_t, 128>>();
  expect_dkv_staging_conflict_free<jagflash::kernels::bwd::TileConfig<cutlass::half_t, 64>>();
  expect_dkv_staging_conflict_free<jagflash::kernels::bwd::TileConfig<cutlass::bfloat16_t, 96>>();
}

TEST(BackwardSmemStores, DsStmatrixMatchesCuteLayout) {
  expect_ds_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::bfloat16_t, 128>>();
  expect_ds_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::half_t, 64>>();
  expect_ds_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::bfloat16_t, 96>>();
}

TEST(BackwardSmemStores, WideHalfStoresAndTransposedViewMatchCuteLayout) {
  expect_wide_half_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::bfloat16_t, 192>>();
  expect_wide_half_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::half_t, 256>>();
}

TEST(BackwardSmemStores, DqPartialStoresMatchCuteLayout) {
  expect_dq_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::bfloat16_t, 128>>();
  expect_dq_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::half_t, 64>>();
  expect_dq_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::bfloat16_t, 96>>();
}

}  // namespace
