"""One call's arguments (jagflash._problem.Problem) and their one flat layout: flattening for the
custom ops and back is the identity, the ops' schemas are Problem's fields in its order with its
types' defaults, and the compiled binding's ops take the layout _launch derives from them, so
none of the three can drift from the class."""
import pytest
import torch

from jagflash import _launch, _lib, ops
from jagflash._problem import (POOLED_FIELDS, SINK_GRAD, TENSOR_FIELDS, Problem, backward_op_args,
                               split_backward_op_args)


def _problem(pooled=False):
    """A problem whose fields all differ from their defaults and from each other (a swap of two
    fields shows), not one the library would accept (two modifiers, a map beside pooled q)."""
    q, k, v = torch.zeros(5, 2, 8), torch.ones(6, 1, 8), torch.full((6, 1, 8), 2.0)
    tensor = torch.arange(3, dtype=torch.int32)
    return Problem(q=q, k=k, v=v, q_offsets=None if pooled else tensor, kv_offsets=tensor.clone(), mask=1,
                   window_left=3, window_right=4, scale=0.5, check_offsets="host", max_seqlen=7, deterministic=True,
                   softcap=30.0, alibi_slopes=torch.ones(2), block_mask_blocks=None if pooled else torch.ones(1),
                   block_mask_offsets=None if pooled else tensor.clone(), score_mod=9, score_mod_table=torch.ones(2, 4),
                   learnable_sink=torch.full((2,), 3.0))


def _same(a, b):
    return len(a) == len(b) and all(x is y or (not isinstance(x, torch.Tensor) and x == y) for x, y in zip(a, b))


@pytest.mark.parametrize("pooled", [False, True])
def test_flatten_then_unflatten_is_the_identity(pooled):
    problem = _problem(pooled)
    args = problem.op_args(pooled=pooled)
    assert len(args) == len(POOLED_FIELDS if pooled else Problem._fields)
    assert _same(Problem.from_op_args(args, pooled=pooled), problem)


@pytest.mark.parametrize("pooled", [False, True])
def test_backward_arguments_split_back_into_the_forward_ones(pooled):
    args = _problem(pooled).op_args(pooled=pooled)
    out, lse, dout = torch.zeros(1), torch.zeros(2), torch.zeros(3)
    backward = backward_op_args(args, out, lse, dout, True)
    assert backward[0] is dout and backward[4] is out and backward[5] is lse  # dout first, out and lse after v
    assert backward[-1] is True  # learnable_sink_grad after the forward's arguments
    forward, *rest = split_backward_op_args(backward, pooled=pooled)
    assert _same(forward, args) and _same(rest, (out, lse, dout, True))
    # torch passes a custom op's trailing defaults as absent: learnable_sink_grad False, the
    # forward's arguments as far as given.
    forward, *rest = split_backward_op_args(backward[:-3], pooled=pooled)
    assert _same(forward, args[:-2]) and _same(rest, (out, lse, dout, False))


def test_the_saved_tensors_are_the_tensor_fields():
    assert [Problem._fields[i] for i in TENSOR_FIELDS] == [
        "q", "k", "v", "q_offsets", "kv_offsets", "alibi_slopes", "block_mask_blocks", "block_mask_offsets",
        "score_mod_table", "learnable_sink"]


def _expected(fields, backward, sink_grad=SINK_GRAD):
    """The argument names of an op on `fields`; a backward op's last says where the sinks' gradient
    goes (the custom ops: learnable_sink_grad; the binding's: dlearnable_sink, a tensor)."""
    return backward_op_args(tuple(fields), "out", "lse", "dout", sink_grad) if backward else tuple(fields)


@pytest.mark.parametrize("op,fields,backward", [
    (ops.fwd, Problem._fields, False), (ops.bwd, Problem._fields, True),
    (ops.pooled_fwd, POOLED_FIELDS, False), (ops.pooled_bwd, POOLED_FIELDS, True)])
def test_op_schemas_take_the_fields_in_order(op, fields, backward):
    arguments = op._opoverload._schema.arguments
    assert tuple(a.name for a in arguments) == _expected(fields, backward)
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
    expected = {name: Problem._field_defaults[name] for name in fields if name in Problem._field_defaults}
    if backward:
        expected[SINK_GRAD] = False
    assert defaults == expected


@pytest.mark.parametrize("op", [ops.bwd, ops.pooled_bwd])
def test_backward_ops_return_the_sinks_gradient_after_dq_dk_dv(op):
    returns = op._opoverload._schema.returns
    assert [str(r.type) for r in returns] == ["Tensor"] * 4

@pytest.mark.parametrize("name,pooled,backward", [
    ("fwd", False, False), ("bwd", False, True), ("pooled_fwd", True, False), ("pooled_bwd", True, True)])
def test_binding_ops_take_the_layout_launch_passes(name, pooled, backward):
    _lib.binding()
    schema = getattr(torch.ops.jagflash_c, name).default._schema
    passed = tuple("offsets_check" if f == "check_offsets" else f for f in _launch.binding_fields(pooled, backward))
    assert tuple(a.name for a in schema.arguments) == _expected(passed, backward, "dlearnable_sink")
