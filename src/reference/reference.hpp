// CPU reference: float64 math over bf16/fp16/fp32 inputs, every feature of the API.
// It is the oracle of the tests and the path the API runs for CPU pointers.
#pragma once

#include <jagflash/jagflash.h>

namespace jagflash::reference {

// Both take validated arguments whose pointers are host memory.
// Every head dim validation accepts (q and k: D, any multiple of 8 up to 256; v, out, dout and dv:
// Dv <= D); the default scale is 1/sqrt(D). The score modifier (problem.score_mod: softcap,
// ALiBi; core/score_mod.hpp) applies to the scaled scores in both directions; alibi_slopes is
// host memory.
// forward: out (input dtype) and lse (if non-null); a row with no visible key gets out = 0 and
// lse = -inf, or its head's sink with problem.learnable_sink (which joins every row's softmax).
void forward(const jf_fwd_args& args);

// backward: dq, dk, dv (input dtype), in float64 from q, k, v, args.dout and the forward's
// statistics as the caller gives them, as the GPU backwards take them: P = exp(score - lse) from
// args.lse, delta = rowsum(dout * out) from args.out as stored. With the out and lse of attention
// over more keys than this call's (merged over K/V blocks, as context parallelism passes them),
// the result is this call's keys' share: the blocks' dq sum, their dk, dv concatenate. With GQA,
// dk/dv sum over the query heads of each group. Rows that see no key, or whose lse is -inf, have
// zero gradients; keys no query sees get dk = dv = 0. Pooled (problem.pooled_q_rows > 0): out, dout
// and lse rows are sequence b's at b * Lq; dq [Lq, H, D] is the sum of every sequence's
// contribution, added in sequence order in float64 and rounded once. With dlearnable_sink, each
// head's sink gradient -sum_i exp(s_h - lse_i) * rowsum(dout_i * out_i), over its rows in order.
void backward(const jf_bwd_args& args);

}  // namespace jagflash::reference
