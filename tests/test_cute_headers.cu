// The pinned CUTLASS/CuTe headers compile with this nvcc for sm_90a (host and device code) and
// their layout algebra gives what the Hopper kernels will rely on.
#include <cute/tensor.hpp>

#include <gtest/gtest.h>

namespace {

// Device code that instantiates CuTe tensors: compiling this file for sm_90a is the check.
__global__ void cute_copy_kernel(const float* in, float* out) {
  using namespace cute;
  auto layout = make_layout(make_shape(Int<8>{}, Int<4>{}), make_stride(Int<4>{}, Int<1>{}));
  Tensor src = make_tensor(make_gmem_ptr(in), layout);
  Tensor dst = make_tensor(make_gmem_ptr(out), layout);
  if (threadIdx.x < size(layout)) dst(threadIdx.x) = src(threadIdx.x);
}

TEST(CuteHeaders, LayoutAlgebraOnHost) {
  using namespace cute;
  auto layout = make_layout(make_shape(8, 4), make_stride(4, 1));  // row-major 8x4
  EXPECT_EQ(size(layout), 32);
  EXPECT_EQ(layout(3, 2), 14);
  auto tiled = zipped_divide(make_layout(make_shape(128, 64)), make_shape(Int<64>{}, Int<32>{}));
  EXPECT_EQ(size<0>(tiled), 64 * 32);
  EXPECT_EQ(size<1>(tiled), 2 * 2);
  EXPECT_NE(reinterpret_cast<const void*>(&cute_copy_kernel), nullptr);
}

}  // namespace

// The forward kernel computes its accumulator coordinates from the thread index instead of
// carrying CuTe's identity-tensor partition in registers; both must agree.
#include "kernels/fwd/kernel_traits.cuh"
#include "kernels/fwd/softmax.cuh"

namespace {

template <class TiledMma, class TileShape>
void expect_coords_match(TileShape tile) {
  using namespace cute;
  TiledMma mma;
  for (int t : {0, 1, 5, 31, 37, 100, 127, 128, 131, 200, 255}) {
    auto thr = mma.get_thread_slice(t);
    Tensor c = thr.partition_C(make_identity_tensor(tile));
    Tensor rc = make_tensor(c.data(), jagflash::kernels::common::rowcol_layout(c.layout()));
    const jagflash::kernels::common::AccumulatorCoords coords(t);
    for (int r = 0; r < size<0>(rc); ++r)
      for (int col = 0; col < size<1>(rc); ++col) {
        ASSERT_EQ(get<0>(rc(r, col)), coords.row(r)) << "thread " << t << " r " << r << " c " << col;
        ASSERT_EQ(get<1>(rc(r, col)), coords.col(col)) << "thread " << t << " r " << r << " c " << col;
      }
  }
}

TEST(CuteHeaders, ForwardAccumulatorCoordinatesMatchCute) {
  using namespace cute;
  using Traits128 =
      jagflash::kernels::fwd::KernelTraits<jagflash::kernels::fwd::TileConfig<cutlass::bfloat16_t, 128>>;
  using Traits64 =
      jagflash::kernels::fwd::KernelTraits<jagflash::kernels::fwd::TileConfig<cutlass::half_t, 64>>;
  expect_coords_match<typename Traits128::TiledMmaQK>(Shape<_128, _128>{});
  expect_coords_match<typename Traits128::TiledMmaPV>(Shape<_128, _128>{});
  expect_coords_match<typename Traits64::TiledMmaPV>(Shape<_128, _64>{});
  // S as an RS wgmma (Q in registers): the mask and softmax read its accumulator the same way.
  using Traits64QRegs = jagflash::kernels::fwd::KernelTraits<
      jagflash::kernels::fwd::TileConfig<cutlass::bfloat16_t, 64, jagflash::kernels::fwd::QInRegisters>>;
  expect_coords_match<typename Traits64QRegs::TiledMmaQK>(Shape<_128, _128>{});
}

// Each option tag sets its own choice, in any order, and leaves the others at their defaults.
TEST(CuteHeaders, TileConfigOptionTagsOverrideOnlyTheirOwnChoice) {
  using namespace jagflash::kernels::fwd;
  using Default = TileConfig<cutlass::bfloat16_t, 128>;
  EXPECT_EQ(Default::kBlockN, 128);
  EXPECT_EQ(Default::kConsumerWarpgroups, 2);
  EXPECT_EQ(Default::kPairs, 1);
  EXPECT_FALSE(Default::kPingPong);
  EXPECT_FALSE(Default::kQInRegisters);
  using TwoPairs = TileConfig<cutlass::bfloat16_t, 128, BlockN<64>, Warpgroups<1>, Pairs<2>>;
  EXPECT_EQ(TwoPairs::kBlockN, 64);
  EXPECT_EQ(TwoPairs::kConsumerWarpgroups, 1);
  EXPECT_EQ(TwoPairs::kPairs, 2);
  EXPECT_EQ(TwoPairs::kBlockM, 64);
  EXPECT_FALSE(TwoPairs::kPingPong);
  using PingPongQ = TileConfig<cutlass::half_t, 64, QInRegisters, PingPong>;
  using QPingPong = TileConfig<cutlass::half_t, 64, PingPong, QInRegisters>;
  EXPECT_TRUE(PingPongQ::kPingPong && PingPongQ::kQInRegisters);
  EXPECT_EQ(PingPongQ::kPingPong, QPingPong::kPingPong);
  EXPECT_EQ(PingPongQ::kQInRegisters, QPingPong::kQInRegisters);
  EXPECT_EQ(PingPongQ::kBlockN, 128);
  using ThreeWarpgroups = TileConfig<cutlass::bfloat16_t, 64, Warpgroups<3>>;
  EXPECT_EQ(ThreeWarpgroups::kBlockM, 192);
  EXPECT_EQ(ThreeWarpgroups::kBlockN, 128);
}

// The O staging tile holds the whole head dim unless that would leave fewer than two K/V stages:
// only the 176-key tile at D = 128 stages O in halves; every tile's shared storage fits a CTA.
template <class Config>
void expect_fits(int staging_columns, int stages, int q_buffers) {
  using namespace jagflash::kernels::fwd;
  SCOPED_TRACE(Config::kHeadDim);
  SCOPED_TRACE(Config::kBlockN);
  EXPECT_EQ(Config::kOStagingColumns, staging_columns);
  EXPECT_EQ(Config::kStages, stages);
  EXPECT_EQ(Config::kQBuffers, q_buffers);
  EXPECT_LE(Config::kPairs * sizeof(SharedStorage<KernelTraits<Config>>), size_t(Config::kSmemLimit));
}

TEST(CuteHeaders, OStagingIsHalvedOnlyWhereTheWholeTileLeavesOneStage) {
  using namespace jagflash::kernels::fwd;
  using bf16 = cutlass::bfloat16_t;
  expect_fits<TileConfig<bf16, 128>>(128, 2, 2);
  expect_fits<TileConfig<bf16, 128, BlockN<160>>>(128, 2, 1);
  expect_fits<TileConfig<bf16, 128, BlockN<176>>>(64, 2, 1);
  expect_fits<TileConfig<cutlass::half_t, 128, BlockN<176>, PingPong>>(64, 2, 1);
  expect_fits<TileConfig<bf16, 256, BlockN<32>>>(256, 3, 1);
  expect_fits<TileConfig<bf16, 192, BlockN<64>>>(192, 2, 1);
  expect_fits<TileConfig<bf16, 128, BlockN<64>, Warpgroups<1>, Pairs<2>>>(128, 2, 1);
  expect_fits<TileConfig<bf16, 64, Warpgroups<3>>>(64, 4, 2);
  expect_fits<TileConfig<bf16, 96>>(96, 3, 2);
}

}  // namespace
