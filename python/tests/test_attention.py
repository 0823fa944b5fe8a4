"""jagged_attention forward and all three gradients against float64 SDPA: every mask, dtypes,
self and cross attention, MHA/GQA/MQA, empty and length-1 sequences, strided inputs."""
import math
import zlib

import pytest
import torch

import jagflash
from conftest import (DEVICES, LSE_TOLERANCE, MASKS, TOLERANCES, assert_close, assert_lse_close, assert_same,
                      check_against_reference, make_batch, random_lengths, reference)

# (heads, kv_heads, cross attention): MHA self-attention, GQA and MQA with Lq != Lk.
LAYOUTS = {"mha_self": (4, 4, False), "gqa_cross": (4, 2, True), "mqa_cross": (4, 1, True)}


def _cases():
    for device in DEVICES:
        name = device if isinstance(device, str) else device.values[0]
        marks = () if isinstance(device, str) else device.marks
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for mask in MASKS:
                for layout in LAYOUTS:
                    yield pytest.param(name, dtype, mask, layout, marks=marks,
                                       id=f"{name}-{str(dtype)[6:]}-{mask}-{layout}")


@pytest.mark.parametrize("device,dtype,mask,layout", list(_cases()))
def test_matches_float64_sdpa(device, dtype, mask, layout):
    heads, kv_heads, cross = LAYOUTS[layout]
    seed = zlib.crc32(f"{dtype}-{mask}-{layout}".encode()) % 100_000
    g = torch.Generator().manual_seed(seed)
    q_lengths = random_lengths(g, 7, 40)
    # Cross attention: unrelated kv lengths, so some sequences have Lq > Lk (rows that see no
    # key once bottom-right aligned) and one has Lq > 0 with Lk = 0.
    kv_lengths = random_lengths(g, 7, 40) if cross else None
    if cross:
        kv_lengths[1], q_lengths[1] = 0, 5
    batch = make_batch(seed, q_lengths=q_lengths, kv_lengths=kv_lengths, heads=heads, kv_heads=kv_heads,
                       dtype=dtype, device=device)
    causal, window = MASKS[mask]
    check_against_reference(batch, causal=causal, window=window)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [128, 256])
def test_other_head_dims(device, head_dim):
    batch = make_batch(11, q_lengths=[5, 0, 33, 1], heads=2, head_dim=head_dim, device=device)
    check_against_reference(batch, causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_scale(device):
    batch = make_batch(12, q_lengths=[9, 1, 20], device=device)
    check_against_reference(batch, scale=0.3)


@pytest.mark.parametrize("device", DEVICES)
def test_int64_offsets_and_default_kv_offsets(device):
    batch = make_batch(13, q_lengths=[3, 0, 17, 1, 8], device=device)
    expected = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    got = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets.long())
    assert_same(got, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lengths", [[], [0, 0, 0], [1]], ids=["B=0", "all-empty", "one-token"])
def test_degenerate_batches(device, lengths):
    batch = make_batch(14, q_lengths=lengths, device=device)
    check_against_reference(batch, causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_from_fused_qkv(device):
    """q, k, v as slices of one [T, 3H, D] projection: their row stride is 3*H*D, passed as is."""
    batch = make_batch(15, q_lengths=[7, 1, 30, 0, 12], device=device)
    fused = torch.cat([batch.q, batch.k, batch.v], dim=1).requires_grad_()
    heads = batch.q.shape[1]
    q, k, v = fused[:, :heads], fused[:, heads:2 * heads], fused[:, 2 * heads:]
    assert not q.is_contiguous()
    out = jagflash.jagged_attention(q, k, v, batch.q_offsets, causal=True)
    out.backward(batch.dout)
    q2, k2, v2 = batch.leaves()
    expected = jagflash.jagged_attention(q2, k2, v2, batch.q_offsets, causal=True)
    expected.backward(batch.dout)
    assert_same(out, expected)
    assert_same(fused.grad, torch.cat([q2.grad, k2.grad, v2.grad], dim=1))


@pytest.mark.parametrize("device", DEVICES)
def test_broadcast_gradient_and_transposed_head_dim(device):
    """out.sum() sends back an expanded (stride 0) gradient, and a q whose head dim is not
    contiguous must be copied: both give the same numbers as dense inputs."""
    batch = make_batch(16, q_lengths=[4, 9, 1], device=device)
    q_t = batch.q.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
    assert q_t.stride(-1) != 1
    out = jagflash.jagged_attention(q_t, batch.k, batch.v, batch.q_offsets)
    out.sum().backward()
    q = batch.q.clone().requires_grad_()
    expected = jagflash.jagged_attention(q, batch.k, batch.v, batch.q_offsets)
    expected.backward(torch.ones_like(expected))
    assert_same(out, expected)
    assert_same(q_t.grad, q.grad)


@pytest.mark.parametrize("device", DEVICES)
def test_lse_is_returned_but_not_differentiable(device):
    batch = make_batch(17, q_lengths=[6, 2], device=device)
    q, k, v = batch.leaves()
    out, lse = jagflash.jagged_attention(q, k, v, batch.q_offsets, return_lse=True)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    assert out.requires_grad and not lse.requires_grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "kwargs,hint",
    [
        ({"max_seqlen_q": 6, "max_seqlen_kv": 7}, 7),  # the larger bound
        ({"max_seqlen_q": 6}, 6),  # kv_offsets=None: kv is q, so its bound too
        ({"max_seqlen_q": 6, "kv_offsets": "given"}, 0),  # kv's bound unknown
        ({}, 0),
    ],
    ids=["both", "self-attention", "kv-unknown", "none"],
)
def test_max_seqlen_reaches_the_launch_and_changes_no_result(device, kwargs, hint, launches):
    """The bounds become jf_launch.max_seqlen_hint of the forward and of the backward (on the GPU
    a short one picks another forward kernel); whatever the hint, the results are the
    reference's. The CPU reference ignores the hint, so only the launch shows it there."""
    batch = make_batch(18, q_lengths=[6, 2], device=device)
    kwargs = dict(kwargs)
    kv_offsets = batch.kv_offsets if kwargs.pop("kv_offsets", None) else None
    q, k, v = batch.leaves()
    out, lse = jagflash.jagged_attention(q, k, v, batch.q_offsets, kv_offsets, return_lse=True, **kwargs)
    out.backward(batch.dout)
    assert [(direction, launch.max_seqlen_hint) for direction, launch in launches] == [("fwd", hint), ("bwd", hint)]
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = reference(batch)
    tol_out, tol_grad = TOLERANCES[batch.q.dtype]
    assert_close("out", out, ref_out, tol_out, batch.seed)
    assert_lse_close(lse, ref_lse, LSE_TOLERANCE[batch.q.dtype], batch.seed)
    for name, got, want in (("dq", q.grad, ref_dq), ("dk", k.grad, ref_dk), ("dv", v.grad, ref_dv)):
        assert_close(name, got, want, tol_grad, batch.seed)


def test_default_scale_is_inverse_sqrt_head_dim():
    batch = make_batch(19, q_lengths=[6, 5])
    a = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets)
    b = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, scale=1 / math.sqrt(64))
    assert_same(a, b)
