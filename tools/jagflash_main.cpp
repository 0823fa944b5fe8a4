// jagflash command line: argument parsing only; the commands live in cli_commands.cpp.
#include "cli_commands.hpp"

#include "gen/distributions.hpp"

#include <jagflash/jagflash.h>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <limits>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>

namespace {

const char* kUsage = R"(usage: jagflash <command> [options]

Jagged FlashAttention (forward + backward) on packed variable-length batches.

commands:
  run      the main job: forward + backward on one batch (default gemskew; H=16, D=128, bf16).
           On a GPU it times both and checks a sample of sequences against the CPU float64
           reference; without a GPU (or with --cpu) it runs the CPU reference on a scaled-down
           batch (its first 12 sequences, lengths / --scale-down) with the same heads, head dim,
           dtype and mask, checks it (a bf16 or fp16 run against an fp32 run on the same values,
           the fp32 one by finite differences), and says so.
  check    compare the GPU path with the GPU oracle on a distribution, and the oracle with the
           CPU reference on the same distribution scaled down (needs a GPU).
  bench    time forward and backward on the benchmark distributions; a table of ms and TFLOP/s
           (needs a GPU).

options (a command refuses the options it does not use, as it refuses a bad value: exit status 2)
of every command:
  --dist NAME[,NAME...]   uniform1k, gemskew, pareto, onegiant, short (run: one name; default:
                          gemskew for run and check, all for bench)
  --causal                causal mask (bottom-right aligned)
  --window L,R            sliding window, L and R from -1 (unbounded) up
  --dtype bf16|fp16|fp32  (default bf16)
  --head-dim 64|128|256   (default 128)
  --heads H               query heads (default 16)
  --heads-kv H            kv heads, a divisor of --heads (default: --heads)
  --seed N                batch seed (default 20261129)
  --input-range A         q, k, v (and dout) drawn from U(-A, A) (default 1; 1.732 has the
                          unit variance of torch.randn, which the Python comparison uses)
of run and bench:
  --iters N               timed iterations, median reported (default 20; run on the CPU
                          reference: 1)
  --warmup N              untimed iterations first (default 3; run on the CPU reference: 0)
of run and check:
  --scale-down K          divide lengths by K for the CPU reference (default 8): run on the CPU
                          reference (refused when run is on the GPU), check's second comparison;
                          refused when it leaves every sequence one token long
of run:
  --cpu                   use the CPU reference even if a GPU is present
of bench:
  --fwd-only              time the forward only
  --deterministic         the backward in deterministic mode (bitwise-reproducible dq)
  --no-max-seqlen-hint    leave launch.max_seqlen_hint unknown (by default the longest
                          sequence is passed, like FlashAttention's max_seqlen)

  -h, --help              this text
)";

// Commands as bits, so each option can list the ones that use it.
enum : unsigned { kRun = 1u, kCheck = 2u, kBench = 4u, kEvery = kRun | kCheck | kBench };

struct OptionInfo {
  const char* name;
  unsigned commands;  // the commands that use it; the others refuse it
};

// Every option, with the commands that honour it (kUsage says the same).
constexpr OptionInfo kOptions[] = {
    {"--dist", kEvery},
    {"--causal", kEvery},
    {"--window", kEvery},
    {"--dtype", kEvery},
    {"--head-dim", kEvery},
    {"--heads", kEvery},
    {"--heads-kv", kEvery},
    {"--seed", kEvery},
    {"--input-range", kEvery},
    {"--iters", kRun | kBench},
    {"--warmup", kRun | kBench},
    {"--scale-down", kRun | kCheck},
    {"--cpu", kRun},
    {"--fwd-only", kBench},
    {"--deterministic", kBench},
    {"--no-max-seqlen-hint", kBench},
};

unsigned command_bit(const std::string& command) {
  return command == "run" ? kRun : command == "check" ? kCheck : kBench;
}

// "run", "run and check", "run, check and bench".
std::string command_list(unsigned commands) {
  std::vector<std::string> names;
  if (commands & kRun) names.push_back("run");
  if (commands & kCheck) names.push_back("check");
  if (commands & kBench) names.push_back("bench");
  std::string s;
  for (size_t i = 0; i < names.size(); ++i)
    s += (i == 0 ? "" : i + 1 == names.size() ? " and " : ", ") + names[i];
  return s;
}

// Refuses an unknown option, and one that `command` does not use: accepting it would ignore it.
void check_applies(const std::string& option, const std::string& command) {
  for (const OptionInfo& info : kOptions) {
    if (option != info.name) continue;
    if ((info.commands & command_bit(command)) == 0)
      throw std::invalid_argument(option + ": an option of " + command_list(info.commands) + ", not of " +
                                  command + "; see --help");
    return;
  }
  throw std::invalid_argument("unknown option '" + option + "'; see --help");
}

// The integer `value` spells, if it is one and fits in a long long.
std::optional<long long> to_integer(const std::string& value) {
  try {
    size_t used = 0;
    const long long v = std::stoll(value, &used);
    if (used == value.size()) return v;
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

// An int in [lo, INT_MAX]; the message gives the range, for a value out of it and for one that
// is not an integer alike.
int parse_int(const std::string& flag, const std::string& value, int lo) {
  constexpr int hi = std::numeric_limits<int>::max();
  const std::optional<long long> v = to_integer(value);
  if (!v || *v < lo || *v > hi)
    throw std::invalid_argument(flag + ": expected an integer from " + std::to_string(lo) + " to " +
                                std::to_string(hi) + ", got '" + value + "'");
  return static_cast<int>(*v);
}

// A seed is any uint64.
uint64_t parse_seed(const std::string& value) {
  const std::string expected = "--seed: expected an integer from 0 to " +
                               std::to_string(std::numeric_limits<uint64_t>::max()) + ", got '" + value + "'";
  // stoull takes "-1" as 2^64-1 and leading blanks: only digits are a seed.
  if (value.empty() || value.find_first_not_of("0123456789") != std::string::npos)
    throw std::invalid_argument(expected);
  try {
    return std::stoull(value);
  } catch (const std::exception&) {
    throw std::invalid_argument(expected);
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
    check_applies(a, o.command);
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + ": missing value");
      return argv[++i];
    };
    if (a == "--dist") {
      // Every comma-separated piece is a name, the empty ones too: "" or "gemskew," is refused
      // rather than read as the default or as "gemskew".
      const std::string list = value();
      for (size_t start = 0;;) {
        const size_t comma = list.find(',', start);
        const std::string name = list.substr(start, comma == std::string::npos ? comma : comma - start);
        bool known = false;
        for (const auto& n : jagflash::gen::distribution_names()) known |= n == name;
        if (!known)
          throw std::invalid_argument(
              "--dist: expected one of uniform1k, gemskew, pareto, onegiant, short; got '" + name + "'");
        o.distributions.push_back(name);
        if (comma == std::string::npos) break;
        start = comma + 1;
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
      constexpr int hi = std::numeric_limits<int>::max();
      const std::optional<long long> left =
          comma == std::string::npos ? std::nullopt : to_integer(v.substr(0, comma));
      const std::optional<long long> right =
          comma == std::string::npos ? std::nullopt : to_integer(v.substr(comma + 1));
      // -1 is the library's "unbounded"; below it the reference would refuse the call.
      if (!left || !right || *left < -1 || *right < -1 || *left > hi || *right > hi)
        throw std::invalid_argument(
            "--window: expected L,R (e.g. 256,0), each an integer from -1 (unbounded) to " +
            std::to_string(hi) + ", got '" + v + "'");
      o.window = true;
      o.window_left = static_cast<int>(*left);
      o.window_right = static_cast<int>(*right);
    } else if (a == "--dtype") {
      o.dtype = value();
      if (o.dtype != "bf16" && o.dtype != "fp16" && o.dtype != "fp32")
        throw std::invalid_argument("--dtype: expected bf16, fp16 or fp32, got '" + o.dtype + "'");
    } else if (a == "--head-dim") {
      const std::string v = value();
      if (v != "64" && v != "96" && v != "128" && v != "192" && v != "256")
        throw std::invalid_argument("--head-dim: expected 64, 96, 128, 192 or 256, got '" + v + "'");
      o.head_dim = std::stoi(v);
    } else if (a == "--heads") {
      o.heads = parse_int(a, value(), 1);
    } else if (a == "--heads-kv") {
      o.heads_kv = parse_int(a, value(), 1);
    } else if (a == "--iters") {
      o.iters = parse_int(a, value(), 1);
    } else if (a == "--warmup") {
      o.warmup = parse_int(a, value(), 0);
    } else if (a == "--scale-down") {
      o.scale_down = parse_int(a, value(), 1);
    } else if (a == "--seed") {
      o.seed = parse_seed(value());
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
    jagflash::cli::validate(options);
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
