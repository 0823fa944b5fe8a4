"""jagflash inside Hugging Face transformers (jagflash.integrations.transformers): tiny randomly
initialised decoder models built from configs (no network) run with attn_implementation=register()
and are compared with transformers' own "eager" and "sdpa" attention on the same weights and
generated data.

- packed documents (position_ids restarts, or cu_seq_lens as DataCollatorWithFlattening gives
  them) against each document run alone with "eager": logits and every parameter's gradient;
- a padded batch with an attention mask against "sdpa" ("eager" for Gemma-2 and gpt-oss:
  transformers' sdpa path has no softcap and no attention sinks);
- gpt-oss's attention sinks (s_aux) against its own eager attention, and in the models above;
- ten optimizer steps of packed training against the same steps on the separate documents;
- greedy decoding with a KV cache against "eager".

Each model-level test runs on two devices:
- cpu (CI): float32 models (jagflash's CPU path computes in float64 and rounds to float32), so
  tolerances are float32's: a few ulps of the logits' size after two layers. Head dim 16.
- cuda (the GPU machine; skipped where there is none): bf16 models, the dtype the Hopper kernels
  take, with head dim 64 (hidden 256, 4 heads, 2 KV heads) so that those kernels serve every call.
  Every jagflash call the model makes is checked to be served by the Hopper kernels in each
  direction it runs (jagflash.backend: "hopper", not the GPU oracle), and at least one is made;
  a build whose Hopper kernels do not serve bf16 / 64 (with softcap for Gemma-2) skips, saying so.
  bf16 has 8 significant bits: after two layers two bf16 implementations differ by about 1e-2 of
  the logits' size, more in the gradients, and neither is "right". So each result is measured
  against a float32 anchor (the reference attention on the same, bf16-rounded, weights in float32)
  and jagflash's bf16 model must be as close to it as transformers' own bf16 model is, up to a
  factor and a small floor (_assert_bf16_close): a tolerance that scales with the rounding the
  model really has, in the manner of FlashAttention's own tests.
"""
import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import jagflash  # noqa: E402
from jagflash.integrations import transformers as jf_transformers  # noqa: E402

from conftest import hopper_unserved  # noqa: E402

VOCAB = 64
DOC_LENGTHS = (5, 11, 3, 8)  # longer and shorter than Gemma-2's window below
ATOL, RTOL = 2e-5, 2e-4  # cpu: float32

HAS_CUDA = torch.cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="no CUDA device: the bf16 cases on the Hopper kernels run on the GPU machine "
                         "(scripts/gpu-transformers.sh); the cpu cases test the float64 reference"))]

# cuda: bf16. err(x) = max |x - anchor| / max |anchor|, the anchor being the float32 model; jagflash's
# bf16 result must have err <= FACTOR * (transformers' bf16 result's err) + FLOOR. The factor leaves
# room for rounding in other places than transformers' (the Hopper kernels round P to bf16 before
# P @ V and accumulate in float32 tiles; eager rounds softmax to bf16 after a float32 softmax); the
# floor, one bf16 ulp (2^-8 relative) of the largest value, covers a reference that happens to
# land closer than its rounding warrants. Gradients pass through more bf16 roundings (every
# backward matmul, the parameter gradient itself), hence the looser pair. Measured with the cuda
# cases run on the CPU in bf16 (jagflash's CPU path takes bf16: float64 inside, rounded once):
# errors of 5e-3 to 9e-3 for both models, jagflash's at most 1.45x transformers', so about half of
# what is allowed; a window off by one or a softcap 10% off fails every case it touches.
BF16_OUT = (2.0, 2 ** -8)
BF16_GRAD = (3.0, 2 ** -7)
# The loss curves of ten AdamW steps: each step's update depends on the previous ones, so the
# bf16 curves drift apart from the float32 one step by step (a few 1e-3 of the loss, about 4.2).
BF16_LOSS = (3.0, 2e-3)
HOPPER_HEAD_DIM = 64


def _configs(head_dim):
    """name -> a 2-layer GQA config (4 query heads, 2 key/value heads, head dim head_dim)."""
    hidden = 4 * head_dim
    shared = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=hidden * 3 // 2, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama": lambda: transformers.LlamaConfig(**shared),
        "qwen2": lambda: transformers.Qwen2Config(**shared),
        "qwen3": lambda: transformers.Qwen3Config(head_dim=head_dim, **shared),
        # a 6-token window on every layer
        "mistral": lambda: transformers.MistralConfig(sliding_window=6, **shared),
        # softcap on the scores and a 4-token window on alternate layers
        "gemma2": lambda: transformers.Gemma2Config(head_dim=head_dim, sliding_window=4, attn_logit_softcapping=5.0,
                                                    query_pre_attn_scalar=head_dim, **shared),
        # attention sinks (s_aux, a parameter per head) and a 4-token window on alternate layers; every
        # expert routed (two of two), so that rounding cannot flip a token's experts
        "gpt_oss": lambda: transformers.GptOssConfig(head_dim=head_dim, sliding_window=4, num_local_experts=2,
                                                     num_experts_per_tok=2,
                                                     rope_parameters={"rope_type": "default", "rope_theta": 1e4},
                                                     **shared),
    }


CONFIGS = _configs(16)  # cpu
CUDA_CONFIGS = _configs(HOPPER_HEAD_DIM)  # cuda: a head dim the Hopper kernels have


@pytest.fixture(scope="module")
def name():
    return jf_transformers.register()


@pytest.fixture
def served(device, monkeypatch):
    """cpu: None. cuda: the list of jagflash calls the integration makes, each checked (before it
    runs) to be served by the Hopper kernels in the forward and, when a gradient will flow, the
    backward; the test asserts the list is not empty (_assert_hopper_ran)."""
    if device == "cpu":
        return None
    calls = []
    real = jf_transformers.jagged_attention

    def hopper_only(q, k, v, q_offsets, kv_offsets=None, **options):
        assert q.is_cuda and q.dtype == torch.bfloat16, (q.device, q.dtype)
        backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        for direction in (False, True) if backward else (False,):
            path = jagflash.backend(q, k, v, q_offsets, kv_offsets, backward=direction, softcap=options.get("softcap"))
            assert path == "hopper", (f"the {'backward' if direction else 'forward'} of q {tuple(q.shape)} "
                                      f"{q.dtype} is served by {path!r}, not the Hopper kernels")
        calls.append(tuple(q.shape))
        return real(q, k, v, q_offsets, kv_offsets, **options)

    monkeypatch.setattr(jf_transformers, "jagged_attention", hopper_only)
    return calls


def _assert_hopper_ran(served):
    assert served is None or served, "no jagflash call reached the Hopper kernels"


def _models(config_name, name, reference, device="cpu"):
    """(jagflash model, reference model, anchor) with the same random weights. Each gets its own
    config: from_config writes the attention implementation into the config object it is given.
    cpu: float32, anchor None. cuda: both models bf16 on the GPU, the anchor the reference model
    in float32 with the bf16-rounded weights (skipped when this build's Hopper kernels do not
    serve the config)."""
    if device == "cuda":
        why = hopper_unserved(torch.bfloat16, HOPPER_HEAD_DIM, backward=True,
                              score_mod="softcap" if config_name == "gemma2" else None)
        if why is not None:
            pytest.skip(why)
    config = (CONFIGS if device == "cpu" else CUDA_CONFIGS)[config_name]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    ref.load_state_dict(model.state_dict())
    assert model.config._attn_implementation == name
    if device == "cpu":
        return model, ref, None
    model.to(device, torch.bfloat16)
    ref.to(device, torch.bfloat16)
    return model, ref, copy.deepcopy(ref).float()


def _documents(seed=1, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (1, n), generator=generator).to(device) for n in DOC_LENGTHS]


def _packed(docs):
    """One row of the documents back to back, position_ids restarting at each (and cu_seq_lens)."""
    device = docs[0].device
    ids = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(d.shape[1]) for d in docs])[None].to(device)
    cu_seq_lens = torch.tensor([0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()], dtype=torch.int32).to(device)
    return ids, position_ids, cu_seq_lens


def _loss(logits_per_doc, docs):
    """Next-token cross entropy over all documents (each predicts only within itself), in float32
    (a bf16 loss would be rounded to 2^-6 near 4)."""
    logits = torch.cat([lg[0, :-1] for lg in logits_per_doc]).float()
    labels = torch.cat([d[0, 1:] for d in docs])
    return torch.nn.functional.cross_entropy(logits, labels)


def _bf16_error(x, anchor):
    anchor = anchor.float()
    return ((x.float() - anchor).abs().max() / anchor.abs().max().clamp_min(1e-30)).item()


def _assert_bf16_close(got, want, anchor, tolerance, what="logits"):
    """got (jagflash, bf16) is as close to anchor (float32) as want (transformers, bf16) is, up to
    tolerance = (factor, floor); errors normalised by anchor's largest magnitude."""
    factor, floor = tolerance
    err_got, err_want = _bf16_error(got, anchor), _bf16_error(want, anchor)
    assert err_got <= factor * err_want + floor, (
        f"{what}: jagflash (bf16) is {err_got:.2e} off the float32 reference, transformers' own bf16 {err_want:.2e} "
        f"(allowed {factor} x that + {floor:.1e})")


def _assert_close(got, want, anchor):
    if anchor is None:
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    else:
        _assert_bf16_close(got, want, anchor, BF16_OUT)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(model, ref, anchor=None):
    got, want = _grads(model), _grads(ref)
    assert got.keys() == want.keys() and got
    if anchor is not None:
        exact = _grads(anchor)
        assert exact.keys() == got.keys()
        for n in got:
            _assert_bf16_close(got[n], want[n], exact[n], BF16_GRAD, what=f"{n}.grad")
        return
    for n in got:
        torch.testing.assert_close(got[n], want[n], atol=ATOL, rtol=RTOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("packing", ["position_ids", "cu_seq_lens"])
def test_packed_documents_match_eager_one_by_one(name, config_name, packing, device, served, monkeypatch):
    model, ref, anchor = _models(config_name, name, "eager", device)
    docs = _documents(device=device)
    ids, position_ids, cu_seq_lens = _packed(docs)
    kwargs = {}
    if packing == "cu_seq_lens":
        # What DataCollatorWithFlattening adds. The offsets must be used as given: the
        # position_ids path (which reads them on the host) is made to fail.
        kwargs = dict(cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=max(DOC_LENGTHS),
                      max_length_k=max(DOC_LENGTHS))

        def no_host_read(*args):
            raise AssertionError("position_ids read although cu_seq_lens were given")

        monkeypatch.setattr(jf_transformers, "_offsets_from_position_ids", no_host_read)
    logits = model(input_ids=ids, position_ids=position_ids, **kwargs).logits
    want = [ref(input_ids=d).logits for d in docs]
    exact = None if anchor is None else [anchor(input_ids=d).logits for d in docs]
    _assert_close(logits, torch.cat(want, dim=1), exact and torch.cat(exact, dim=1))
    _loss(logits.split(DOC_LENGTHS, dim=1), docs).backward()
    _loss(want, docs).backward()
    if anchor is not None:
        _loss(exact, docs).backward()
    _assert_grads_close(model, ref, anchor)
    _assert_hopper_ran(served)


def _reference_attention(config_name):
    """transformers' sdpa path drops Gemma-2's softcap and has no sinks (gpt-oss): its eager path
    is the reference there."""
    return "eager" if config_name in ("gemma2", "gpt_oss") else "sdpa"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config_name", ["llama", "gemma2", "gpt_oss"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_sdpa(name, config_name, side, device, served):
    model, ref, anchor = _models(config_name, name, _reference_attention(config_name), device)
    for m in (model, ref, anchor):
        if m is not None:
            m.config.pad_token_id = 0
    docs = _documents(seed=2)
    longest = max(DOC_LENGTHS)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros(len(docs), longest, dtype=torch.long)
    for row, d in enumerate(docs):
        cols = slice(0, d.shape[1]) if side == "right" else slice(longest - d.shape[1], longest)
        ids[row, cols], mask[row, cols] = d[0], 1
    ids, mask = ids.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=mask).logits
    want = ref(input_ids=ids, attention_mask=mask).logits
    exact = None if anchor is None else anchor(input_ids=ids, attention_mask=mask).logits
    kept = mask.bool()
    _assert_close(logits[kept], want[kept], None if exact is None else exact[kept])
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3)).to(device)
    for out in (logits, want) if exact is None else (logits, want, exact):
        ((out.float() * weights)[kept]).sum().backward()
    _assert_grads_close(model, ref, anchor)
    _assert_hopper_ran(served)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config_name", ["llama", "gemma2", "gpt_oss"])
def test_packed_training_follows_separate_documents(name, config_name, device, served):
    model, ref, anchor = _models(config_name, name, _reference_attention(config_name), device)
    docs = _documents(seed=4, device=device)
    ids, position_ids, _ = _packed(docs)
    models = {"jagflash": model, "reference": ref}
    if anchor is not None:
        models["float32"] = anchor  # the reference attention, trained in float32 from the same weights
    curves = {key: [] for key in models}
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in models.values()]
    for _ in range(10):
        for m, opt, curve in zip(models.values(), optimizers, curves.values()):
            opt.zero_grad()
            if m is model:
                per_doc = model(input_ids=ids, position_ids=position_ids).logits.split(DOC_LENGTHS, dim=1)
            else:
                per_doc = [m(input_ids=d).logits for d in docs]
            loss = _loss(per_doc, docs)
            loss.backward()
            opt.step()
            curve.append(loss.item())
    assert curves["reference"][-1] < curves["reference"][0]  # it trains
    if anchor is None:
        torch.testing.assert_close(torch.tensor(curves["jagflash"]), torch.tensor(curves["reference"]),
                                   atol=1e-5, rtol=1e-4)
    else:
        assert curves["jagflash"][-1] < curves["jagflash"][0]
        _assert_bf16_close(torch.tensor(curves["jagflash"]), torch.tensor(curves["reference"]),
                           torch.tensor(curves["float32"]), BF16_LOSS, what=f"loss curves {curves}")
    _assert_hopper_ran(served)


class _Follow(transformers.LogitsProcessor):
    """Greedy decoding made to take the given sequences' tokens (the raw logits, which
    output_logits returns, are left as the model computed them)."""

    def __init__(self, sequences):
        self.sequences = sequences

    def __call__(self, input_ids, scores):
        forced = self.sequences[:, input_ids.shape[1]].to(scores.device)
        return torch.full_like(scores, -float("inf")).scatter_(1, forced[:, None], 0.0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config_name", ["llama", "gemma2"])
def test_generation_with_kv_cache_matches_eager(name, config_name, device, served):
    """Decoding with a KV cache (queries fewer than keys: bottom-right causal), plain and with a
    left-padded batch: the same greedy tokens and logits as eager. cuda: bf16 logits of two
    implementations can swap a near tie, so the references are made to follow jagflash's tokens
    and the logits along them are compared (with the bf16 rule)."""
    model, ref, anchor = _models(config_name, name, "eager", device)
    for m in (model, ref, anchor):
        if m is not None:
            m.config.pad_token_id = 0
    docs = _documents(seed=5)[:2]
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    for row, d in enumerate(docs):
        ids[row, 11 - d.shape[1]:], mask[row, 11 - d.shape[1]:] = d[0], 1
    for inputs in (dict(input_ids=docs[1]), dict(input_ids=ids, attention_mask=mask)):
        inputs = {key: t.to(device) for key, t in inputs.items()}
        settings = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        got = model.generate(**inputs, **settings)
        if anchor is None:
            want = ref.generate(**inputs, **settings)
            assert torch.equal(got.sequences, want.sequences)
            torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=ATOL, rtol=RTOL)
            continue
        follow = transformers.LogitsProcessorList([_Follow(got.sequences)])
        want, exact = (m.generate(**inputs, **settings, logits_processor=follow) for m in (ref, anchor))
        assert torch.equal(want.sequences, got.sequences) and torch.equal(exact.sequences, got.sequences)
        _assert_bf16_close(torch.stack(got.logits), torch.stack(want.logits), torch.stack(exact.logits), BF16_OUT)
    _assert_hopper_ran(served)


def test_dropout_in_training_is_refused(name):
    config = CONFIGS["llama"]()
    config.attention_dropout = 0.1
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name).train()
    with pytest.raises(jagflash.UnsupportedError, match=r"dropout: expected 0\.0.*got 0\.1"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    model.eval()  # transformers passes dropout 0.0 in eval mode
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_refuses_what_it_cannot_serve():
    module = torch.nn.Module()
    q = torch.randn(1, 4, 6, 16)
    kv = torch.randn(1, 2, 6, 16)
    with pytest.raises(jagflash.UnsupportedError, match=r"attention_mask: expected None or a 2D padding mask.*"
                                                        r"got a tensor of shape \(1, 1, 6, 6\)"):
        jf_transformers.attention_forward(module, q, kv, kv, torch.ones(1, 1, 6, 6, dtype=torch.bool))
    with pytest.raises(jagflash.InvalidArgumentError, match=r"^s_aux: expected .* shape \(4,\)"):
        jf_transformers.attention_forward(module, q, kv, kv, None, s_aux=torch.zeros(2))
    with pytest.raises(jagflash.InvalidArgumentError, match=r"cu_seq_lens_q, cu_seq_lens_k: expected both"):
        jf_transformers.attention_forward(module, q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 6]))


def test_s_aux_are_attention_sinks():
    """gpt-oss's s_aux against its own eager attention (the sinks as a softmax column without a
    value): the output and the gradients of query, key, value and the sinks, at a padded batch."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    module.sinks = torch.nn.Parameter(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    generator = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, heads, 6, 16, generator=generator, requires_grad=True) for heads in (4, 2, 2))
    keep = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    out, _ = jf_transformers.attention_forward(module, q, k, v, keep.long(), scaling=0.25, s_aux=module.sinks)
    grads = torch.autograd.grad(out[keep].sum(), (q, k, v, module.sinks))
    visible = torch.ones(6, 6, dtype=torch.bool).tril() & keep[:, None, None, :]
    additive = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    want, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25)
    want_grads = torch.autograd.grad(want[keep].sum(), (q, k, v, module.sinks))
    torch.testing.assert_close(out[keep], want[keep], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[~keep], torch.zeros_like(out[~keep]))  # padded query rows: zeros
    for got, expected, what in zip(grads, want_grads, ("query", "key", "value", "sinks")):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_contract_and_registration(name, device, served):
    """(attn_output [B, S, H, D], None), as transformers' FlashAttention path returns; register() is
    idempotent and fills both of transformers' interfaces. cuda: bf16 at head dim 64 against
    float32 SDPA, within bf16's rounding of the output (values below 1: 2^-8 relative)."""
    assert name == jf_transformers.register() == "jagged_attention"
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert ALL_ATTENTION_FUNCTIONS[name] is jf_transformers.attention_forward
    assert name in ALL_MASK_ATTENTION_FUNCTIONS
    module = torch.nn.Module()
    module.is_causal = True
    head_dim = 16 if device == "cpu" else HOPPER_HEAD_DIM
    if device == "cuda":
        why = hopper_unserved(torch.bfloat16, head_dim)
        if why is not None:
            pytest.skip(why)
    q, kv = torch.randn(2, 4, 6, head_dim), torch.randn(2, 2, 6, head_dim)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    out, weights = jf_transformers.attention_forward(module, q.to(device, dtype), kv.to(device, dtype),
                                                     kv.to(device, dtype), None, scaling=0.25)
    assert weights is None and out.shape == (2, 6, 4, head_dim)
    if device == "cuda":  # the reference in float32 on the bf16-rounded inputs
        q, kv = q.bfloat16().float(), kv.bfloat16().float()
    want = torch.nn.functional.scaled_dot_product_attention(q, kv.repeat_interleave(2, 1), kv.repeat_interleave(2, 1),
                                                            is_causal=True, scale=0.25).transpose(1, 2)
    if device == "cpu":
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out.float().cpu(), want, atol=1e-2, rtol=1e-2)
    _assert_hopper_ran(served)


def test_offsets_from_position_ids_read_once_a_forward():
    """Restarts in any row start a sequence; the same position_ids tensor (every layer of one
    forward gets it) is read once, and again after it is written in place."""
    position_ids = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]])
    offsets = jf_transformers._offsets_from_position_ids(position_ids, 2)
    assert offsets.tolist() == [0, 3, 5, 7, 10] and offsets.dtype == torch.int32
    assert jf_transformers._offsets_from_position_ids(position_ids, 2) is offsets
    position_ids[1] = torch.arange(5)
    assert jf_transformers._offsets_from_position_ids(position_ids, 2).tolist() == [0, 3, 5, 10]
    # One row of positions for a batch of rows, as models make them when none are given.
    assert jf_transformers._offsets_from_position_ids(torch.arange(4)[None], 3).tolist() == [0, 4, 8, 12]


def test_importing_jagflash_does_not_import_transformers():
    code = "import sys, jagflash; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
