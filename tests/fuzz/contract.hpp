// The fuzzer's own reading of the C API's contract (jagflash.h, README "API in one screen"),
// written independently of src/api/validate.cpp: every rule a call breaks, by the name of the
// argument the library must then name. A call must succeed exactly when it breaks none; a failed
// call's message must begin with one of the broken arguments' names.
#pragma once

#include <jagflash/jagflash.h>

#include <string>
#include <vector>

namespace jagflash::fuzz {

struct Violation {
  std::string argument;  // as the API spells it: "problem.q.row_stride", "out", "launch.backend"
  jf_status status;      // JF_ERR_UNSUPPORTED for a head dim the library lacks, else INVALID_ARGUMENT
  bool offsets_values;   // found only by reading the offsets (the workspace query does not)
  std::string rule;      // what was broken, for the report
};

struct Verdict {
  std::vector<Violation> violations;

  bool call_valid() const { return violations.empty(); }
  bool query_valid() const;  // the workspace query checks everything but the offsets' values
  // The violation that a failed call's message names (with the returned status), or nullptr:
  // the message's argument is the text before its first ": ", and may add an index
  // ("problem.q_offsets[2]") to a violated argument.
  const Violation* named_by(const std::string& message, jf_status status, bool query) const;
  std::string list(bool query) const;
};

// `bytes_null`: the workspace query is given no output pointer (the call has none; pass false).
// `gpu_present`: whether the process sees a CUDA device (JF_DEVICE_CUDA is then allowed).
// `backed`: whether memory backs every pointer (the sinks' and ALiBi slopes' values are read only
// then).
Verdict judge_forward(const jf_fwd_args* args, bool bytes_null, bool gpu_present, bool backed);
Verdict judge_backward(const jf_bwd_args* args, bool bytes_null, bool gpu_present, bool backed);

}  // namespace jagflash::fuzz
