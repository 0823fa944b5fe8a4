// Validation, in one place, for every entry point. Each check throws ApiError naming the
// argument, what was expected and what was given. Validation only reads; it writes nothing the
// caller owns.
#pragma once

#include <jagflash/jagflash.h>

#include <cstddef>
#include <cstdint>

namespace jagflash::detail {

// Checks everything that can be checked without reading device memory, and, for CPU pointers
// or JF_CHECK_OFFSETS_HOST, the offsets themselves (device offsets are copied to the host; the
// stream is synchronised). `require_workspace`: false for the workspace-size queries; when true,
// the workspace's first `workspace_needed` bytes must also be disjoint from every input and output,
// and a GPU call fails if an earlier call on the current device failed its device offsets check
// unreported (take_latched_offsets_error). Pointer locations are asked of the driver
// unless launch.caller_checked_pointers vouches for them.
void validate_forward(const jf_fwd_args& args, size_t workspace_needed, bool require_workspace);
void validate_backward(const jf_bwd_args& args, size_t workspace_needed, bool require_workspace);

// The argument-shape part alone (no offsets, no workspace): what the size queries need.
void validate_forward_shapes(const jf_fwd_args& args);
void validate_backward_shapes(const jf_bwd_args& args);

// The problem and the launch alone (what choosing a backend needs): jagflash_query_backend.
void validate_problem_and_launch(const jf_problem& problem, const jf_launch& launch);

// Whether the CUDA driver knows `p` as device (or managed) memory; false without a driver. One
// driver query, unless a PointerLocationScope is open on this thread and `p` lies in an allocation
// already asked about in it.
bool is_device_pointer(const void* p);

// While one is open on a thread (nested ones share it), the allocation ranges the driver reported
// are remembered, so each allocation is asked about once; forgotten when the outermost closes. A
// C API entry point opens one for the whole call (c_api.cpp): nothing is freed during a call.
class PointerLocationScope {
 public:
  PointerLocationScope();
  ~PointerLocationScope();
  PointerLocationScope(const PointerLocationScope&) = delete;
  PointerLocationScope& operator=(const PointerLocationScope&) = delete;
};

// For tests: the pointer-location queries this thread has made (driver or runtime calls).
uint64_t pointer_location_queries();

// Host offsets [B+1]: offsets[0] == 0, non-decreasing, offsets[B] == total.
void validate_host_offsets(const char* name, const int32_t* offsets, int32_t batch_size, int64_t total);

// Host block-mask offsets [B+1] against the (already checked) host q and kv offsets:
// map_offsets[0] == 0, map_offsets[b+1] - map_offsets[b] == BlockMask::entries(Lq_b, Lk_b) and
// map_offsets[B] <= bytes (the size of the caller's map buffer).
void validate_host_block_mask_offsets(const int32_t* map_offsets, const int32_t* q_offsets,
                                      const int32_t* kv_offsets, int32_t batch_size, int64_t bytes);

}  // namespace jagflash::detail
