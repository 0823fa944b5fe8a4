// Benchmark knobs: environment variables that force one choice of the library's (a forward tile
// variant, a schedule, the plan builder, the backward's group splits ...) so that bench/ and the
// GPU tests can measure or test each. They exist only in a build configured with
// -DJAGFLASH_BENCH_KNOBS=ON (the default where the tests are built, JAGFLASH_BUILD_TESTS=ON; off in
// the library pip and a plain install build): there the library reads no environment variable
// and the kernel variants only a knob can select are not compiled.
#pragma once

#include <cstdlib>

#ifndef JAGFLASH_BENCH_KNOBS
#define JAGFLASH_BENCH_KNOBS 0
#endif

namespace jagflash {

inline constexpr bool kBenchKnobs = JAGFLASH_BENCH_KNOBS != 0;

// The knob's value, or nullptr when it is unset or this build has no knobs.
inline const char* bench_knob(const char* name) {
  if constexpr (kBenchKnobs)
    return std::getenv(name);
  else
    return (void)name, nullptr;
}

}  // namespace jagflash
