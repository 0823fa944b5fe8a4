// The jagflash command line: run (the main job), check (GPU path vs the oracles), bench.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jagflash::cli {

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
  int heads_kv = 0;  // 0: same as heads
  int iters = 20;
  int warmup = 3;
  int scale_down = 8;  // check: lengths divided by this for the CPU-reference comparison
  uint64_t seed = 20261129;
  float input_range = 1.f;
  bool max_seqlen_hint = true;  // bench: pass the longest sequence as launch.max_seqlen_hint  // q, k, v,
                                // dout drawn from U(-input_range, input_range)
};

// Each returns the process exit code.
int run(const Options& o);
int check(const Options& o);
int bench(const Options& o);

}  // namespace jagflash::cli
