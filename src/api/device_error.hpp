// What the checks a call makes on the device report (the offsets check, the plan key): one text
// for jagflash_read_device_error and for the report, at a later call, of an earlier call's
// failure latched by the offsets check (take_latched_offsets_error, api/offsets_check_device.hpp).
#pragma once

#include "api/error.hpp"
#include "api/offsets_check_device.hpp"
#include "schedule/plan.hpp"

#include <cstdint>
#include <sstream>
#include <string>

namespace jagflash::detail {

// "the call failed a check on the device (nothing was written): <argument: expected ...;>..."
inline std::string device_check_failures(int32_t flag) {
  std::ostringstream m;
  m << "the call failed a check on the device (nothing was written):";
  const struct {
    int32_t bit;
    const char* text;
  } checks[] = {{kQFirstNotZero, " problem.q_offsets: expected [0] == 0;"},
                {kQDecreasing, " problem.q_offsets: expected non-decreasing values;"},
                {kQLastNotTotal, " problem.q_offsets: expected [B] == q.rows;"},
                {kKvFirstNotZero, " problem.kv_offsets: expected [0] == 0;"},
                {kKvDecreasing, " problem.kv_offsets: expected non-decreasing values;"},
                {kKvLastNotTotal, " problem.kv_offsets: expected [B] == k.rows;"},
                {kBlockMaskFirstNotZero, " problem.block_mask.offsets: expected [0] == 0;"},
                {kBlockMaskSizeMismatch,
                 " problem.block_mask.offsets: expected [b+1] - [b] == ceil(Lq_b/128) * ceil(Lk_b/128)"
                 " (sequence b's map bytes) for every sequence b, found another difference;"},
                {kBlockMaskPastEnd,
                 " problem.block_mask.offsets: expected [B] <= problem.block_mask.bytes (the size of the"
                 " blocks buffer), found more: the map would be read past the buffer's end;"},
                {schedule::kPlanMismatchFlag,
                 " launch.reuse_plan: expected the workspace to hold the plan of an earlier call"
                 " with the same batch size, q/kv rows and kernel variant (dtype, head dim, mask,"
                 " shapes, max_seqlen_hint), found another or none; pass reuse_plan = 0 to build it;"}};
  static_assert((schedule::kPlanMismatchFlag & (2 * kKvLastNotTotal - 1)) == 0, "flag bits overlap");
  static_assert((schedule::kPlanMismatchFlag &
                 (kBlockMaskFirstNotZero | kBlockMaskSizeMismatch | kBlockMaskPastEnd)) == 0,
                "flag bits overlap");
  for (const auto& c : checks)
    if (flag & c.bit) m << c.text;
  return m.str();
}

// Throws JF_ERR_INVALID_ARGUMENT when an earlier call on `device` failed its device offsets
// check and no call has reported it yet (then it counts as reported): the earlier call's text
// behind a prefix that says whose failure it is, as CUDA reports an asynchronous error at a later
// call.
inline void report_latched_device_error(int device) {
  const int32_t bits = take_latched_offsets_error(device);
  if (bits == 0) return;
  std::ostringstream m;
  m << "an earlier jagflash call on CUDA device " << device
    << " (reported once, here; this call ran nothing): " << device_check_failures(bits);
  throw ApiError(JF_ERR_INVALID_ARGUMENT, m.str());
}

}  // namespace jagflash::detail
