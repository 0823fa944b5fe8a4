"""The single-device training examples (examples/train_llm_packed.py, train_recsys_histories.py)
run a few steps on the CPU, in this process through their main(argv), so they cannot rot.

What is asserted of each: the jagged run and the padded baseline start from the same weights on
the same batches, so their losses must agree at the first step and, the math being the same up to
float32 rounding, along the whole curve (a jagged path that let documents or users see each other,
or dropped tokens, would not); the losses are finite, start near the chance level of the task and
fall (the synthetic tasks are easy, the seed fixed); tokens/s is positive; the output says the CPU
ran the reference path, and the progress bar and the closing table are printed. Each takes a
few seconds on 2 cores.
"""
import importlib.util
import math
import os
import sys

import pytest

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples"))


def _load(name):
    """examples/<name>.py as a module (the examples folder is no package)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)  # for their shared example_common
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_training(result, names, chance_loss):
    assert result["reference_path"] and result["device"] == "cpu"
    assert list(result["results"]) == names
    runs = [result["results"][n] for n in names]
    for name, run in zip(names, runs):
        losses = run["losses"]
        assert all(math.isfinite(x) for x in losses), f"{name}: {losses}"
        assert abs(losses[0] - chance_loss) < 0.15 * chance_loss, f"{name} starts at {losses[0]}, not near chance"
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        assert last < 0.85 * first, f"{name}: the loss did not fall: {losses}"
        assert run["final_loss"] == losses[-1]
        assert math.isfinite(run["tokens_per_s"]) and run["tokens_per_s"] > 0, name
    jagged, padded = (r["losses"] for r in runs)
    assert jagged[0] == pytest.approx(padded[0], rel=1e-5), "different losses at the first step"
    assert jagged == pytest.approx(padded, rel=1e-3), f"the curves part:\n{jagged}\n{padded}"


def _check_output(capsys, names, steps):
    out, err = capsys.readouterr()
    assert "float64 C++ reference" in out  # the CPU run says what it ran
    assert "implementation" in out and "tokens/s" in out and "final loss" in out
    for name in names:
        assert any(line.startswith(name) for line in out.splitlines()), f"no table row for {name}:\n{out}"
        assert f"{name} [" in err and f"] {steps}/{steps} loss " in err  # the built-in text bar
    return out


def test_train_llm_packed(capsys):
    pytest.importorskip("transformers", reason="train_llm_packed.py needs Hugging Face transformers")
    example = _load("train_llm_packed")
    steps = 12
    result = example.main(["--device", "cpu", "--steps", str(steps), "--progress", "text"])
    names = ["jagged_attention", "sdpa"]
    _check_training(result, names, chance_loss=math.log(64))  # uniform over the CPU default vocab
    # PyTorch's FlashAttention-2 peer needs CUDA: reported as skipped, with the reason, not failed.
    assert "CPU kernel" in result["skipped"]["torch_varlen"]
    out = _check_output(capsys, names, steps)
    assert "torch_varlen skipped: PyTorch has no CPU kernel" in out


def test_train_llm_packed_varlen_peer_code_path(monkeypatch):
    """The torch_varlen peer's transformers attention function on the CPU: aten has no flash
    kernels there, so jagflash's are registered for CPU tensors under varlen_attn (as the DDP
    example's CPU test does). Its curve must then follow jagflash's own integration's: the
    wrapper's layout (transpose, flatten, GQA heads, causal window, the output's shape) is right."""
    pytest.importorskip("transformers", reason="train_llm_packed.py needs Hugging Face transformers")
    from jagflash import registry

    example = _load("train_llm_packed")
    monkeypatch.setattr(example, "varlen_unavailable", lambda device: None)
    library = registry.register_kernels("CPU")
    try:
        # Head dim 64 (width 128, 2 heads; GQA with 1 KV head): the flash ops' jagflash kernels
        # serve 64, 128 and 256, as FlashAttention's common ones.
        result = example.main(["--device", "cpu", "--steps", "4", "--hidden", "128", "--heads", "2", "--kv-heads", "1",
                               "--progress", "none", "--implementations", "jagged_attention", "torch_varlen"])
    finally:
        library._destroy()
    assert result["skipped"] == {}
    jagged, varlen = (result["results"][n]["losses"] for n in ("jagged_attention", "torch_varlen"))
    assert all(math.isfinite(x) for x in varlen)
    assert varlen == pytest.approx(jagged, rel=1e-4)


def test_train_recsys_histories(capsys):
    example = _load("train_recsys_histories")
    steps = 20
    result = example.main(["--device", "cpu", "--steps", str(steps), "--progress", "text"])
    names = ["jagflash", "padded_sdpa"]
    _check_training(result, names, chance_loss=math.log(2))  # clicks are half the candidates
    assert result["skipped"] == {}
    # The batches are skewed: padding to the longest history costs several times the events.
    assert result["padded_per_step"] > 2 * result["events_per_step"]
    _check_output(capsys, names, steps)


def test_progress_bar_without_tqdm(monkeypatch):
    """"auto" falls back to the built-in bar when tqdm is not installed (no runtime dependency)."""
    common = _load("example_common")
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    assert isinstance(common.progress_bar(3, "x"), common._TextBar)
    with pytest.raises(ImportError):
        common.progress_bar(3, "x", mode="tqdm")
