// Pooled attention (jf_problem.pooled_q_rows): the row counts it changes, in one place
// for the validation, the dispatch, the reference and the oracle.
#pragma once

#include <jagflash/jagflash.h>

#include <cstdint>

namespace jagflash {

// One query set [Lq, H, D] shared by every sequence (pooled_q_rows = Lq > 0).
inline bool is_pooled(const jf_problem& p) { return p.pooled_q_rows > 0; }

// Rows of out and dout, and the row count of lse [H, rows]: B * Lq when pooled (sequence b's rows
// at b * Lq), else q.rows (= total_q). Valid once pooled_q_rows >= 0 and batch_size >= 0.
inline int64_t output_rows(const jf_problem& p) {
  return is_pooled(p) ? int64_t{p.batch_size} * p.pooled_q_rows : p.q.rows;
}

}  // namespace jagflash
