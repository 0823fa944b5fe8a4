"""bench/models.py and what it added to bench/peers.py, without a GPU: the layers' shapes and FLOPs,
each peer's refusal in words, the arguments the GPU peers are given for a layer's features (fake
FA4 and aten FA2 stand in), FlexAttention's window, sinks and pooled queries against jagflash on
the CPU, the table rendered from synthetic rows, the merge of two runs and the RESULTS.md section,
and a small CPU run end to end (the GPU run uses the same code with CUDA events)."""
import json
import sys
import types
from pathlib import Path

import pytest
import torch

import jagflash

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import compare  # noqa: E402
import models  # noqa: E402
import peers  # noqa: E402

CPU = torch.device("cpu")
# FlexAttention runs eagerly on the CPU (its compiled kernels are the GPU's), on purpose here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _layer(layer_id, *argv):
    (layer,) = [x for x in models.layers(models.parse_args(["--device", "cpu", *argv])) if x.id == layer_id]
    return layer


def _inputs(layer_id, *argv, lengths=(40, 90, 7), seed=0):
    layer = _layer(layer_id, *argv)
    return models.layer_inputs(layer, list(lengths), CPU, torch.Generator().manual_seed(seed))


def test_the_layers_have_the_models_shapes():
    by_id = {layer.id: layer for layer in models.layers(models.parse_args(["--device", "cpu"]))}
    assert list(by_id) == ["llama3-8b", "qwen2.5-7b", "gpt-oss-full", "gpt-oss-sliding", "gemma2-9b-global",
                           "gemma2-9b-local", "deepseek-v3-mla", "recsys-none", "recsys-causal", "recsys-pooled"]
    llama, qwen, oss = by_id["llama3-8b"], by_id["qwen2.5-7b"], by_id["gpt-oss-sliding"]
    assert (llama.heads, llama.kv_heads, llama.head_dim, llama.causal) == (32, 8, 128, True)
    assert (qwen.heads, qwen.kv_heads) == (28, 4)
    assert (oss.heads, oss.kv_heads, oss.head_dim, oss.window, oss.sinks) == (64, 8, 64, 128, True)
    assert by_id["gpt-oss-full"].sinks and not by_id["gpt-oss-full"].window
    gemma = by_id["gemma2-9b-local"]
    assert (gemma.heads, gemma.kv_heads, gemma.head_dim, gemma.softcap, gemma.window) == (16, 8, 256, 50.0, 4096)
    mla = by_id["deepseek-v3-mla"]
    assert (mla.head_dim, mla.v_head_dim, mla.heads, mla.model_heads) == (192, 128, 16, 128)
    assert by_id["recsys-pooled"].pooled == 32 and by_id["recsys-none"].batch == "gemskew"
    assert {layer.batch for layer in by_id.values() if not layer.id.startswith("recsys")} == {"docpack"}
    # A smoke run's heads: 1/scale of the KV heads, each with its query group (GQA stays GQA).
    small = {layer.id: layer for layer in models.layers(models.parse_args(["--device", "cpu", "--scale", "4"]))}
    assert (small["llama3-8b"].heads, small["llama3-8b"].kv_heads) == (8, 2)
    assert (small["qwen2.5-7b"].heads, small["qwen2.5-7b"].kv_heads) == (7, 1)
    assert models.parse_args(["--models", "gpt-oss", "--device", "cpu"]).impls == ["jagflash", "FlexAttention"]
    assert models.parse_args(["--device", "cuda"]).impls == list(models.GPU_IMPLS)


def test_batches_come_from_the_shared_generators():
    args = models.parse_args(["--device", "cpu"])
    docpack = models.batch_lengths(_layer("llama3-8b"), args)
    assert docpack == __import__("sweep").own_lengths("docpack", 131072) and sum(docpack) == 131072
    assert models.batch_lengths(_layer("recsys-none"), args) == jagflash.generate_lengths("gemskew", args.seed)
    small = models.batch_lengths(_layer("recsys-none"), models.parse_args(["--device", "cpu", "--scale", "32"]))
    assert len(small) == 256 // 32 and all(n >= 1 for n in small)


def test_flops_count_the_visible_pairs_as_compare_does():
    lengths = [100, 300]
    full = _layer("llama3-8b")
    pairs = models.visible_pairs(full, lengths)
    assert pairs == sum(jagflash.visible_pairs(n, n, causal=True) for n in lengths)
    flops = models.useful_flops(full, pairs)
    assert flops["fwd"] == 4.0 * 32 * 128 * pairs and flops["bwd"] == compare.BWD_FLOPS * flops["fwd"]
    assert flops["step"] == flops["fwd"] + flops["bwd"]
    sliding = _layer("gpt-oss-sliding")  # a window of 128: the query and the 127 keys before it
    assert models.visible_pairs(sliding, [300]) == jagflash.visible_pairs(300, 300, causal=True, window=(127, 0))
    assert models.visible_pairs(sliding, [300]) == 128 * 300 - 127 * 128 // 2
    assert models.visible_pairs(_layer("recsys-pooled"), lengths) == 32 * 400
    mla = _layer("deepseek-v3-mla")
    assert models.useful_flops(mla, 1)["fwd"] == 2.0 * 16 * (192 + 128)


def _fake_fa3(monkeypatch):
    def flash_attn_varlen_func(*args, **kwargs):
        raise AssertionError("not called: the layer is refused first")

    monkeypatch.setitem(sys.modules, "flash_attn_interface",
                        types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))


def _refusal(name, x):
    with pytest.raises(peers.Skip) as caught:
        peers.make(name, x, compile_flex=False)
    return str(caught.value)


def test_each_peer_says_in_words_what_it_lacks(monkeypatch):
    _fake_fa3(monkeypatch)
    gemma = _inputs("gemma2-9b-local")
    assert _refusal("FA3 varlen", gemma) == "no softcap, no sliding window, no D=256 in this FA3 build"
    assert _refusal("FA2 varlen", gemma) == "no softcap"
    assert _refusal(peers.CUDNN, gemma) == ("no softcap, no sliding window, no GQA, no D=256 in torch's nested "
                                            "cuDNN path")
    assert _refusal("varlen_attn", gemma) == "no softcap"
    mla = _inputs("deepseek-v3-mla")
    assert _refusal("FA3 varlen", mla) == "no Dv ≠ D, no D=192 in this FA3 build"
    assert _refusal(peers.CUDNN, mla) == "no Dv ≠ D, no D=192 in torch's nested cuDNN path"
    oss = _inputs("gpt-oss-full")
    assert _refusal("FA3 varlen", oss) == "no sinks"
    assert _refusal("FA2 varlen", oss) == "no sinks"
    monkeypatch.setattr(peers, "jagflash_has_sinks", lambda: False)
    assert _refusal("jagflash", oss) == "no sinks in this build"
    # What a peer has is no refusal: FA2 and FA4 take the window (and need CUDA, which the CPU lacks).
    for name in ("FA2 varlen", "FA3 varlen"):
        with pytest.raises(RuntimeError, match="needs CUDA"):
            peers.make(name, _inputs("llama3-8b"))


def _on_cpu(cls, x, **fields):
    """A GPU peer over CPU tensors, past its device check."""
    impl = cls.__new__(cls)
    impl.__dict__.update(x=x, **fields)
    return impl


def test_fa4_is_given_the_window_softcap_and_sinks(monkeypatch):
    calls = []

    def flash_attn_varlen_func(q, k, v, **kwargs):
        calls.append(kwargs)
        sinks = kwargs.get("learnable_sink", torch.zeros(1))
        out = q.float().sum(-1, keepdim=True) + k.float().sum() + v.float().sum() + sinks.sum()
        out = out * torch.ones(v.shape[-1])
        return out, None  # differentiable in every argument, as FA4's is

    x = _inputs("gpt-oss-sliding")
    impl = _on_cpu(peers.FlashAttention4, x, leaves=x.leaves(), dout=x.dout, fn=flash_attn_varlen_func)
    out = impl.forward()
    (kwargs,) = calls
    assert kwargs["window_size"] == (127, 0) and kwargs["learnable_sink"] is x.sinks and kwargs["causal"]
    assert "softcap" not in kwargs and kwargs["cu_seqlens_q"] is kwargs["cu_seqlens_k"] is x.offsets
    grads = impl.backward(out)
    assert len(grads) == 4 and grads[3].shape == (x.q.shape[1],)  # the sinks' gradient too
    impl.x = _inputs("gemma2-9b-global")
    impl.forward()
    assert calls[-1]["softcap"] == 50.0 and "window_size" not in calls[-1] and "learnable_sink" not in calls[-1]


def test_fa2_pads_a_narrow_v_and_passes_the_window(monkeypatch):
    seen = {}

    def forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, **kwargs):
        seen["fwd"] = (v.shape[-1], kwargs)
        return torch.ones(q.shape[0], q.shape[1], v.shape[-1]), "lse", "rng", "unused", None

    def backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, rng, unused, **kwargs):
        seen["bwd"] = (dout.shape[-1], out.shape[-1], kwargs)
        return torch.zeros_like(q), torch.zeros_like(k), torch.ones_like(v)

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", forward)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", backward)
    x = _inputs("deepseek-v3-mla")
    impl = _on_cpu(peers.FlashAttention2, x, v_pad=64, window={})
    out = impl.forward()
    assert seen["fwd"] == (192, {}) and out.shape[-1] == 128
    dq, dk, dv = impl.backward(out)
    assert seen["bwd"] == (192, 192, {}) and dv.shape == x.v.shape and dq.shape == x.q.shape
    x = _inputs("gemma2-9b-local")
    impl = _on_cpu(peers.FlashAttention2, x, v_pad=0, window={"window_size_left": 4095, "window_size_right": 0})
    impl.backward(impl.forward())
    assert seen["fwd"][1] == seen["bwd"][2] == {"window_size_left": 4095, "window_size_right": 0}


def _block_mask_matches_the_tokens(lengths, causal, window_left, q_lengths=None):
    """Every block pair the BlockMask lists holds a visible pair, every full one only visible pairs,
    and no visible pair lies in an unlisted block."""
    length = -(-sum(lengths) // 128) * 128
    q_length = -(-sum(q_lengths) // 128) * 128 if q_lengths else length
    mask = peers.document_block_mask(lengths, length, causal, CPU, q_lengths, q_length, window_left)
    q_doc, kv_doc = peers._flex_state["q_doc"], peers._flex_state["kv_doc"]
    qi, ki = torch.arange(q_length)[:, None], torch.arange(length)[None, :]
    visible = q_doc[:, None] == kv_doc[None, :]
    if causal:
        visible &= ki <= qi
    if window_left >= 0:
        visible &= qi - ki <= window_left
    blocks = visible.view(q_length // 128, 128, length // 128, 128)
    some, every = blocks.any(dim=(1, 3)), blocks.all(dim=(1, 3))
    dense = mask.to_dense()[0, 0].bool()
    full = torch.zeros_like(dense)
    num, idx = mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]
    for row in range(dense.shape[0]):
        full[row, idx[row, : num[row]].long()] = True
    assert torch.equal(dense, some)
    assert not (full & ~every).any()


def test_the_block_mask_lists_the_window_and_cross_attention_blocks():
    _block_mask_matches_the_tokens([100, 300, 7, 600], causal=True, window_left=-1)
    _block_mask_matches_the_tokens([100, 300, 7, 600], causal=True, window_left=127)
    _block_mask_matches_the_tokens([1000, 300], causal=True, window_left=299)
    _block_mask_matches_the_tokens([100, 300, 7, 600], causal=False, window_left=-1, q_lengths=[32] * 4)


def _flex(x):
    impl = peers.make("FlexAttention", x, compile_flex=False)
    return impl.unpad(impl.forward(), ())[0]


def test_flex_attention_has_the_window_sinks_and_pooled_queries_of_jagflash():
    x = _inputs("gpt-oss-sliding", "--scale", "8", lengths=(40, 300, 7))  # 300 > the window of 128
    ours, lse = jagflash.jagged_attention(x.q, x.k, x.v, x.offsets, causal=True, window=(127, 0), return_lse=True)
    # A sink joins the denominator: out · exp(lse) / (exp(lse) + exp(s)).
    with_sinks = ours.float() * torch.sigmoid(lse.transpose(0, 1) - x.sinks[None, :]).unsqueeze(-1)
    assert compare.normalised_error(_flex(x), with_sinks) < 2e-2
    x = _inputs("gemma2-9b-local", "--scale", "8")
    ours = jagflash.jagged_attention(x.q, x.k, x.v, x.offsets, causal=True, window=(4095, 0), softcap=50.0)
    assert compare.normalised_error(_flex(x), ours) < 2e-2
    x = _inputs("recsys-pooled", "--scale", "8")
    ours = jagflash.pooled_attention(x.q, x.k, x.v, x.offsets)
    assert x.q.shape[0] == 32 and compare.normalised_error(_flex(x), ours) < 2e-2
    assert peers.make("FlexAttention", x, compile_flex=False).no_backward == "FlexAttention has no backward on CPU"


def test_a_peer_fed_repeated_queries_has_its_dq_summed_over_the_copies():
    x = _inputs("recsys-pooled", "--scale", "8")
    impl = peers.make("jagflash", peers.query_repeated(x))  # jagged_attention on the repeated queries
    wrapped = peers.QueryRepeated(impl, x.q.shape[0])
    out = wrapped.forward()
    out, (dq, dk, dv) = wrapped.unpad(out, wrapped.backward(out))
    pooled = peers.make("jagflash", x)
    assert isinstance(pooled, peers.JagflashPooled)
    ref_out = pooled.forward()
    ref_dq, ref_dk, ref_dv = pooled.backward(ref_out)
    assert dq.shape == ref_dq.shape == x.q.shape
    for mine, theirs in ((out, ref_out), (dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        assert compare.normalised_error(mine, theirs) < 2e-2


class _Fake:
    """An implementation whose forward or backward fails, or that has no backward, as asked."""

    def __init__(self, value, fail=None, no_backward=None):
        self.value, self.fail, self.no_backward = value, fail, no_backward

    def forward(self):
        if self.fail == "fwd":
            raise RuntimeError("forward broke")
        return torch.full((4, 2, 8), self.value)

    def backward(self, out, retain_graph=True):
        if self.fail == "bwd":
            raise RuntimeError("backward broke")
        return out + 1, out + 2, out + 3

    def step(self):
        return self.forward(), self.backward(None if self.fail else self.forward())

    def unpad(self, out, grads):
        return out, grads


def test_a_failed_or_missing_backward_leaves_the_forward_standing():
    args = models.parse_args(["--device", "cpu", "--iters", "1", "--warmup", "0"])
    impls = {"jagflash": _Fake(1.0), "FA2 varlen": _Fake(1.5, fail="bwd"), "FA3 varlen": _Fake(1.0, fail="fwd"),
             "FlexAttention": _Fake(1.0, no_backward="FlexAttention has no backward on CPU")}
    results, trainable = models.time_layer(impls, CPU, args)
    flops = {part: 1e9 for part in models.PARTS}
    rows = {r["impl"]: r for r in models.layer_rows(list(impls) + ["FA4 varlen"], impls,
                                                    {"FA4 varlen": peers.Skip("no D=512")}, results, flops, {})}
    models.time_steps(trainable, results, CPU, args)
    for name, row in rows.items():
        models.part_cell_fields(row, "step", results.get(name, {}), flops)
    assert all(rows["jagflash"][f"{part}_tflops"] > 0 for part in models.PARTS)
    fa2 = rows["FA2 varlen"]
    assert fa2["fwd_tflops"] > 0 and fa2["bwd_error"] == "RuntimeError: backward broke"
    assert fa2["step_skipped"] == "no backward" and fa2["max_abs_err"] == 0.5 and fa2["mismatch"]
    assert rows["FA3 varlen"]["fwd_error"] == "RuntimeError: forward broke"
    assert rows["FA3 varlen"]["bwd_skipped"] == "no forward"
    flex = rows["FlexAttention"]
    assert flex["fwd_tflops"] > 0
    assert flex["bwd_skipped"] == flex["step_skipped"] == "FlexAttention has no backward on CPU"
    assert flex["max_abs_err"] == 0.0 and flex["checked_against"] == "jagflash"
    assert rows["FA4 varlen"]["skipped"] == "no D=512" and models.cell(rows["FA4 varlen"], "bwd") == "no D=512"
    assert models.cell(fa2, "bwd") == "error¹" and models.cell(fa2, "fwd").endswith("²")


def _row(layer, impl, fwd=None, bwd=None, step=None, **extra):
    row = {"layer": layer, "case": layer, "mask": "causal", "head_dim": 128, "impl": impl, **extra}
    for part, tflops in (("fwd", fwd), ("bwd", bwd), ("step", step)):
        if tflops is not None:
            row[f"{part}_tflops"], row[f"{part}_ms"] = tflops, 1000.0 / tflops
    return row


def _meta(**extra):
    layer_info = {"name": "Llama-3-8B", "kind": "causal", "heads": 32, "kv_heads": 8, "head_dim": 128,
                  "v_head_dim": 128, "batch": "docpack", "tokens": 131072, "sequences": 99, "model_heads": 0}
    meta = {"date": "2026-12-08", "commit": "abc1234", "command": "python bench/models.py", "gpu": "NVIDIA H100",
            "torch": "2.11.0", "cuda": "13.0", "cudnn": 91900, "jagflash": "0.1.0", "timer": "CUDA events",
            "fwd_calls": 4, "bwd_calls": 2, "tokens": 131072, "scale": 1, "iters": 5,
            "columns": ["jagflash", "FA3 varlen", peers.FA4, "FA2 varlen"], "impls": ["jagflash", "FA3 varlen",
                                                                                      "FA2 varlen"],
            "skipped": {peers.FA4: "flash_attn.cute does not import"},
            "layers": {"llama3-8b": layer_info, "gemma2-9b-global": dict(layer_info, name="Gemma-2-9B",
                                                                           kind="causal, softcap 50", heads=16)}}
    meta.update(extra)
    return meta


def _rows():
    return [_row("llama3-8b", "jagflash", 500.0, 400.0, 420.0),
            _row("llama3-8b", "FA3 varlen", 520.0, 380.0, 400.0, max_abs_err=0.0039, checked_against="jagflash"),
            _row("llama3-8b", "FA2 varlen", 300.0, bwd_error="RuntimeError: boom", max_abs_err=0.0078,
                 checked_against="jagflash"),
            _row("gemma2-9b-global", "jagflash", 400.0, 300.0, 320.0),
            _row("gemma2-9b-global", "FA3 varlen", skipped="no softcap, no D=256 in this FA3 build"),
            _row("gemma2-9b-global", "FA2 varlen", skipped="no softcap")]


def test_the_table_gives_figures_words_and_the_best_peer():
    text = models.table(_meta(), _rows())
    lines = text.splitlines()
    assert lines[0] == ("| model | layer | batch (tokens / seqs) | part | jagflash | FA3 varlen | FA4 varlen | "
                        "FA2 varlen | jagflash / best peer |")
    assert lines[2] == ("| Llama-3-8B | causal; H 32/8, D=128 | docpack 131072 / 99 | forward | 500 (2.00 ms) | "
                        "520 (1.92 ms) | not in this run | 300 (3.33 ms) | 0.96 (FA3 varlen) |")
    assert lines[3] == ("|  |  |  | backward | 400 (2.50 ms) | 380 (2.63 ms) | not in this run | error¹ | "
                        "1.05 (FA3 varlen) |")
    assert "| Gemma-2-9B | causal, softcap 50; H 16/8, D=128 |" in lines[5]
    assert lines[5].endswith("| forward | 400 (2.50 ms) | no softcap, no D=256 in this FA3 build | not in this run | "
                             "no softcap | — |")
    checks = models.check_table(_meta(), _rows())
    assert "| Llama-3-8B | causal | jagflash | 0.0039 | 0.0078 |" in checks
    notes = models.notes(_meta(), _rows())
    assert f"{peers.FA4} not in this run: flash_attn.cute does not import." in notes
    assert "¹ FA2 varlen on llama3-8b, backward: RuntimeError: boom" in notes
    heading, body = models.markdown(_meta(), _rows(), "models.png")
    assert heading == "## bench/models.py, 2026-12-08, abc1234" and "`python bench/models.py`" in body
    assert body.endswith("![jagflash / best peer per layer](models.png)\n")


def test_two_runs_render_as_one_and_replace_the_results_section(tmp_path):
    first, second = _rows()[:3], _rows()[3:]
    for name, rows, command in (("a", first, "python bench/models.py --models llama3-8b"),
                                ("b", second, "python bench/models.py --models gemma2-9b")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "models.json").write_text(json.dumps({"meta": _meta(command=command), "rows": rows}))
    meta, rows = models.load([tmp_path / "a", tmp_path / "b"])
    assert rows == first + second and [r["command"] for r in meta["runs"]] == [
        "python bench/models.py --models llama3-8b", "python bench/models.py --models gemma2-9b"]
    heading, body = models.markdown(meta, rows, None)
    assert "`python bench/models.py --models llama3-8b`; `python bench/models.py --models gemma2-9b`" in body
    results = tmp_path / "RESULTS.md"
    results.write_text(f"# r\n\n## 16. Before\n\nkept\n\n## 17. {models.RESULTS_SECTION}\n\nold text\n\n"
                       "## 18. After\n\nkept too\n")
    models.update_results(results, heading, body)
    text = results.read_text()
    assert "old text" not in text and body in text and text.count("kept") == 2
    assert text.index(body) < text.index("## 18. After")


def test_a_small_cpu_run_writes_its_table(tmp_path):
    argv = ["--device", "cpu", "--scale", "64", "--models", "gpt-oss", "recsys", "--iters", "1", "--warmup", "0",
            "--fwd-calls", "1", "--bwd-calls", "1", "--out", str(tmp_path)]
    assert models.main(argv) == 0
    saved = json.loads((tmp_path / "models.json").read_text())
    rows = {(r["layer"], r["impl"]): r for r in saved["rows"]}
    assert set(saved["meta"]["layers"]) == {"gpt-oss-full", "gpt-oss-sliding", "recsys-none", "recsys-causal",
                                            "recsys-pooled"}
    for layer in ("recsys-none", "recsys-causal", "recsys-pooled"):
        mine, flex = rows[(layer, "jagflash")], rows[(layer, "FlexAttention")]
        assert all(mine[f"{part}_tflops"] > 0 for part in models.PARTS)
        assert flex["fwd_tflops"] > 0 and flex["bwd_skipped"] == "FlexAttention has no backward on CPU"
        assert flex["checked_against"] == "jagflash" and flex["max_abs_err"] < 0.05
    if not peers.jagflash_has_sinks():
        assert rows[("gpt-oss-full", "jagflash")]["skipped"] == "no sinks in this build"
    assert rows[("gpt-oss-sliding", "FlexAttention")]["fwd_tflops"] > 0
    section = (tmp_path / "models.md").read_text()
    assert "| recsys history | pooled, Lq = 32; H 1, D=128 |" in section
    assert "recsys-pooled: the peers take the 32-row query set repeated per sequence" in section
    assert saved["meta"]["command"] == "python bench/models.py " + " ".join(argv)
