// The jagflash command line: run (the main job), check (GPU path vs the oracles), bench.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace jagflash::cli {

// Timing defaults: the GPU's, and the CPU reference's (one run of each direction, which takes
// seconds at --scale-down 1).
constexpr int kGpuIters = 20, kGpuWarmup = 3;
constexpr int kCpuIters = 1, kCpuWarmup = 0;
constexpr int kDefaultScaleDown = 8;

// What the parser read. Every field is one the command uses (the parser refuses the options of
// other commands); the optional ones are unset when not given, so a command can tell a default
// from a choice.
struct Options {
  std::string command;
  std::vector<std::string> distributions;  // empty: the command's default
  bool cpu = false;                        // run: force the CPU reference path
  bool causal = false;
  bool forward_only = false;                // bench: skip the backward
  bool deterministic = false;               // bench: the backward in deterministic mode
  int window_left = -1, window_right = -1;  // --window L,R
  bool window = false;
  std::string dtype = "bf16";
  int head_dim = 128;
  int heads = 16;
  int heads_kv = 0;               // 0: same as heads
  std::optional<int> iters;       // run, bench: unset: kGpuIters, or kCpuIters on the CPU reference
  std::optional<int> warmup;      // likewise kGpuWarmup / kCpuWarmup
  std::optional<int> scale_down;  // run on the CPU reference, check: lengths divided by this
  uint64_t seed = 20261129;
  float input_range = 1.f;      // q, k, v, dout drawn from U(-input_range, input_range)
  bool max_seqlen_hint = true;  // bench: pass the longest sequence as launch.max_seqlen_hint
};

// The checks that need more than the options themselves: the batch a command would build (a
// --scale-down that leaves every sequence one token long checks nothing) and the path `run` takes
// (GPU or CPU reference). Throws std::invalid_argument, a usage error (exit status 2).
void validate(const Options& o);

// Each returns the process exit code.
int run(const Options& o);
int check(const Options& o);
int bench(const Options& o);

}  // namespace jagflash::cli
