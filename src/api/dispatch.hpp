// From validated arguments to the implementation that serves them: the CPU reference for CPU
// pointers; on the GPU the Hopper kernels where they serve the call, else the GPU oracle.
#pragma once

#include <jagflash/jagflash.h>

#include <cstddef>
#include <cstdint>

namespace jagflash::detail {

// The backend a call of that direction runs for `problem` and `launch` (the calls choose through
// the same functions): jagflash_query_backend; with kernel_head_dim, also the head dim of the
// kernel that runs (jagflash_query_kernel).
jf_backend query_backend(const jf_problem& problem, const jf_launch& launch, bool backward,
                         int32_t* kernel_head_dim = nullptr);
size_t forward_workspace_size(const jf_fwd_args& args);
size_t backward_workspace_size(const jf_bwd_args& args);
void run_forward(const jf_fwd_args& args);
void run_backward(const jf_bwd_args& args);
void read_device_error(const void* workspace, void* stream);

}  // namespace jagflash::detail
