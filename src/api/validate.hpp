// Validation, in one place, for every entry point. Each check throws ApiError naming the
// argument, what was expected and what was given. Validation only reads; it writes nothing the
// caller owns.
#pragma once

#include <jagflash/jagflash.h>

#include <cstddef>

namespace jagflash::detail {

// Checks everything that can be checked without reading device memory, and, for CPU pointers
// or JF_CHECK_OFFSETS_HOST, the offsets themselves (device offsets are copied to the host; the
// stream is synchronised). `require_workspace`: false for the workspace-size queries; when true,
// the workspace's first `workspace_needed` bytes must also be disjoint from every input and output.
void validate_forward(const jf_fwd_args& args, size_t workspace_needed, bool require_workspace);
void validate_backward(const jf_bwd_args& args, size_t workspace_needed, bool require_workspace);

// The argument-shape part alone (no offsets, no workspace): what the size queries need.
void validate_forward_shapes(const jf_fwd_args& args);
void validate_backward_shapes(const jf_bwd_args& args);

// The problem and the launch alone (what choosing a backend needs): jagflash_query_backend.
void validate_problem_and_launch(const jf_problem& problem, const jf_launch& launch);

// Whether the CUDA runtime knows `p` as device (or managed) memory; false without a driver.
bool is_device_pointer(const void* p);

// Host offsets [B+1]: offsets[0] == 0, non-decreasing, offsets[B] == total.
void validate_host_offsets(const char* name, const int32_t* offsets, int32_t batch_size, int64_t total);

}  // namespace jagflash::detail
