// jagflash_fuzz_c_api: random and adversarial jf_fwd_args / jf_bwd_args on host pointers, through
// the C entry points, in a build with AddressSanitizer and UndefinedBehaviorSanitizer (a crash or
// undefined behaviour ends the process with the case that caused it). For each case:
//   - the workspace query, then the call, each succeeds exactly when the contract (contract.hpp)
//     finds nothing broken; a failure's message names a broken argument, with the status that
//     argument gives, and says what was expected and what was given;
//   - a failed query or call changes no byte the caller owns (every buffer is pattern-filled and
//     surrounded by guards, all compared with a snapshot); a successful one writes only the output
//     views' elements (not their padding), the forward's lse, the backward's dlearnable_sink,
//     *bytes and the workspace.
// A failing case prints its seed, index and mutations; --seed S --case I reruns it alone.
#include "contract.hpp"
#include "fuzz_case.hpp"
#include "fuzz_rng.hpp"

#include <jagflash/jagflash.h>

#include <unistd.h>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define JF_FUZZ_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define JF_FUZZ_SANITIZED 1
#endif
#endif
#ifdef JF_FUZZ_SANITIZED
#include <sanitizer/common_interface_defs.h>
// The CUDA driver (on a machine with a GPU) maps memory where AddressSanitizer keeps its shadow
// gap; without a driver this changes nothing.
extern "C" const char* __asan_default_options() { return "protect_shadow_gap=0"; }
// UBSan's runtime is a library of its own beside ASan's (GCC), so the death callback set below
// does not reach it: it aborts instead, and the SIGABRT handler prints the case.
extern "C" const char* __ubsan_default_options() { return "print_stacktrace=1:abort_on_error=1"; }
#endif

namespace jagflash::fuzz {
namespace {

struct Options {
  uint64_t seed = 1;
  uint64_t iterations = 0;  // 0: until --seconds
  double seconds = 0;       // 0: until --iterations
  int64_t only_case = -1;
  bool verbose = false;
  bool stats = false;
  uint64_t min_arguments = 0;  // fail if fewer distinct arguments were named by errors
  uint64_t min_accepted = 0;   // fail if fewer calls were accepted
};

// The running case, written to stderr if a sanitizer report or a signal ends the process.
std::string g_current_case;

void print_current_case() {
  if (g_current_case.empty()) return;
  const char* p = g_current_case.data();
  size_t left = g_current_case.size();
  while (left > 0) {
    const ssize_t n = write(STDERR_FILENO, p, left);
    if (n <= 0) break;
    p += n;
    left -= static_cast<size_t>(n);
  }
}

extern "C" void on_fatal_signal(int sig) {
  print_current_case();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

struct Stats {
  uint64_t cases = 0, forward = 0, backward = 0;
  uint64_t calls_ok = 0, calls_failed = 0, queries_ok = 0, queries_failed = 0, unbacked = 0;
  // Accepted calls that ran the reference with learnable sinks, and backwards among them that
  // returned the sinks' gradient.
  uint64_t sink_forwards_ok = 0, sink_backwards_ok = 0, sink_gradients_ok = 0;
  std::map<std::string, uint64_t> named;  // argument (index stripped) -> errors that named it

  // An accepted call's problem, and the gradient a backward was given for its sinks.
  void count_sinks(const jf_problem& p, const float* gradient, bool forward) {
    if (p.learnable_sink == nullptr) return;
    ++(forward ? sink_forwards_ok : sink_backwards_ok);
    if (gradient != nullptr) ++sink_gradients_ok;
  }

  void count_error(const std::string& message) {
    std::string argument = message.substr(0, message.find(": "));
    argument = argument.substr(0, argument.find('['));
    ++named[argument];
  }
};

const char* status_name(jf_status s) {
  switch (s) {
    case JF_OK:
      return "JF_OK";
    case JF_ERR_INVALID_ARGUMENT:
      return "JF_ERR_INVALID_ARGUMENT";
    case JF_ERR_UNSUPPORTED:
      return "JF_ERR_UNSUPPORTED";
    case JF_ERR_CUDA:
      return "JF_ERR_CUDA";
    case JF_ERR_INTERNAL:
      return "JF_ERR_INTERNAL";
  }
  return "(unknown status)";
}

// "" when the status and message agree with the verdict; else what is wrong.
std::string check_outcome(jf_status status, const Verdict& verdict, bool query) {
  const std::string message = jagflash_last_error();
  const bool valid = query ? verdict.query_valid() : verdict.call_valid();
  if (status == JF_OK) {
    if (!valid) return "accepted, but the call breaks: " + verdict.list(query);
    if (!message.empty()) return "succeeded, yet jagflash_last_error() is \"" + message + "\"";
    return "";
  }
  const std::string got = std::string(status_name(status)) + " \"" + message + "\"";
  if (valid) return "rejected a valid call: " + got;
  if (verdict.named_by(message, status, query) == nullptr)
    return "the error names no broken argument with that status: " + got + "; broken: " + verdict.list(query);
  if (message.find(": expected ") == std::string::npos || message.find(", got ") == std::string::npos)
    return "the error does not say what was expected and what was given: " + got;
  return "";
}

class CaseRunner {
 public:
  CaseRunner(const Options& o, bool gpu_present) : options_(o), gpu_present_(gpu_present) {}

  // false: the case failed (reported on stderr).
  bool run(uint64_t index, Stats& stats) {
    Rng rng = case_rng(options_.seed, index);
    CaseSpec spec = generate_case(rng);
    const std::string label = "seed " + std::to_string(options_.seed) + " case " + std::to_string(index) +
                              " (rerun: --seed " + std::to_string(options_.seed) + " --case " +
                              std::to_string(index) + ")";
    return run(spec, rng.next(), label, stats);
  }

  bool run(CaseSpec spec, uint64_t pattern_seed, const std::string& label, Stats& stats) {
    // The fuzzer's pointers are host memory: vouching for them on a GPU call, where a GPU is
    // present, would be a lie the library is entitled to believe (its kernels would read host
    // pointers). Without a GPU such a call is refused before any pointer matters.
    if (gpu_present_ && spec.device == JF_DEVICE_CUDA && spec.caller_checked_pointers != 0) {
      spec.caller_checked_pointers = 0;
      spec.mutations.push_back(
          "launch.caller_checked_pointers = 0 (host pointers on a GPU call, GPU present)");
    }
    describe(spec, label);
    auto memory = std::make_unique<CallMemory>(spec, pattern_seed);
    if (judge(spec, *memory, /*bytes_null=*/false).call_valid() && !memory->backed()) {
      break_offsets_for_unbacked_views(spec);
      describe(spec, label);
      memory = std::make_unique<CallMemory>(spec, pattern_seed);
      ++stats.unbacked;
    }
    const bool forward = spec.direction == Direction::kForward;
    ++(forward ? stats.forward : stats.backward);
    if (options_.verbose) std::fputs(header_.c_str(), stderr);

    // The workspace query.
    size_t* bytes = spec.bytes_null ? nullptr : memory->bytes_slot();
    const Verdict query = judge(spec, *memory, bytes == nullptr);
    memory->snapshot();
    jf_status status = forward ? jagflash_fwd_workspace_size(spec.args_null ? nullptr : memory->fwd(), bytes)
                               : jagflash_bwd_workspace_size(spec.args_null ? nullptr : memory->bwd(), bytes);
    if (!outcome("workspace query", status, query, /*query=*/true, stats)) return false;
    if (!unchanged(spec, *memory, "workspace query", status == JF_OK, /*query_result=*/true)) return false;
    if (status == JF_OK && bytes != nullptr && !memory->bytes_written())
      return fail("workspace query", "succeeded without writing *bytes");
    size_t queried = 0;
    if (status == JF_OK && bytes != nullptr) std::memcpy(&queried, bytes, sizeof queried);
    if (status == JF_OK && queried > (size_t{1} << 40))
      return fail("workspace query", "returned an absurd size " + std::to_string(queried));

    // The call.
    memory->attach_workspace(spec, queried);
    const Verdict call = judge(spec, *memory, /*bytes_null=*/false);
    memory->snapshot();
    status = forward ? jagflash_fwd(spec.args_null ? nullptr : memory->fwd())
                     : jagflash_bwd(spec.args_null ? nullptr : memory->bwd());
    if (!outcome(forward ? "jagflash_fwd" : "jagflash_bwd", status, call, /*query=*/false, stats))
      return false;
    if (!unchanged(spec, *memory, forward ? "jagflash_fwd" : "jagflash_bwd", status == JF_OK,
                   /*query_result=*/false))
      return false;
    if (status == JF_OK)
      stats.count_sinks(memory->fwd()->problem, forward ? nullptr : memory->bwd()->dlearnable_sink, forward);
    g_current_case.clear();
    return true;
  }

 private:
  void describe(const CaseSpec& spec, const std::string& label) {
    header_ = "c_api_fuzz: " + label + "\n" + spec.describe() + "\n";
    g_current_case = "c_api_fuzz: the process ended during this case\n" + header_;
  }

  Verdict judge(const CaseSpec& spec, CallMemory& memory, bool bytes_null) const {
    if (spec.direction == Direction::kForward)
      return judge_forward(spec.args_null ? nullptr : memory.fwd(), bytes_null, gpu_present_,
                           memory.backed());
    return judge_backward(spec.args_null ? nullptr : memory.bwd(), bytes_null, gpu_present_, memory.backed());
  }

  bool outcome(const char* what, jf_status status, const Verdict& verdict, bool query, Stats& stats) {
    if (query)
      ++(status == JF_OK ? stats.queries_ok : stats.queries_failed);
    else
      ++(status == JF_OK ? stats.calls_ok : stats.calls_failed);
    if (status != JF_OK) stats.count_error(jagflash_last_error());
    if (options_.verbose)
      std::fprintf(stderr, "  %s: %s \"%s\"\n", what, status_name(status), jagflash_last_error());
    const std::string problem = check_outcome(status, verdict, query);
    return problem.empty() || fail(what, problem);
  }

  bool unchanged(const CaseSpec& spec, const CallMemory& memory, const char* what, bool succeeded,
                 bool query_result) {
    const std::string where = memory.changed(spec.direction, succeeded && !query_result,
                                             succeeded && query_result, succeeded && !query_result);
    if (where.empty()) return true;
    return fail(what, std::string(succeeded ? "succeeded and wrote " : "failed and wrote ") + where);
  }

  bool fail(const char* what, const std::string& problem) {
    g_current_case.clear();
    std::fprintf(stderr, "%sc_api_fuzz: FAIL in %s: %s\n", header_.c_str(), what, problem.c_str());
    return false;
  }

  const Options& options_;
  bool gpu_present_;
  std::string header_;
};

[[noreturn]] void usage(const char* bad) {
  std::fprintf(stderr,
               "jagflash_fuzz_c_api: %s\n"
               "usage: jagflash_fuzz_c_api [--seed S] [--iterations N] [--seconds T] [--case I] [--verbose]\n"
               "                           [--stats] [--min-arguments N] [--min-accepted N]\n"
               "  runs cases 0, 1, ... of seed S until N cases or T seconds (whichever comes first;\n"
               "  default 1000 cases); --case I runs case I alone, verbosely\n",
               bad);
  std::exit(2);
}

uint64_t parse_u64(const char* flag, const char* text) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(text, &end, 10);
  if (text[0] == '\0' || text[0] == '-' || *end != '\0')
    usage((std::string(flag) + ": expected a count").c_str());
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) usage((a + ": missing value").c_str());
      return argv[++i];
    };
    if (a == "--seed") {
      o.seed = parse_u64("--seed", value());
    } else if (a == "--iterations") {
      o.iterations = parse_u64("--iterations", value());
    } else if (a == "--seconds") {
      o.seconds = static_cast<double>(parse_u64("--seconds", value()));
    } else if (a == "--case") {
      o.only_case = static_cast<int64_t>(parse_u64("--case", value()));
      o.verbose = true;
    } else if (a == "--verbose") {
      o.verbose = true;
    } else if (a == "--stats") {
      o.stats = true;
    } else if (a == "--min-arguments") {
      o.min_arguments = parse_u64("--min-arguments", value());
    } else if (a == "--min-accepted") {
      o.min_accepted = parse_u64("--min-accepted", value());
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  if (o.iterations == 0 && o.seconds == 0) o.iterations = 1000;
  return o;
}

}  // namespace
}  // namespace jagflash::fuzz

int main(int argc, char** argv) {
  using namespace jagflash::fuzz;
  const Options o = parse(argc, argv);
#ifdef JF_FUZZ_SANITIZED
  __sanitizer_set_death_callback(print_current_case);
#endif
#ifdef JF_FUZZ_SANITIZED
  // AddressSanitizer reports the other signals itself (and calls the death callback).
  std::signal(SIGABRT, on_fatal_signal);
#else
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL}) std::signal(sig, on_fatal_signal);
#endif

  const bool gpu_present = jagflash_cuda_device_count() > 0;
  CaseRunner runner(o, gpu_present);
  Stats stats;
  const auto start = std::chrono::steady_clock::now();
  auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  bool ok = true;
  if (o.only_case >= 0) {
    ++stats.cases;
    ok = runner.run(static_cast<uint64_t>(o.only_case), stats);
  } else {
    const std::vector<CaseSpec> regressions = regression_cases();
    for (size_t i = 0; ok && i < regressions.size(); ++i) {
      ++stats.cases;
      ok = runner.run(regressions[i], /*pattern_seed=*/i, "regression case " + std::to_string(i), stats);
    }
    for (uint64_t i = 0;
         ok && (o.iterations == 0 || i < o.iterations) && (o.seconds == 0 || elapsed() < o.seconds); ++i) {
      ++stats.cases;
      ok = runner.run(i, stats);
    }
  }
  std::printf(
      "c_api_fuzz: seed %llu: %llu cases (%llu forward, %llu backward) in %.1f s%s; calls: %llu accepted, "
      "%llu "
      "rejected; workspace queries: %llu accepted, %llu rejected; %llu cases needed their offsets broken "
      "(views "
      "no memory backs); errors named %zu distinct arguments\n",
      static_cast<unsigned long long>(o.seed), static_cast<unsigned long long>(stats.cases),
      static_cast<unsigned long long>(stats.forward), static_cast<unsigned long long>(stats.backward),
      elapsed(), gpu_present ? " (a CUDA device is visible)" : "",
      static_cast<unsigned long long>(stats.calls_ok), static_cast<unsigned long long>(stats.calls_failed),
      static_cast<unsigned long long>(stats.queries_ok),
      static_cast<unsigned long long>(stats.queries_failed), static_cast<unsigned long long>(stats.unbacked),
      stats.named.size());
  if (o.stats) {
    std::printf("  accepted with learnable sinks: %llu forward, %llu backward (%llu with their gradient)\n",
                static_cast<unsigned long long>(stats.sink_forwards_ok),
                static_cast<unsigned long long>(stats.sink_backwards_ok),
                static_cast<unsigned long long>(stats.sink_gradients_ok));
    std::printf("  errors by argument:\n");
  }
  if (o.stats)
    for (const auto& [argument, count] : stats.named)
      std::printf("  %8llu  %s\n", static_cast<unsigned long long>(count), argument.c_str());
  if (ok && stats.named.size() < o.min_arguments) {
    std::fprintf(stderr,
                 "c_api_fuzz: FAIL: errors named %zu distinct arguments, fewer than --min-arguments %llu\n",
                 stats.named.size(), static_cast<unsigned long long>(o.min_arguments));
    ok = false;
  }
  if (ok && stats.calls_ok < o.min_accepted) {
    std::fprintf(stderr, "c_api_fuzz: FAIL: %llu calls accepted, fewer than --min-accepted %llu\n",
                 static_cast<unsigned long long>(stats.calls_ok),
                 static_cast<unsigned long long>(o.min_accepted));
    ok = false;
  }
  return ok ? 0 : 1;
}
