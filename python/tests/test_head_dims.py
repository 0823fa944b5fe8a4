"""Every head dim that is a multiple of 8 up to 256, and a v head dim of its own (Dv <= D), on CPU
tensors (the C++ float64 reference) through jagged_attention, attention (nested),
flash_attn_varlen_func and the custom ops' fake kernels; on CUDA tensors the Hopper kernels' head
dims (padded below 64 / 128 / 256, either direction) against the float64 reference, and what no GPU
path serves yet refused with UnsupportedError before anything launches (checked on fake CUDA
tensors, which need no GPU: the fake kernels and jagflash.backend run the C library's rules)."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import jagflash
from conftest import (MASKS, TOLERANCES, LSE_TOLERANCE, assert_close, assert_lse_close, assert_same,
                      check_against_reference, make_batch, needs_cuda, offsets_of, assert_compiled_matches_eager,
                      opcheck_fwd_bwd, reference, skip_unless_hopper_serves)

# (D, Dv): head dims models bring (Phi-2's 80, GPT-NeoX's 96, DeepSeek's 192 / 128) and the
# edges of the range.
HEAD_DIMS = [(8, 8), (72, 72), (80, 80), (96, 96), (200, 200), (192, 128), (64, 32), (256, 8)]
Q_LENGTHS = [7, 0, 1, 13, 5]
KV_LENGTHS = [9, 4, 0, 13, 2]


def _id(dims):
    d, dv = dims
    return f"d{d}" if d == dv else f"d{d}_v{dv}"


def _batch(seed, dims, **kwargs):
    d, dv = dims
    kwargs.setdefault("q_lengths", Q_LENGTHS)
    kwargs.setdefault("kv_lengths", KV_LENGTHS)
    kwargs.setdefault("heads", 4)
    kwargs.setdefault("kv_heads", 2)
    return make_batch(seed, head_dim=d, v_head_dim=dv, **kwargs)


@pytest.mark.parametrize("dims", HEAD_DIMS, ids=_id)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_left8", "window_3_2"])
def test_jagged_attention_matches_the_reference(dims, mask):
    causal, window = MASKS[mask]
    batch = _batch(900 + HEAD_DIMS.index(dims), dims)
    check_against_reference(batch, causal=causal, window=window)


@pytest.mark.parametrize("dims", [(192, 128), (96, 96), (64, 32)], ids=_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_and_mqa(dims, dtype):
    batch = _batch(920, dims, dtype=dtype, kv_heads=1)
    check_against_reference(batch, causal=True)


@pytest.mark.parametrize("dims", [(192, 128), (72, 72)], ids=_id)
def test_scale_default_is_one_over_sqrt_of_q_s_head_dim(dims):
    batch = _batch(930, dims)
    default = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    explicit = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                         scale=dims[0] ** -0.5)
    torch.testing.assert_close(default, explicit, rtol=1e-6, atol=1e-6)
    check_against_reference(batch, scale=0.3)


def test_shapes_follow_v_s_head_dim():
    batch = _batch(940, (192, 128))
    q, k, v = batch.leaves()
    out, lse = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, return_lse=True)
    assert out.shape == (q.shape[0], 4, 128) and lse.shape == (4, q.shape[0])
    out.backward(batch.dout)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape == (k.shape[0], 2, 128)
    assert jagflash.backend(q, k, v, batch.q_offsets, batch.kv_offsets) == "reference"
    assert jagflash.backend(q, k, v, batch.q_offsets, batch.kv_offsets, backward=True) == "reference"


def test_the_eager_path_and_the_custom_op_agree():
    """The plain eager call (the binding through an autograd.Function) and the registered op (its
    autograd formula) on a v head dim of its own."""
    batch = _batch(945, (192, 128))
    results = []
    for through_op in (False, True):
        q, k, v = batch.leaves()
        if through_op:
            out, _ = torch.ops.jagflash.fwd(q, k, v, batch.q_offsets, batch.kv_offsets, 1, -1, -1, 0.0, "auto")
        else:
            out = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=True)
        out.backward(batch.dout)
        results.append((out, q.grad, k.grad, v.grad))
    for got, expected in zip(*results):
        assert_same(got, expected)


def test_bad_head_dims_are_refused_on_the_cpu():
    batch = _batch(950, (64, 64))
    q, k, v = batch.q, batch.k, batch.v
    with pytest.raises(jagflash.UnsupportedError, match=r"^v.shape\[-1\]: expected a multiple of 8 from 8 to q's head "
                                                        r"dim \(64\), got 72$"):
        jagflash.jagged_attention(q, k, torch.randn(v.shape[0], 2, 72), batch.q_offsets, batch.kv_offsets)
    with pytest.raises(jagflash.UnsupportedError, match=r"^v.shape\[-1\]: expected a multiple of 8 .*, got 20$"):
        jagflash.jagged_attention(q, k, v[..., :20], batch.q_offsets, batch.kv_offsets)
    with pytest.raises(jagflash.UnsupportedError, match=r"^q.shape\[-1\]: expected a multiple of 8 from 8 to 256, "
                                                        r"got 264$"):
        big = torch.randn(q.shape[0], 4, 264)
        jagflash.jagged_attention(big, big, big, batch.q_offsets)
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^k.shape\[-1\]: expected 64, got 32$"):
        jagflash.jagged_attention(q, k[..., :32], v[..., :32], batch.q_offsets, batch.kv_offsets)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.parametrize("dims", [(192, 128), (80, 80)], ids=_id)
def test_nested_attention(dims):
    batch = _batch(960, dims, kv_lengths=Q_LENGTHS)
    q_off = batch.q_offsets

    def nested(t):
        return torch.nested.nested_tensor_from_jagged(t, q_off)

    q, k, v = batch.leaves()
    out = jagflash.attention(nested(q), nested(k), nested(v), causal=True)
    assert out.is_nested and out.values().shape == (q.shape[0], 4, dims[1])
    out.values().backward(batch.dout)
    ref_out, _, ref_dq, ref_dk, ref_dv = reference(batch, causal=True)
    tol_out, tol_grad = TOLERANCES[q.dtype]
    assert_close("out", out.values(), ref_out, tol_out, batch.seed)
    assert_close("dq", q.grad, ref_dq, tol_grad, batch.seed)
    assert_close("dk", k.grad, ref_dk, tol_grad, batch.seed)
    assert_close("dv", v.grad, ref_dv, tol_grad, batch.seed)


@pytest.mark.parametrize("dims", [(192, 128), (96, 96)], ids=_id)
def test_flash_attn_varlen_func(dims):
    batch = _batch(970, dims)
    q, k, v = batch.leaves()
    out, lse, s_dmask = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, 13, 13,
                                                        causal=True, return_attn_probs=True)
    assert out.shape == (q.shape[0], 4, dims[1]) and s_dmask.numel() == 0
    out.backward(batch.dout)
    ref_out, _, ref_dq, ref_dk, ref_dv = reference(batch, causal=True)
    tol_out, tol_grad = TOLERANCES[q.dtype]
    assert_close("out", out, ref_out, tol_out, batch.seed)
    assert_close("dq", q.grad, ref_dq, tol_grad, batch.seed)
    assert_close("dk", k.grad, ref_dk, tol_grad, batch.seed)
    assert_close("dv", v.grad, ref_dv, tol_grad, batch.seed)


def test_pooled_attention_with_a_v_head_dim_of_its_own():
    kv_off = offsets_of([5, 0, 9])
    q = torch.randn(3, 4, 96, requires_grad=True)
    k = torch.randn(14, 2, 96, requires_grad=True)
    v = torch.randn(14, 2, 64, requires_grad=True)
    out = jagflash.pooled_attention(q, k, v, kv_off)
    assert out.shape == (9, 4, 64)
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape
    # Each sequence's rows equal jagged attention of the query set against that sequence.
    q_off = offsets_of([3, 3, 3])
    jagged = jagflash.jagged_attention(q.detach().repeat(3, 1, 1), k.detach(), v.detach(), q_off, kv_off)
    assert_same(out.detach(), jagged)


# ---- torch.compile and the fake kernels: shapes [.., Dv], no graph break.

def test_fake_kernels_give_v_s_head_dim():
    with FakeTensorMode():
        q = torch.empty(12, 4, 192)
        k = torch.empty(9, 2, 192)
        v = torch.empty(9, 2, 128)
        q_off = torch.zeros(3, dtype=torch.int32)
        kv_off = torch.zeros(3, dtype=torch.int32)
        out, lse = torch.ops.jagflash.fwd(q, k, v, q_off, kv_off, 0, -1, -1, 0.0, "auto")
        assert out.shape == (12, 4, 128) and lse.shape == (4, 12)
        dq, dk, dv, _ = torch.ops.jagflash.bwd(out, q, k, v, out, lse, q_off, kv_off, 0, -1, -1, 0.0, "auto")
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        pooled_out, pooled_lse = torch.ops.jagflash.pooled_fwd(q[:3], k, v, kv_off, 0, -1, -1, 0.0, "auto")
        assert pooled_out.shape == (6, 4, 128) and pooled_lse.shape == (4, 6)


def test_opcheck_with_a_v_head_dim_of_its_own():
    batch = _batch(980, (64, 32), q_lengths=[3, 0, 9, 1], kv_lengths=[5, 2, 9, 0])
    q, k, v = batch.leaves()
    scalars = (1, -1, -1, 0.0, "auto")
    opcheck_fwd_bwd(batch, q, k, v, scalars)


def test_compiled_fullgraph_matches_eager():
    def attention(q, k, v, q_offsets, kv_offsets):
        return jagflash.jagged_attention(q, k, v, q_offsets, kv_offsets, causal=True)

    batch = _batch(990, (192, 128))
    out = assert_compiled_matches_eager(attention, batch)
    assert out.shape == (batch.q.shape[0], 4, 128)


# ---- CUDA: the Hopper kernels take every head dim (padded below 64 / 128 / 256) for bf16/fp16
# without a score modifier or a block mask, either direction (the backward past 128 on the wide
# kernel of 256, padded below it), and a v head dim below q's (not pooled); what nothing serves is
# refused before launch, naming the head dim (checked on fake CUDA tensors, no GPU needed).

V_OF_ITS_OWN = r"^v.shape\[-1\]: expected q's head dim \({d}\) for this call on CUDA \(a v head dim of its own, " \
               r"{dv} here, runs on the Hopper kernels with bf16/fp16, no score modifier, no block mask, not pooled, " \
               r"either direction; otherwise on CPU tensors only so far\), got {dv}$"
Q_HEAD_DIM = r"^q.shape\[-1\]: expected 64, 128 or 256 for this call on CUDA \(head dim {d} runs on the Hopper " \
             r"kernels with bf16/fp16 and no score modifier, either direction; otherwise on CPU tensors only so " \
             r"far\), got {d}$"


def _fake_cuda(dims, dtype=torch.bfloat16):
    d, dv = dims
    q = torch.empty(12, 4, d, dtype=dtype, device="cuda")
    k = torch.empty(9, 2, d, dtype=dtype, device="cuda")
    v = torch.empty(9, 2, dv, dtype=dtype, device="cuda")
    offsets = torch.zeros(3, dtype=torch.int32, device="cuda")
    return q, k, v, offsets


def _entries(q, k, v, off, **kwargs):
    """{name: call} of every forward and backward entry on fake tensors (kwargs: a modifier; the
    pooled ones take q's first 3 rows, so B * Lq = 6 output rows)."""
    op_mod = (kwargs.get("softcap", 0.0), kwargs.get("alibi_slopes"))
    lse = torch.empty(4, 12, device="cuda")
    dv = v.shape[-1]
    return {
        "forward": {
            "jagged_attention": lambda: jagflash.jagged_attention(q, k, v, off, off, causal=True, **kwargs),
            "flash_attn_varlen_func": lambda: jagflash.flash_attn_varlen_func(q, k, v, off, off, 4, 4, **kwargs),
            "op fwd": lambda: torch.ops.jagflash.fwd(q, k, v, off, off, 0, -1, -1, 0.0, "auto", 0, False, *op_mod),
            "pooled_fwd": lambda: torch.ops.jagflash.pooled_fwd(q[:3], k, v, off, 0, -1, -1, 0.0, "auto", 0, False,
                                                                *op_mod),
            "backend": lambda: jagflash.backend(q, k, v, off, off, **kwargs),
        },
        "backward": {
            "op bwd": lambda: torch.ops.jagflash.bwd(q[..., :dv], q, k, v, q[..., :dv], lse, off, off, 0, -1, -1, 0.0,
                                                     "auto", 0, False, *op_mod),
            "pooled_bwd": lambda: torch.ops.jagflash.pooled_bwd(q[:6, :, :dv], q[:3], k, v, q[:6, :, :dv], lse[:, :6],
                                                                off, 0, -1, -1, 0.0, "auto", 0, False, *op_mod),
            "backend backward": lambda: jagflash.backend(q, k, v, off, off, backward=True, **kwargs),
        },
    }


def _expect_refused(calls, message):
    for name, call in calls.items():
        with pytest.raises(jagflash.UnsupportedError, match=message):
            call()


def _block_mask_entries(q, k, v, off):
    """The forward and backward ops with a block-sparse map (the ops' last arguments; fake tensors)."""
    lse = torch.empty(4, 12, device="cuda")
    dv = v.shape[-1]
    blocks = torch.empty(2, dtype=torch.uint8, device="cuda")
    return {
        "op fwd": lambda: torch.ops.jagflash.fwd(q, k, v, off, off, 0, -1, -1, 0.0, "auto", 0, False, 0.0, None,
                                                 blocks, off),
        "op bwd": lambda: torch.ops.jagflash.bwd(q[..., :dv], q, k, v, q[..., :dv], lse, off, off, 0, -1, -1, 0.0,
                                                 "auto", 0, False, 0.0, None, blocks, off),
    }


@pytest.mark.parametrize("dims", [(128, 64), (192, 128), (256, 128), (160, 64)], ids=_id)
def test_cuda_a_v_head_dim_of_its_own_runs_on_the_hopper_kernels(dims):
    """Dv < D (DeepSeek's 192 / 128 among them): both directions on the Hopper kernels (out, dv
    [.., Dv]), past q head dim 128 too (the backward's wide kernel of 256, padded)."""
    with FakeTensorMode():
        q, k, v, off = _fake_cuda(dims)
        entries = _entries(q, k, v, off)
        out, lse = entries["forward"]["op fwd"]()
        assert out.shape == (12, 4, dims[1])
        assert entries["forward"]["jagged_attention"]().shape == (12, 4, dims[1])
        dq, dk, dv, _ = entries["backward"]["op bwd"]()
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_cuda_a_v_head_dim_of_its_own_is_refused_off_the_hopper_kernels():
    """Pooled, with a modifier, with a block mask or fp32: refused in either direction, naming v's
    head dim (before q's, as the C library does: 192 / 128 with a modifier names v's too)."""
    with FakeTensorMode():
        for d, dv in ((128, 64), (256, 64), (192, 128)):
            q, k, v, off = _fake_cuda((d, dv))
            refused = V_OF_ITS_OWN.format(d=d, dv=dv)
            entries = _entries(q, k, v, off)
            _expect_refused({"pooled_fwd": entries["forward"]["pooled_fwd"],
                             "pooled_bwd": entries["backward"]["pooled_bwd"]}, refused)
            for direction in ("forward", "backward"):
                _expect_refused(_entries(q, k, v, off, softcap=5.0)[direction], refused)
                _expect_refused(_entries(*_fake_cuda((d, dv), torch.float32))[direction], refused)
            _expect_refused(_block_mask_entries(q, k, v, off), refused)


@pytest.mark.parametrize("d", [136, 192, 248])
def test_cuda_backward_past_128_runs_on_the_hopper_kernels(d):
    """D off 64/128/256 past 128: both directions on the Hopper kernel of 256, padded (pooled too)."""
    with FakeTensorMode():
        q, k, v, off = _fake_cuda((d, d))
        entries = _entries(q, k, v, off)
        out, lse = entries["forward"]["op fwd"]()
        assert out.shape == (12, 4, d)
        dq, dk, dv, _ = entries["backward"]["op bwd"]()
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        dq, dk, dv, _ = entries["backward"]["pooled_bwd"]()
        assert dq.shape == (3, 4, d) and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("d", [80, 192])
def test_cuda_refuses_a_padded_head_dim_with_a_modifier_a_block_mask_or_fp32(d):
    """Only the Hopper kernels serve D off 64/128/256, and not with a score modifier, a block mask
    or fp32: refused in either direction, naming q's head dim."""
    refused = Q_HEAD_DIM.format(d=d)
    with FakeTensorMode():
        for direction in ("forward", "backward"):
            _expect_refused(_entries(*_fake_cuda((d, d)), softcap=5.0)[direction], refused)
            _expect_refused(_entries(*_fake_cuda((d, d)), alibi_slopes=torch.empty(4, device="cuda"))[direction],
                            refused)
            _expect_refused(_entries(*_fake_cuda((d, d), torch.float32))[direction], refused)
        _expect_refused(_block_mask_entries(*_fake_cuda((d, d))), refused)


@pytest.mark.parametrize("d", [8, 40, 64, 80, 96, 112, 128, 136, 160, 192, 224, 248, 256])
def test_cuda_head_dims_the_hopper_kernels_serve_trace(d):
    """Every head dim, either direction: shapes come out."""
    with FakeTensorMode():
        q, k, v, off = _fake_cuda((d, d))
        out, lse = torch.ops.jagflash.fwd(q, k, v, off, off, 0, -1, -1, 0.0, "auto")
        assert out.shape == (12, 4, d) and out.device.type == "cuda"
        dq, dk, dv, _ = torch.ops.jagflash.bwd(out, q, k, v, out, lse, off, off, 0, -1, -1, 0.0, "auto")
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


CUDA_Q_LENGTHS = [1, 0, 200, 65, 130, 2]
CUDA_KV_LENGTHS = [3, 5, 257, 64, 130, 0]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [8, 32, 40, 72, 80, 96, 112])
@pytest.mark.parametrize("mask", ["none", "causal", "window_3_2"])
def test_cuda_padded_head_dims_match_the_reference(d, dtype, mask):
    causal, window = MASKS[mask]
    batch = make_batch(3000 + d, q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, heads=4, kv_heads=2,
                       head_dim=d, dtype=dtype, device="cuda")
    skip_unless_hopper_serves(dtype, d, backward=True)
    assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets) == "hopper"
    assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, backward=True) == "hopper"
    check_against_reference(batch, causal=causal, window=window)


@needs_cuda
@pytest.mark.parametrize("d", [136, 160, 192, 224])
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_padded_forward_past_128_matches_the_reference(d, causal):
    batch = make_batch(3100 + d, q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, heads=4, kv_heads=2,
                       head_dim=d, device="cuda")
    skip_unless_hopper_serves(batch.q.dtype, d)
    assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets) == "hopper"
    out, lse = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                         causal=causal, return_lse=True)
    ref_out, ref_lse = reference(batch, causal=causal)[:2]
    assert_close("out", out, ref_out, TOLERANCES[batch.q.dtype][0], batch.seed)
    assert_lse_close(lse, ref_lse, LSE_TOLERANCE[batch.q.dtype], batch.seed)


@needs_cuda
@pytest.mark.parametrize("dims", [(192, 128), (128, 64), (80, 32)], ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_narrower_v_forward_matches_the_reference(dims, causal):
    """Dv < D (DeepSeek's 192 / 128): the forward on the Hopper kernels, out [.., Dv]."""
    batch = make_batch(3150 + dims[0] + dims[1], q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, heads=4,
                       kv_heads=2, head_dim=dims[0], v_head_dim=dims[1], device="cuda")
    skip_unless_hopper_serves(batch.q.dtype, *dims)
    assert batch.v.shape[-1] == dims[1]
    assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets) == "hopper"
    out, lse = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                         causal=causal, return_lse=True)
    assert out.shape == (batch.q.shape[0], 4, dims[1])
    ref_out, ref_lse = reference(batch, causal=causal)[:2]
    assert_close("out", out, ref_out, TOLERANCES[batch.q.dtype][0], batch.seed)
    assert_lse_close(lse, ref_lse, LSE_TOLERANCE[batch.q.dtype], batch.seed)


@needs_cuda
@pytest.mark.parametrize("dims", [(128, 64), (96, 64), (64, 32), (80, 8)], ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("mask", ["none", "causal", "window_3_2"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_cuda_narrower_v_backward_matches_the_reference(dims, mask, deterministic):
    """Dv < D with q's head dim up to 128: both directions on the Hopper kernels (V and dO
    zero-filled past Dv), dv [.., Dv], against the float64 reference."""
    causal, window = MASKS[mask]
    batch = make_batch(3170 + dims[0] + dims[1], q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, heads=4,
                       kv_heads=2, head_dim=dims[0], v_head_dim=dims[1], device="cuda")
    skip_unless_hopper_serves(batch.q.dtype, *dims, backward=True)
    assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, backward=True) == "hopper"
    check_against_reference(batch, causal=causal, window=window, deterministic=deterministic)


# ---- CUDA: the backward past head dim 128 on the Hopper kernels: the wide kernel of 256 (its own
# head dim and, padded, every multiple of 8 from 136 to 248 and a narrower v such as DeepSeek's
# 192 / 128), against the float64 reference like the backward up to 128 above.

WIDE_HEAD_DIMS = [136, 160, 192, 224, 248, 256]


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", WIDE_HEAD_DIMS)
@pytest.mark.parametrize("mask", ["none", "causal", "window_3_2"])
def test_cuda_backward_past_128_matches_the_reference(d, dtype, mask):
    """Both directions on the Hopper kernels (the backward's wide kernel of 256, q, k, v, dout
    zero-filled past D below it), GQA (4 heads over 2)."""
    causal, window = MASKS[mask]
    batch = make_batch(3400 + d, q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, heads=4, kv_heads=2,
                       head_dim=d, dtype=dtype, device="cuda")
    skip_unless_hopper_serves(dtype, d, backward=True)
    assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets) == "hopper"
    assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, backward=True) == "hopper"
    check_against_reference(batch, causal=causal, window=window)


@needs_cuda
@pytest.mark.parametrize("dims", [(192, 128), (256, 128)], ids=lambda d: f"{d[0]}-{d[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["none", "causal", "window_3_2"])
def test_cuda_narrower_v_backward_past_128_matches_the_reference(dims, dtype, mask):
    """Dv < D past q head dim 128 (DeepSeek's 192 / 128): both directions on the Hopper kernels (the
    backward's wide kernel of 256, padded: V and dO zero-filled past Dv), dv [.., Dv]."""
    causal, window = MASKS[mask]
    batch = make_batch(3500 + dims[0] + dims[1], q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, heads=4,
                       kv_heads=2, head_dim=dims[0], v_head_dim=dims[1], dtype=dtype, device="cuda")
    skip_unless_hopper_serves(dtype, *dims, backward=True)
    assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, backward=True) == "hopper"
    check_against_reference(batch, causal=causal, window=window)


@needs_cuda
@pytest.mark.parametrize("dims", [(192, 192), (256, 256), (192, 128)], ids=_id)
def test_cuda_backward_past_128_with_mqa(dims):
    """8 query heads over one KV head: the group's dK, dV summed over its 8 heads (and over the
    tiles the group may be split across)."""
    batch = make_batch(3600 + dims[0] + dims[1], q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, heads=8,
                       kv_heads=1, head_dim=dims[0], v_head_dim=dims[1], device="cuda")
    skip_unless_hopper_serves(batch.q.dtype, *dims, backward=True)
    assert jagflash.backend(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, backward=True) == "hopper"
    check_against_reference(batch, causal=True)


@needs_cuda
@pytest.mark.parametrize("dims", [(256, 256), (192, 128)], ids=_id)
def test_cuda_backward_past_128_deterministic_repeats_bitwise(dims):
    """deterministic=True on the wide kernel: out, dq, dk, dv bitwise the same from run to run (dq's
    KV blocks summed in a fixed order), and matching the reference."""
    batch = make_batch(3700 + dims[0] + dims[1], q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, heads=8,
                       kv_heads=2, head_dim=dims[0], v_head_dim=dims[1], device="cuda")
    skip_unless_hopper_serves(batch.q.dtype, *dims, backward=True)
    check_against_reference(batch, deterministic=True)
    runs = []
    for _ in range(3):
        q, k, v = batch.leaves()
        out = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, deterministic=True)
        out.backward(batch.dout)
        runs.append((out, q.grad, k.grad, v.grad))
    for run in runs[1:]:
        for name, got, first in zip(("out", "dq", "dk", "dv"), run, runs[0]):
            assert torch.equal(got, first), f"{name} differs between deterministic runs"


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dims", [(192, 192), (256, 256), (192, 128)], ids=_id)
def test_cuda_backend_says_hopper_for_the_backward_past_128(dims, dtype):
    """jagflash.backend on real CUDA tensors: the Hopper kernels in both directions at 192 and 256;
    with a score modifier the backward at 256 on the oracle, at 192 still refused (naming q's head
    dim, or v's for 192 / 128)."""
    batch = make_batch(3800, q_lengths=[3, 0, 70], kv_lengths=[5, 2, 64], heads=4, kv_heads=2, head_dim=dims[0],
                       v_head_dim=dims[1], dtype=dtype, device="cuda")
    skip_unless_hopper_serves(dtype, *dims, backward=True)
    if dims[0] == 256:
        skip_unless_hopper_serves(dtype, *dims, score_mod="softcap")
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets)
    for backward in (False, True):
        assert jagflash.backend(*args, backward=backward) == "hopper"
    if dims[0] == 256:
        assert jagflash.backend(*args, softcap=5.0) == "hopper"
        assert jagflash.backend(*args, backward=True, softcap=5.0) == "oracle"
    else:
        message = Q_HEAD_DIM.format(d=dims[0]) if dims[0] == dims[1] else V_OF_ITS_OWN.format(d=dims[0], dv=dims[1])
        with pytest.raises(jagflash.UnsupportedError, match=message):
            jagflash.backend(*args, backward=True, softcap=5.0)


@needs_cuda
def test_cuda_padded_head_dim_through_flash_attn_varlen_func():
    batch = make_batch(3200, q_lengths=CUDA_Q_LENGTHS, kv_lengths=CUDA_KV_LENGTHS, heads=4, head_dim=80,
                       device="cuda")
    q, k, v = batch.leaves()
    out = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, max(CUDA_Q_LENGTHS),
                                          max(CUDA_KV_LENGTHS), causal=True)
    out.backward(batch.dout)
    ref_out, _, ref_dq, ref_dk, ref_dv = reference(batch, causal=True)
    tol_out, tol_grad = TOLERANCES[q.dtype]
    assert_close("out", out, ref_out, tol_out, batch.seed)
    for name, got, want in (("dq", q.grad, ref_dq), ("dk", k.grad, ref_dk), ("dv", v.grad, ref_dv)):
        assert_close(name, got, want, tol_grad, batch.seed)
