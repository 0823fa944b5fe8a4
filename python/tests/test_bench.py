"""bench/compare.py without a GPU: its timing helper and a small CPU run end to end (the GPU run
on the H200 uses the same code with CUDA events)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

import jagflash
from jagflash import _lib

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import compare  # noqa: E402


def test_measure_queues_calls_and_reports_per_call_time():
    calls = []

    def fn():
        calls.append(len(calls))
        return len(calls)

    ms, last = compare.measure(fn, torch.device("cpu"), warmup=1, iters=3, budget_s=10.0, calls=4)
    assert len(calls) == (1 + 3) * 4  # one warm-up sample and three timed ones, four calls each
    assert last == len(calls)
    assert ms >= 0.0


def test_measure_stops_at_the_budget():
    def slow():
        torch.ones(1).add_(1)  # something to time
        return None

    count = 0

    def counted():
        nonlocal count
        count += 1
        return slow()

    compare.measure(counted, torch.device("cpu"), warmup=0, iters=1000, budget_s=0.0, calls=2)
    assert count == 2  # at least one sample is always taken, then the budget stops it


def test_interleaved_takes_samples_in_turns_and_reverses_every_other_round():
    order = []

    def recorder(name):
        def fn():
            order.append(name)
            return name
        return fn

    fns = {"a": recorder("a"), "b": recorder("b"), "c": recorder("c")}
    out = compare.measure_interleaved(fns, torch.device("cpu"), warmup=1, iters=3, budget_s=10.0, calls=2)
    warmup, timed = order[:6], order[6:]
    assert warmup == ["a", "a", "b", "b", "c", "c"]
    assert timed == ["a", "a", "b", "b", "c", "c", "c", "c", "b", "b", "a", "a", "a", "a", "b", "b", "c", "c"]
    assert {name: result for name, (ms, result) in out.items()} == {"a": "a", "b": "b", "c": "c"}
    assert all(ms >= 0.0 for ms, _ in out.values())


def test_interleaved_drops_a_failing_function_and_keeps_the_others():
    calls = {"ok": 0, "bad": 0}

    def ok():
        calls["ok"] += 1
        return 1

    def bad():
        calls["bad"] += 1
        if calls["bad"] > 1:  # passes its warm-up, fails when timed
            raise RuntimeError("no kernel for this")
        return 2

    out = compare.measure_interleaved({"bad": bad, "ok": ok}, torch.device("cpu"), warmup=1, iters=4,
                                      budget_s=10.0, calls=1)
    assert isinstance(out["bad"], RuntimeError) and calls["bad"] == 2
    assert out["ok"][1] == 1 and calls["ok"] == 1 + 4


def test_interleaved_stops_at_the_budget_after_one_round():
    count = 0

    def counted():
        nonlocal count
        count += 1
        torch.ones(1).add_(1)

    compare.measure_interleaved({"x": counted, "y": counted}, torch.device("cpu"), warmup=0, iters=1000,
                                budget_s=0.0, calls=2)
    assert count == 4  # one round of both, two calls a sample


def test_compare_runs_on_the_cpu(tmp_path):
    env = dict(os.environ, JAGFLASH_LIBRARY=str(_lib.library_path()), JAGFLASH_COMMIT="test")
    cmd = [sys.executable, str(BENCH / "compare.py"), "--device", "cpu", "--scale", "32", "--max-batch", "6",
           "--dists", "short", "--head-dims", "64", "--masks", "causal", "--impls", "jagflash",
           "--iters", "2", "--warmup", "1", "--fwd-calls", "2", "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, env=env, capture_output=True, text=True, timeout=300)
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["meta"]["commit"] == "test" and saved["meta"]["fwd_calls"] == 2
    (row,) = saved["rows"]
    assert row["impl"] == "jagflash" and "error" not in row, row
    assert row["fwd_tflops"] > 0 and row["bwd_tflops"] > 0
    section = (tmp_path / "compare.md").read_text()
    assert "2 call(s) queued back to back" in section and "| short | causal | 64 |" in section
    assert jagflash.library_version() in section


def test_bar_table_holds_jagflash_over_fa2_against_the_bar():
    import report

    def row(impl, dist, mask, d, tflops):
        return {"impl": impl, "dist": dist, "mask": mask, "head_dim": d, "fwd_tflops": tflops, "bwd_tflops": 1.0}

    rows = [row("jagflash", "uniform1k", "none", 128, 330.0), row("FA2 varlen", "uniform1k", "none", 128, 200.0),
            row("FlexAttention", "uniform1k", "none", 128, 250.0),  # a faster peer does not change the bar's ratio
            row("jagflash", "short", "causal", 128, 100.0), row("FA2 varlen", "short", "causal", 128, 50.0),
            row("jagflash", "uniform1k", "none", 64, 900.0), row("FA2 varlen", "uniform1k", "none", 64, 100.0)]
    text = report.bar_table(rows)
    assert "| uniform1k none, D = 128 | 330.0 / 200.0 = 1.65 | 1.64 | **yes** |" in text
    assert "| short causal, D = 128 | 100.0 / 50.0 = 2.00 | 2.88 | no (-31%) |" in text
    assert "D = 64" not in text  # uniform1k at D = 64 has no bar
    assert "Bar met on 1 of 2 cases" in text
    assert report.bar_table([row("jagflash", "short", "none", 64, 1.0)]) is None


def test_benchmark_batch_draws_the_distribution_in_bf16():
    import peers

    def batch(uniform):
        return peers.benchmark_batch("pareto", 8, torch.Generator().manual_seed(3), heads=2, uniform=uniform)

    lengths, offsets, tensors = batch(False)
    assert lengths == jagflash.generate_lengths("pareto", jagflash.DEFAULT_SEED)
    assert offsets.dtype == torch.int32 and offsets[0] == 0 and int(offsets[-1]) == sum(lengths)
    assert len(tensors) == 4
    for t in tensors:
        assert t.shape == (sum(lengths), 2, 8) and t.dtype == torch.bfloat16
    assert not torch.equal(tensors[0], tensors[1])  # four independent draws
    assert torch.equal(tensors[0], batch(False)[2][0])  # the generator's seed fixes them
    _, _, uniform = batch(True)
    assert all(t.abs().max() <= 1.0 for t in uniform) and tensors[0].abs().max() > 1.0
