"""jagflash as PyTorch's flash attention, through torch.nn.attention's registry (torch 2.11).

    import jagflash                                                # registers "jagflash", activates nothing
    torch.nn.attention.activate_flash_attention_impl("jagflash")   # the one line
    torch.nn.attention.restore_flash_attention_impl()              # PyTorch's own kernel again

Activation overrides the CUDA kernels of four aten ops (and their .quantized overloads), the way
torch's own FA3/FA4 plug-ins do (torch/nn/attention/_fa3.py), through a
torch.library.Library("aten", "IMPL", "CUDA"):
  _flash_attention_forward / _flash_attention_backward: what varlen_attn and SDPA on jagged nested
      tensors call (packed [total, H, D] with cumulative offsets), and a dense [B, S, H, D] form;
  _scaled_dot_product_flash_attention / its backward: dense SDPA ([B, H, S, D]) when torch picks
      its flash backend.
aten's own autograd formulas still connect each forward to its backward; only the kernels change.
Restoring destroys the Library, which puts PyTorch's kernels back.

Once active nothing falls back to PyTorch's kernel: a call jagflash cannot serve raises
UnsupportedError naming what it cannot serve (dropout, the debug mask, ALiBi, seqused_k, fp8
descales, a dtype other than fp16/bf16, a head dim other than 64/128/256, a GPU other than sm_90).
Block-sparse attention (jagflash.BlockMask) is not served here: the aten ops have no argument that
could carry a map (an SDPA attn_mask is a dense token mask, and the flash ops take none), so a
block mask goes through jagflash.jagged_attention / jagflash.attention only.
The backward's deterministic mode follows torch.are_deterministic_algorithms_enabled() when it
runs. Offsets a caller passes (varlen, nested) are checked as jagflash.set_check_offsets says
("auto": on the device, no sync); the dense path's offsets, built here, are checked on the
device (no sync).

Dense [B, H, S, D] inputs are read in place where the memory allows one jagged view of them
(the block above _dense_rows says how), else copied:
  - contiguous [B, H, S, D] with as many kv heads as q heads: B*H one-head sequences; out and
    lse [B, H, S] come out in torch's layouts.
  - [B, S, H, D] memory seen as [B, H, S, D] (x.view(B, S, H, D).transpose(1, 2), GQA included):
    B sequences of H heads; lse is permuted into [B, H, S] (a copy of B*H*S floats).
  - anything else (GQA on contiguous [B, H, S, D], odd strides): the tensors that fit neither are
    copied, and results that come out in another layout than torch expects are copied back.
Outputs always have the strides of the op's meta kernel (torch.empty_like of the input), which is
what torch.compile's generated code assumes.
"""
import functools
from typing import Any, List, NoReturn, Optional, Sequence, Tuple

import torch
import torch.nn.attention
from torch import Tensor
from torch.library import Library

from . import _capi, _launch, _offsets_check
from ._errors import InvalidArgumentError, UnsupportedError
from ._mask import mask_args
from ._problem import Problem
from .functional import _offsets, _out_of_int32, _scale

NAME = "jagflash"
_DTYPES = (torch.float16, torch.bfloat16)
_HEAD_DIMS = (64, 128, 256)
# sm_90a code runs on compute capability 9.0 only.
_CAPABILITY = (9, 0)


def _unsupported(op: str, what: str) -> UnsupportedError:
    return UnsupportedError(
        f"jagflash, active as PyTorch's flash attention (aten::{op}): {what}. Nothing falls back to "
        "PyTorch's kernel while jagflash is active; torch.nn.attention.restore_flash_attention_impl() "
        "brings it back.",
        _capi.ERR_UNSUPPORTED,
    )


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> Tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _check_device(op: str, device: torch.device) -> None:
    """A CUDA device must be one jagflash has kernels for. CPU tensors reach these kernels only
    where a test registers them for the CPU key (register_kernels("CPU")): the C++ reference."""
    if device.type != "cuda":
        return
    capability = _device_capability(torch.cuda.current_device() if device.index is None else device.index)
    if capability != _CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise _unsupported(op, f"{name} (compute capability {capability[0]}.{capability[1]}): jagflash's kernels "
                               "are built for sm_90a (H100/H200) only")


def _check_inputs(op: str, tensors: Sequence[Tensor], *, dense: bool) -> None:
    """dtype, head dim, rank and device: what jagflash serves on this route. fp16/bf16 as PyTorch's
    flash kernels (jagflash's fp32 on the GPU is its oracle, ~75x slower than the Hopper kernels:
    refused rather than served slowly); CPU tensors (the tests' CPU registration) also fp32."""
    query = tensors[0]
    dtypes = _DTYPES if query.device.type == "cuda" else _DTYPES + (torch.float32,)
    for t in tensors:
        if t.dtype not in dtypes:
            raise _unsupported(op, f"dtype {t.dtype}: jagflash serves the flash ops in torch.float16 and torch.bfloat16")
    rank = 4 if dense else 3
    for t in tensors:
        if t.dim() != rank:
            layout = "dense [B, S, H, D] or [B, H, S, D]" if dense else "packed [total, H, D] with cum_seq_q/cum_seq_k"
            raise InvalidArgumentError(f"aten::{op}: expected {rank}-D tensors ({layout}), got shape "
                                       f"{tuple(t.shape)}", _capi.ERR_INVALID_ARGUMENT)
        if t.size(-1) != query.size(-1):
            raise _unsupported(op, f"head dims {query.size(-1)} (query) and {t.size(-1)}: jagflash needs one head "
                                   "dim for q, k and v")
    if query.size(-1) not in _HEAD_DIMS:
        raise _unsupported(op, f"head_dim {query.size(-1)}: jagflash serves head dims 64, 128 and 256")
    _check_device(op, query.device)


def _check_forward_options(op: str, dropout_p: float, return_debug_mask: bool, alibi_slopes: Optional[Tensor] = None,
                           seqused_k: Optional[Tensor] = None) -> None:
    if dropout_p != 0.0:
        raise _unsupported(op, f"dropout_p={dropout_p}: jagflash has no attention dropout (it serves dropout_p=0, "
                               "e.g. in eval mode or with dropout applied outside attention)")
    if return_debug_mask:
        raise _unsupported(op, "return_debug_mask=True: jagflash never forms the attention probabilities")
    if alibi_slopes is not None:
        raise _unsupported(op, "alibi_slopes: jagflash has no ALiBi bias")
    if seqused_k is not None:
        raise _unsupported(op, "seqused_k: jagflash reads every key of cum_seq_k's sequences (no per-sequence "
                               "used-key counts)")


def _check_no_descale(op: str, q_descale: Optional[Tensor], k_descale: Optional[Tensor],
                      v_descale: Optional[Tensor]) -> None:
    for name, t in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if t is not None:
            raise _unsupported(op, f"{name}: jagflash has no fp8 path (descale tensors)")


def _mask(is_causal: bool, window_size_left: Optional[int], window_size_right: Optional[int]) -> Tuple[int, int, int]:
    """aten's (is_causal, window_size_left/right with None = unbounded) as jf_mask and window; with
    is_causal the right side is 0 whatever is passed, as in PyTorch's FA2 kernels."""
    sides = []
    for name, side in (("window_size_left", window_size_left), ("window_size_right", window_size_right)):
        value = -1 if side is None else int(side)
        if value < -1:
            raise InvalidArgumentError(f"{name}: expected >= -1 (-1 or None = unbounded), got {value}",
                                       _capi.ERR_INVALID_ARGUMENT)
        sides.append(value)
    if is_causal:
        # As PyTorch's own FA2 kernels (mha_varlen_fwd / _bwd: `if (is_causal) window_size_right = 0`):
        # causal sees no key to the right, whatever window_size_right says.
        sides[1] = 0
    return mask_args(bool(is_causal), (sides[0], sides[1]))


def _like(reference: Tensor, result: Tensor) -> Tensor:
    """result with the strides torch.empty_like(reference) has: those the ops' meta kernels give,
    which torch.compile's generated code relies on. result itself when they agree (the common
    case), else a copy."""
    if result.stride() == reference.stride():
        # result is dense, so reference is too, and empty_like keeps a dense tensor's strides.
        return result
    if result.stride() == torch.empty_like(reference, device="meta").stride():
        return result
    copy = torch.empty_like(reference)
    copy.copy_(result)
    return copy


def _view(t: Tensor, shape: Tuple[int, ...]) -> Optional[Tensor]:
    """t as shape without a copy, or None where its strides do not allow it."""
    try:
        return t.view(shape)
    except RuntimeError:
        return None


def _seq_offsets(count: int, length: int, device: torch.device) -> Tensor:
    """int32 [count+1] offsets of count sequences of one length, back to back."""
    if count * length >= 2**31:
        raise InvalidArgumentError(f"dense attention: {count} x {length} = {count * length} rows, expected fewer "
                                   "than 2^31 (jagflash's offsets are int32)", _capi.ERR_INVALID_ARGUMENT)
    if length == 0:
        return torch.zeros(count + 1, dtype=torch.int32, device=device)
    return torch.arange(0, count * length + 1, length, dtype=torch.int32, device=device)


def _rng_outputs(device: torch.device) -> Tuple[Tensor, Tensor]:
    """The (rng_state, unused) pair the flash ops return: zeros, as no dropout ever draws from them."""
    return torch.zeros((2,), dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device)


def _empty_debug_mask(query: Tensor) -> Tensor:
    return torch.empty(0, dtype=query.dtype, device=query.device)


# --- packed (varlen) path ---------------------------------------------------------------------


def _hint(max_q: int, max_k: int) -> int:
    """max_q/max_k as jagflash's kernel-choice hint: the larger one; 0 (no hint) for a value the
    hint cannot hold. A hint only picks a kernel, so a wrong one never fails a call."""
    hint = max(int(max_q), int(max_k))
    return hint if 0 <= min(int(max_q), int(max_k)) and hint < 2**31 else 0


def _varlen_offsets(cum_seq_q: Tensor, cum_seq_k: Tensor) -> Tuple[Tensor, Tensor]:
    q_offsets = _offsets("cum_seq_q", cum_seq_q)
    kv_offsets = q_offsets if cum_seq_k is cum_seq_q else _offsets("cum_seq_k", cum_seq_k)
    return q_offsets, kv_offsets


def _raise_int32_cause(error: InvalidArgumentError, cum_seq_q: Tensor, cum_seq_k: Tensor) -> NoReturn:
    """An int64 offset past int32 became -1 in _offsets: name it rather than the -1 (error path only)."""
    cause = _out_of_int32((("cum_seq_q", cum_seq_q), ("cum_seq_k", cum_seq_k)))
    if cause is None:
        raise error
    raise cause from error


def _varlen_forward(query: Tensor, key: Tensor, value: Tensor, cum_seq_q: Tensor, cum_seq_k: Tensor, max_q: int,
                    max_k: int, is_causal: bool, scale: Optional[float], window_size_left: Optional[int],
                    window_size_right: Optional[int]) -> Tuple[Tensor, Tensor]:
    mask, left, right = _mask(is_causal, window_size_left, window_size_right)
    q_offsets, kv_offsets = _varlen_offsets(cum_seq_q, cum_seq_k)
    try:
        out, lse = _launch.forward(Problem(q=query, k=key, v=value, q_offsets=q_offsets, kv_offsets=kv_offsets,
                                           mask=mask, window_left=left, window_right=right, scale=_scale(scale),
                                           check_offsets=_offsets_check.resolve(None),
                                           max_seqlen=_hint(max_q, max_k)))
    except InvalidArgumentError as error:
        _raise_int32_cause(error, cum_seq_q, cum_seq_k)
    return _like(query, out), lse


def _varlen_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor,
                     cum_seq_q: Tensor, cum_seq_k: Tensor, max_q: int, max_k: int, is_causal: bool,
                     scale: Optional[float], window_size_left: Optional[int],
                     window_size_right: Optional[int]) -> Tuple[Tensor, Tensor, Tensor]:
    mask, left, right = _mask(is_causal, window_size_left, window_size_right)
    q_offsets, kv_offsets = _varlen_offsets(cum_seq_q, cum_seq_k)
    try:
        problem = Problem(q=query, k=key, v=value, q_offsets=q_offsets, kv_offsets=kv_offsets, mask=mask,
                          window_left=left, window_right=right, scale=_scale(scale),
                          check_offsets=_offsets_check.resolve(None), max_seqlen=_hint(max_q, max_k),
                          deterministic=torch.are_deterministic_algorithms_enabled())
        dq, dk, dv, _ = _launch.backward(problem, out, logsumexp, grad_out)
    except InvalidArgumentError as error:
        _raise_int32_cause(error, cum_seq_q, cum_seq_k)
    return _like(query, dq), _like(key, dk), _like(value, dv)


# --- dense path ---------------------------------------------------------------------------------
# [B, H, S, D] tensors are described to the C library one of two ways, both without a copy when
# the memory allows:
#   per head:  [B*H*S, 1, D] rows, B*H sequences of S rows with one head each; needs contiguous
#              [B, H, S, D] memory and as many kv heads as q heads (GQA would have a query head's
#              sequence share its kv sequence with the group's other heads). lse [1, B*H*S] is
#              torch's [B, H, S] as it is.
#   per token: [B*S, H, D] rows, B sequences of S rows with H heads; needs [B, S, H, D] memory
#              (x.view(B, S, H, D).transpose(1, 2), what most models pass). lse [H, B*S] is
#              permuted into [B, H, S] (a copy of B*H*S floats).
# The description that leaves the fewest elements to copy wins; a tensor it cannot view is copied.


def _per_head(t: Tensor) -> Optional[Tensor]:
    batch, heads, length, head_dim = t.shape
    return _view(t, (batch * heads * length, 1, head_dim))


def _per_token(t: Tensor) -> Optional[Tensor]:
    batch, heads, length, head_dim = t.shape
    return _view(t.transpose(1, 2), (batch * length, heads, head_dim))


def _dense_rows(tensors: Sequence[Tensor]) -> Tuple[bool, List[Tensor]]:
    """(per_head, the tensors as rows): the description of the block above that copies least."""
    heads = tensors[0].size(1)
    per_token = [_per_token(t) for t in tensors]
    token_cost = sum(t.numel() for t, view in zip(tensors, per_token) if view is None)
    if all(t.size(1) == heads for t in tensors):
        per_head = [_per_head(t) for t in tensors]
        head_cost = sum(t.numel() for t, view in zip(tensors, per_head) if view is None)
        if head_cost <= token_cost:
            return True, [view if view is not None else t.contiguous().view(-1, 1, t.size(3))
                          for t, view in zip(tensors, per_head)]
    return False, [view if view is not None else t.transpose(1, 2).reshape(-1, t.size(1), t.size(3))
                   for t, view in zip(tensors, per_token)]


def _check_dense_shapes(op: str, query: Tensor, key: Tensor, value: Tensor) -> None:
    """[B, H, Sq, D] q and [B, H_kv, Sk, D] k, v with H % H_kv == 0: the rest is the C library's."""
    batch, heads = query.size(0), query.size(1)
    if key.shape != value.shape or key.size(0) != batch or key.size(1) == 0 or heads % key.size(1):
        raise InvalidArgumentError(
            f"aten::{op}: expected q [B, H, Sq, D] and k, v of one shape [B, H_kv, Sk, D] with H % H_kv == 0, got q "
            f"{tuple(query.shape)}, k {tuple(key.shape)}, v {tuple(value.shape)} (as [B, H, S, D])",
            _capi.ERR_INVALID_ARGUMENT)


def _dense_forward(query: Tensor, key: Tensor, value: Tensor, is_causal: bool, scale: Optional[float],
                   window: Tuple[Optional[int], Optional[int]] = (None, None)) -> Tuple[Tensor, Tensor]:
    """out [B, H, Sq, D] (any strides) and lse [B, H, Sq] float32 from [B, H, S, D] q, k, v."""
    mask, left, right = _mask(is_causal, *window)
    batch, heads, len_q, head_dim = query.shape
    len_kv = key.size(2)
    per_head, rows = _dense_rows((query, key, value))
    sequences = batch * heads if per_head else batch
    q_offsets = _seq_offsets(sequences, len_q, query.device)
    kv_offsets = _seq_offsets(sequences, len_kv, query.device)
    q_rows, k_rows, v_rows = rows
    out_rows, lse = _launch.forward(Problem(q=q_rows, k=k_rows, v=v_rows, q_offsets=q_offsets, kv_offsets=kv_offsets,
                                            mask=mask, window_left=left, window_right=right, scale=_scale(scale),
                                            check_offsets=_offsets_check.BUILT, max_seqlen=_hint(len_q, len_kv)))
    if per_head:
        return out_rows.view(batch, heads, len_q, head_dim), lse.view(batch, heads, len_q)
    out = out_rows.view(batch, len_q, heads, head_dim).transpose(1, 2)
    return out, lse.view(heads, batch, len_q).transpose(0, 1).contiguous()


def _dense_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor,
                    is_causal: bool, scale: Optional[float],
                    window: Tuple[Optional[int], Optional[int]] = (None, None)) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv [B, H, S, D] (any strides) for [B, H, S, D] inputs and lse [B, H, Sq]."""
    mask, left, right = _mask(is_causal, *window)
    batch, heads, len_q, head_dim = query.shape
    kv_heads, len_kv = key.size(1), key.size(2)
    if logsumexp.shape != (batch, heads, len_q):
        raise InvalidArgumentError(f"logsumexp: expected [B, H, Sq] = {[batch, heads, len_q]}, got "
                                   f"{list(logsumexp.shape)}", _capi.ERR_INVALID_ARGUMENT)
    per_head, rows = _dense_rows((grad_out, query, key, value, out))
    if per_head:
        lse_rows = logsumexp.reshape(1, batch * heads * len_q)
    else:
        lse_rows = logsumexp.transpose(0, 1).reshape(heads, batch * len_q)
    sequences = batch * heads if per_head else batch
    q_offsets = _seq_offsets(sequences, len_q, query.device)
    kv_offsets = _seq_offsets(sequences, len_kv, query.device)
    dout_rows, q_rows, k_rows, v_rows, out_rows = rows
    problem = Problem(q=q_rows, k=k_rows, v=v_rows, q_offsets=q_offsets, kv_offsets=kv_offsets, mask=mask,
                      window_left=left, window_right=right, scale=_scale(scale), check_offsets=_offsets_check.BUILT,
                      max_seqlen=_hint(len_q, len_kv), deterministic=torch.are_deterministic_algorithms_enabled())
    dq, dk, dv, _ = _launch.backward(problem, out_rows, lse_rows, dout_rows)
    if per_head:
        return (dq.view(batch, heads, len_q, head_dim), dk.view(batch, heads, len_kv, head_dim),
                dv.view(batch, heads, len_kv, head_dim))
    return (dq.view(batch, len_q, heads, head_dim).transpose(1, 2),
            dk.view(batch, len_kv, kv_heads, head_dim).transpose(1, 2),
            dv.view(batch, len_kv, kv_heads, head_dim).transpose(1, 2))


# --- the aten kernels ---------------------------------------------------------------------------
# Signatures follow the aten schemas (torch 2.11): positional arguments as the schema lists them,
# keyword-only ones after the *.


def flash_attention_forward(query: Tensor, key: Tensor, value: Tensor, cum_seq_q: Optional[Tensor],
                            cum_seq_k: Optional[Tensor], max_q: int, max_k: int, dropout_p: float, is_causal: bool,
                            return_debug_mask: bool, *, scale: Optional[float] = None,
                            window_size_left: Optional[int] = None, window_size_right: Optional[int] = None,
                            seqused_k: Optional[Tensor] = None,
                            alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """aten::_flash_attention_forward: packed q [total_q, H, D] with cum_seq_q/cum_seq_k (lse
    [H, total_q]), or dense [B, S, H, D] without them (lse [B, H, S])."""
    op = "_flash_attention_forward"
    _check_forward_options(op, dropout_p, return_debug_mask, alibi_slopes, seqused_k)
    if (cum_seq_q is None) != (cum_seq_k is None):
        raise InvalidArgumentError(f"aten::{op}: cum_seq_q and cum_seq_k must both be given (packed) or both be "
                                   "None (dense)", _capi.ERR_INVALID_ARGUMENT)
    _check_inputs(op, (query, key, value), dense=cum_seq_q is None)
    if cum_seq_q is None or cum_seq_k is None:
        # Dense [B, S, H, D]: SDPA's [B, H, S, D] seen through a transpose.
        q_t, k_t, v_t = (t.transpose(1, 2) for t in (query, key, value))
        _check_dense_shapes(op, q_t, k_t, v_t)
        out_t, lse = _dense_forward(q_t, k_t, v_t, is_causal, scale, (window_size_left, window_size_right))
        out = _like(query, out_t.transpose(1, 2))
    else:
        out, lse = _varlen_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, is_causal, scale,
                                   window_size_left, window_size_right)
    rng_state, unused = _rng_outputs(query.device)
    return out, lse, rng_state, unused, _empty_debug_mask(query)


def flash_attention_forward_quantized(query: Tensor, key: Tensor, value: Tensor, cum_seq_q: Optional[Tensor],
                                      cum_seq_k: Optional[Tensor], max_q: int, max_k: int, dropout_p: float,
                                      is_causal: bool, return_debug_mask: bool, q_descale: Optional[Tensor],
                                      k_descale: Optional[Tensor], v_descale: Optional[Tensor], *,
                                      scale: Optional[float] = None, window_size_left: Optional[int] = None,
                                      window_size_right: Optional[int] = None, seqused_k: Optional[Tensor] = None,
                                      alibi_slopes: Optional[Tensor] = None) -> Tuple[Tensor, ...]:
    """aten::_flash_attention_forward.quantized: served without descale tensors only."""
    _check_no_descale("_flash_attention_forward.quantized", q_descale, k_descale, v_descale)
    return flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                                   return_debug_mask, scale=scale, window_size_left=window_size_left,
                                   window_size_right=window_size_right, seqused_k=seqused_k, alibi_slopes=alibi_slopes)


def flash_attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                             logsumexp: Tensor, cum_seq_q: Optional[Tensor], cum_seq_k: Optional[Tensor], max_q: int,
                             max_k: int, dropout_p: float, is_causal: bool, rng_state: Tensor, unused: Tensor, *,
                             scale: Optional[float] = None, window_size_left: Optional[int] = None,
                             window_size_right: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """aten::_flash_attention_backward; cum_seq_q None (undefined) for the dense form."""
    op = "_flash_attention_backward"
    _check_forward_options(op, dropout_p, False)
    if (cum_seq_q is None) != (cum_seq_k is None):
        raise InvalidArgumentError(f"aten::{op}: cum_seq_q and cum_seq_k must both be given (packed) or both be "
                                   "undefined (dense)", _capi.ERR_INVALID_ARGUMENT)
    _check_inputs(op, (query, key, value, out, grad_out), dense=cum_seq_q is None)
    if cum_seq_q is None or cum_seq_k is None:
        grad_out_t, q_t, k_t, v_t, out_t = (t.transpose(1, 2) for t in (grad_out, query, key, value, out))
        _check_dense_shapes(op, q_t, k_t, v_t)
        dq, dk, dv = _dense_backward(grad_out_t, q_t, k_t, v_t, out_t, logsumexp, is_causal, scale,
                                     (window_size_left, window_size_right))
        return _like(query, dq.transpose(1, 2)), _like(key, dk.transpose(1, 2)), _like(value, dv.transpose(1, 2))
    return _varlen_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, is_causal,
                            scale, window_size_left, window_size_right)


def scaled_dot_product_flash_attention(query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0,
                                       is_causal: bool = False, return_debug_mask: bool = False, *,
                                       scale: Optional[float] = None) -> Tuple[Any, ...]:
    """aten::_scaled_dot_product_flash_attention: dense q [B, H, Sq, D], k/v [B, H_kv, Sk, D]."""
    op = "_scaled_dot_product_flash_attention"
    _check_forward_options(op, dropout_p, return_debug_mask)
    _check_inputs(op, (query, key, value), dense=True)
    _check_dense_shapes(op, query, key, value)
    out, lse = _dense_forward(query, key, value, is_causal, scale)
    out = _like(query, out)
    rng_state, unused = _rng_outputs(query.device)
    # cum_seq_q / cum_seq_k: undefined for dense inputs, as PyTorch's kernel returns them.
    return out, lse, None, None, query.size(2), key.size(2), rng_state, unused, _empty_debug_mask(query)


def scaled_dot_product_flash_attention_quantized(query: Tensor, key: Tensor, value: Tensor,
                                                 q_descale: Optional[Tensor], k_descale: Optional[Tensor],
                                                 v_descale: Optional[Tensor], dropout_p: float = 0.0,
                                                 is_causal: bool = False, return_debug_mask: bool = False, *,
                                                 scale: Optional[float] = None) -> Tuple[Any, ...]:
    """aten::_scaled_dot_product_flash_attention.quantized: served without descale tensors only."""
    _check_no_descale("_scaled_dot_product_flash_attention.quantized", q_descale, k_descale, v_descale)
    return scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, return_debug_mask, scale=scale)


def scaled_dot_product_flash_attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor,
                                                out: Tensor, logsumexp: Tensor, cum_seq_q: Optional[Tensor],
                                                cum_seq_k: Optional[Tensor], max_q: int, max_k: int,
                                                dropout_p: float, is_causal: bool, philox_seed: Tensor,
                                                philox_offset: Tensor, *,
                                                scale: Optional[float] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """aten::_scaled_dot_product_flash_attention_backward: dense [B, H, S, D]."""
    op = "_scaled_dot_product_flash_attention_backward"
    _check_forward_options(op, dropout_p, False)
    _check_inputs(op, (query, key, value, out, grad_out), dense=True)
    _check_dense_shapes(op, query, key, value)
    dq, dk, dv = _dense_backward(grad_out, query, key, value, out, logsumexp, is_causal, scale)
    return _like(query, dq), _like(key, dk), _like(value, dv)


_KERNELS = {
    "_flash_attention_forward": flash_attention_forward,
    "_flash_attention_forward.quantized": flash_attention_forward_quantized,
    "_flash_attention_backward": flash_attention_backward,
    "_scaled_dot_product_flash_attention": scaled_dot_product_flash_attention,
    "_scaled_dot_product_flash_attention.quantized": scaled_dot_product_flash_attention_quantized,
    "_scaled_dot_product_flash_attention_backward": scaled_dot_product_flash_attention_backward,
}


def register_kernels(dispatch_key: str = "CUDA") -> Library:
    """Registers jagflash's kernels for the flash ops under dispatch_key and returns the Library
    that holds them (destroying it, Library._destroy(), unregisters them). Activation uses "CUDA";
    the tests also register them for "CPU", where aten has no flash kernels, to run varlen_attn and
    the ops' autograd on the C++ reference."""
    library = Library("aten", "IMPL", dispatch_key)  # noqa: TOR901 - overriding aten is the point
    for op, kernel in _KERNELS.items():
        library.impl(op, kernel, dispatch_key)
    return library


class Handle:
    """What activation returns to torch's registry: remove() unregisters the kernels."""

    def __init__(self, library: Library) -> None:
        self.library: Optional[Library] = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def activate() -> Handle:
    """The register_fn torch.nn.attention.activate_flash_attention_impl("jagflash") calls."""
    return Handle(register_kernels("CUDA"))


def register() -> None:
    """Makes "jagflash" known to torch.nn.attention's registry without activating it (import
    jagflash calls this)."""
    torch.nn.attention.register_flash_attention_impl(NAME, register_fn=activate)
