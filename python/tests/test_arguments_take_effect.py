"""No entry point accepts an argument and ignores it: for every optional argument of
jagged_attention, attention, pooled_attention and flash_attn_varlen_func, a value other than the
default either changes the result or raises. The arguments are read from each function's
signature, so a new one fails here until it is given a value below (or a reason it cannot change a
result on the CPU)."""
import inspect

import pytest
import torch

import jagflash
from conftest import make_batch, offsets_of
from jagflash import BlockMask

HEADS, KV_HEADS, HEAD_DIM = 2, 1, 16
Q_LENGTHS, KV_LENGTHS = [5, 3], [6, 4]
LQ = 3  # pooled queries

# Arguments that by contract change no value on the CPU: hints (speed only), the offsets check
# mode (CPU offsets are always checked on the host) and the backward's deterministic mode (the
# reference is deterministic).
NO_EFFECT_ON_CPU = {"max_seqlen_q", "max_seqlen_kv", "max_seqlen_k", "check_offsets", "deterministic"}


def _batch():
    return make_batch(541, q_lengths=Q_LENGTHS, kv_lengths=KV_LENGTHS, heads=HEADS, kv_heads=KV_HEADS,
                      head_dim=HEAD_DIM)


def _hide_all(q_lengths, kv_lengths):
    """A block map that hides every block: any call that reads it gives out = 0."""
    maps = [torch.zeros(-(-lq // 128), -(-lk // 128), dtype=torch.bool) for lq, lk in zip(q_lengths, kv_lengths)]
    return BlockMask.from_maps(maps, offsets_of(q_lengths), offsets_of(kv_lengths))


def _table():
    return torch.linspace(-2.0, 2.0, HEADS * 5).reshape(HEADS, 5)


# One value per argument that must change the result (or raise). score_mod and score_mod_table are
# given together (either alone raises, which the test also accepts, but together they must change
# the output).
_SLOPES = torch.tensor([0.5, 2.0])
CHANGED = {
    "causal": True,
    "window": (1, 0),
    "window_size": (1, 0),
    "scale": 0.5,
    "softmax_scale": 0.5,
    "return_lse": True,
    "return_attn_probs": True,
    "softcap": 0.1,
    "alibi_slopes": _SLOPES,
    "score_mod": {"score_mod": "relative_bias", "score_mod_table": _table()},
    "score_mod_table": {"score_mod": "relative_bias", "score_mod_table": _table()},
    "dropout_p": 0.5,
    "block_table": torch.zeros(2, 1, dtype=torch.int32),
    "learnable_sink": torch.tensor([0.5, 2.0]),
}


def _jagged(batch, **kwargs):
    return jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, **kwargs)


def _nested(batch, **kwargs):
    def nest(t, offsets):
        return torch.nested.nested_tensor_from_jagged(t, offsets)

    out = jagflash.attention(nest(batch.q, batch.q_offsets), nest(batch.k, batch.kv_offsets),
                             nest(batch.v, batch.kv_offsets), **kwargs)
    return out.values()


def _pooled(batch, **kwargs):
    return jagflash.pooled_attention(batch.q[:LQ], batch.k, batch.v, batch.kv_offsets, **kwargs)


def _varlen(batch, **kwargs):
    return jagflash.flash_attn_varlen_func(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, None, None,
                                           **kwargs)


ENTRY_POINTS = {
    "jagged_attention": (jagflash.jagged_attention, _jagged, 5, (Q_LENGTHS, KV_LENGTHS)),
    "attention": (jagflash.attention, _nested, 3, (Q_LENGTHS, KV_LENGTHS)),
    "pooled_attention": (jagflash.pooled_attention, _pooled, 4, ([LQ] * len(KV_LENGTHS), KV_LENGTHS)),
    "flash_attn_varlen_func": (jagflash.flash_attn_varlen_func, _varlen, 7, None),
}


def _optional_arguments(function, positional):
    return list(inspect.signature(function).parameters)[positional:]


def _cases():
    for entry, (function, _, positional, _) in ENTRY_POINTS.items():
        for name in _optional_arguments(function, positional):
            yield pytest.param(entry, name, id=f"{entry}-{name}")


def _first(result):
    return result[0] if isinstance(result, tuple) else result


@pytest.mark.parametrize("entry,name", list(_cases()))
def test_every_argument_changes_the_result_or_raises(entry, name):
    _, call, _, block_lengths = ENTRY_POINTS[entry]
    if name in NO_EFFECT_ON_CPU:
        pytest.skip(f"{name} changes no value on the CPU by contract (module docstring)")
    if name == "block_mask":
        changed = {"block_mask": _hide_all(*block_lengths)}
    else:
        assert name in CHANGED, f"{entry}'s argument {name} has no value in CHANGED: give it one"
        value = CHANGED[name]
        changed = value if isinstance(value, dict) else {name: value}
    batch = _batch()
    plain = call(batch)
    try:
        result = call(batch, **changed)
    except jagflash.JagflashError:
        return  # refused: not ignored
    if type(result) is not type(plain):
        return  # another return convention (return_lse, return_attn_probs)
    assert not torch.equal(_first(result), _first(plain)), f"{entry} accepted {name}={changed} and ignored it"


def test_pooled_attention_refuses_a_block_mask_naming_it():
    batch = _batch()
    mask = _hide_all([LQ] * len(KV_LENGTHS), KV_LENGTHS)
    with pytest.raises(jagflash.UnsupportedError, match=r"^block_mask: expected None \(pooled attention .*got "
                                                        r"BlockMask$"):
        _pooled(batch, block_mask=mask)


@pytest.mark.parametrize("entry", ["jagged_attention", "pooled_attention"])
@pytest.mark.parametrize("flag", ["no", 0, 1, None])
def test_return_lse_takes_only_a_bool(entry, flag):
    """A truthy "no" was taken as True (and 0 as False): refused as causal= is."""
    _, call, _, _ = ENTRY_POINTS[entry]
    with pytest.raises(jagflash.InvalidArgumentError, match=rf"^return_lse: expected True or False, got {flag!r}$"):
        call(_batch(), return_lse=flag)
