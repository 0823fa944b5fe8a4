// The backward's hand-written shared-memory stores (kernels/bwd/smem_stores_bwd.cuh) put every
// element where CuTe's layouts of the same buffers say it is: dS for the dQ GEMM's A operand
// (stmatrix, emulated here lane by lane) and the fp32 dQ partial for the TMA reduce-add.
#include "kernels/bwd/kernel_traits_bwd.cuh"
#include "kernels/bwd/smem_stores_bwd.cuh"

#include <gtest/gtest.h>

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
  using Offsets =
      jagflash::kernels::bwd::SmemStoreOffsets<Config::kBlockM, Config::kHeadDim, Config::kKeysPerWarpgroup>;
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

template <class Config>
void expect_dq_stores_match_cute() {
  using Traits = jagflash::kernels::bwd::KernelTraits<Config>;
  using Offsets =
      jagflash::kernels::bwd::SmemStoreOffsets<Config::kBlockM, Config::kHeadDim, Config::kKeysPerWarpgroup>;
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

TEST(BackwardSmemStores, DsStmatrixMatchesCuteLayout) {
  expect_ds_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::bfloat16_t, 128>>();
  expect_ds_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::half_t, 64>>();
}

TEST(BackwardSmemStores, DqPartialStoresMatchCuteLayout) {
  expect_dq_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::bfloat16_t, 128>>();
  expect_dq_stores_match_cute<jagflash::kernels::bwd::TileConfig<cutlass::half_t, 64>>();
}

}  // namespace
