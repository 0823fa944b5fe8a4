"""The PyTorch custom ops torch.ops.jagflash.fwd / .bwd (and .pooled_fwd / .pooled_bwd): real kernels (the C library), fake
kernels (shapes only, for torch.compile and meta tensors) and the autograd formula.

The ops take the fields of one Problem flat (torch.library custom ops take tensors and scalars
only); _problem.py lays them out (argument order, schemas, the pooled subset, the backward ops'
dout, out and lse), so a new argument is a field there and nothing here. The ops take int32
offsets on the tensors' device, plain scalars, the score modifier, the block-sparse map and the
learnable sinks (the pooled ops: no q_offsets and no map). They return fresh contiguous tensors. They read no tensor
value on the host, so a compiled graph holds them with no break and no sync of its own; "auto"
offsets checking is decided when the op runs, so a CUDA-graph capture gets the device check.
The backward ops return dq, dk, dv and the sinks' gradient (dlearnable_sink: float32 [H] when
asked for with learnable_sink_grad, else an empty tensor). Their gradients cannot be
differentiated again: a double backward raises UnsupportedError.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _capi, _launch
from ._errors import UnsupportedError
from ._problem import POOLED_FIELDS, TENSOR_FIELDS, Problem, backward_op_args, op_schema, split_backward_op_args

# A saved problem's tensors are the ones ctx.save_for_backward holds (_save).
_NO_TENSORS = dict.fromkeys(Problem._fields[i] for i in TENSOR_FIELDS)
# Where the sink sits among the forward ops' arguments (its gradient goes there).
_SINK_AT = Problem._fields.index("learnable_sink")
_POOLED_SINK_AT = POOLED_FIELDS.index("learnable_sink")


def _check_fake(problem: Problem, backward: bool = False, pooled: bool = False) -> None:
    """What the real kernels check before reading anything, for the fake kernels: a traced call
    fails where an eager one would."""
    q, k, v = problem.q, problem.k, problem.v
    if pooled:
        _launch.check_pooled_inputs(q, k, v, problem.kv_offsets)
    else:
        _launch.check_inputs(q, k, v, problem.q_offsets, problem.kv_offsets)
    _launch.check_head_dims(q, k, v, backward=backward, modified=problem.modified,
                            blocked=problem.block_mask_blocks is not None, pooled=pooled)
    _launch.check_op_scalars(problem.scale, problem.check_offsets)
    _launch.check_score_mod(q, problem.softcap, problem.alibi_slopes, problem.score_mod, problem.score_mod_table)
    _launch.check_learnable_sink(q, problem.learnable_sink)
    if not pooled:
        _launch.check_block_mask(q, problem.q_offsets, problem.block_mask_blocks, problem.block_mask_offsets)


@torch.library.custom_op("jagflash::fwd", mutates_args=(), schema=op_schema())
def fwd(*args):
    """out [total_q, H, Dv] (Dv: v's head dim) and lse [H, total_q] float32 of the Problem these are
    the fields of. The lse is always produced: the backward needs it."""
    return _launch.forward(Problem.from_op_args(args))


@fwd.register_fake
def _fwd_fake(*args):
    problem = Problem.from_op_args(args)
    _check_fake(problem)
    q = problem.q
    total_q, heads, _ = q.shape
    return q.new_empty((total_q, heads, problem.v.shape[-1])), q.new_empty((heads, total_q), dtype=torch.float32)


@torch.library.custom_op("jagflash::bwd", mutates_args=(), schema=op_schema(backward=True))
def bwd(*args):
    """dq, dk, dv (shaped like q, k, v) from dout and the forward's out and lse (dout and out
    [total_q, H, Dv]), and dlearnable_sink (float32 [H] with learnable_sink_grad, else empty); the
    problem's deterministic: dq bitwise reproducible too (dk, dv and dlearnable_sink always are).
    The block mask and the sinks: the forward's."""
    forward_args, out, lse, dout, sink_grad = split_backward_op_args(args)
    return _op_gradients(*_launch.backward(Problem.from_op_args(forward_args), out, lse, dout, sink_grad))


def _op_gradients(dq: Tensor, dk: Tensor, dv: Tensor, dsink: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """A backward op's four outputs: an op returns tensors only, so no sinks' gradient is an empty one."""
    return dq, dk, dv, (dq.new_empty((0,), dtype=torch.float32) if dsink is None else dsink)


def _gradients_fake(problem: Problem, sink_grad: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Empty dq, dk, dv and dlearnable_sink as a backward op returns them."""
    q, k, v = problem.q, problem.k, problem.v
    sink_shape = (q.shape[1],) if sink_grad else (0,)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), q.new_empty(sink_shape,
                                                                                          dtype=torch.float32)


@bwd.register_fake
def _bwd_fake(*args):
    forward_args, _, _, _, sink_grad = split_backward_op_args(args)
    problem = Problem.from_op_args(forward_args)
    _check_fake(problem, backward=True)
    _launch.check_sink_grad(problem.learnable_sink, sink_grad)
    return _gradients_fake(problem, sink_grad)


def _save(ctx, problem: Problem, out: Tensor, lse: Tensor) -> None:
    """What a backward needs: the problem (its tensors saved for backward, see TENSOR_FIELDS), out
    and lse. lse is an output for callers that want it, not a differentiable one: the C API has no
    gradient input for it."""
    ctx.save_for_backward(out, lse, *(problem[i] for i in TENSOR_FIELDS))
    ctx.problem = problem._replace(**_NO_TENSORS)
    ctx.mark_non_differentiable(lse)


def _saved(ctx) -> Tuple[Problem, Tensor, Tensor]:
    """(problem, out, lse) as _save left them."""
    out, lse, *tensors = ctx.saved_tensors
    fields = list(ctx.problem)
    for index, t in zip(TENSOR_FIELDS, tensors):
        fields[index] = t
    return Problem(*fields), out, lse


def _setup_context(ctx, inputs, output):
    problem = Problem.from_op_args(inputs)
    refuse_modifier_gradient(problem.alibi_slopes, problem.score_mod_table, recording=True)
    _save(ctx, problem, *output)


_DOUBLE_BACKWARD_MESSAGE = (
    "jagflash: double backward is not supported: the gradients of jagged_attention cannot be "
    "differentiated again (torch.autograd.grad(..., create_graph=True) and then a backward through "
    "its result, as a gradient penalty does)"
)


class _RefuseDoubleBackward(torch.autograd.Function):
    """The gradients as a backward under create_graph=True returns them (dq, dk, dv, and the sinks'
    when asked for), tied to what they depend on (dout, q, k, v, the sinks) by a node whose own
    backward raises. The C library's gradients are constants to autograd: without this node a loss
    built on them (a gradient penalty) would train on a gradient that silently lacks the
    attention's second-order term."""

    @staticmethod
    def forward(ctx, count, *gradients_then_depends_on):
        return gradients_then_depends_on[:count]

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


def _refuse_double_backward(gradients, dout, problem):
    """Only under create_graph=True (grad mode on inside a backward) is there anything to tie;
    a plain backward returns the gradients (a tuple) as they are."""
    if not torch.is_grad_enabled():
        return gradients
    depends_on = [t for t in (dout, problem.q, problem.k, problem.v, problem.learnable_sink) if t is not None]
    if any(t.requires_grad for t in depends_on):
        return _RefuseDoubleBackward.apply(len(gradients), *gradients, *depends_on)
    return gradients


def _sink_gradient(problem: Problem, dlearnable_sink: Tensor, wanted: bool) -> Optional[Tensor]:
    """The sinks' gradient in their own dtype (the C library gives float32), None when not wanted."""
    return dlearnable_sink.to(problem.learnable_sink.dtype) if wanted else None


def _op_backward(ctx, dout, pooled):
    """The registered forward ops' autograd: the backward op's gradients where the forward op's
    inputs were (q, k, v first; the sinks' where they were, when they require grad); no gradient
    for the offsets, the scalars, the slopes, the block mask or the modifier's table."""
    problem, out, lse = _saved(ctx)
    op, sink_at, field_count = (pooled_bwd, _POOLED_SINK_AT, len(POOLED_FIELDS)) if pooled else \
        (bwd, _SINK_AT, len(Problem._fields))
    sink_grad = problem.learnable_sink is not None and ctx.needs_input_grad[sink_at]
    args = backward_op_args(problem.op_args(pooled=pooled), out, lse, dout.to(problem.q.dtype), sink_grad)
    # no_grad: the op has no autograd of its own; _refuse_double_backward gives the gradients theirs.
    with torch.no_grad():
        dq, dk, dv, dsink = op(*args)
        dsink = _sink_gradient(problem, dsink, sink_grad)
    gradients = _refuse_double_backward((dq, dk, dv) if dsink is None else (dq, dk, dv, dsink), dout, problem)
    result = [*gradients[:3]] + [None] * (field_count - 3)
    if dsink is not None:
        result[sink_at] = gradients[3]
    return tuple(result)


def _backward(ctx, dout, _dlse):
    return _op_backward(ctx, dout, pooled=False)


fwd.register_autograd(_backward, setup_context=_setup_context)


# ---- Pooled attention (jf_problem.pooled_q_rows): q [Lq, H, D] shared by every sequence of k, v.
@torch.library.custom_op("jagflash::pooled_fwd", mutates_args=(), schema=op_schema(pooled=True))
def pooled_fwd(*args):
    """out [B*Lq, H, Dv] (sequence b's rows at b*Lq) and lse [H, B*Lq] float32, B = kv_offsets'
    length - 1. deterministic: for the backward, as in fwd."""
    return _launch.pooled_forward(Problem.from_op_args(args, pooled=True))


@pooled_fwd.register_fake
def _pooled_fwd_fake(*args):
    problem = Problem.from_op_args(args, pooled=True)
    _check_fake(problem, pooled=True)
    q = problem.q
    lq, heads, _ = q.shape
    rows = (problem.kv_offsets.shape[0] - 1) * lq
    return q.new_empty((rows, heads, problem.v.shape[-1])), q.new_empty((heads, rows), dtype=torch.float32)


@torch.library.custom_op("jagflash::pooled_bwd", mutates_args=(), schema=op_schema(pooled=True, backward=True))
def pooled_bwd(*args):
    """dq [Lq, H, D] (the sum of every sequence's contribution), dk, dv per sequence, and
    dlearnable_sink as bwd's."""
    forward_args, out, lse, dout, sink_grad = split_backward_op_args(args, pooled=True)
    return _op_gradients(*_launch.pooled_backward(Problem.from_op_args(forward_args, pooled=True), out, lse, dout,
                                                  sink_grad))


@pooled_bwd.register_fake
def _pooled_bwd_fake(*args):
    forward_args, _, _, _, sink_grad = split_backward_op_args(args, pooled=True)
    problem = Problem.from_op_args(forward_args, pooled=True)
    _check_fake(problem, backward=True, pooled=True)
    _launch.check_sink_grad(problem.learnable_sink, sink_grad)
    return _gradients_fake(problem, sink_grad)


def _pooled_setup_context(ctx, inputs, output):
    problem = Problem.from_op_args(inputs, pooled=True)
    refuse_modifier_gradient(problem.alibi_slopes, problem.score_mod_table, recording=True)
    _save(ctx, problem, *output)


def _pooled_backward(ctx, dout, _dlse):
    return _op_backward(ctx, dout, pooled=True)


pooled_fwd.register_autograd(_pooled_backward, setup_context=_pooled_setup_context)


class EagerAttention(torch.autograd.Function):
    """The same forward/backward as torch.ops.jagflash.fwd with its autograd formula, without the
    custom-op dispatch (argument filling, redispatch: a large share of the binding's host time per
    call; figures: bench/NOTES.md, "Figures moved out of code comments"). jagged_attention takes it
    in plain eager mode only; anything that
    traces (torch.compile, export, fake or meta tensors, subclasses, function modes) goes through
    the registered op, which is what gives those their fake kernel and opcheck guarantees.

    Called through eager_attention (below): q, k, v, q_offsets and kv_offsets, the tensors autograd
    is to see, then the whole Problem (each argument costs autograd.Function's apply time), then
    the sinks when the problem has them (autograd sees them there: they are differentiable). The
    backward gets what the registered op's gets (_save, _saved)."""

    @staticmethod
    def forward(ctx, q, k, v, q_offsets, kv_offsets, problem, *learnable_sink):
        # The tensors as apply passed them (unwrapped), in place of the problem's.
        problem = Problem(q, k, v, q_offsets, kv_offsets, *problem[5:_SINK_AT], *learnable_sink or (None,))
        out, lse = _launch.forward(problem)
        _save(ctx, problem, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        problem, out, lse = _saved(ctx)
        if dout.dtype is not problem.q.dtype:
            dout = dout.to(problem.q.dtype)
        has_sink = problem.learnable_sink is not None
        sink_grad = has_sink and ctx.needs_input_grad[_EAGER_SINK_AT]
        # Under create_graph=True the copies the binding may make are not recorded (a plain backward
        # records nothing anyway).
        with torch.no_grad():
            dq, dk, dv, dsink = _launch.backward(problem, out, lse, dout, sink_grad)
            dsink = _sink_gradient(problem, dsink, sink_grad)
        gradients = _refuse_double_backward((dq, dk, dv) if dsink is None else (dq, dk, dv, dsink), dout, problem)
        dsink = gradients[3] if sink_grad else None
        return (*gradients[:3], None, None, None) + ((dsink,) if has_sink else ())


# The sinks' place among EagerAttention.forward's inputs (after q, k, v, the offsets and the problem).
_EAGER_SINK_AT = 6


# autograd.Function.apply less its Python prologue: outside functorch transforms that prologue
# only unwraps dead functorch wrappers (done below, per tensor) before calling this C function;
# together with the problem as one argument it saves about a third of the eager call's autograd cost.
_apply_eager = super(torch.autograd.Function, EagerAttention).apply
_functorch_transforms_active = torch._C._are_functorch_transforms_active
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead


def eager_attention(problem: Problem):
    """EagerAttention on a Problem: (out, lse), differentiable in q, k, v and the sinks."""
    q, k, v, q_offsets, kv_offsets = problem[:5]
    # The sinks as one input more only when given: an argument costs apply time on every call.
    sink = () if problem.learnable_sink is None else (problem.learnable_sink,)
    if _functorch_transforms_active():
        return EagerAttention.apply(q, k, v, q_offsets, kv_offsets, problem, *sink)
    return _apply_eager(_unwrap_if_dead(q), _unwrap_if_dead(k), _unwrap_if_dead(v), _unwrap_if_dead(q_offsets),
                        _unwrap_if_dead(kv_offsets), problem, *map(_unwrap_if_dead, sink))
# Looked up once: the check below runs on every eager call.
_is_compiling = torch.compiler.is_compiling
_function_mode_depth = torch._C._len_torch_function_stack


_Parameter = torch.nn.Parameter


def eager_fast_path_allowed(*tensors: Tensor) -> bool:
    """Plain tensors (an nn.Parameter is one: a model's learnable sinks are) on a real device, no
    tracing and no function mode: nothing the custom op's dispatch would add anything for.
    (is_cuda / is_cpu rather than device.type: no torch.device built per tensor, a third of this
    check's cost.)"""
    if _is_compiling() or _function_mode_depth():
        return False
    for t in tensors:
        if (type(t) is not torch.Tensor and type(t) is not _Parameter) or not (t.is_cuda or t.is_cpu):
            return False
    return True
