/* jagflash: FlashAttention on jagged (packed, variable-length) batches.
 *
 * Stable C API. Plain structs, no exceptions across this boundary, usable from ctypes.
 * Every function returns a jf_status; on anything but JF_OK, jagflash_last_error() gives a
 * message naming the argument, what was expected and what was given. Nothing the caller owns
 * is written when a call fails validation.
 *
 * Layout contract (README.md, "API in one screen", has the same with an example call):
 *   q    [total_q,  H,    D]   k [total_kv, H_kv, D]   v [total_kv, H_kv, Dv]   out [total_q, H, Dv]
 *   lse  [H, total_q] float32, natural log of the softmax denominator
 *   Head dims: D any multiple of 8 from 8 to 256; Dv (v.head_dim) a multiple of 8 from 8 to D. The
 *   backward's dout is [.., Dv] like out, dq [.., D] like q, dk like k, dv like v. Served on CPU
 *   pointers for every such pair; on CUDA with Dv = D: D = 64, 128 or 256 always, any other D where
 *   the Hopper kernels take it (bf16/fp16, no score modifier, forward up to 256, backward up to
 *   128; else JF_ERR_UNSUPPORTED naming q's head dim); with Dv < D the forward on the Hopper
 *   kernels (bf16/fp16, no score modifier, no block mask; else, and for the backward,
 *   JF_ERR_UNSUPPORTED naming v's head dim). The default scale is 1/sqrt(D).
 *   q_offsets / kv_offsets: int32 [B+1], offsets[0] == 0, non-decreasing, last == total.
 * Pooled attention (problem.pooled_q_rows = Lq > 0: one query set shared by every sequence, as in
 * Pooling by Multihead Attention):
 *   q    [Lq, H, D]   k [total_kv, H_kv, D]   v [total_kv, H_kv, Dv]   out, dout [B*Lq, H, Dv]
 *   lse  [H, B*Lq]
 *   dq   [Lq, H, D], the sum over the B sequences;  q_offsets NULL, kv_offsets as above.
 *   Sequence b's output rows are [b*Lq, (b+1)*Lq). Wherever total_q stands for output rows
 *   (out, dout, lse) it is B*Lq.
 * Strides are in elements; the head dim is contiguous.
 */
#ifndef JAGFLASH_JAGFLASH_H
#define JAGFLASH_JAGFLASH_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define JAGFLASH_VERSION_MAJOR 0
#define JAGFLASH_VERSION_MINOR 1
#define JAGFLASH_VERSION_PATCH 0

typedef enum jf_status {
  JF_OK = 0,
  JF_ERR_INVALID_ARGUMENT = 1, /* bad shape, stride, pointer, offsets, mask ... */
  JF_ERR_UNSUPPORTED = 2,      /* valid request this build cannot serve (head dim, dtype, backend, device) */
  JF_ERR_CUDA = 3,             /* a CUDA runtime call failed */
  JF_ERR_INTERNAL = 4
} jf_status;

typedef enum jf_dtype { JF_BF16 = 0, JF_FP16 = 1, JF_FP32 = 2 } jf_dtype;

/* Where every pointer of a call lives (tensors, offsets, lse, workspace). */
typedef enum jf_device { JF_DEVICE_CPU = 0, JF_DEVICE_CUDA = 1 } jf_device;

/* Masks are per sequence, bottom-right aligned when Lq != Lk: with shift = Lk - Lq, query i
 * sees key j when  i + shift - window_left <= j <= i + shift + window_right  (-1 = unbounded).
 * JF_MASK_CAUSAL is the window (-1, 0). For NONE and CAUSAL the window fields must be -1. */
typedef enum jf_mask { JF_MASK_NONE = 0, JF_MASK_CAUSAL = 1, JF_MASK_WINDOW = 2 } jf_mask;

/* A score modifier, applied to each visible pair's scaled score s = scale * q_i . k_j before the
 * softmax (FlashAttention-2's conventions, src/core/score_mod.hpp):
 *  SOFTCAP: s -> softcap * tanh(s / softcap), problem.softcap finite and > 0 (Gemma 2, Grok).
 *  ALIBI:   s -> s - slope_h * |i + Lk - Lq - j| for query head h, query i and key j of a sequence
 *           (bottom-right aligned like the masks: 0 on the causal diagonal, negative off it), one
 *           fp32 slope per query head in problem.alibi_slopes [H], in the memory q lives in.
 * The kinds after ALIBI read problem.score_mod_table, fp32 [H][score_mod_table_width] in the
 * memory q lives in (row h for query head h), as each kind says:
 *  RELATIVE_BIAS: s -> s + table[h][clip(j - i - (Lk - Lq), -R, R) + R], width 2R + 1 (odd): a
 *           bias per head and clipped relative position (T5, HSTU; T5's log buckets expand to it).
 * A kind sets the fields it reads and leaves every other modifier field 0 / NULL (NONE: all).
 * jagflash_score_mod_by_name gives a kind from its name ("softcap", "alibi", ...).
 * Served on CPU pointers and on CUDA (the Hopper kernels at head dim 64/128/256, backward 64/128;
 * the oracle elsewhere, jagflash_query_backend). */
typedef enum jf_score_mod {
  JF_SCORE_MOD_NONE = 0,
  JF_SCORE_MOD_SOFTCAP = 1,
  JF_SCORE_MOD_ALIBI = 2,
  JF_SCORE_MOD_RELATIVE_BIAS = 3
} jf_score_mod;

/* Block-sparse attention (FlexAttention's BlockMask over a jagged batch, src/core/block_mask.hpp):
 * which (query block, key block) pairs of JF_BLOCK_MASK_BLOCK x JF_BLOCK_MASK_BLOCK tokens of each
 * sequence may attend, counted from the sequence's first query row and first key. Sequence b with
 * nq = ceil(Lq_b / 128) query blocks and nk = ceil(Lk_b / 128) key blocks has its map at
 * blocks + offsets[b]: nq x nk bytes, row-major (query block major), nonzero = visible. Query i
 * sees key j when the mask (jf_mask) lets it AND the map's byte (i / 128, j / 128) is nonzero: a
 * document or prefix-LM mask whose boundaries fall on block edges, or any pattern of blocks, with
 * causal or a window inside them. A row that sees no key gets out = 0, lse = -inf (as with a
 * window). Shared by every head.
 *   blocks:  uint8, offsets[B] bytes, in the memory q lives in.
 *   offsets: int32 [B+1], in the memory q lives in: offsets[0] == 0 and
 *            offsets[b+1] - offsets[b] == nq_b * nk_b (checked like q_offsets, jf_offsets_check).
 *   bytes:   the size of the buffer at blocks, in bytes: >= 0, and offsets[B] <= bytes (checked
 *            with the offsets, jf_offsets_check), so a map whose offsets claim more than the buffer
 *            holds is refused instead of read past its end. 0 when blocks is NULL.
 * All NULL / 0: no block mask. Not with pooled attention (JF_ERR_UNSUPPORTED). Time is proportional
 * to the visible blocks: the kernels skip hidden ones and the schedule weighs sequences by them.
 * Served on CPU pointers and on CUDA (the Hopper kernels at head dim 64/128 without a score
 * modifier; the oracle elsewhere). */
#define JF_BLOCK_MASK_BLOCK 128
typedef struct jf_block_mask {
  const uint8_t* blocks;
  const int32_t* offsets;
  int64_t bytes; /* the size of the buffer at blocks; 0 with no map */
} jf_block_mask;

/* How device offsets are validated (CPU calls always check them on the host, for free).
 *  HOST:   copied to the host and checked before anything runs: one copy and stream sync per
 *          offsets vector (q_offsets, kv_offsets), so two per call; refused while launch.stream is
 *          being captured. Bad offsets fail this call.
 *  DEVICE: checked by a small kernel: no host sync, safe under CUDA-graph capture. On bad offsets
 *          the call still returns JF_OK (it cannot know yet), every kernel of it exits without
 *          writing anything the caller owns, and the failure is reported asynchronously, as CUDA
 *          reports a kernel's fault:
 *          - the next jagflash_fwd or jagflash_bwd on the same CUDA device (either direction, any
 *            offsets_check) that starts after the GPU ran the failed check fails with
 *            JF_ERR_INVALID_ARGUMENT and runs nothing; its message is the failed call's
 *            jagflash_read_device_error text behind "an earlier jagflash call on CUDA device N
 *            (reported once, here; this call ran nothing): ". A call that starts before the GPU
 *            reached the check does not see it yet (a later one does); a synchronisation in
 *            between makes the very next call report it.
 *          - jagflash_synchronize(stream) syncs and reports it the same way;
 *          - jagflash_read_device_error(workspace, stream) syncs and reports the flag the call left
 *            in its workspace (until the workspace is used again).
 *          Each failure is reported once by the first two (one latch word per device in mapped
 *          host memory, which the check kernel writes and the next call reads without a sync);
 *          jagflash_read_device_error clears what it reports from the latch. The latch is
 *          allocated by the first DEVICE call on a device that is not being captured into a
 *          CUDA graph: a call captured before that latches nothing (replay it after one eager
 *          DEVICE call, or ask jagflash_read_device_error). A captured call's replays latch like
 *          eager calls. Only the offsets check latches: a reuse_plan mismatch is reported by
 *          jagflash_read_device_error alone. */
typedef enum jf_offsets_check { JF_CHECK_OFFSETS_HOST = 0, JF_CHECK_OFFSETS_DEVICE = 1 } jf_offsets_check;

/* Which implementation runs. AUTO: the CPU reference for CPU pointers; on the GPU the Hopper
 * kernel where it serves the call (compute capability 9.0, bf16/fp16; head dims up to 256 in
 * either direction (below 64, 128, 192 and 256 padded); pooled problems too), else the oracle.
 * jagflash_query_backend says which one a call runs. */
typedef enum jf_backend {
  JF_BACKEND_AUTO = 0,
  JF_BACKEND_REFERENCE = 1, /* CPU, float64 math */
  JF_BACKEND_ORACLE = 2,    /* GPU, fp32 math, no tensor cores: correct on every GPU, slow */
  JF_BACKEND_HOPPER = 3 /* GPU, sm_90a warp-specialised kernel; JF_ERR_UNSUPPORTED where it cannot serve */
} jf_backend;

/* A [rows, heads, head_dim] view. Element (r, h, d) is at data[r*row_stride + h*head_stride + d]. */
typedef struct jf_tensor {
  void* data;
  int64_t rows;
  int32_t heads;
  int32_t head_dim;
  int64_t row_stride;
  int64_t head_stride;
} jf_tensor;

/* What both directions share: the jagged problem. */
typedef struct jf_problem {
  jf_dtype dtype;
  jf_device device;
  int32_t batch_size;        /* B; offsets hold B+1 entries */
  const int32_t* q_offsets;  /* [B+1] */
  const int32_t* kv_offsets; /* [B+1] */
  jf_tensor q;               /* [total_q, H, D] */
  jf_tensor k;               /* [total_kv, H_kv, D] */
  jf_tensor v;               /* [total_kv, H_kv, Dv], Dv <= D */
  jf_mask mask;
  int32_t window_left; /* JF_MASK_WINDOW only, -1 = unbounded */
  int32_t window_right;
  float scale; /* 0 means 1/sqrt(D), D = q.head_dim */
  /* 0: ordinary attention (the contract above). Lq > 0: pooled attention. The query set q
   * [Lq, H, D] (q.rows == Lq) is shared by all B sequences: sequence b attends with every query
   * row over its own keys kv_offsets[b] .. kv_offsets[b+1]. q_offsets must be NULL. out and dout
   * are [B*Lq, H, D] (sequence b's rows at b*Lq), lse [H, B*Lq], dq [Lq, H, D] (the sum over the
   * sequences of their contributions; the reference sums in float64, the oracle in fp32, each
   * rounded once), dk and dv per sequence as always. Masks keep their meaning per sequence with
   * len_q = Lq and len_kv = the sequence's length (bottom-right aligned): none and a key-side
   * window (JF_MASK_WINDOW) are what pooling uses; causal is served too. A sequence of length 0
   * gets out = 0, lse = -inf and contributes no gradient. B*Lq must fit in int32 (2^31-1).
   * The Hopper kernels serve pooled calls as they serve the others (each sequence's query block
   * loaded from q's first row; a sequence takes its own tiles, 64 rows a warpgroup, two sequences
   * a CTA in the forward when Lq <= 64); with Lq <= 64 and launch.deterministic = 0 the backward
   * sums the sequences' dq inside each CTA, in an order that may vary between calls (dk, dv stay
   * bitwise repeatable; deterministic mode sums each row's sequences in order). The workspace then
   * also holds the offsets b * Lq. */
  int32_t pooled_q_rows;
  /* The score modifier (jf_score_mod above); zero-initialised, none. */
  jf_score_mod score_mod;
  float softcap;             /* JF_SCORE_MOD_SOFTCAP: the cap, finite and > 0; else 0 */
  const float* alibi_slopes; /* JF_SCORE_MOD_ALIBI: [H] fp32, one slope per query head; else NULL */
  /* The block-sparse map (jf_block_mask above); zero-initialised, none. */
  jf_block_mask block_mask;
  /* The table of a modifier that reads one (jf_score_mod above); else NULL and 0. */
  const float* score_mod_table; /* fp32 [H][score_mod_table_width], rows contiguous */
  int32_t score_mod_table_width;
  /* Learnable attention sinks (gpt-oss; FlashAttention-4's learnable_sink): NULL, or fp32 [H], one
   * logit s_h per query head that joins every row's softmax denominator without a value:
   * out_i = sum_j exp(x_ij - m_i) v_j / (exp(s_h - m_i) + sum_j exp(x_ij - m_i)), m_i the max over
   * s_h and the row's visible scores x_ij (after scale and any score modifier; the sink itself is
   * not modified), and lse_i = log(exp(s_h) + sum_j exp(x_ij)). A row that sees no key gets out = 0
   * and lse = s_h. Any mask, modifier, block map, GQA and pooled attention. The backward reads the
   * same sinks and returns their gradient in jf_bwd_args.dlearnable_sink. */
  const float* learnable_sink;
} jf_problem;

typedef struct jf_launch {
  void* workspace; /* device (or host) scratch of at least the queried size */
  size_t workspace_bytes;
  void* stream; /* cudaStream_t; NULL = default stream */
  jf_offsets_check offsets_check;
  jf_backend backend;
  /* Non-zero: `workspace` already holds the schedule an earlier call of the same direction built
   * for the same offsets, shapes, mask and max_seqlen_hint, so it is not built again (saves its
   * kernels). The schedule's tiles follow the kernel variant those choose. Both directions check
   * on the device that the workspace's schedule was built for this call's batch size, q/kv rows
   * and variant; if not, the call writes nothing and jagflash_read_device_error reports it.
   * Offsets changed in place with the same batch size and totals are not detected. */
  int32_t reuse_plan;
  /* 0 = unknown; otherwise an upper bound on every sequence's q and kv length (FlashAttention's
   * max_seqlen). A hint for choosing the forward's kernel variant: it changes speed, never
   * results, and a wrong value is not detected (the kernels serve any length). A call that
   * reuses a plan (reuse_plan) must pass the hint of the call that built it. */
  int32_t max_seqlen_hint;
  /* Backward only. Non-zero: dq, dk and dv are bitwise identical from run to run (the Hopper
   * backward adds the dq partials of a query block in a fixed order). With 0, dk and dv still
   * are; dq may differ in the last bits (fp32 reduce-adds in arrival order). The forward is
   * always deterministic. */
  int32_t deterministic;
  /* Non-zero: the caller vouches that every pointer of the call lives where problem.device says
   * (a binding that takes them from torch tensors of one device knows it), so the call skips its
   * pointer-location queries to the CUDA driver. 0: the call asks the driver, at most once per
   * distinct allocation. */
  int32_t caller_checked_pointers;
} jf_launch;

typedef struct jf_fwd_args {
  jf_problem problem;
  jf_tensor out; /* [total_q, H, Dv], same dtype as q */
  float* lse;    /* [H, total_q]; may be NULL */
  jf_launch launch;
} jf_fwd_args;

typedef struct jf_bwd_args {
  jf_problem problem;
  jf_tensor out;    /* forward output [total_q, H, Dv] */
  jf_tensor dout;   /* gradient of out [total_q, H, Dv] */
  const float* lse; /* [H, total_q] from the forward; required */
  jf_tensor dq;     /* [total_q, H, D] */
  jf_tensor dk;     /* [total_kv, H_kv, D]; with GQA the sum over the group's heads */
  jf_tensor dv;     /* [total_kv, H_kv, Dv], likewise */
  /* With problem.learnable_sink: NULL, or fp32 [H], overwritten with d loss / d s_h (the sum over
   * the head's rows of -exp(s_h - lse_i) * rowsum(dout_i * out_i)); summed in a fixed order, so
   * bitwise repeatable in either mode. Must be NULL without sinks. */
  float* dlearnable_sink;
  jf_launch launch;
} jf_bwd_args;

/* "0.1.0", and 10000*major + 100*minor + patch. */
const char* jagflash_version(void);
int jagflash_version_number(void);

/* Message of the last failed call on this thread ("" after success). */
const char* jagflash_last_error(void);

jf_status jagflash_fwd_workspace_size(const jf_fwd_args* args, size_t* bytes);
jf_status jagflash_fwd(const jf_fwd_args* args);
jf_status jagflash_bwd_workspace_size(const jf_bwd_args* args, size_t* bytes);
jf_status jagflash_bwd(const jf_bwd_args* args);

/* The direction a backend query is about. */
typedef enum jf_direction { JF_DIRECTION_FORWARD = 0, JF_DIRECTION_BACKWARD = 1 } jf_direction;

/* Which backend serves a jagflash_fwd (JF_DIRECTION_FORWARD) or jagflash_bwd call with this
 * problem and launch, on the current CUDA device: launch->backend resolved exactly as the call
 * resolves it (both run the same choice), so a call that returned JF_OK was served by *served.
 *   JF_BACKEND_REFERENCE  CPU pointers (every head dim pair validation accepts).
 *   JF_BACKEND_HOPPER     fast path: compute capability 9.0 (H100, H200, GH200), bf16/fp16,
 *                         head dim up to 256, either direction (with a score modifier
 *                         64/128/256, backward 64/128), in a build with sm_90a.
 *   JF_BACKEND_ORACLE     slow path (fp32 on CUDA cores, correct, one to two orders of magnitude
 *                         slower): every other GPU call at head dim 64/128/256 (v's the
 *                         same as q's, as for the Hopper kernels). On compute capability 9.0 it
 *                         runs from SASS; on any other GPU of compute capability 8.0 or newer
 *                         (A100, L40, B200, ...) from compute_80 PTX the driver compiles on
 *                         first use.
 * Checks `problem` and `launch` as the calls do (not the outputs, the offsets' values, the
 * workspace or the stream; launch->workspace may be NULL) and fails where the call would fail for
 * them: JF_ERR_UNSUPPORTED when no path serves it: on CUDA a v head dim of its own that the Hopper
 * kernels do not take (naming problem.v.head_dim) or a head dim other than 64, 128 or 256 that the Hopper
 * kernels do not take for this call (naming problem.q.head_dim), a dtype/head dim this build does not
 * instantiate, JF_BACKEND_HOPPER where it cannot serve, and a GPU this build has no device code for (older
 * than compute capability 8.0). Reads no device memory and does not sync. */
jf_status jagflash_query_backend(const jf_problem* problem, const jf_launch* launch, jf_direction direction,
                                 jf_backend* served);

/* jagflash_query_backend's answer and the head dim of the kernel that serves the call: on the
 * Hopper kernels the kernel's own (the call's head dim or, padded, the next kernel up: 80 runs the
 * forward and backward of 96, 160 those of 192, 200 those of 256); on the oracle
 * and the reference q's head dim. Fails as jagflash_query_backend does (kernel_head_dim non-NULL
 * too), writing nothing then. */
jf_status jagflash_query_kernel(const jf_problem* problem, const jf_launch* launch, jf_direction direction,
                                jf_backend* served, int32_t* kernel_head_dim);

/* The head dim of the Hopper kernel this build instantiates for a call of this dtype, q head dim,
 * v head dim (0: q's), score modifier and block mask (block_sparse non-zero) in `direction`, into
 * *kernel_head_dim: the one jagflash_query_kernel names on a compute capability 9.0 GPU (the
 * narrowest at or above head_dim), or 0 when the build has none (JAGFLASH_PTX_ONLY, or a build
 * trimmed by JAGFLASH_HOPPER_DTYPES or its head dim lists). What the build holds, asked of no
 * device: a test may ask it before expecting the Hopper kernels. Not pooled. JF_ERR_INVALID_ARGUMENT
 * for a direction, dtype or score modifier that is none of the enums' values. */
jf_status jagflash_hopper_kernel(jf_direction direction, jf_dtype dtype, int32_t head_dim, int32_t v_head_dim,
                                 jf_score_mod score_mod, int32_t block_sparse, int32_t* kernel_head_dim);

/* "auto", "reference", "oracle" or "hopper"; "unknown" for any other value. */
const char* jagflash_backend_name(jf_backend backend);

/* After a JF_CHECK_OFFSETS_DEVICE call or a forward that reused a plan: synchronises `stream`
 * and reads the flag the call left in `workspace`. Returns JF_OK if the call's device checks
 * passed (valid offsets; a plan built for the call), else JF_ERR_INVALID_ARGUMENT with a message
 * saying which check failed (the call then wrote nothing); the failure is then also cleared from
 * the current device's latch (jf_offsets_check), so no later call reports it again. */
jf_status jagflash_read_device_error(const void* workspace, void* stream);

/* "Did an earlier call fail?": synchronises `stream` (NULL = the default stream), then returns
 * JF_ERR_INVALID_ARGUMENT, with the message a later call would give (jf_offsets_check, DEVICE),
 * if a call on the current CUDA device failed its device offsets check and no call has reported
 * it yet; it then counts as reported. JF_OK otherwise, and without a CUDA device. Calls on other
 * streams are covered once they have run (synchronise those streams, or the device, first). */
jf_status jagflash_synchronize(void* stream);

/* The benchmark length distributions (uniform1k, gemskew, pareto, onegiant, short), one generator
 * for every caller. Writes up to `capacity` lengths; *batch_size gets the batch size. Pass
 * lengths = NULL to query the batch size only. */
jf_status jagflash_generate_lengths(const char* distribution, uint64_t seed, int32_t* lengths,
                                    int32_t capacity, int32_t* batch_size);

/* Number of visible (query, key) pairs of one sequence under a mask: FLOP counts use it. Returns
 * -1 (which no count equals) on invalid input: a negative length, an unknown mask, window fields
 * that break jf_mask's rules (JF_MASK_NONE and JF_MASK_CAUSAL take -1, -1; JF_MASK_WINDOW
 * takes values >= -1); jagflash_last_error() then says which. */
int64_t jagflash_visible_pairs(int32_t len_q, int32_t len_kv, jf_mask mask, int32_t window_left,
                               int32_t window_right);

/* Number of CUDA devices this process sees (0 without a GPU or driver). */
int jagflash_cuda_device_count(void);

/* The score modifier named `name` ("none", "softcap", "alibi", ...: src/core/score_mod.hpp's
 * kName) into *kind; JF_ERR_INVALID_ARGUMENT (and *kind untouched) for a name no modifier has. */
jf_status jagflash_score_mod_by_name(const char* name, jf_score_mod* kind);

#ifdef __cplusplus
}
#endif
#endif /* JAGFLASH_JAGFLASH_H */
