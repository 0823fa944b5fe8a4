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
