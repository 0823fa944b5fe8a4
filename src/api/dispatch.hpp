// From validated arguments to the implementation that serves them: the CPU reference for CPU
// pointers, the GPU oracle (until the Hopper kernels land) for device pointers.
#pragma once

#include <jagflash/jagflash.h>

#include <cstddef>

namespace jagflash::detail {

size_t forward_workspace_size(const jf_fwd_args& args);
size_t backward_workspace_size(const jf_bwd_args& args);
void run_forward(const jf_fwd_args& args);
void run_backward(const jf_bwd_args& args);
void read_device_error(const void* workspace, void* stream);

}  // namespace jagflash::detail
