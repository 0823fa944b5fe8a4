"""jagflash.flash_attn_varlen_func: FlashAttention-2's signature on jagged_attention. Bitwise equal to
jagged_attention with the same arguments (the same launch underneath), close to the float64
reference, every option jagflash does not have refused by name, max_seqlen_* taken as hints."""
import inspect
import re

import pytest
import torch

import jagflash
from jagflash import _capi
from conftest import DEVICES, MASKS, TOLERANCES, assert_close, make_batch, offsets_of, reference

# FlashAttention-2's flash_attn_varlen_func (flash_attn 2.x): names, order and defaults.
FA2_SIGNATURE = [
    ("q", inspect.Parameter.empty), ("k", inspect.Parameter.empty), ("v", inspect.Parameter.empty),
    ("cu_seqlens_q", inspect.Parameter.empty), ("cu_seqlens_k", inspect.Parameter.empty),
    ("max_seqlen_q", inspect.Parameter.empty), ("max_seqlen_k", inspect.Parameter.empty),
    ("dropout_p", 0.0), ("softmax_scale", None), ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0),
    ("alibi_slopes", None), ("deterministic", False), ("return_attn_probs", False), ("block_table", None),
]


def _batch(seed, device="cpu", **kwargs):
    kwargs.setdefault("q_lengths", [7, 0, 1, 31, 12])
    kwargs.setdefault("kv_lengths", [9, 4, 0, 31, 5])
    return make_batch(seed, heads=4, kv_heads=2, device=device, **kwargs)


def _max(lengths_offsets):
    return int((lengths_offsets[1:] - lengths_offsets[:-1]).max())


def test_signature_is_flash_attention_2s():
    """FA2's arguments in FA2's order; after them, keyword only, FlashAttention-4's learnable_sink."""
    parameters = list(inspect.signature(jagflash.flash_attn_varlen_func).parameters.values())
    fa2, extra = parameters[:len(FA2_SIGNATURE)], parameters[len(FA2_SIGNATURE):]
    assert [(p.name, p.default) for p in fa2] == FA2_SIGNATURE
    assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in fa2)
    assert [(p.name, p.default, p.kind) for p in extra] == [("learnable_sink", None, inspect.Parameter.KEYWORD_ONLY)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_left8", "window_3_2", "window_unbounded_left_5"])
def test_matches_jagged_attention_bitwise_and_the_reference(device, mask):
    causal, window = MASKS[mask]
    batch = _batch(301, device)
    max_q, max_k = _max(batch.q_offsets), _max(batch.kv_offsets)

    q, k, v = batch.leaves()
    # deterministic on both sides: on the GPU dq is then bitwise reproducible too.
    out = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, max_q, max_k, causal=causal,
                                          window_size=window, deterministic=True)
    assert isinstance(out, torch.Tensor)  # FA2's convention: the output alone
    grads = torch.autograd.grad(out, (q, k, v), batch.dout)

    q2, k2, v2 = batch.leaves()
    expected = jagflash.jagged_attention(q2, k2, v2, batch.q_offsets, batch.kv_offsets, causal=causal, window=window,
                                         max_seqlen_q=max_q, max_seqlen_kv=max_k, deterministic=True)
    expected_grads = torch.autograd.grad(expected, (q2, k2, v2), batch.dout)
    assert torch.equal(out, expected)
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want)

    ref_out, _, ref_dq, ref_dk, ref_dv = reference(batch, causal=causal, window=window)
    tol_out, tol_grad = TOLERANCES[batch.q.dtype]
    assert_close("out", out, ref_out, tol_out, batch.seed)
    for name, got, want in zip(("dq", "dk", "dv"), grads, (ref_dq, ref_dk, ref_dv)):
        assert_close(name, got, want, tol_grad, batch.seed)


def test_positional_arguments_in_fa2_order():
    batch = _batch(302)
    q, k, v = batch.q, batch.k, batch.v
    scale = 0.3
    # dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs
    out = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, 31, 31, 0.0, scale, True,
                                          (-1, -1), 0.0, None, False, False)
    expected = jagflash.jagged_attention(q, k, v, batch.q_offsets, batch.kv_offsets, causal=True, scale=scale)
    assert torch.equal(out, expected)


def test_int64_cu_seqlens():
    batch = _batch(303)
    out = jagflash.flash_attn_varlen_func(batch.q, batch.k, batch.v, batch.q_offsets.long(), batch.kv_offsets.long(),
                                          31, 31, causal=True)
    expected = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, causal=True)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("max_q,max_k,hint", [
    (31, 31, 31),
    (1, 2, 2),          # below the true maxima: a hint, not checked, results unchanged
    (10**6, 5, 10**6),  # far above
    (None, 31, 0),      # no hint at all
    (31, None, 0),
])
def test_max_seqlen_are_hints(launches, max_q, max_k, hint):
    batch = _batch(304)
    q, k, v = batch.leaves()
    out = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, max_q, max_k, causal=True)
    out.backward(batch.dout)
    assert [(direction, launch.max_seqlen_hint) for direction, launch in launches] == [("fwd", hint), ("bwd", hint)]
    expected = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, causal=True)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("kwargs,option", [
    ({"dropout_p": 0.1}, "dropout_p=0.1"),
    ({"alibi_slopes": torch.ones(2, 4)}, r"alibi_slopes of shape \(2, 4\) \(batch_size, nheads\)"),
    ({"block_table": torch.zeros(3, 1, dtype=torch.int32)}, "block_table"),
])
def test_unsupported_options_raise_naming_the_option(kwargs, option, launches):
    batch = _batch(305)
    with pytest.raises(jagflash.UnsupportedError, match=f"flash_attn_varlen_func: {option} is not supported") as info:
        jagflash.flash_attn_varlen_func(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 31, 31, **kwargs)
    assert info.value.status == _capi.ERR_UNSUPPORTED
    assert launches == []  # refused before anything ran


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", ["none", "causal"])
def test_return_attn_probs_gives_fa2s_triple(device, mask):
    """(out, softmax_lse [H, total_q] float32, S_dmask): out and its gradients those of the plain
    call bitwise, the lse the reference's (natural log, -inf where a row sees no key: sequence 2
    has a query and no key), not differentiable, and S_dmask empty as FA2's with dropout_p = 0."""
    causal, window = MASKS[mask]
    batch = _batch(306, device)
    max_q, max_k = _max(batch.q_offsets), _max(batch.kv_offsets)
    q, k, v = batch.leaves()
    result = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, max_q, max_k,
                                             causal=causal, deterministic=True, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3
    out, lse, s_dmask = result
    q2, k2, v2 = batch.leaves()
    plain = jagflash.flash_attn_varlen_func(q2, k2, v2, batch.q_offsets, batch.kv_offsets, max_q, max_k,
                                            causal=causal, deterministic=True)
    assert torch.equal(out, plain)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), batch.dout),
                         torch.autograd.grad(plain, (q2, k2, v2), batch.dout)):
        assert torch.equal(got, want)
    heads, total_q = batch.q.shape[1], batch.q.shape[0]
    assert lse.shape == (heads, total_q) and lse.dtype == torch.float32 and lse.device == out.device
    assert not lse.requires_grad
    _, ref_lse, _, _, _ = reference(batch, causal=causal, window=window)
    lse_cpu = lse.cpu().double()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse_cpu), finite)
    assert bool((~finite).any())  # the row that sees no key is in the batch
    assert (lse_cpu[finite] - ref_lse[finite]).abs().max().item() < 1e-3
    assert s_dmask.numel() == 0 and s_dmask.dtype == out.dtype and s_dmask.device == out.device


@pytest.mark.parametrize("kwargs,match", [
    ({"max_seqlen_q": torch.tensor(31)}, "max_seqlen_q: expected a Python int"),
    ({"max_seqlen_k": 3.5}, "max_seqlen_k: expected a Python int"),
    ({"max_seqlen_q": True}, "max_seqlen_q: expected a Python int"),
    ({"window_size": (1, 2, 3)}, "window_size: expected a pair"),
    ({"window_size": 4}, "window_size: expected a pair"),
    ({"dropout_p": "0"}, "dropout_p: expected a number"),
    ({"return_attn_probs": 0}, "return_attn_probs: expected True or False"),
    ({"causal": 1}, "causal: expected True or False"),
])
def test_malformed_arguments_raise(kwargs, match):
    batch = _batch(307)
    args = dict(max_seqlen_q=31, max_seqlen_k=31)
    args.update(kwargs)
    with pytest.raises(jagflash.InvalidArgumentError, match=match):
        jagflash.flash_attn_varlen_func(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, **args)


def test_zero_options_of_any_number_type_are_accepted():
    batch = _batch(308)
    out = jagflash.flash_attn_varlen_func(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 31, 31,
                                          dropout_p=0, softcap=0, window_size=[-1, -1])
    assert torch.equal(out, jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets))


@pytest.mark.parametrize("deterministic,torch_switch,expected", [
    (True, False, 1),
    (False, False, 0),
    (False, True, 1),  # FA2's default False still follows torch.use_deterministic_algorithms(True)
    (True, True, 1),
])
def test_deterministic(launches, deterministic, torch_switch, expected):
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(torch_switch)
    try:
        batch = _batch(309)
        q, k, v = batch.leaves()
        out = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, 31, 31,
                                              deterministic=deterministic)
        out.backward(batch.dout)
    finally:
        torch.use_deterministic_algorithms(before)
    assert [(direction, launch.deterministic) for direction, launch in launches] == [("fwd", 0), ("bwd", expected)]


def test_compiles_in_one_graph():
    from torch._dynamo.testing import CompileCounterWithBackend

    batch = _batch(310)
    counter = CompileCounterWithBackend("aot_eager")

    def fn(q, k, v, cu_q, cu_k):
        return jagflash.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 31, 31, causal=True)

    torch._dynamo.reset()
    try:
        out = torch.compile(fn, backend=counter, fullgraph=True)(batch.q, batch.k, batch.v, batch.q_offsets,
                                                                 batch.kv_offsets)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out, fn(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets))
    assert counter.frame_count == 1


# ---- causal=True with a window: FA2 sets the right side to 0 (mha_varlen_fwd: `if (is_causal)
# window_size_right = 0`); HuggingFace transformers calls it so for sliding-window models.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [(3, 3), (8, 8), (0, 5), (-1, 7), (4, -1), (4, 0)])
def test_causal_takes_the_right_window_as_0_as_fa2_does(device, window):
    batch = _batch(311, device)
    q, k, v = batch.leaves()
    out = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, 31, 31, causal=True,
                                          window_size=window, deterministic=True)
    grads = torch.autograd.grad(out, (q, k, v), batch.dout)
    q2, k2, v2 = batch.leaves()
    # The same max_seqlen hints: on the GPU they pick the kernel, and bitwise needs the same one.
    expected = jagflash.jagged_attention(q2, k2, v2, batch.q_offsets, batch.kv_offsets, causal=True,
                                         window=(window[0], 0), max_seqlen_q=31, max_seqlen_kv=31,
                                         deterministic=True)
    expected_grads = torch.autograd.grad(expected, (q2, k2, v2), batch.dout)
    assert torch.equal(out, expected)
    for got, want in zip(grads, expected_grads):
        assert torch.equal(got, want)


def test_hugging_face_s_sliding_window_call():
    """transformers' _flash_attention_forward: causal=True, window_size=(w - 1, w - 1)."""
    batch = _batch(312)
    w = 4
    out = jagflash.flash_attn_varlen_func(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 31, 31,
                                          causal=True, window_size=(w - 1, w - 1))
    ref_out = reference(batch, causal=True, window=(w - 1, 0))[0]
    assert_close("out", out, ref_out, TOLERANCES[batch.q.dtype][0], batch.seed)


@pytest.mark.parametrize("right,match", [(-2, r"window_size\[1\]: expected >= -1"),
                                         (1.5, r"window_size\[1\]: expected an int")])
def test_causal_still_checks_the_right_window(right, match):
    batch = _batch(313)
    with pytest.raises(jagflash.InvalidArgumentError, match=match):
        jagflash.flash_attn_varlen_func(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, 31, 31,
                                        causal=True, window_size=(2, right))


# ---- Errors name FA2's arguments, not jagged_attention's.
def _fa2_error(**changes):
    batch = _batch(314)
    args = dict(q=batch.q, k=batch.k, v=batch.v, cu_seqlens_q=batch.q_offsets, cu_seqlens_k=batch.kv_offsets,
                max_seqlen_q=31, max_seqlen_k=31)
    args.update(changes)
    with pytest.raises(jagflash.JagflashError) as info:
        jagflash.flash_attn_varlen_func(**args)
    return str(info.value)


@pytest.mark.parametrize("changes,message", [
    (lambda b: {"cu_seqlens_k": offsets_of([9, 4, 0, 31, 6])}, r"^cu_seqlens_k\[B=5\]: expected the token count 49, got 50$"),
    (lambda b: {"cu_seqlens_q": offsets_of([7, 0, 1, 31, 12]) + 1}, r"^cu_seqlens_q\[0\]: expected 0, got 1$"),
    (lambda b: {"cu_seqlens_k": offsets_of([9, 4, 0, 31])},
     r"^cu_seqlens_k: expected B\+1 = 6 entries \(as many as cu_seqlens_q\), got 5$"),
    (lambda b: {"cu_seqlens_k": offsets_of([9, 4, 0, 31, 5]).float()}, r"^cu_seqlens_k: expected an int32 or int64"),
    (lambda b: {"cu_seqlens_k": None}, r"^cu_seqlens_k: expected an int32 tensor of B\+1 cumulative key lengths, got None$"),
    (lambda b: {"softmax_scale": 1e-50}, r"^softmax_scale: expected .*, got 1e-50$"),
    (lambda b: {"softmax_scale": "0.1"}, r"^softmax_scale: expected a real number"),
    (lambda b: {"window_size": (-2, 0)}, r"^window_size\[0\]: expected >= -1"),
    (lambda b: {"window_size": (3, 1.5)}, r"^window_size\[1\]: expected an int"),
    (lambda b: {"max_seqlen_k": -1}, r"^max_seqlen_k: expected None or an int in \[0, 2\^31\)"),
    # Past 256 nothing pads it (D = 36 runs padded to 40, as in FA2: test_head_dims_not_multiples_of_8...).
    (lambda b: {"q": torch.zeros(49, 4, 260), "k": torch.zeros(49, 2, 260), "v": torch.zeros(49, 2, 260)},
     r"^q.shape\[-1\]: expected a multiple of 8 from 8 to 256, got 260$"),
    (lambda b: {"q": None}, r"^q: expected a \[tokens, heads, head_dim\] tensor"),
], ids=["cu_seqlens_k-total", "cu_seqlens_q-first", "cu_seqlens-lengths", "cu_seqlens-dtype", "cu_seqlens_k-None",
        "softmax_scale-tiny", "softmax_scale-str", "window_size-left", "window_size-right", "max_seqlen_k", "head-dim",
        "q-None"])
def test_errors_name_fa2_s_arguments(changes, message):
    batch = _batch(314)
    got = _fa2_error(**changes(batch))
    assert re.search(message, got), got
    for internal in ("problem.", "kv_offsets", "q_offsets", "window[", "max_seqlen_kv"):
        assert internal not in got, got


# ---- Where FA2's kernels behave otherwise than jagflash's own API, the compat entry does what FA2
# does: lse +inf for a row that sees no key, head dims padded to a multiple of 8, softcap <= 0 off.
@pytest.mark.parametrize("device", DEVICES)
def test_lse_of_a_row_that_sees_no_key_is_plus_inf_as_fa2s(device):
    """FA2's kernel writes INFINITY into softmax_lse for a row that sees no key (sequence 2 has a
    query and no key, and the window hides keys from some rows); jagged_attention keeps -inf
    (FlexAttention's), and every other value is the same."""
    batch = _batch(330, device)
    q, k, v = batch.leaves()
    _, lse, _ = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, None, None,
                                                window_size=(1, 0), return_attn_probs=True)
    _, own_lse = jagflash.jagged_attention(batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets,
                                           window=(1, 0), return_lse=True)
    no_key = own_lse == float("-inf")
    assert bool(no_key.any())
    assert torch.all(lse[no_key] == float("inf"))
    assert torch.equal(lse[~no_key], own_lse[~no_key])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim,v_head_dim", [(36, 36), (4, 4), (250, 250), (60, 36), (64, 20)])
def test_head_dims_not_multiples_of_8_run_padded_as_in_fa2(device, head_dim, v_head_dim):
    """FA2 pads a head dim that is not a multiple of 8 and runs it (D = 36): so does the compat
    entry, with the scale 1/sqrt of the caller's D; out and the gradients have the caller's shapes
    and match the float64 reference."""
    batch = _batch(331, device, head_dim=head_dim, v_head_dim=v_head_dim)
    q, k, v = batch.leaves()
    out = jagflash.flash_attn_varlen_func(q, k, v, batch.q_offsets, batch.kv_offsets, None, None, causal=True)
    assert out.shape == (batch.q.shape[0], batch.q.shape[1], v_head_dim)
    grads = torch.autograd.grad(out, (q, k, v), batch.dout)
    ref_out, _, *ref_grads = reference(batch, causal=True)
    out_tol, grad_tol = TOLERANCES[batch.q.dtype]
    assert_close("out", out.detach().double().cpu(), ref_out, out_tol, batch.seed)
    for name, got, want, t in zip(("dq", "dk", "dv"), grads, ref_grads, (q, k, v)):
        assert got.shape == t.shape
        assert_close(name, got.double().cpu(), want, grad_tol, batch.seed)


@pytest.mark.parametrize("softcap", [-1.0, -0.0, -1e30, float("-inf")])
def test_softcap_at_or_below_0_is_no_softcap_as_in_fa2(softcap):
    batch = _batch(332)
    args = (batch.q, batch.k, batch.v, batch.q_offsets, batch.kv_offsets, None, None)
    assert torch.equal(jagflash.flash_attn_varlen_func(*args, softcap=softcap),
                       jagflash.flash_attn_varlen_func(*args, softcap=0.0))


@pytest.mark.parametrize("softcap", [1e-50, 1e39, float("inf")])
def test_softcap_float32_cannot_hold_is_named_in_fa2_s_terms(softcap):
    message = _fa2_error(softcap=softcap)
    assert re.fullmatch(r"softcap: expected a finite number > 0 that stays finite and non-zero in float32, or <= 0 "
                        r"\(FA2's 0.0\) for no softcap, got " + re.escape(repr(softcap)), message), message
