"""The PyTorch custom ops torch.ops.jagflash.fwd / .bwd (and .pooled_fwd / .pooled_bwd): real kernels (the C library), fake
kernels (shapes only, for torch.compile and meta tensors) and the autograd formula.

Both ops take int32 offsets on the tensors' device and plain scalars (jf_mask, window, scale with
0 = 1/sqrt(D) and any other value finite and non-zero in float32, the check_offsets mode "auto",
"host" or "device", the max_seqlen hint, deterministic), then the score modifier (softcap: 0 = none;
alibi_slopes: None or float32 [H], not differentiable), last (fwd and bwd only) the block-sparse map
(block_mask_blocks uint8, block_mask_offsets int32 [B+1], both None for none; not differentiable,
the backward gets the forward's), and return fresh
contiguous tensors. They read no tensor value on the host, so a compiled graph holds them with no
break and no sync of its own; "auto" offsets checking is decided when the op runs, so a
CUDA-graph capture gets the device check. Their gradients cannot be differentiated again: a
double backward raises UnsupportedError.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _capi, _launch
from ._errors import UnsupportedError


@torch.library.custom_op("jagflash::fwd", mutates_args=())
def fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Tensor,
    mask: int,
    window_left: int,
    window_right: int,
    scale: float,
    check_offsets: str,
    max_seqlen: int = 0,
    deterministic: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    block_mask_blocks: Optional[Tensor] = None,
    block_mask_offsets: Optional[Tensor] = None,
    score_mod: int = 0,
    score_mod_table: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """out [total_q, H, Dv] (Dv: v's head dim) and lse [H, total_q] float32. The lse is always produced: the
    backward needs it. max_seqlen: 0 (unknown) or a bound on every q and kv length, a hint for
    the choice of kernel. deterministic: for the backward (the forward always is), which gets it
    with the other scalars. softcap, alibi_slopes: the score modifier. block_mask_blocks,
    block_mask_offsets: the block-sparse map (jagflash.BlockMask's blocks and offsets). score_mod,
    score_mod_table: a modifier that reads a table (its jf_score_mod, float32 [H, W]), 0 and None for
    none; not differentiable."""
    return _launch.forward(q, k, v, q_offsets, kv_offsets, mask, window_left, window_right, scale, check_offsets,
                           max_seqlen, softcap, alibi_slopes, block_mask_blocks, block_mask_offsets, score_mod,
                           score_mod_table)


@fwd.register_fake
def _fwd_fake(q, k, v, q_offsets, kv_offsets, mask, window_left, window_right, scale, check_offsets, max_seqlen=0,
              deterministic=False, softcap=0.0, alibi_slopes=None, block_mask_blocks=None, block_mask_offsets=None,
              score_mod=0, score_mod_table=None):
    _launch.check_inputs(q, k, v, q_offsets, kv_offsets)
    _launch.check_head_dims(q, k, v, modified=softcap != 0 or alibi_slopes is not None or score_mod != 0,
                            blocked=block_mask_blocks is not None)
    _launch.check_op_scalars(scale, check_offsets)
    _launch.check_score_mod(q, softcap, alibi_slopes, score_mod, score_mod_table)
    _launch.check_block_mask(q, q_offsets, block_mask_blocks, block_mask_offsets)
    total_q, heads, _ = q.shape
    return q.new_empty((total_q, heads, v.shape[-1])), q.new_empty((heads, total_q), dtype=torch.float32)


@torch.library.custom_op("jagflash::bwd", mutates_args=())
def bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    q_offsets: Tensor,
    kv_offsets: Tensor,
    mask: int,
    window_left: int,
    window_right: int,
    scale: float,
    check_offsets: str,
    max_seqlen: int = 0,
    deterministic: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    block_mask_blocks: Optional[Tensor] = None,
    block_mask_offsets: Optional[Tensor] = None,
    score_mod: int = 0,
    score_mod_table: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv (shaped like q, k, v) from dout and the forward's out and lse (dout and out
    [total_q, H, Dv]); deterministic: dq bitwise reproducible too (dk and dv always are). The block
    mask: the forward's."""
    return _launch.backward(
        dout, q, k, v, out, lse, q_offsets, kv_offsets, mask, window_left, window_right, scale, check_offsets,
        max_seqlen, deterministic, softcap, alibi_slopes, block_mask_blocks, block_mask_offsets, score_mod,
        score_mod_table,
    )


@bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, q_offsets, kv_offsets, mask, window_left, window_right, scale, check_offsets,
              max_seqlen=0, deterministic=False, softcap=0.0, alibi_slopes=None, block_mask_blocks=None,
              block_mask_offsets=None, score_mod=0, score_mod_table=None):
    _launch.check_inputs(q, k, v, q_offsets, kv_offsets)
    _launch.check_head_dims(q, k, v, backward=True,
                            modified=softcap != 0 or alibi_slopes is not None or score_mod != 0,
                            blocked=block_mask_blocks is not None)
    _launch.check_op_scalars(scale, check_offsets)
    _launch.check_score_mod(q, softcap, alibi_slopes, score_mod, score_mod_table)
    _launch.check_block_mask(q, q_offsets, block_mask_blocks, block_mask_offsets)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    # The slopes, the block mask and the modifier's table are saved as tensors; the scalars before
    # them (and the table's kind) go back to bwd as they came.
    q, k, v, q_offsets, kv_offsets, *scalars, alibi_slopes, block_mask_blocks, block_mask_offsets, score_mod, \
        score_mod_table = inputs
    refuse_modifier_gradient(alibi_slopes, score_mod_table, recording=True)
    out, lse = output
    ctx.save_for_backward(q, k, v, q_offsets, kv_offsets, out, lse, alibi_slopes, block_mask_blocks,
                          block_mask_offsets, score_mod_table)
    ctx.scalars = scalars
    ctx.score_mod = score_mod
    # lse is an output for callers that want it, not a differentiable one: the C API has no
    # gradient input for it.
    ctx.mark_non_differentiable(lse)


_DOUBLE_BACKWARD_MESSAGE = (
    "jagflash: double backward is not supported: the gradients of jagged_attention cannot be "
    "differentiated again (torch.autograd.grad(..., create_graph=True) and then a backward through "
    "its result, as a gradient penalty does)"
)


class _RefuseDoubleBackward(torch.autograd.Function):
    """dq, dk, dv as a backward under create_graph=True returns them, tied to what they depend on
    (dout, q, k, v) by a node whose own backward raises. The C library's gradients are constants
    to autograd: without this node a loss built on them (a gradient penalty) would train on a
    gradient that silently lacks the attention's second-order term."""

    @staticmethod
    def forward(ctx, dq, dk, dv, *depends_on):
        return dq, dk, dv

    @staticmethod
    def backward(ctx, *grads):
        raise UnsupportedError(_DOUBLE_BACKWARD_MESSAGE, _capi.ERR_UNSUPPORTED)


def refuse_modifier_gradient(alibi_slopes, score_mod_table, recording=None):
    """A score modifier's tensors (ALiBi's slopes, a modifier's table) get no gradient from the C
    library: one that asks for it (learnable slopes or bias) would otherwise train on a silent
    zero (slopes.grad stays None). recording: whether autograd records the call (None: grad mode;
    the ops' setup_context, which runs only when autograd records and under no_grad, passes True)."""
    if recording is None:
        recording = torch.is_grad_enabled()
    for name, t in (("alibi_slopes", alibi_slopes), ("score_mod_table", score_mod_table)):
        if isinstance(t, torch.Tensor) and t.requires_grad and recording:
            raise UnsupportedError(f"jagflash: {name} requires grad, and jagflash computes no gradient for a "
                                   f"score modifier's {name} (only dq, dk, dv); pass {name}.detach() to train "
                                   "without one", _capi.ERR_UNSUPPORTED)


def _refuse_double_backward(dq, dk, dv, dout, q, k, v):
    """Only under create_graph=True (grad mode on inside a backward) is there anything to tie;
    a plain backward returns the gradients as they are."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (dout, q, k, v)):
        return _RefuseDoubleBackward.apply(dq, dk, dv, dout, q, k, v)
    return dq, dk, dv


def _backward(ctx, dout, _dlse):
    q, k, v, q_offsets, kv_offsets, out, lse, alibi_slopes, block_mask_blocks, block_mask_offsets, \
        score_mod_table = ctx.saved_tensors
    # no_grad: the op has no autograd of its own; _refuse_double_backward gives the gradients theirs.
    with torch.no_grad():
        dq, dk, dv = bwd(dout.to(q.dtype), q, k, v, out, lse, q_offsets, kv_offsets, *ctx.scalars, alibi_slopes,
                         block_mask_blocks, block_mask_offsets, ctx.score_mod, score_mod_table)
    dq, dk, dv = _refuse_double_backward(dq, dk, dv, dout, q, k, v)
    # No gradient for the offsets, the scalars, the slopes, the block mask or the modifier's table.
    return (dq, dk, dv) + (None,) * 15


fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- Pooled attention (jf_problem.pooled_q_rows): q [Lq, H, D] shared by every sequence of k, v.
@torch.library.custom_op("jagflash::pooled_fwd", mutates_args=())
def pooled_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    kv_offsets: Tensor,
    mask: int,
    window_left: int,
    window_right: int,
    scale: float,
    check_offsets: str,
    max_seqlen: int = 0,
    deterministic: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    score_mod: int = 0,
    score_mod_table: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor]:
    """out [B*Lq, H, Dv] (sequence b's rows at b*Lq) and lse [H, B*Lq] float32, B = kv_offsets'
    length - 1. deterministic: for the backward, as in fwd."""
    return _launch.pooled_forward(q, k, v, kv_offsets, mask, window_left, window_right, scale, check_offsets,
                                  max_seqlen, softcap, alibi_slopes, score_mod, score_mod_table)


@pooled_fwd.register_fake
def _pooled_fwd_fake(q, k, v, kv_offsets, mask, window_left, window_right, scale, check_offsets, max_seqlen=0,
                     deterministic=False, softcap=0.0, alibi_slopes=None, score_mod=0, score_mod_table=None):
    _launch.check_pooled_inputs(q, k, v, kv_offsets)
    _launch.check_head_dims(q, k, v, modified=softcap != 0 or alibi_slopes is not None or score_mod != 0,
                            pooled=True)
    _launch.check_op_scalars(scale, check_offsets)
    _launch.check_score_mod(q, softcap, alibi_slopes, score_mod, score_mod_table)
    lq, heads, _ = q.shape
    rows = (kv_offsets.shape[0] - 1) * lq
    return q.new_empty((rows, heads, v.shape[-1])), q.new_empty((heads, rows), dtype=torch.float32)


@torch.library.custom_op("jagflash::pooled_bwd", mutates_args=())
def pooled_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    kv_offsets: Tensor,
    mask: int,
    window_left: int,
    window_right: int,
    scale: float,
    check_offsets: str,
    max_seqlen: int = 0,
    deterministic: bool = False,
    softcap: float = 0.0,
    alibi_slopes: Optional[Tensor] = None,
    score_mod: int = 0,
    score_mod_table: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """dq [Lq, H, D] (the sum of every sequence's contribution), dk, dv per sequence."""
    return _launch.pooled_backward(dout, q, k, v, out, lse, kv_offsets, mask, window_left, window_right, scale,
                                   check_offsets, max_seqlen, deterministic, softcap, alibi_slopes, score_mod,
                                   score_mod_table)


@pooled_bwd.register_fake
def _pooled_bwd_fake(dout, q, k, v, out, lse, kv_offsets, mask, window_left, window_right, scale, check_offsets,
                     max_seqlen=0, deterministic=False, softcap=0.0, alibi_slopes=None, score_mod=0,
                     score_mod_table=None):
    _launch.check_pooled_inputs(q, k, v, kv_offsets)
    _launch.check_head_dims(q, k, v, backward=True,
                            modified=softcap != 0 or alibi_slopes is not None or score_mod != 0, pooled=True)
    _launch.check_op_scalars(scale, check_offsets)
    _launch.check_score_mod(q, softcap, alibi_slopes, score_mod, score_mod_table)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _pooled_setup_context(ctx, inputs, output):
    q, k, v, kv_offsets, *scalars, alibi_slopes, score_mod, score_mod_table = inputs
    refuse_modifier_gradient(alibi_slopes, score_mod_table, recording=True)
    out, lse = output
    ctx.save_for_backward(q, k, v, kv_offsets, out, lse, alibi_slopes, score_mod_table)
    ctx.scalars = scalars
    ctx.score_mod = score_mod
    ctx.mark_non_differentiable(lse)


def _pooled_backward(ctx, dout, _dlse):
    q, k, v, kv_offsets, out, lse, alibi_slopes, score_mod_table = ctx.saved_tensors
    with torch.no_grad():
        dq, dk, dv = pooled_bwd(dout.to(q.dtype), q, k, v, out, lse, kv_offsets, *ctx.scalars, alibi_slopes,
                                ctx.score_mod, score_mod_table)
    dq, dk, dv = _refuse_double_backward(dq, dk, dv, dout, q, k, v)
    return (dq, dk, dv) + (None,) * 12


pooled_fwd.register_autograd(_pooled_backward, setup_context=_pooled_setup_context)


class EagerAttention(torch.autograd.Function):
    """The same forward/backward as torch.ops.jagflash.fwd with its autograd formula, without the
    custom-op dispatch (argument filling, redispatch: ~40% of the binding's host time per call,
    measured with cProfile). jagged_attention takes it in plain eager mode only; anything that
    traces (torch.compile, export, fake or meta tensors, subclasses, function modes) goes through
    the registered op, which is what gives those their fake kernel and opcheck guarantees.

    Called through eager_attention (below): the six arguments q, k, v, q_offsets, kv_offsets and
    the op's scalars as one tuple (each argument costs autograd.Function's apply time; after
    deterministic: softcap, alibi_slopes, the block mask's blocks and offsets, score_mod and
    score_mod_table, not differentiated). The offsets, the slopes, the block mask and the table are
    saved for backward with the tensors, as the registered op saves them: one changed in place
    between the forward and the backward then raises torch's "modified by an inplace operation"
    instead of giving the gradients of other sequences, another map or other modifier values."""

    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, scalars):
        # scalars: mask .. max_seqlen, deterministic (the backward's), softcap, alibi_slopes, the block
        # mask's blocks and offsets, the table modifier's kind and table.
        out, lse = _launch.forward(q, k, v, q_offsets, kv_offsets, *scalars[:6], *scalars[7:])
        # The slopes, the block mask and the table are saved like the offsets (one changed in place
        # before the backward raises).
        ctx.save_for_backward(q, k, v, out, lse, q_offsets, kv_offsets, scalars[8], scalars[9], scalars[10],
                              scalars[12])
        ctx.scalars = scalars[:8]
        ctx.score_mod = scalars[11]
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, q_offsets, kv_offsets, alibi_slopes, blocks, block_offsets, table = ctx.saved_tensors
        if dout.dtype is not q.dtype:
            dout = dout.to(q.dtype)
        if not torch.is_grad_enabled():  # a plain backward: nothing is recorded anyway
            dq, dk, dv = _launch.backward(dout, q, k, v, out, lse, q_offsets, kv_offsets, *ctx.scalars, alibi_slopes,
                                          blocks, block_offsets, ctx.score_mod, table)
            return dq, dk, dv, None, None, None
        # create_graph=True: the copies the binding may make are not recorded.
        with torch.no_grad():
            dq, dk, dv = _launch.backward(dout, q, k, v, out, lse, q_offsets, kv_offsets, *ctx.scalars, alibi_slopes,
                                          blocks, block_offsets, ctx.score_mod, table)
        dq, dk, dv = _refuse_double_backward(dq, dk, dv, dout, q, k, v)
        return dq, dk, dv, None, None, None


# autograd.Function.apply less its Python prologue: outside functorch transforms that prologue
# only unwraps dead functorch wrappers (done below, per tensor) before calling this C function;
# together with the tuple of scalars it saves about a third of the eager call's autograd cost.
_apply_eager = super(torch.autograd.Function, EagerAttention).apply
_functorch_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def eager_attention(q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, kv_offsets: Tensor, *scalars):
    """EagerAttention on the op's arguments (q, k, v, the offsets, then its thirteen scalars; as with
    the op, the score modifier's two, the block mask's two and the table modifier's two may be left
    out)."""
    if len(scalars) != 13:
        scalars = scalars + (0.0, None, None, None, 0, None)[len(scalars) - 7:]
    if _functorch_transforms_active():
        return EagerAttention.apply(q, k, v, q_offsets, kv_offsets, scalars)
    return _apply_eager(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), _unwrap_if_dead(q_offsets),
                        _unwrap_if_dead(kv_offsets), scalars)


# Looked up once: the check below runs on every eager call.
_is_compiling = torch.compiler.is_compiling
_function_mode_depth = torch._C._len_torch_function_stack


def eager_fast_path_allowed(*tensors: Tensor) -> bool:
    """Plain tensors on a real device, no tracing and no function mode: nothing the custom op's
    dispatch would add anything for. (is_cuda / is_cpu rather than device.type: no torch.device
    built per tensor, a third of this check's cost.)"""
    if _is_compiling() or _function_mode_depth():
        return False
    for t in tensors:
        if type(t) is not torch.Tensor or not (t.is_cuda or t.is_cpu):
            return False
    return True
