// Entry point of the GPU tests: exits with 77 (ctest's SKIP_RETURN_CODE) and says so when the
// machine has no CUDA device, so a CPU-only run shows them as skipped, never as passed.
#include <jagflash/jagflash.h>

#include <gtest/gtest.h>

#include <cstdio>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (jagflash_cuda_device_count() == 0) {
    std::printf("SKIPPED: no CUDA device; the GPU tests run on the GPU machine (scripts/gpu-check.sh)\n");
    return 77;
  }
  return RUN_ALL_TESTS();
}
