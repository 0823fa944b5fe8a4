// jagflash command line: argument parsing only; the commands live in cli_commands.cpp.
#include "cli_commands.hpp"

#include "gen/distributions.hpp"

#include <jagflash/jagflash.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

namespace {

const char* kUsage = R"(usage: jagflash <command> [options]

Jagged FlashAttention (forward + backward) on packed variable-length batches.

commands:
  run      the main job: forward + backward on the default gemskew batch (H=16, D=128, bf16).
           On a GPU it times both and checks a sample of sequences against the CPU float64
           reference; without a GPU (or with --cpu) it runs the CPU reference on a scaled-down
           batch (its first 12 sequences, lengths / --scale-down) with the same heads, head dim,
           dtype and mask, checks it (a bf16 or fp16 run against an fp32 run on the same values,
           the fp32 one by finite differences), and says so.
  check    compare the GPU path with the GPU oracle on a distribution, and the oracle with the
           CPU reference on the same distribution scaled down (needs a GPU).
  bench    time forward and backward on the benchmark distributions; a table of ms and TFLOP/s.

options:
  --dist NAME[,NAME...]   uniform1k, gemskew, pareto, onegiant, short (check/bench; default: all
                          for bench, gemskew for check)
  --causal                causal mask (bottom-right aligned)
  --fwd-only              bench: time the forward only
  --deterministic         bench: the backward in deterministic mode (bitwise-reproducible dq)
  --window L,R            sliding window, -1 = unbounded
  --dtype bf16|fp16|fp32  (default bf16)
  --head-dim 64|128|256   (default 128)
  --heads H               query heads (default 16)
  --heads-kv H            kv heads, a divisor of --heads (default: --heads)
  --iters N               timed iterations, median reported (default 20)
  --warmup N              untimed iterations first (default 3)
  --scale-down K          check, and run without a GPU: divide lengths by K for the CPU
                          reference (default 8)
  --seed N                batch seed (default 20261129)
  --no-max-seqlen-hint    bench: leave launch.max_seqlen_hint unknown (by default the longest
                          sequence is passed, like FlashAttention's max_seqlen)
  --input-range A         q, k, v (and dout) drawn from U(-A, A) (default 1; 1.732 has the
                          unit variance of torch.randn, which the Python comparison uses)
  --cpu                   run: use the CPU reference even if a GPU is present
  -h, --help              this text
)";

int parse_int(const std::string& flag, const std::string& value) {
  try {
    size_t used = 0;
    const long v = std::stol(value, &used);
    if (used != value.size()) throw std::invalid_argument("trailing characters");
    // The cast below would wrap 4294967297 to 1.
    if (v < std::numeric_limits<int>::min() || v > std::numeric_limits<int>::max())
      throw std::out_of_range("past int");
    return static_cast<int>(v);
  } catch (const std::exception&) {
    throw std::invalid_argument(flag + ": expected an integer, got '" + value + "'");
  }
}

jagflash::cli::Options parse(int argc, char** argv) {
  jagflash::cli::Options o;
  if (argc < 2) throw std::invalid_argument("missing command (run, check or bench); see --help");
  o.command = argv[1];
  if (o.command != "run" && o.command != "check" && o.command != "bench")
    throw std::invalid_argument("unknown command '" + o.command + "': expected run, check or bench");
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + ": missing value");
      return argv[++i];
    };
    if (a == "--dist") {
      std::stringstream s(value());
      std::string name;
      while (std::getline(s, name, ',')) {
        bool known = false;
        for (const auto& n : jagflash::gen::distribution_names()) known |= n == name;
        if (!known)
          throw std::invalid_argument(
              "--dist: expected one of uniform1k, gemskew, pareto, onegiant, short; got '" + name + "'");
        o.distributions.push_back(name);
      }
    } else if (a == "--causal") {
      o.causal = true;
    } else if (a == "--fwd-only") {
      o.forward_only = true;
    } else if (a == "--deterministic") {
      o.deterministic = true;
    } else if (a == "--window") {
      const std::string v = value();
      const size_t comma = v.find(',');
      if (comma == std::string::npos)
        throw std::invalid_argument("--window: expected L,R (e.g. 256,0), got '" + v + "'");
      o.window = true;
      o.window_left = parse_int("--window", v.substr(0, comma));
      o.window_right = parse_int("--window", v.substr(comma + 1));
    } else if (a == "--dtype") {
      o.dtype = value();
      if (o.dtype != "bf16" && o.dtype != "fp16" && o.dtype != "fp32")
        throw std::invalid_argument("--dtype: expected bf16, fp16 or fp32, got '" + o.dtype + "'");
    } else if (a == "--head-dim") {
      o.head_dim = parse_int(a, value());
      if (o.head_dim != 64 && o.head_dim != 128 && o.head_dim != 256)
        throw std::invalid_argument("--head-dim: expected 64, 128 or 256, got " + std::to_string(o.head_dim));
    } else if (a == "--heads") {
      o.heads = parse_int(a, value());
      if (o.heads < 1) throw std::invalid_argument("--heads: expected >= 1, got " + std::to_string(o.heads));
    } else if (a == "--heads-kv") {
      o.heads_kv = parse_int(a, value());
      if (o.heads_kv < 1)
        throw std::invalid_argument("--heads-kv: expected >= 1, got " + std::to_string(o.heads_kv));
    } else if (a == "--iters") {
      o.iters = parse_int(a, value());
      if (o.iters < 1) throw std::invalid_argument("--iters: expected >= 1, got " + std::to_string(o.iters));
    } else if (a == "--warmup") {
      o.warmup = parse_int(a, value());
      if (o.warmup < 0)
        throw std::invalid_argument("--warmup: expected >= 0, got " + std::to_string(o.warmup));
    } else if (a == "--scale-down") {
      o.scale_down = parse_int(a, value());
      if (o.scale_down < 1)
        throw std::invalid_argument("--scale-down: expected >= 1, got " + std::to_string(o.scale_down));
    } else if (a == "--seed") {
      o.seed = static_cast<uint64_t>(parse_int(a, value()));
    } else if (a == "--no-max-seqlen-hint") {
      o.max_seqlen_hint = false;
    } else if (a == "--input-range") {
      const std::string v = value();
      try {
        size_t used = 0;
        o.input_range = std::stof(v, &used);
        if (used != v.size() || !(o.input_range > 0.f) || o.input_range > 1e3f)
          throw std::invalid_argument("range");
      } catch (const std::exception&) {
        throw std::invalid_argument("--input-range: expected a number in (0, 1000], got '" + v + "'");
      }
    } else if (a == "--cpu") {
      o.cpu = true;
    } else {
      throw std::invalid_argument("unknown option '" + a + "'; see --help");
    }
  }
  if (o.causal && o.window)
    throw std::invalid_argument("--causal and --window: give one (causal is --window -1,0)");
  if (o.heads_kv == 0) o.heads_kv = o.heads;
  if (o.heads % o.heads_kv != 0)
    throw std::invalid_argument("--heads-kv: expected a divisor of --heads (" + std::to_string(o.heads) +
                                "), got " + std::to_string(o.heads_kv));
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
  }
  jagflash::cli::Options options;
  try {
    options = parse(argc, argv);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "jagflash: %s\n", e.what());
    return 2;
  }
  try {
    if (options.command == "run") return jagflash::cli::run(options);
    if (options.command == "check") return jagflash::cli::check(options);
    return jagflash::cli::bench(options);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "jagflash %s: %s\n", options.command.c_str(), e.what());
    return 1;
  }
}
