"""jagflash inside Hugging Face transformers (jagflash.integrations.transformers), on the CPU
reference: tiny randomly initialised decoder models built from configs (no network) run with
attn_implementation=register() and are compared with transformers' own "eager" and "sdpa"
attention on the same weights and generated data.

- packed documents (position_ids restarts, or cu_seq_lens as DataCollatorWithFlattening gives
  them) against each document run alone with "eager": logits and every parameter's gradient;
- a padded batch with an attention mask against "sdpa" ("eager" for Gemma-2: transformers' sdpa
  path has no softcap);
- ten optimizer steps of packed training against the same steps on the separate documents.

float32 models (jagflash's CPU path computes in float64 and rounds to float32), so tolerances are
float32's: a few ulps of the logits' size after two layers.
"""
import copy
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import jagflash  # noqa: E402
from jagflash.integrations import transformers as jf_transformers  # noqa: E402

VOCAB = 64
DOC_LENGTHS = (5, 11, 3, 8)  # longer and shorter than Gemma-2's window below
ATOL, RTOL = 2e-5, 2e-4


def _configs():
    """name -> a 2-layer GQA config (4 query heads, 2 key/value heads, head dim 16)."""
    shared = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return {
        "llama": lambda: transformers.LlamaConfig(**shared),
        "qwen2": lambda: transformers.Qwen2Config(**shared),
        "qwen3": lambda: transformers.Qwen3Config(head_dim=16, **shared),
        # a 6-token window on every layer
        "mistral": lambda: transformers.MistralConfig(sliding_window=6, **shared),
        # softcap on the scores and a 4-token window on alternate layers
        "gemma2": lambda: transformers.Gemma2Config(head_dim=16, sliding_window=4, attn_logit_softcapping=5.0,
                                                    query_pre_attn_scalar=16, **shared),
    }


CONFIGS = _configs()


@pytest.fixture(scope="module")
def name():
    return jf_transformers.register()


def _models(config_name, name, reference):
    """(jagflash model, reference model) with the same random weights. Each gets its own config:
    from_config writes the attention implementation into the config object it is given."""
    config = CONFIGS[config_name]()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=name)
    ref = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=reference)
    ref.load_state_dict(model.state_dict())
    assert model.config._attn_implementation == name
    return model, ref


def _documents(seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (1, n), generator=generator) for n in DOC_LENGTHS]


def _packed(docs):
    """One row of the documents back to back, position_ids restarting at each (and cu_seq_lens)."""
    ids = torch.cat(docs, dim=1)
    position_ids = torch.cat([torch.arange(d.shape[1]) for d in docs])[None]
    cu_seq_lens = torch.tensor([0, *torch.tensor(DOC_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return ids, position_ids, cu_seq_lens


def _loss(logits_per_doc, docs):
    """Next-token cross entropy over all documents (each predicts only within itself)."""
    logits = torch.cat([lg[0, :-1] for lg in logits_per_doc])
    labels = torch.cat([d[0, 1:] for d in docs])
    return torch.nn.functional.cross_entropy(logits, labels)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_grads_close(model, ref):
    got, want = _grads(model), _grads(ref)
    assert got.keys() == want.keys() and got
    for n in got:
        torch.testing.assert_close(got[n], want[n], atol=ATOL, rtol=RTOL, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@pytest.mark.parametrize("packing", ["position_ids", "cu_seq_lens"])
def test_packed_documents_match_eager_one_by_one(name, config_name, packing, monkeypatch):
    model, ref = _models(config_name, name, "eager")
    docs = _documents()
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
    torch.testing.assert_close(logits, torch.cat(want, dim=1), atol=ATOL, rtol=RTOL)
    _loss(logits.split(DOC_LENGTHS, dim=1), docs).backward()
    _loss(want, docs).backward()
    _assert_grads_close(model, ref)


@pytest.mark.parametrize("config_name", ["llama", "gemma2"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_matches_sdpa(name, config_name, side):
    # transformers' sdpa path drops Gemma-2's softcap; its eager path is the reference there.
    model, ref = _models(config_name, name, "eager" if config_name == "gemma2" else "sdpa")
    model.config.pad_token_id = ref.config.pad_token_id = 0
    docs = _documents(seed=2)
    longest = max(DOC_LENGTHS)
    ids = torch.zeros(len(docs), longest, dtype=torch.long)
    mask = torch.zeros(len(docs), longest, dtype=torch.long)
    for row, d in enumerate(docs):
        cols = slice(0, d.shape[1]) if side == "right" else slice(longest - d.shape[1], longest)
        ids[row, cols], mask[row, cols] = d[0], 1
    logits = model(input_ids=ids, attention_mask=mask).logits
    want = ref(input_ids=ids, attention_mask=mask).logits
    kept = mask.bool()
    torch.testing.assert_close(logits[kept], want[kept], atol=ATOL, rtol=RTOL)
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3))
    ((logits * weights)[kept]).sum().backward()
    ((want * weights)[kept]).sum().backward()
    _assert_grads_close(model, ref)


@pytest.mark.parametrize("config_name", ["llama", "gemma2"])
def test_packed_training_follows_separate_documents(name, config_name):
    model, ref = _models(config_name, name, "eager" if config_name == "gemma2" else "sdpa")
    docs = _documents(seed=4)
    ids, position_ids, _ = _packed(docs)
    curves = {"jagflash": [], "reference": []}
    optimizers = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, ref)]
    for _ in range(10):
        for m, opt, curve in zip((model, ref), optimizers, curves.values()):
            opt.zero_grad()
            if m is model:
                per_doc = model(input_ids=ids, position_ids=position_ids).logits.split(DOC_LENGTHS, dim=1)
            else:
                per_doc = [ref(input_ids=d).logits for d in docs]
            loss = _loss(per_doc, docs)
            loss.backward()
            opt.step()
            curve.append(loss.item())
    assert curves["reference"][-1] < curves["reference"][0]  # it trains
    torch.testing.assert_close(torch.tensor(curves["jagflash"]), torch.tensor(curves["reference"]),
                               atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("config_name", ["llama", "gemma2"])
def test_generation_with_kv_cache_matches_eager(name, config_name):
    """Decoding with a KV cache (queries fewer than keys: bottom-right causal), plain and with a
    left-padded batch: the same greedy tokens and logits as eager."""
    model, ref = _models(config_name, name, "eager")
    model.config.pad_token_id = ref.config.pad_token_id = 0
    docs = _documents(seed=5)[:2]
    ids = torch.zeros(2, 11, dtype=torch.long)
    mask = torch.zeros(2, 11, dtype=torch.long)
    for row, d in enumerate(docs):
        ids[row, 11 - d.shape[1]:], mask[row, 11 - d.shape[1]:] = d[0], 1
    for inputs in (dict(input_ids=docs[1]), dict(input_ids=ids, attention_mask=mask)):
        settings = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True)
        got, want = model.generate(**inputs, **settings), ref.generate(**inputs, **settings)
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=ATOL, rtol=RTOL)


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
    with pytest.raises(jagflash.UnsupportedError, match=r"s_aux: expected None"):
        jf_transformers.attention_forward(module, q, kv, kv, None, s_aux=torch.zeros(4))
    with pytest.raises(jagflash.InvalidArgumentError, match=r"cu_seq_lens_q, cu_seq_lens_k: expected both"):
        jf_transformers.attention_forward(module, q, kv, kv, None, cu_seq_lens_q=torch.tensor([0, 6]))


def test_contract_and_registration(name):
    """(attn_output [B, S, H, D], None), as transformers' FlashAttention path returns; register() is
    idempotent and fills both of transformers' interfaces."""
    assert name == jf_transformers.register() == "jagged_attention"
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    assert ALL_ATTENTION_FUNCTIONS[name] is jf_transformers.attention_forward
    assert name in ALL_MASK_ATTENTION_FUNCTIONS
    module = torch.nn.Module()
    module.is_causal = True
    q, kv = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    out, weights = jf_transformers.attention_forward(module, q, kv, kv, None, scaling=0.25)
    assert weights is None and out.shape == (2, 6, 4, 16)
    want = torch.nn.functional.scaled_dot_product_attention(q, kv.repeat_interleave(2, 1), kv.repeat_interleave(2, 1),
                                                            is_causal=True, scale=0.25).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


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
