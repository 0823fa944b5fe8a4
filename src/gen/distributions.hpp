// The benchmark length distributions of shared/bench/distributions.md, one generator for the C++
// tests, the CLI, the benchmarks and (through the C API) Python.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace jagflash::gen {

// The five names, in the order the tables list them.
const std::vector<std::string>& distribution_names();

// Lengths of one batch. A portable RNG (no std:: distributions, whose output differs between
// standard libraries), so the same (name, seed) gives the same batch everywhere.
// Throws std::invalid_argument for an unknown name.
std::vector<int32_t> generate_lengths(const std::string& name, uint64_t seed);

// Default seed used by the CLI and the benchmarks.
constexpr uint64_t kDefaultSeed = 20261129;

}  // namespace jagflash::gen
