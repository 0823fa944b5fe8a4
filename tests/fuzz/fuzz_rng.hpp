// The fuzzer's random numbers: splitmix64, written out so that a (seed, case) pair gives the same
// case with every standard library (std::uniform_*_distribution is implementation-defined).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <vector>

namespace jagflash::fuzz {

class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}

  uint64_t next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi] (hi - lo < 2^63).
  int64_t range(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(next() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool chance(int percent) { return range(0, 99) < percent; }
  template <typename T>
  T pick(std::initializer_list<T> values) {
    return values.begin()[range(0, static_cast<int64_t>(values.size()) - 1)];
  }
  template <typename T>
  const T& pick(const std::vector<T>& values) {
    return values[static_cast<size_t>(range(0, static_cast<int64_t>(values.size()) - 1))];
  }

 private:
  uint64_t state_;
};

// The generator of case `index` of a run with `seed`: each case is independent of the others, so
// one failing case reruns alone (--case).
inline Rng case_rng(uint64_t seed, uint64_t index) {
  Rng mix(seed ^ 0x6a09e667f3bcc909ull);
  const uint64_t a = mix.next();
  return Rng(a ^ (index * 0xd1b54a32d192ed03ull));
}

}  // namespace jagflash::fuzz
