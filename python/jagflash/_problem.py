"""One attention call's arguments (Problem) and the one place that lays them out flat for the
custom ops torch.ops.jagflash.fwd / .bwd / .pooled_fwd / .pooled_bwd (ops.py), which take
tensors and scalars only: their argument order, their schemas, the pooled subset, and where the
backward ops put dout, out and lse. A new argument is a new field of Problem; the ops' schemas,
fake kernels and autograd follow from here."""
import inspect
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor


class Problem(NamedTuple):
    """One attention call, built once by its caller (jagged_attention, pooled_attention, backend(),
    the registry's kernels) and passed whole to _launch's forward / backward. A NamedTuple, not a
    dataclass: the eager path builds one per call, and a tuple's construction and field reads are
    the cheapest Python has.

    q [total_q, H, D], k [total_kv, H_kv, D], v [total_kv, H_kv, Dv]; q_offsets, kv_offsets int32
    [B+1] on their device (pooled: q [Lq, H, D] shared by every sequence, q_offsets None). Then the
    C API's scalars: jf_mask and its window (-1 unbounded), scale (0 = 1/sqrt(D), else finite and
    non-zero in float32), the check_offsets mode ("auto", "host" or "device"), max_seqlen (0 or a
    bound on every q and kv length, a kernel-choice hint), deterministic (the backward's dq bitwise
    reproducible too; the forward always is). Then the score modifier: softcap (0 = none),
    alibi_slopes (None or float32 [H]), score_mod and score_mod_table (0 and None, or the jf_score_mod
    of a modifier with a table and that table, float32 [H, W]); one at a time, not differentiable.
    block_mask_blocks (uint8) and block_mask_offsets (int32 [B+1]): the block-sparse map
    (jf_block_mask), both None for none; not pooled. learnable_sink: None, or one logit per query
    head [H] (float32, bfloat16 or float16; jf_problem.learnable_sink) that joins every row's
    softmax denominator without a value; differentiable (the backward ops' dlearnable_sink).

    The field order is the custom ops' argument order (torch.ops.jagflash.fwd(q, k, v, q_offsets,
    ...) is public), so a new field goes after the others, with a default."""

    q: Tensor
    k: Tensor
    v: Tensor
    q_offsets: Tensor
    kv_offsets: Tensor
    mask: int
    window_left: int
    window_right: int
    scale: float
    check_offsets: str
    max_seqlen: int = 0
    deterministic: bool = False
    softcap: float = 0.0
    alibi_slopes: Optional[Tensor] = None
    block_mask_blocks: Optional[Tensor] = None
    block_mask_offsets: Optional[Tensor] = None
    score_mod: int = 0
    score_mod_table: Optional[Tensor] = None
    learnable_sink: Optional[Tensor] = None

    @property
    def modified(self) -> bool:
        """Whether a score modifier applies (the head dims served depend on it)."""
        return self.softcap != 0 or self.alibi_slopes is not None or self.score_mod != 0

    def op_args(self, pooled: bool = False) -> tuple:
        """The arguments of the forward op (pooled_fwd when `pooled`): the fields, flat."""
        if pooled:
            return tuple(getattr(self, name) for name in POOLED_FIELDS)
        return tuple(self)

    @classmethod
    def from_op_args(cls, args: tuple, pooled: bool = False) -> "Problem":
        """The Problem whose op_args(pooled) are `args` (a pooled one has no q_offsets)."""
        if pooled:
            return cls(q_offsets=None, **dict(zip(POOLED_FIELDS, args)))
        return cls(*args)


# Pooled attention (jf_problem.pooled_q_rows) shares one query set among the sequences: no
# q_offsets, and no block mask (the C library serves none there).
POOLED_FIELDS = tuple(f for f in Problem._fields if f not in ("q_offsets", "block_mask_blocks", "block_mask_offsets"))

# The positions of the fields that hold tensors: what autograd saves for the backward
# (ctx.save_for_backward), so one changed in place in between raises torch's "modified by an
# inplace operation" instead of giving the gradients of other sequences, another map or other
# modifier values.
TENSOR_FIELDS = tuple(i for i, kind in enumerate(Problem.__annotations__.values())
                      if kind in (Tensor, Optional[Tensor]))

# The backward ops take dout first and the forward's out and lse after v, and after the fields
# whether to return the sinks' gradient: a sink that does not require grad gets none computed
# (jf_bwd_args.dlearnable_sink NULL).
_OUT_LSE_AT = Problem._fields.index("v") + 1
SINK_GRAD = "learnable_sink_grad"


def backward_op_args(forward_args: tuple, out: Tensor, lse: Tensor, dout: Tensor,
                     learnable_sink_grad: bool = False) -> tuple:
    """A backward op's arguments from its forward op's (the binding's backward ops take the same
    layout, with where the sinks' gradient goes, a tensor or None, for learnable_sink_grad)."""
    return (dout, *forward_args[:_OUT_LSE_AT], out, lse, *forward_args[_OUT_LSE_AT:], learnable_sink_grad)


def split_backward_op_args(args: tuple, pooled: bool = False) -> Tuple[tuple, Tensor, Tensor, Tensor, bool]:
    """(forward op's arguments, out, lse, dout, learnable_sink_grad) from a backward op's (pooled:
    pooled_bwd's): backward_op_args undone. torch hands a custom op its arguments as the caller
    gave them, so those left at their defaults at the end may be missing (learnable_sink_grad's is
    False; from_op_args fills in the forward's)."""
    sink_grad_at = len(POOLED_FIELDS if pooled else Problem._fields) + 3
    forward_args = args[1:_OUT_LSE_AT + 1] + args[_OUT_LSE_AT + 3:sink_grad_at]
    sink_grad = args[sink_grad_at] if len(args) > sink_grad_at else False
    return forward_args, args[_OUT_LSE_AT + 1], args[_OUT_LSE_AT + 2], args[0], sink_grad


def op_schema(pooled: bool = False, backward: bool = False) -> str:
    """The schema of one of the four custom ops: the fields (POOLED_FIELDS when `pooled`) as its
    arguments, typed and defaulted as Problem declares them; a backward op's dout, out, lse and
    learnable_sink_grad where backward_op_args puts them, and four gradients returned instead of
    out and lse: dq, dk, dv and dlearnable_sink (float32 [H] with learnable_sink_grad, else empty)."""
    declared = inspect.signature(Problem).parameters
    arguments = [declared[name] for name in (POOLED_FIELDS if pooled else Problem._fields)]
    returns = Tuple[Tensor, Tensor]
    if backward:
        def argument(name, annotation=Tensor, **default):
            return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation, **default)
        arguments = backward_op_args(tuple(arguments), argument("out"), argument("lse"), argument("dout"),
                                     argument(SINK_GRAD, bool, default=False))
        returns = Tuple[Tensor, Tensor, Tensor, Tensor]

    def prototype(*args):
        pass

    signature = inspect.Signature(list(arguments), return_annotation=returns)
    prototype.__signature__ = signature  # type: ignore[attr-defined]
    return torch.library.infer_schema(prototype, mutates_args=())
