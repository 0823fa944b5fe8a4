"""ctypes mirrors of the structs and enums of include/jagflash/jagflash.h.

Field order and types follow the header exactly: ctypes lays the structs out with the platform's C
rules, so a mirror that matches field by field has the same size and offsets
(python/tests/test_capi_layout.py compiles the header and checks this).
"""
import ctypes

# jf_status
OK = 0
ERR_INVALID_ARGUMENT = 1
ERR_UNSUPPORTED = 2
ERR_CUDA = 3
ERR_INTERNAL = 4

# jf_dtype
BF16 = 0
FP16 = 1
FP32 = 2

# jf_device
DEVICE_CPU = 0
DEVICE_CUDA = 1

# jf_mask
MASK_NONE = 0
MASK_CAUSAL = 1
MASK_WINDOW = 2

# jf_score_mod (the kinds after these are known by name: jagflash_score_mod_by_name)
SCORE_MOD_NONE = 0
SCORE_MOD_SOFTCAP = 1
SCORE_MOD_ALIBI = 2

# jf_offsets_check
CHECK_OFFSETS_HOST = 0
CHECK_OFFSETS_DEVICE = 1

# jf_backend
BACKEND_AUTO = 0

# C enums are ints on every ABI jagflash builds for.
c_enum = ctypes.c_int


class Tensor(ctypes.Structure):
    """jf_tensor: a [rows, heads, head_dim] view; element (r, h, d) at r*row_stride + h*head_stride + d."""

    _fields_ = [
        ("data", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
        ("row_stride", ctypes.c_int64),
        ("head_stride", ctypes.c_int64),
    ]


class BlockMask(ctypes.Structure):
    """jf_block_mask: the block-sparse map, every sequence's ceil(Lq/128) x ceil(Lk/128) uint8 map
    (row-major, nonzero = visible) at blocks + offsets[b]; offsets int32 [B+1]; bytes the size of
    the buffer at blocks (offsets[B] <= bytes). NULL, NULL, 0: none."""

    _fields_ = [
        ("blocks", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("bytes", ctypes.c_int64),
    ]


# JF_BLOCK_MASK_BLOCK: tokens per block of a block mask, both sides.
BLOCK_MASK_BLOCK = 128


class Problem(ctypes.Structure):
    """jf_problem: what forward and backward share."""

    _fields_ = [
        ("dtype", c_enum),
        ("device", c_enum),
        ("batch_size", ctypes.c_int32),
        ("q_offsets", ctypes.c_void_p),
        ("kv_offsets", ctypes.c_void_p),
        ("q", Tensor),
        ("k", Tensor),
        ("v", Tensor),
        ("mask", c_enum),
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("scale", ctypes.c_float),
        # 0: ordinary attention; Lq > 0: pooled (q [Lq, H, D] shared by every sequence, q_offsets
        # NULL, out [B*Lq, H, D], lse [H, B*Lq], dq [Lq, H, D] summed over the sequences).
        ("pooled_q_rows", ctypes.c_int32),
        # jf_score_mod: 0 none, 1 softcap (softcap > 0), 2 ALiBi (alibi_slopes: [H] float32).
        ("score_mod", c_enum),
        ("softcap", ctypes.c_float),
        ("alibi_slopes", ctypes.c_void_p),
        # jf_block_mask: zero-initialised, no block mask.
        ("block_mask", BlockMask),
        # The table of a modifier that reads one: float32 [H][score_mod_table_width]; else NULL, 0.
        ("score_mod_table", ctypes.c_void_p),
        ("score_mod_table_width", ctypes.c_int32),
        # Learnable attention sinks: NULL, or float32 [H], one logit per query head that joins
        # every row's softmax denominator without a value.
        ("learnable_sink", ctypes.c_void_p),
    ]


class Launch(ctypes.Structure):
    """jf_launch: workspace, stream and the run-time choices (reuse_plan stays 0: every call
    builds its own schedule in its own workspace)."""

    _fields_ = [
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_size_t),
        ("stream", ctypes.c_void_p),
        ("offsets_check", c_enum),
        ("backend", c_enum),
        ("reuse_plan", ctypes.c_int32),
        ("max_seqlen_hint", ctypes.c_int32),
        ("deterministic", ctypes.c_int32),
        ("caller_checked_pointers", ctypes.c_int32),
    ]


class FwdArgs(ctypes.Structure):
    """jf_fwd_args."""

    _fields_ = [
        ("problem", Problem),
        ("out", Tensor),
        ("lse", ctypes.c_void_p),
        ("launch", Launch),
    ]


class BwdArgs(ctypes.Structure):
    """jf_bwd_args."""

    _fields_ = [
        ("problem", Problem),
        ("out", Tensor),
        ("dout", Tensor),
        ("lse", ctypes.c_void_p),
        ("dq", Tensor),
        ("dk", Tensor),
        ("dv", Tensor),
        # NULL, or float32 [H] overwritten with d loss / d learnable_sink (NULL without sinks).
        ("dlearnable_sink", ctypes.c_void_p),
        ("launch", Launch),
    ]


# (struct, C name) pairs, for the layout test.
STRUCTS = [
    (Tensor, "jf_tensor"),
    (BlockMask, "jf_block_mask"),
    (Problem, "jf_problem"),
    (Launch, "jf_launch"),
    (FwdArgs, "jf_fwd_args"),
    (BwdArgs, "jf_bwd_args"),
]
