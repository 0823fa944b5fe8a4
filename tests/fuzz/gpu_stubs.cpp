// The GPU half of the library, as the host-only fuzz build sees it: the C API, validation,
// dispatch and the CPU reference are compiled from src/ with the sanitizers; the CUDA kernels
// are not (nvcc device code cannot be built with AddressSanitizer). Every call the fuzzer makes
// has host pointers, which validation sends to the CPU reference or rejects before dispatch
// reaches any of these entry points, so reaching one is a failure of its own.
#include "api/offsets_check_device.hpp"
#include "api/sink_gradient_device.hpp"
#include "kernels/hopper_backward.hpp"
#include "kernels/hopper_forward.hpp"
#include "oracle/oracle.hpp"
#include "schedule/plan_device.hpp"

#include <cstdio>
#include <cstdlib>

namespace {
[[noreturn]] void gpu_path_reached(const char* what) {
  std::fprintf(stderr, "c_api_fuzz: a host-pointer call reached the GPU path (%s)\n", what);
  std::abort();
}
}  // namespace

namespace jagflash::oracle {
const Entry* find(jf_dtype, int) { gpu_path_reached("oracle::find"); }
std::string instantiated() { gpu_path_reached("oracle::instantiated"); }
}  // namespace jagflash::oracle

namespace jagflash::detail {
cudaError_t launch_offsets_check(const int32_t*, const int32_t*, const int32_t*, int64_t, int32_t, int64_t,
                                 int64_t, int32_t*, bool, cudaStream_t) {
  gpu_path_reached("launch_offsets_check");
}
cudaError_t portable_image(cudaFuncAttributes*) { gpu_path_reached("portable_image"); }
int32_t take_latched_offsets_error(int) { gpu_path_reached("take_latched_offsets_error"); }
void clear_latched_offsets_error(int, int32_t) { gpu_path_reached("clear_latched_offsets_error"); }
cudaError_t launch_sink_gradient(const SinkGradientArgs&, cudaStream_t) {
  gpu_path_reached("launch_sink_gradient");
}
}  // namespace jagflash::detail

namespace jagflash::kernels {
const HopperForwardEntry* find_hopper_forward(jf_dtype, int, jf_score_mod, bool, int) {
  gpu_path_reached("find_hopper_forward");
}
const HopperBackwardEntry* find_hopper_backward(jf_dtype, int, jf_score_mod, bool, int) {
  gpu_path_reached("find_hopper_backward");
}
bool hopper_device_present() { gpu_path_reached("hopper_device_present"); }
}  // namespace jagflash::kernels

namespace jagflash::schedule {
DevicePlanLayout DevicePlanLayout::make(size_t, int32_t, int64_t, int64_t, int, int, bool) {
  gpu_path_reached("DevicePlanLayout::make");
}
cudaError_t fill_uniform_offsets(int32_t*, int32_t, int32_t, cudaStream_t) {
  gpu_path_reached("schedule::fill_uniform_offsets");
}
}  // namespace jagflash::schedule
