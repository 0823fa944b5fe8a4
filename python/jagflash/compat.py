"""FlashAttention's varlen entry point, so code written for flash_attn changes its import only:

    from jagflash import flash_attn_varlen_func   # was: from flash_attn import flash_attn_varlen_func

Signature, argument names and defaults are FlashAttention-2's (flash_attn 2.x,
flash_attn_varlen_func), and so is the return convention: the output tensor alone.

Why FA2's convention rather than FA3's: the two differ only when return_attn_probs=True. FA2 then
returns (out, softmax_lse, S_dmask); FA3 returns (out, softmax_lse). A caller of this signature
(FA2's: dropout_p third after the max_seqlens, alibi_slopes, block_table) wrote for FA2 and
unpacks three values, so return_attn_probs=True gives FA2's triple: out, the softmax lse [H,
total_q] float32 (natural log, FA2's layout; not differentiable, as in FA2, whose backward takes
no gradient for it) and S_dmask. FA2 fills S_dmask only with dropout (it encodes the dropout
pattern, and its return_softmax is return_attn_probs and dropout_p > 0); with dropout_p = 0, the
only value jagflash takes, FA2 returns an empty tensor there, and so does jagflash. Code that
reads the lse this way (ring-attention wrappers do) runs unchanged.

Options jagflash does not have raise UnsupportedError naming the option (dropout_p != 0,
block_table, alibi_slopes of FA2's per-sequence shape (batch_size, nheads)); none is ignored.
softcap > 0 and alibi_slopes (nheads,) are served on CPU and CUDA tensors; softcap <= 0 is no
softcap, as in FA2 (flash_api.cpp: `if (softcap > 0.0)`). Where FA2's kernels behave differently
from jagflash's own API, this entry does what FA2 does: a row that sees no key has softmax_lse
+inf (FA2's kernel writes INFINITY; jagged_attention gives -inf, as FlexAttention does), and a
head dim that is not a multiple of 8 is zero-padded to the next one with a copy of q, k and v
(FA2's mha_varlen_fwd pads the same way), the result sliced back, the scale 1/sqrt of the
caller's head dim. With
causal=True the right side of window_size is set to 0 whatever it is, as FA2 does (mha_varlen_fwd:
`if (is_causal) window_size_right = 0`): HuggingFace transformers calls it so for sliding-window
models, causal=True with window_size=(w - 1, w - 1). Errors name FA2's arguments (cu_seqlens_k,
softmax_scale, window_size), not jagged_attention's.
"""
import numbers
import operator
from typing import Any, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _capi
from ._errors import JagflashError, UnsupportedError, invalid_argument, reworded
from ._mask import window_side
from .functional import jagged_attention

# jagged_attention's argument names, as its errors give them -> FA2's. The offsets' names anywhere
# in a message ("as many as q_offsets"); the others where a message starts (the argument it is
# about), so that words such as "scale" inside a message stay as they are.
_FA2_TERMS = (
    (r"\bq_offsets\b", "cu_seqlens_q"),
    (r"\bkv_offsets\b", "cu_seqlens_k"),
    (r"^scale\b", "softmax_scale"),
    (r"^window\b", "window_size"),
    (r"^max_seqlen_kv\b", "max_seqlen_k"),
    (r"or None for no softcap", "or <= 0 (FA2's 0.0) for no softcap"),
)


def _unsupported(option: str, why: str) -> UnsupportedError:
    return UnsupportedError(f"flash_attn_varlen_func: {option} is not supported: {why}", _capi.ERR_UNSUPPORTED)


def _hint(name: str, value: Any) -> Optional[int]:
    """A max_seqlen as the int hint jagflash takes (None: no hint). FlashAttention requires these;
    jagflash only uses them to pick a kernel, so they need not be exact."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        # int() of a CUDA tensor would sync the host in the middle of the call without a word.
        raise invalid_argument(name, "a Python int (or None: jagflash needs no maximum)", "a tensor")
    if isinstance(value, bool):
        raise invalid_argument(name, "a Python int (or None: jagflash needs no maximum)", repr(value))
    try:
        return operator.index(value)
    except TypeError:
        raise invalid_argument(name, "a Python int (or None: jagflash needs no maximum)", repr(value)) from None


def _is_zero(name: str, value: Any) -> bool:
    _check_number(name, value)
    return value == 0


def _check_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise invalid_argument(name, "a number", repr(value))


_HEAD_DIM_STEP, _MAX_HEAD_DIM = 8, 256


def _padded_head_dims(q: Any, k: Any, v: Any) -> Optional[Tuple[int, int]]:
    """(q's and k's, v's) head dims as FA2 runs them when one is not a multiple of 8: the next
    multiple of 8 (FA2 pads head_size_og % 8 != 0), where that is one jagflash takes; else None,
    and the call goes on unpadded (anything malformed is then refused by jagged_attention's checks,
    naming the caller's values)."""
    if not all(isinstance(t, Tensor) and t.dim() == 3 for t in (q, k, v)) or k.shape[-1] != q.shape[-1]:
        return None
    d, dv = q.shape[-1], v.shape[-1]
    padded_d, padded_dv = (-(-n // _HEAD_DIM_STEP) * _HEAD_DIM_STEP for n in (d, dv))
    if (padded_d, padded_dv) == (d, dv) or not 0 < padded_d <= _MAX_HEAD_DIM or padded_dv <= 0:
        return None
    return padded_d, padded_dv


def _pad_head_dim(t: Tensor, padded: int) -> Tensor:
    """t zero-padded to `padded` columns (a copy, differentiable: the gradient is sliced back)."""
    return torch.nn.functional.pad(t, (0, padded - t.shape[-1]))


# FA2's softmax_lse for a row that sees no key.
_NO_KEY_LSE = float("inf")


def flash_attn_varlen_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    dropout_p: float = 0.0,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    window_size: Sequence[int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: Optional[Tensor] = None,
    *,
    learnable_sink: Optional[Tensor] = None,
) -> Tensor:
    """FlashAttention-2's flash_attn_varlen_func on jagflash; returns out [total_q, H, Dv].

    q: [total_q, H, D]; k: [total_k, H_kv, D]; v: [total_k, H_kv, Dv], H % H_kv == 0 (head h of q
    attends to head h // (H / H_kv) of k and v, as in FlashAttention). fp16/bf16 on the GPU
    (sm_90) at any D up to 256, either direction, and any Dv <= D (a D other than 64, 128, 256
    and a Dv < D without softcap or ALiBi); CPU tensors (fp32 too) run the C++ float64 reference
    at any D up to 256 and any Dv <= D. A D or Dv that is not a multiple of 8 is zero-padded to
    the next one, as FA2 does (below).
    cu_seqlens_q, cu_seqlens_k: int32 (or int64) [B+1] cumulative lengths on the tensors' device.
    max_seqlen_q, max_seqlen_k: FlashAttention requires them; for jagflash they are hints for the
    forward's kernel choice (when both are given), never required to be exact or even given
    (None). A hint changes speed, not results.
    dropout_p: 0.0 only. softmax_scale: default 1/sqrt(D); a value float32 turns into 0 or
    infinity is refused (FA2 computes with 0: uniform attention).
    causal, window_size=(left, right): FlashAttention's masks, bottom-right aligned when
    seqlen_q != seqlen_k; -1 unbounded; causal with a left window is a causal sliding window, and
    with causal=True the right side is 0 whatever is passed (as in FA2).
    softcap: 0.0 (FA2's default), or any value <= 0, for none (as FA2), else a tanh softcap on the
    scaled score, as FA2's (finite in float32; 1e-50 and 1e39 are refused).
    alibi_slopes: None, or float32 (nheads,) as FA2's (bias -slope * |i + seqlen_k - seqlen_q - j|);
    FA2's per-sequence (batch_size, nheads) is refused (UnsupportedError). One of softcap and ALiBi
    at a time.
    deterministic: True gives a bitwise reproducible backward (jagflash's forward always is);
    False, FA2's default, still gives it while torch.use_deterministic_algorithms(True) is on,
    since torch's switch asks every op for its deterministic variant.
    return_attn_probs: True returns (out, softmax_lse [H, total_q] float32, S_dmask), S_dmask an
    empty tensor as FA2's with dropout_p = 0 (the module docstring says why); softmax_lse is +inf
    for a row that sees no key, as FA2's (jagged_attention's lse is -inf there).
    Head dims that are not a multiple of 8 (D = 36) run as FA2 runs them: q, k, v zero-padded to
    the next multiple of 8 (a copy of each, and of out's columns back), scale 1/sqrt(D) of the
    caller's D.
    block_table: None only (no paged KV cache).
    learnable_sink (keyword only, FlashAttention-4's name; FA2 has none): None, or attention sinks
    (gpt-oss), one logit per query head of shape (nheads,), float32, bfloat16 or float16, that
    joins every row's softmax denominator without a value (jagged_attention's learnable_sink);
    differentiable. With sinks a row that sees no key has softmax_lse = its head's sink.
    Differentiable in q, k and v (and learnable_sink).
    """
    if not _is_zero("dropout_p", dropout_p):
        raise _unsupported(f"dropout_p={dropout_p}", "jagflash has no attention dropout; pass 0.0 (FlashAttention "
                                                     "users typically pass `p if self.training else 0.0`)")
    _check_number("softcap", softcap)
    cap = softcap if softcap > 0 else None  # FA2: <= 0 (and NaN) is no softcap
    if isinstance(alibi_slopes, Tensor) and alibi_slopes.dim() == 2:
        raise _unsupported(f"alibi_slopes of shape {tuple(alibi_slopes.shape)} (batch_size, nheads)",
                           "jagflash takes one slope per head for every sequence; pass shape (nheads,)")
    if block_table is not None:
        raise _unsupported("block_table", "jagflash has no paged KV cache; pass None")
    if not isinstance(return_attn_probs, bool):
        raise invalid_argument("return_attn_probs", "True or False", repr(return_attn_probs))
    if deterministic is False and torch.are_deterministic_algorithms_enabled():
        deterministic = True
    try:
        window = tuple(window_size)
    except TypeError:
        window = ()
    if len(window) != 2:
        raise invalid_argument("window_size", "a pair (left, right) of ints, -1 = unbounded", repr(window_size))
    if causal is True:
        # FA2 (mha_varlen_fwd): causal sees no key to the right, whatever window_size[1] says; it
        # must still be an int >= -1.
        window_side("window_size[1]", window[1])
        window = (window[0], 0)
    if cu_seqlens_k is None:
        # jagged_attention would take q's offsets for k's; FA2 has no such default.
        raise invalid_argument("cu_seqlens_k", "an int32 tensor of B+1 cumulative key lengths", "None")
    padded = _padded_head_dims(q, k, v)
    if padded is not None:
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5  # the caller's head dim, not the padded one
        v_cols = v.shape[-1]
        head_dim, v_head_dim = padded
        q, k, v = _pad_head_dim(q, head_dim), _pad_head_dim(k, head_dim), _pad_head_dim(v, v_head_dim)
    try:
        result = jagged_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, window=window,  # type: ignore[arg-type]  # checked there
            scale=softmax_scale, max_seqlen_q=_hint("max_seqlen_q", max_seqlen_q),
            max_seqlen_kv=_hint("max_seqlen_k", max_seqlen_k), deterministic=deterministic,
            return_lse=return_attn_probs, softcap=cap, alibi_slopes=alibi_slopes, learnable_sink=learnable_sink,
        )
    except JagflashError as error:
        error = reworded(error, _FA2_TERMS)
        if padded is not None:
            error = type(error)(f"{error} (q and k padded to head dim {padded[0]} and v to {padded[1]}, as FA2 "
                                f"pads a head dim that is not a multiple of 8)", error.status)
        raise error from None
    out, lse = result if return_attn_probs else (result, None)
    if padded is not None:
        out = out[..., :v_cols]
    if lse is None:
        return out
    # FA2's lse where a row sees no key: +inf (a new tensor: the autograd node keeps the original).
    lse = torch.where(lse == float("-inf"), _NO_KEY_LSE, lse)
    # FA2's S_dmask with dropout_p = 0: an empty tensor of the output's dtype and device.
    return out, lse, torch.empty((0,), dtype=out.dtype, device=out.device)
