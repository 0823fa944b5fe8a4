// GPU oracle: a plain CUDA implementation of forward and backward (fp32 math, no tensor cores),
// correct over fast. It checks the Hopper kernels on batches too large for the CPU reference.
//
// One warp owns one (row, head): the lanes split the head dim, a shuffle reduction gives each
// score, and the loop runs only over the keys the mask leaves visible, stepping over the blocks a
// block-sparse map hides (problem.block_mask, core/block_mask.hpp; read on the device; a row that
// sees no key gets out = 0, lse = -inf, zero gradients). The call's score modifier
// (core/score_mod.hpp: softcap, ALiBi) maps each scaled score and gives dS its derivative, as in
// the CPU reference; problem.alibi_slopes is read on the device. No atomics anywhere, so results
// are bitwise reproducible.
#pragma once

#include <jagflash/jagflash.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace jagflash::oracle {

struct Workspace {
  const int32_t* error_flag;  // non-zero: offsets were found invalid on the device; write nothing
  float* delta;               // [H, total_q], backward only
};

using ForwardFn = cudaError_t (*)(const jf_fwd_args&, const Workspace&, cudaStream_t);
using BackwardFn = cudaError_t (*)(const jf_bwd_args&, const Workspace&, cudaStream_t);

struct Entry {
  jf_dtype dtype;
  int head_dim;
  ForwardFn forward;
  BackwardFn backward;
};

// The entry for (dtype, head_dim), or nullptr when this build did not instantiate it.
const Entry* find(jf_dtype dtype, int head_dim);

// "bf16/128, fp16/64, ...": for error messages of trimmed builds.
std::string instantiated();

}  // namespace jagflash::oracle
