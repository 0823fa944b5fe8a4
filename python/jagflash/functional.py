"""The user-facing attention functions: argument conventions in, torch.ops.jagflash.fwd out; and
jagflash.backend, which path would serve one of them."""
import ctypes
import numbers
import re
from typing import Any, Iterable, Literal, Optional, Tuple, Union, overload

import torch
from torch import Tensor

from . import _backend, _capi, _launch, _lib, _offsets_check, ops
from ._errors import InvalidArgumentError, JagflashError, invalid_argument, reworded, unsupported
from .block_mask import BlockMask
from ._mask import mask_args
from ._offsets_check import CheckOffsets
from ._problem import Problem

# jagged_attention's default window: the call that passes none skips mask_args' checks.
_NO_WINDOW = (-1, -1)
_STRIDED = torch.strided


def _what(value: object) -> str:
    """How an error names a value that is not a usable tensor."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            return f"a nested tensor of layout {value.layout}"
        if value.layout is not _STRIDED:
            return f"a tensor of layout {value.layout}"
        if value.is_meta:
            return "a meta tensor"
    return type(value).__name__


def _check_tensor(name: str, t: object, expected: str = "a [tokens, heads, head_dim] tensor",
                  nested_hint: str = "for torch.nested jagged tensors call jagflash.attention") -> None:
    """What every tensor argument must be before anything reads it: a torch.Tensor (subclasses
    that trace, such as FakeTensor, included), dense (strided) and with data (not meta). None, a
    list, a nested or sparse tensor would otherwise fail deep inside torch's dispatcher, in its
    terms (AttributeError, NotImplementedError: jagflash.fwd.default)."""
    if isinstance(t, torch.Tensor) and not t.is_nested and t.layout is _STRIDED and not t.is_meta:
        return
    if isinstance(t, torch.Tensor) and t.is_nested:
        expected = f"{expected} ({nested_hint})"
    elif isinstance(t, torch.Tensor) and t.is_meta:
        expected = f"{expected} on the CPU or a CUDA device"
    elif isinstance(t, torch.Tensor):
        expected = f"{expected}, dense (layout torch.strided)"
    raise invalid_argument(name, expected, _what(t))


def _check_plain(*named: Tuple[str, object]) -> None:
    """_check_tensor on each (name, tensor); a plain tensor passes at the cost of a type check and two
    attribute reads."""
    for name, t in named:
        if type(t) is not Tensor or t.layout is not _STRIDED or t.is_meta:
            _check_tensor(name, t)


def _offsets(name: str, offsets: object) -> Tensor:
    """int32 or int64 [B+1] on the tensors' device -> int32, with no host sync. Checked as given
    (dtype, shape), so an error names what the caller passed, not the converted tensor."""
    expected = "an int32 or int64 tensor of B+1 offsets"
    if not isinstance(offsets, torch.Tensor) or offsets.is_nested or offsets.layout is not _STRIDED or \
            offsets.is_meta:
        raise invalid_argument(name, expected, _what(offsets))
    if offsets.dtype not in (torch.int32, torch.int64):
        raise invalid_argument(name, expected, offsets.dtype)
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise invalid_argument(name, "an int32 or int64 vector of B+1 >= 1 offsets",
                               f"{offsets.dtype} of shape {tuple(offsets.shape)}")
    if offsets.dtype == torch.int32:
        return offsets  # the binding copies non-contiguous offsets
    # The cast wraps: 2^32 + 4 would become 4, in offsets that may well pass every check. A value
    # the cast changes becomes -1 instead, which no valid offsets hold (they start at 0 and never
    # decrease), so the offsets check rejects the call, on the host or on the device, with no sync
    # here; _out_of_int32 then names the value given. Two small kernels more than the cast: int32
    # offsets skip them.
    narrowed = offsets.to(torch.int32)
    return torch.where(narrowed != offsets, -1, narrowed)


def _out_of_int32(named_offsets: Iterable[Tuple[str, Optional[Tensor]]]) -> Optional[InvalidArgumentError]:
    """An InvalidArgumentError for the first int64 offset that int32 cannot hold, or None. Reads
    the offsets on the host: called on the error path only."""
    for name, offsets in named_offsets:
        if not isinstance(offsets, torch.Tensor) or offsets.dtype != torch.int64:
            continue
        bad = (offsets.to(torch.int32) != offsets).nonzero()
        if bad.numel():
            index = int(bad[0, 0])
            return invalid_argument(f"{name}[{index}]", "an offset that fits int32", offsets[index].item())
    return None


# The C API holds the scale as a float32 and reads 0 as "1/sqrt(D)". A magnitude at or below
# 2^-150 (half the smallest subnormal; the tie rounds to even, 0) becomes 0 there, so 1e-50 would
# silently be the default; one at or above 2^128 - 2^103 (halfway from the largest float32 to 2^128)
# becomes infinity. Compared here in float64, without a float32 conversion: torch.compile traces
# this function, and plain comparisons are what it folds.
_SCALE_ROUNDS_TO_ZERO = 2.0**-150
_SCALE_ROUNDS_TO_INF = 2.0**128 - 2.0**103


def _scale(scale: Optional[float]) -> float:
    """The C API's scale: None -> 0 (its marker for 1/sqrt(D)); anything else a real number (not a
    bool, string or complex) that is finite and non-zero once float32, else InvalidArgumentError
    naming the value given."""
    if scale is None:
        return 0.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise invalid_argument("scale", "a real number, or None for 1/sqrt(head_dim)", repr(scale))
    value = float(scale)
    if not _SCALE_ROUNDS_TO_ZERO < abs(value) < _SCALE_ROUNDS_TO_INF:  # NaN fails too
        raise invalid_argument("scale", "a number that is finite and non-zero in float32 (the kernels' precision), "
                               "or None for 1/sqrt(head_dim)", repr(scale))
    return value


# The C library's names for jagged_attention's arguments -> the caller's: q.shape[-1], not
# problem.q.head_dim. Not applied to the report of an earlier call's failed device check
# (_EARLIER): that one reaches whichever call comes next (any entry point, jagflash.synchronize), so
# it keeps the library's words, the same everywhere.
_EARLIER = "an earlier jagflash call"
_C_TERMS = (
    (r"\bproblem\.([qkv])\.rows\b", r"\1.shape[0]"),
    (r"\bproblem\.([qkv])\.heads\b", r"\1.shape[1]"),
    (r"\bproblem\.([qkv])\.head_dim\b", r"\1.shape[-1]"),
    (r"\bproblem\.([qkv])\.row_stride\b", r"\1.stride(0)"),
    (r"\bproblem\.([qkv])\.head_stride\b", r"\1.stride(1)"),
    (r"\bproblem\.([qkv])\.data\b", r"\1.data_ptr()"),
    (r"\bproblem\.(q_offsets|kv_offsets)\b", r"\1"),
    (r"\bproblem\.scale\b", "scale"),
    (r"\bproblem\.alibi_slopes\b", "alibi_slopes"),
    (r"\bproblem\.score_mod_table\[(\d+)\]\[(\d+)\]", r"score_mod_table[\1, \2]"),
    (r"\bproblem\.score_mod_table_width\b", "score_mod_table.shape[1]"),
    (r"\bproblem\.score_mod_table\b", "score_mod_table"),
    (r"\bproblem\.block_mask\.(blocks|offsets)\b", r"block_mask.\1"),
    (r"\bproblem\.block_mask\.bytes\b", "block_mask.blocks.numel()"),
    (r"\bproblem\.learnable_sink\b", "learnable_sink"),
    (r"\bproblem\.window_left\b", "window[0]"),
    (r"\bproblem\.window_right\b", "window[1]"),
    # Inside a message: "a divisor of q.heads (4)".
    (r"(?<![\w.])([qkv])\.rows\b", r"\1.shape[0]"),
    (r"(?<![\w.])([qkv])\.heads\b", r"\1.shape[1]"),
)
# The one check a call without kv_offsets fails on kv's side: k's rows against q's offsets, which
# the C library knows only as kv_offsets.
_KV_TOTAL = re.compile(r"^problem\.kv_offsets\[B=(\d+)\]: expected the token count (-?\d+), got (-?\d+)$")


def _in_caller_terms(error: JagflashError, named_offsets: Iterable[Tuple[str, object]],
                     kv_offsets_given: bool = True) -> JagflashError:
    """A failed call's error as the caller would put it: an int64 offset past int32 named with the
    value given (not the -1 _offsets put there), the C library's names in Python's, and, when the
    caller passed no kv_offsets, k's row count against q's offsets said as such. Error path only
    (_out_of_int32 reads the offsets on the host)."""
    if isinstance(error, InvalidArgumentError):
        cause = _out_of_int32(named_offsets)  # type: ignore[arg-type]  # non-tensors are skipped
        if cause is not None:
            return cause
    if str(error).startswith(_EARLIER):
        return error
    found = None if kv_offsets_given else _KV_TOTAL.match(str(error))
    if found is not None:
        batch, k_rows, q_total = found.groups()
        return invalid_argument("k.shape[0]", f"{q_total} rows, q_offsets[B={batch}] (kv_offsets=None: q's offsets "
                                              f"serve k and v too; pass kv_offsets for other lengths)", k_rows)
    return reworded(error, _C_TERMS)


def _block_mask_tensors(block_mask: object, q: Tensor, q_offsets: Tensor) -> Tuple[Tensor, Tensor]:
    """(blocks, offsets) of a jagflash.BlockMask, checked against the call before anything runs
    (B+1 offsets as q_offsets, q's device); the C library checks the offsets' values."""
    if not isinstance(block_mask, BlockMask):
        raise invalid_argument("block_mask", "a jagflash.BlockMask or None", type(block_mask).__name__)
    blocks, offsets = block_mask.blocks, block_mask.offsets
    if blocks.device != q.device:
        raise invalid_argument("block_mask.device", f"{q.device} (q's device; BlockMask.to moves it)", blocks.device)
    if offsets.numel() != q_offsets.numel():
        raise invalid_argument("block_mask", f"a map for B = {q_offsets.numel() - 1} sequences (as q_offsets)",
                               f"one for {offsets.numel() - 1}")
    return blocks, offsets


_SOFTCAP_EXPECTED = "a finite number > 0 that stays finite and non-zero in float32, or None for no softcap"


def _softcap(softcap: Optional[float]) -> float:
    """The C API's softcap: None -> 0 (none); anything else a real number (not a bool or string)
    > 0 that float32 (the C API's field) holds as a finite non-zero number, named as given: 1e-50
    would become 0 there (none) and 1e39 infinity (_launch.check_score_mod checks the rest: one
    modifier)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise invalid_argument("softcap", _SOFTCAP_EXPECTED, repr(softcap))
    value = float(softcap)
    if not _SCALE_ROUNDS_TO_ZERO < value < _SCALE_ROUNDS_TO_INF:  # 0, negatives and NaN fail too
        raise invalid_argument("softcap", _SOFTCAP_EXPECTED, repr(softcap))
    return value


_TABLE_KINDS = {}  # name -> jf_score_mod, asked of the C library once per name


def score_mod_kind(name: str) -> int:
    """The jf_score_mod of the score modifier `name` (src/core/score_mod.hpp's names: "softcap",
    "alibi", and the modifiers with a table after them), from the C library; InvalidArgumentError
    listing the names for one that no modifier has."""
    if not isinstance(name, str):
        raise invalid_argument("score_mod", "a score modifier's name (a str)", type(name).__name__)
    kind = _TABLE_KINDS.get(name)
    if kind is None:
        value = ctypes.c_int(0)
        if _lib.lib().jagflash_score_mod_by_name(name.encode(), ctypes.byref(value)) != _capi.OK:
            message = _lib.lib().jagflash_last_error().decode()
            raise invalid_argument("score_mod", message.split("expected ", 1)[-1].split(", got")[0], repr(name))
        kind = _TABLE_KINDS[name] = value.value
    return kind


def _table_score_mod(score_mod: Optional[str], score_mod_table: Optional[Tensor]) -> int:
    """The C API's kind of a modifier with a table: None (and no table) -> 0; softcap and ALiBi have
    arguments of their own."""
    if score_mod is None:
        if score_mod_table is not None:
            raise invalid_argument("score_mod", "the name of the modifier that reads score_mod_table", "None")
        return 0
    kind = score_mod_kind(score_mod)
    ops.refuse_modifier_gradient(None, score_mod_table)
    if kind <= _capi.SCORE_MOD_ALIBI:
        raise invalid_argument("score_mod", "the name of a modifier with a table (softcap= and alibi_slopes= "
                               "give those two; None for none)", repr(score_mod))
    return kind


# learnable_sink's expected value before the heads are known (_launch.check_learnable_sink names them).
_SINK_EXPECTED = "a float32, bfloat16 or float16 tensor of shape (H,) (one logit per query head)"


def _check_sink(learnable_sink: object) -> None:
    """learnable_sink None or a dense tensor with data, before anything reads it (its dtype, shape
    and device: _launch.check_learnable_sink, where the call runs)."""
    if learnable_sink is not None:
        _check_tensor("learnable_sink", learnable_sink, _SINK_EXPECTED)


def _check_return_lse(return_lse: object) -> None:
    """return_lse as given: True or False only (a truthy "no" is not taken as yes)."""
    if return_lse is not True and return_lse is not False:
        raise invalid_argument("return_lse", "True or False", repr(return_lse))


def _deterministic(deterministic: Optional[bool]) -> bool:
    """None follows torch's switch (torch.use_deterministic_algorithms), like torch's own ops."""
    if deterministic is None:
        return torch.are_deterministic_algorithms_enabled()
    if not isinstance(deterministic, bool):
        raise invalid_argument("deterministic", "None, True or False", repr(deterministic))
    return deterministic


def _max_seqlen_hint(max_seqlen_q: Optional[int], max_seqlen_kv: Optional[int]) -> int:
    """The C API's max_seqlen_hint: the larger bound when both are given, else 0 (unknown)."""
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_kv", max_seqlen_kv)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31):
            raise invalid_argument(name, "None or an int in [0, 2^31)", repr(value))
    if max_seqlen_q is None or max_seqlen_kv is None:
        return 0
    return max(max_seqlen_q, max_seqlen_kv)


@overload
def jagged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Optional[Tensor] = None,
    *,
    causal: bool = False,
    window: Tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    return_lse: Literal[False] = False,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    check_offsets: Optional[CheckOffsets] = None,
    deterministic: Optional[bool] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    block_mask: Optional[BlockMask] = None,
    score_mod: Optional[str] = None,
    score_mod_table: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
) -> Tensor: ...


@overload
def jagged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Optional[Tensor] = None,
    *,
    causal: bool = False,
    window: Tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    return_lse: Literal[True],
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    check_offsets: Optional[CheckOffsets] = None,
    deterministic: Optional[bool] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    block_mask: Optional[BlockMask] = None,
    score_mod: Optional[str] = None,
    score_mod_table: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]: ...


@overload
def jagged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Optional[Tensor] = None,
    *,
    causal: bool = False,
    window: Tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    return_lse: bool = False,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    check_offsets: Optional[CheckOffsets] = None,
    deterministic: Optional[bool] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    block_mask: Optional[BlockMask] = None,
    score_mod: Optional[str] = None,
    score_mod_table: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]: ...


def jagged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Optional[Tensor] = None,
    *,
    causal: bool = False,
    window: Tuple[int, int] = _NO_WINDOW,
    scale: Optional[float] = None,
    return_lse: bool = False,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_kv: Optional[int] = None,
    check_offsets: Optional[CheckOffsets] = None,
    deterministic: Optional[bool] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    block_mask: Optional[BlockMask] = None,
    score_mod: Optional[str] = None,
    score_mod_table: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Attention over a jagged (packed) batch; differentiable in q, k, v (and learnable_sink).

    q: [total_q, H, D]; k: [total_kv, H_kv, D]; v: [total_kv, H_kv, Dv] with H % H_kv == 0
    (GQA/MQA); bf16 or fp16 (fp32 also accepted). Returns out [total_q, H, Dv]. Head dims: on CPU
    tensors D any multiple of 8 from 8 to 256 and Dv one up to D (DeepSeek's 192 / 128); on CUDA
    tensors D = 64, 128 or 256 with Dv = D, or any other such D, or Dv < D, on the Hopper kernels
    (bf16/fp16, no score modifier, no block mask, either direction; Dv < D not pooled): others
    raise UnsupportedError naming q.shape[-1] or v.shape[-1] (jagflash.backend says the same).
    Rows may be strided (slices of a fused QKV); the head dim is made contiguous when it is not.
    q_offsets, kv_offsets: int32 or int64 [B+1] on the tensors' device, offsets[0] == 0,
    non-decreasing, last == total, every value within int32; kv_offsets=None means q's.
    causal / window: FlashAttention's convention, bottom-right aligned when Lq != Lk: query i of a
    sequence sees key j when i + Lk - Lq - left <= j <= i + Lk - Lq + right, -1 unbounded; causal
    is (-1, 0) and may be combined with a left window. A row that sees no key gives 0 (lse -inf,
    as FlexAttention's; flash_attn_varlen_func gives FA2's +inf) and zero gradients.
    scale: defaults to 1/sqrt(D) (q's head dim); else a real number that stays finite and non-zero in float32
    (the kernels' precision): one that float32 rounds to 0 or infinity (1e-50, 1e39) is refused.
    return_lse: also return lse [H, total_q] float32 (natural log; not differentiable).
    max_seqlen_q / max_seqlen_kv: optional, as in FlashAttention: upper bounds on the q and kv
    lengths (max_seqlen_kv defaults to max_seqlen_q when kv_offsets is None). jagflash needs no
    host-side maximum; when both are known they are a hint for the choice of forward kernel
    (batches of short sequences get 64-row tiles). A hint changes speed, never results, and
    is not checked against the offsets.
    check_offsets: "auto" | "host" | "device", None for the module setting (see
    jagflash.set_check_offsets).
    deterministic: True makes the backward's dq bitwise identical from run to run too (dk, dv
    and the forward always are); None follows torch.are_deterministic_algorithms_enabled() when
    the forward is called (in a compiled graph: when it is traced).
    softcap: None for none, else a tanh softcap (Gemma 2, Grok) on the scaled score s:
    softcap * tanh(s / softcap), a number > 0 that stays finite and non-zero in float32 (as scale).
    alibi_slopes: None, or ALiBi's float32 [H] (one slope per query head, on q's device; not
    differentiable: slopes that require grad are refused, as a table that does): s - slope_h * |i + Lk - Lq - j| for query i, key j of a sequence (FlashAttention-2's
    bias, bottom-right aligned like the masks). One modifier at a time; on CUDA the Hopper kernels
    serve both at head dims 64 and 128 (forward also 256), the GPU oracle the rest.
    score_mod, score_mod_table: None, or the name of a score modifier that reads a table (the C
    library's, src/core/score_mod.hpp: e.g. "relative_bias") and that table, float32 [H, W] on q's
    device, as the modifier defines it (not differentiable: a table that requires grad is refused).
    block_mask: None, or a jagflash.BlockMask for this batch (on q's device): query i of sequence b
    sees key j when the mask (causal, window) lets it AND block (i // 128, j // 128) of b's map is
    visible (blocks counted from the sequence's first query and key; see jagflash.BlockMask for
    the constructors). Not differentiable; the backward uses the same map. On CUDA the Hopper
    kernels serve it at head dims 64 and 128 without a score modifier, the GPU oracle at 256 and
    with one.
    learnable_sink: None, or attention sinks (gpt-oss; FlashAttention-4's learnable_sink): one logit
    s_h per query head, a tensor of shape (H,) on q's device, float32, bfloat16 or float16 (read as
    float32). s_h joins every row's softmax denominator without a value: out_i = sum_j
    exp(x_ij) v_j / (exp(s_h) + sum_j exp(x_ij)), x_ij the visible scores after scale and any score
    modifier (the sink itself is not modified), and lse_i = log(exp(s_h) + sum_j exp(x_ij)); a row
    that sees no key gives out 0 and lse s_h. Differentiable: when it requires grad it gets its
    gradient (in its dtype), sum_i -exp(s_h - lse_i) * (dout_i . out_i) over the head's rows. Any
    mask, window, score modifier and block mask.
    CUDA tensors run the GPU path, CPU tensors the C++ float64 reference.
    Errors: InvalidArgumentError (a ValueError) or UnsupportedError naming the argument in these
    terms (q.shape[-1], kv_offsets[B=2], scale); q, k, v and the offsets are checked to be dense
    tensors with data (not None, nested, sparse or meta) before anything else.
    """
    # Plain tensors pass in two attribute reads each; anything else is named before it is used.
    _check_plain(("q", q), ("k", k), ("v", v))
    if return_lse is not False:
        _check_return_lse(return_lse)
    # The defaults take no checks (a few hundred ns a call: the eager call's host time counts).
    if max_seqlen_q is None and max_seqlen_kv is None:
        hint = 0
    else:
        hint = _max_seqlen_hint(max_seqlen_q,
                                max_seqlen_q if kv_offsets is None and max_seqlen_kv is None else max_seqlen_kv)
    if window is _NO_WINDOW and type(causal) is bool:
        mask, window_left, window_right = (_capi.MASK_CAUSAL if causal else _capi.MASK_NONE), -1, -1
    else:
        mask, window_left, window_right = mask_args(causal, window)
    # Dense int32 tensors as they are (the common case, without _offsets' call and checks).
    q_offsets_i32 = q_offsets if type(q_offsets) is Tensor and q_offsets.dtype is torch.int32 and \
        q_offsets.layout is _STRIDED and not q_offsets.is_meta else _offsets("q_offsets", q_offsets)
    if kv_offsets is None:
        kv_offsets_i32 = q_offsets_i32
    elif type(kv_offsets) is Tensor and kv_offsets.dtype is torch.int32 and kv_offsets.layout is _STRIDED and \
            not kv_offsets.is_meta:
        kv_offsets_i32 = kv_offsets
    else:
        kv_offsets_i32 = _offsets("kv_offsets", kv_offsets)
    cap = _softcap(softcap)
    if alibi_slopes is not None:
        ops.refuse_modifier_gradient(alibi_slopes, None)
    blocks, block_offsets = (None, None) if block_mask is None else _block_mask_tensors(block_mask, q, q_offsets_i32)
    table_kind = 0 if score_mod is None and score_mod_table is None else _table_score_mod(score_mod, score_mod_table)
    _check_sink(learnable_sink)
    # Positional, in Problem's field order (fixed: it is the custom ops' public argument order):
    # naming every field would add about 1 us to each eager call's host time.
    problem = Problem(q, k, v, q_offsets_i32, kv_offsets_i32, mask, window_left, window_right, _scale(scale),
                      _offsets_check.resolve(check_offsets), hint, _deterministic(deterministic), cap, alibi_slopes,
                      blocks, block_offsets, table_kind, score_mod_table, learnable_sink)
    try:
        # q, k, v and the sinks only: the binding refuses offsets on another device (check_inputs words it).
        if ops.eager_fast_path_allowed(q, k, v) and (learnable_sink is None or
                                                    ops.eager_fast_path_allowed(learnable_sink)):
            if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or
                                            (learnable_sink is not None and learnable_sink.requires_grad)):
                out, lse = ops.eager_attention(problem)
            else:
                # Nothing to differentiate: the binding's op alone (no autograd node to build).
                out, lse = _launch.forward(problem)
        else:
            out, lse = ops.fwd(*problem.op_args())
    except JagflashError as error:
        raise _in_caller_terms(error, (("q_offsets", q_offsets), ("kv_offsets", kv_offsets)),
                               kv_offsets_given=kv_offsets is not None) from None
    return (out, lse) if return_lse else out


def _offsets_of(t: Any) -> Tensor:
    """offsets() of a jagged nested tensor: a method of torch's nested-tensor subclass, which the
    public type (Tensor) does not declare."""
    return t.offsets()


def _jagged_values(name: str, t: Any) -> Tensor:
    """The packed [total, H, D] values of a (B, j, H, D) jagged nested tensor."""
    if not (isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged):
        raise invalid_argument(name, "a torch.nested tensor with layout=torch.jagged", _what(t))
    ragged_dim = getattr(t, "_ragged_idx", 1)
    if t.dim() != 4 or ragged_dim != 1:
        raise invalid_argument(name, "shape (B, j, H, D), ragged in dim 1", f"{t.dim()}-D, ragged in dim {ragged_dim}")
    nested: Any = t  # lengths(): a method of the nested-tensor subclass, as offsets() (above)
    if nested.lengths() is not None:
        raise invalid_argument(name, "a packed nested tensor (no holes: call .contiguous())", "one with lengths")
    return t.values()


def _kv_offsets(k: Tensor, v: Tensor) -> Tensor:
    """k's offsets, checked against v's without a host sync: v's must be the same, and where a
    value differs the offsets passed on hold -1, which fails the offsets check (see _offsets)."""
    k_offsets, v_offsets = _offsets_of(k), _offsets_of(v)
    # v on another device is reported by the checks of the values.
    if v_offsets is k_offsets or v_offsets.device != k_offsets.device:
        return k_offsets
    if v_offsets.shape != k_offsets.shape:
        raise invalid_argument("v", f"B = {k.size(0)} sequences (as k)", v.size(0))
    return torch.where(v_offsets == k_offsets, k_offsets, -1)


def _v_offsets_differ(k: Tensor, v: Tensor) -> Optional[InvalidArgumentError]:
    """An InvalidArgumentError if v's offsets are not k's, or None. Reads both on the host: called
    on the error path only."""
    k_offsets, v_offsets = _offsets_of(k), _offsets_of(v)
    if v_offsets.device != k_offsets.device:
        return None
    differ = (k_offsets != v_offsets).nonzero()
    if not differ.numel():
        return None
    index = int(differ[0, 0])
    return invalid_argument(f"v.offsets()[{index}]", f"k's offset {k_offsets[index].item()} (v must have k's lengths)",
                            v_offsets[index].item())


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: Tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    check_offsets: Optional[CheckOffsets] = None,
    deterministic: Optional[bool] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    block_mask: Optional[BlockMask] = None,
    score_mod: Optional[str] = None,
    score_mod_table: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
) -> Tensor:
    """jagged_attention on torch.nested jagged tensors shaped (B, j, H, D) (v: (B, j, H_kv, Dv),
    head dims as in jagged_attention).

    k and v must have the same offsets (lengths); q the same batch size. Returns a nested tensor
    (B, j, H, Dv) with q's offsets (so it adds to q when Dv = D). Masks, scale, check_offsets, deterministic, softcap,
    alibi_slopes, block_mask (built for q's and k's offsets), score_mod, score_mod_table and
    learnable_sink as in jagged_attention.
    """
    q_values, k_values, v_values = _jagged_values("q", q), _jagged_values("k", k), _jagged_values("v", v)
    if _offsets_of(k).shape != _offsets_of(q).shape:
        raise invalid_argument("k", f"B = {q.size(0)} sequences (as q)", k.size(0))
    kv_offsets = _kv_offsets(k, v)
    try:
        out = jagged_attention(q_values, k_values, v_values, _offsets_of(q), kv_offsets, causal=causal, window=window,
                               scale=scale, check_offsets=check_offsets, deterministic=deterministic,
                               softcap=softcap, alibi_slopes=alibi_slopes, block_mask=block_mask,
                               score_mod=score_mod, score_mod_table=score_mod_table, learnable_sink=learnable_sink)
    except InvalidArgumentError as error:
        cause = _v_offsets_differ(k, v)
        if cause is None:
            raise reworded(error, _NESTED_TERMS) from None
        raise cause from error
    except JagflashError as error:
        raise reworded(error, _NESTED_TERMS) from None
    return _nested_like_q(out, _offsets_of(q))


# jagged_attention's words for the packed values -> the (B, j, H, D) nested tensors': heads are
# dim 2 there, the packed rows those of values(), the offsets those of offsets().
_NESTED_TERMS = (
    (r"\b([qkv])\.shape\[1\]", r"\1.shape[2]"),
    (r"\b([qkv])\.shape\[0\]", r"\1.values().shape[0]"),
    (r"\bq_offsets\b", "q.offsets()"),
    (r"\bkv_offsets\b", "k.offsets()"),
)


def _nested_like_q(values: Tensor, offsets: Tensor) -> Tensor:
    """The (B, j, H, D) jagged nested view of values with q's offsets (so it adds to q).
    torch.nested.nested_tensor_from_jagged's first call asks torch.fx whether it is tracing, which
    logs torch's "is_fx_tracing will return true ..." deprecation warning into the caller's output;
    the view it then builds is made here directly (torch 2.11's
    torch.nested._internal.nested_tensor.nested_view_from_values_offsets, the function it calls).
    A torch without that function gets the public call."""
    if _nested_view is None:
        return torch.nested.nested_tensor_from_jagged(values, offsets)
    return _nested_view(values, offsets)


try:
    from torch.nested._internal.nested_tensor import nested_view_from_values_offsets as _nested_view
except ImportError:  # pragma: no cover - a torch that moved it
    _nested_view = None


def pooled_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_offsets: Optional[Tensor] = None,
    *,
    window: Tuple[int, int] = (-1, -1),
    scale: Optional[float] = None,
    return_lse: bool = False,
    check_offsets: Optional[CheckOffsets] = None,
    deterministic: Optional[bool] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[Tensor] = None,
    block_mask: Optional[BlockMask] = None,
    score_mod: Optional[str] = None,
    score_mod_table: Optional[Tensor] = None,
    learnable_sink: Optional[Tensor] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """Pooled attention (Pooling by Multihead Attention): one query set attends over every sequence
    of a jagged batch; differentiable in q, k, v (and learnable_sink).

    q: [Lq, H, D], shared by all B sequences (no need to repeat it B times); k, v: [total_kv, H_kv,
    D] with H % H_kv == 0 (GQA/MQA) and kv_offsets int32 or int64 [B+1] on their device, or k and v
    as torch.nested jagged tensors (B, j, H_kv, D) with kv_offsets None (their offsets are used).
    Returns out [B*Lq, H, Dv] (Dv: v's head dim, as in jagged_attention), sequence b's rows at b*Lq
    ([B, Lq, H, Dv] for nested k, v), and with
    return_lse also lse [H, B*Lq] float32 (natural log; not differentiable). A sequence of length 0
    gives out = 0, lse = -inf (learnable_sink's s_h with sinks) and no gradient. The gradient of q
    is the sum over the sequences.
    window: (left, right) on the keys, -1 unbounded, bottom-right aligned per sequence as in
    jagged_attention with Lq queries against the sequence's length. scale: defaults to 1/sqrt(D)
    (other values as in jagged_attention).
    check_offsets, deterministic, softcap, alibi_slopes, score_mod, score_mod_table and
    learnable_sink as in jagged_attention (positions, as ALiBi's, with Lq
    queries against the sequence's length, bottom-right aligned). block_mask: None only (the C
    library serves no block-sparse map in pooled attention; a map raises UnsupportedError rather
    than being ignored). CUDA tensors run the GPU path (the Hopper kernels where they serve the
    call, as jagged_attention's), CPU tensors the C++ float64 reference.
    """
    if block_mask is not None:
        raise unsupported("block_mask", "None (pooled attention takes no block-sparse map; jagged_attention with "
                          "the query set repeated per sequence does)", type(block_mask).__name__)
    _check_tensor("q", q, "a query set [Lq, H, D] shared by every sequence",
                  "pooled q is one plain tensor; k and v may be nested")
    _check_return_lse(return_lse)
    nested = isinstance(k, torch.Tensor) and k.is_nested
    if not nested:
        _check_plain(("k", k), ("v", v))
    if nested:
        if kv_offsets is not None:
            raise invalid_argument("kv_offsets", "None when k and v are nested tensors (their offsets are used)",
                                   type(kv_offsets).__name__)
        k_values, v_values = _jagged_values("k", k), _jagged_values("v", v)
        kv_offsets_i32 = _offsets("kv_offsets", _kv_offsets(k, v))
    else:
        if kv_offsets is None:
            raise invalid_argument("kv_offsets", "an int32 or int64 tensor of B+1 offsets (or k, v as nested tensors)",
                                   "None")
        k_values, v_values = k, v
        kv_offsets_i32 = _offsets("kv_offsets", kv_offsets)
    mask, window_left, window_right = mask_args(False, window)
    if alibi_slopes is not None:
        ops.refuse_modifier_gradient(alibi_slopes, None)
    _check_sink(learnable_sink)
    try:
        problem = Problem(q=q, k=k_values, v=v_values, q_offsets=None, kv_offsets=kv_offsets_i32, mask=mask,
                          window_left=window_left, window_right=window_right, scale=_scale(scale),
                          check_offsets=_offsets_check.resolve(check_offsets),
                          deterministic=_deterministic(deterministic), softcap=_softcap(softcap),
                          alibi_slopes=alibi_slopes, score_mod=_table_score_mod(score_mod, score_mod_table),
                          score_mod_table=score_mod_table, learnable_sink=learnable_sink)
        out, lse = ops.pooled_fwd(*problem.op_args(pooled=True))
    except InvalidArgumentError as error:
        cause = _v_offsets_differ(k, v) if nested else None
        if cause is None:
            raise _in_caller_terms(error, (("kv_offsets", kv_offsets),)) from None
        raise cause from error
    except JagflashError as error:
        raise _in_caller_terms(error, ()) from None
    if nested:
        out = out.unflatten(0, (k.size(0), q.shape[0]))
    return (out, lse) if return_lse else out


def backend(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Optional[Tensor] = None, *,
            backward: bool = False, softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
            block_mask: Optional[BlockMask] = None, score_mod: Optional[str] = None,
            score_mod_table: Optional[Tensor] = None,
            learnable_sink: Optional[Tensor] = None) -> "_backend.Backend":
    """Which path serves jagged_attention on these tensors ("hopper", "oracle" or "reference"), or
    its backward with backward=True, on the tensors' device. The mask, scale and the other options
    do not change it. Reads no tensor data and does not sync; raises where the call would raise
    for the tensors' dtype, shapes, device or head dim (UnsupportedError when no path serves the
    head dims on that device for this call: on CUDA a v head dim of its own off the Hopper kernels,
    or one other than 64, 128 or 256 that the Hopper kernels do not take: fp32, a score modifier
    or a block mask). block_mask: the call's jagflash.BlockMask, which the choice depends on (its
    values are not read); learnable_sink: the call's sinks, checked as the call checks them. The
    answer is a str with one attribute more, kernel_head_dim: the head dim of the kernel that
    serves the call (on the Hopper kernels the narrowest at or above q's, per direction: D = 80
    runs the forward and the backward of 96, D = 160 those of 192, D = 200 those of 256;
    elsewhere q's own)."""
    if not isinstance(backward, bool):
        raise invalid_argument("backward", "True or False", repr(backward))
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    q_offsets = _offsets("q_offsets", q_offsets)
    kv_offsets = q_offsets if kv_offsets is None else _offsets("kv_offsets", kv_offsets)
    _launch.check_inputs(q, k, v, q_offsets, kv_offsets)
    cap = _softcap(softcap)
    blocks, block_offsets = (None, None) if block_mask is None else _block_mask_tensors(block_mask, q, q_offsets)
    table_kind = _table_score_mod(score_mod, score_mod_table)
    _check_sink(learnable_sink)
    problem = Problem(q=q, k=k, v=v, q_offsets=q_offsets, kv_offsets=kv_offsets, mask=_capi.MASK_NONE, window_left=-1,
                      window_right=-1, scale=0.0, check_offsets="auto", softcap=cap, alibi_slopes=alibi_slopes,
                      block_mask_blocks=blocks, block_mask_offsets=block_offsets, score_mod=table_kind,
                      score_mod_table=score_mod_table, learnable_sink=learnable_sink)
    _launch.check_head_dims(q, k, v, backward=backward, modified=problem.modified, blocked=blocks is not None)
    _launch.check_score_mod(q, cap, alibi_slopes, table_kind, score_mod_table)
    _launch.check_learnable_sink(q, learnable_sink)
    problem = problem._replace(q=_launch._prepared(q), k=_launch._prepared(k), v=_launch._prepared(v),
                               learnable_sink=None if learnable_sink is None else _launch.float32_sink(learnable_sink))
    launch = _capi.Launch(backend=_capi.BACKEND_AUTO)
    direction = _backend.DIRECTION_BACKWARD if backward else _backend.DIRECTION_FORWARD
    try:
        with _launch._device_guard(q.device):
            served, kernel_head_dim = _backend.query_kernel(_launch.describe(problem), launch, direction)
    except JagflashError as error:
        raise _in_caller_terms(error, ()) from None
    return _backend.Backend(_backend.name(served), kernel_head_dim)
