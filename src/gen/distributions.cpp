// The benchmark length distributions (shared/bench/distributions.md) and their C entry points.
//
// The RNG is written here rather than taken from <random>: the engines are portable but the
// std:: distributions are not, and every caller (C++, CLI, Python through the C API) must see the
// same batch for the same (name, seed).
#include "gen/distributions.hpp"

#include "api/error.hpp"
#include "core/mask.hpp"

#include <jagflash/jagflash.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

namespace jagflash::gen {

namespace {

constexpr double kPi = 3.14159265358979323846;

uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// splitmix64 (Steele, Lea, Flood): expands one 64-bit seed into well-mixed words.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// FNV-1a over the name, so that two distributions drawn with the same seed are independent.
uint64_t fnv1a(const std::string& text) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (const char c : text) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001B3ull;
  }
  return h;
}

// xoshiro256** (Blackman, Vigna).
class Rng {
 public:
  Rng(const std::string& name, uint64_t seed) {
    uint64_t state = seed;
    const uint64_t mixed_seed = splitmix64(state);
    state = mixed_seed ^ fnv1a(name);
    for (uint64_t& word : s_) word = splitmix64(state);
  }

  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }

  // Uniform in [0, 1): the top 53 bits, exact in a double.
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

  // Standard normal by Box-Muller; one of the pair is used, so each draw costs two uniforms.
  double normal() {
    const double u1 = 1.0 - uniform();  // (0, 1]: log stays finite
    const double u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(2.0 * kPi * u2);
  }

  // Uniform integer in [lo, hi], unbiased (rejection of the last partial range).
  int64_t uniform_int(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    const uint64_t limit = ~0ull - (~0ull % span + 1) % span;  // largest multiple of span, minus 1
    uint64_t x = next();
    while (x > limit) x = next();
    return lo + static_cast<int64_t>(x % span);
  }

 private:
  uint64_t s_[4];
};

// Round half up after clipping, so huge draws (pareto's tail) never overflow the conversion.
int32_t clip_round(double x, double lo, double hi) {
  return static_cast<int32_t>(std::floor(std::min(std::max(x, lo), hi) + 0.5));
}

}  // namespace

const std::vector<std::string>& distribution_names() {
  static const std::vector<std::string> names = {"uniform1k", "gemskew", "pareto", "onegiant", "short"};
  return names;
}

std::vector<int32_t> generate_lengths(const std::string& name, uint64_t seed) {
  Rng rng(name, seed);
  std::vector<int32_t> lengths;
  if (name == "uniform1k") {
    lengths.assign(64, 1024);
  } else if (name == "gemskew") {
    // exp(N(ln 300, 1.0)), clipped to [16, 8192].
    lengths.resize(256);
    for (int32_t& len : lengths) len = clip_round(std::exp(std::log(300.0) + rng.normal()), 16, 8192);
  } else if (name == "pareto") {
    // 32 * (1-u)^(-1/1.2), clipped to [32, 16384]; 1-u is in (0, 1].
    lengths.resize(512);
    for (int32_t& len : lengths)
      len = clip_round(32.0 * std::pow(1.0 - rng.uniform(), -1.0 / 1.2), 32, 16384);
  } else if (name == "onegiant") {
    // The straggler first, so it is also first in (batch, head, block) order.
    lengths.assign(256, 128);
    lengths[0] = 16384;
  } else if (name == "short") {
    lengths.resize(2048);
    for (int32_t& len : lengths) len = static_cast<int32_t>(rng.uniform_int(16, 256));
  } else {
    std::string known;
    for (const std::string& n : distribution_names()) known += (known.empty() ? "" : ", ") + n;
    throw std::invalid_argument("distribution must be one of " + known + ", got '" + name + "'");
  }
  return lengths;
}

}  // namespace jagflash::gen

extern "C" jf_status jagflash_generate_lengths(const char* distribution, uint64_t seed, int32_t* lengths,
                                               int32_t capacity, int32_t* batch_size) {
  using jagflash::detail::set_last_error;
  try {
    if (distribution == nullptr) {
      set_last_error("jagflash_generate_lengths: distribution must be a name, got NULL");
      return JF_ERR_INVALID_ARGUMENT;
    }
    if (batch_size == nullptr) {
      set_last_error("jagflash_generate_lengths: batch_size must be a pointer to int32, got NULL");
      return JF_ERR_INVALID_ARGUMENT;
    }
    std::vector<int32_t> generated;
    try {
      generated = jagflash::gen::generate_lengths(distribution, seed);
    } catch (const std::invalid_argument& e) {
      set_last_error(std::string("jagflash_generate_lengths: ") + e.what());
      return JF_ERR_INVALID_ARGUMENT;
    }
    const int32_t count = static_cast<int32_t>(generated.size());
    if (lengths != nullptr && capacity < count) {
      // Nothing is written on failure, batch_size included (the C API's contract).
      set_last_error("jagflash_generate_lengths: capacity must be >= the batch size of '" +
                     std::string(distribution) + "' (" + std::to_string(count) + "), got " +
                     std::to_string(capacity));
      return JF_ERR_INVALID_ARGUMENT;
    }
    if (lengths != nullptr) std::copy(generated.begin(), generated.end(), lengths);
    *batch_size = count;
    set_last_error("");
    return JF_OK;
  } catch (const std::exception& e) {
    set_last_error(std::string("jagflash_generate_lengths: internal error: ") + e.what());
    return JF_ERR_INTERNAL;
  } catch (...) {
    set_last_error("jagflash_generate_lengths: internal error");
    return JF_ERR_INTERNAL;
  }
}

extern "C" int64_t jagflash_visible_pairs(int32_t len_q, int32_t len_kv, jf_mask mask, int32_t window_left,
                                          int32_t window_right) {
  // No status to return: invalid input (negative length, unknown mask, window fields that break
  // jf_mask's rules) gives -1, which no valid count equals, and leaves a message for
  // jagflash_last_error().
  using jagflash::detail::set_last_error;
  try {
    if (len_q < 0 || len_kv < 0) {
      set_last_error("jagflash_visible_pairs: len_q and len_kv must be >= 0, got " + std::to_string(len_q) +
                     " and " + std::to_string(len_kv));
      return -1;
    }
    // A C caller may pass any int as the mask: its bytes are read as an int before the value is
    // used as a jf_mask (an out-of-range value of the C++ enum type is undefined behaviour).
    static_assert(sizeof(jf_mask) == sizeof(int), "jf_mask is int-sized");
    int mask_value = 0;
    std::memcpy(&mask_value, &mask, sizeof mask_value);
    if (mask_value != JF_MASK_NONE && mask_value != JF_MASK_CAUSAL && mask_value != JF_MASK_WINDOW) {
      set_last_error(
          "jagflash_visible_pairs: mask must be JF_MASK_NONE, JF_MASK_CAUSAL or "
          "JF_MASK_WINDOW, got " +
          std::to_string(mask_value));
      return -1;
    }
    if (mask != JF_MASK_WINDOW && (window_left != -1 || window_right != -1)) {
      set_last_error(
          "jagflash_visible_pairs: for JF_MASK_NONE and JF_MASK_CAUSAL window_left and "
          "window_right must be -1, got " +
          std::to_string(window_left) + " and " + std::to_string(window_right));
      return -1;
    }
    if (mask == JF_MASK_WINDOW && (window_left < -1 || window_right < -1)) {
      set_last_error("jagflash_visible_pairs: window_left and window_right must be >= -1, got " +
                     std::to_string(window_left) + " and " + std::to_string(window_right));
      return -1;
    }
    const int64_t pairs =
        jagflash::MaskPolicy::from(mask, window_left, window_right).visible_pairs(len_q, len_kv);
    set_last_error("");
    return pairs;
  } catch (...) {
    return -1;  // set_last_error itself failed (allocation); nothing else here throws
  }
}
