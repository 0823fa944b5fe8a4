"""bench/op_overhead.py (the per-call cost of attention on small jagged batches) on a machine without a GPU: its options, the table and the
bars it prints from rows, and the --cpu mode (jagflash's host time per layer) end to end."""
import json
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import op_overhead  # noqa: E402


def _row(impl, direction, b, latency, host=1.0, gpu=1.0, length=128):
    return {"B": b, "L": length, "tokens": b * 10, "direction": direction, "impl": impl, "latency_us": latency,
            "host_us": host, "gpu_us": gpu}


def test_defaults_are_the_issue_grid():
    args = op_overhead.parse_args([])
    assert args.batches == [1, 8, 64, 256] and args.lengths == [128, 256, 512]
    assert args.directions == ["fwd", "fwd+bwd"] and "FA2 varlen" in args.impls and "FA3 varlen" in args.impls
    assert {"jagflash eager", "jagflash compile", "jagflash graph"} <= set(args.impls)


def test_table_has_a_cell_per_implementation_and_an_error_cell():
    args = op_overhead.parse_args(["--directions", "fwd"])
    rows = [_row("jagflash eager", "fwd", 8, 30.4, 9.6, 18.2), dict(_row("FA2 varlen", "fwd", 8, 0), error="E: x")]
    text = op_overhead.table(rows, ["jagflash eager", "FA2 varlen"], args)
    assert "| 8 | 128 | 80 | 30 (10 / 18) | error |" in text


def test_bars_say_met_and_not_met():
    rows = [_row("jagflash eager", "fwd", 8, 30, host=12), _row("FA2 varlen", "fwd", 8, 25),
            _row("jagflash eager", "fwd", 64, 40, host=16), _row("FA2 varlen", "fwd", 64, 45),
            _row("jagflash eager", "fwd+bwd", 8, 90), _row("FA2 varlen", "fwd+bwd", 8, 90)]
    text = op_overhead.bars(rows)
    assert "worst 16.0 us (NOT met)" in text
    assert "fwd B=8 L=128: jagflash 30 us vs FA2 25 us (NOT met)" in text
    assert "fwd B=64 L=128: jagflash 40 us vs FA2 45 us (met)" in text
    assert "fwd+bwd B=8 L=128: jagflash 90 us vs FA2 90 us (met)" in text


def _env():
    import jagflash

    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(Path(jagflash.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH")])))


def test_help_runs_without_a_gpu():
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "op_overhead.py"), "--help"], capture_output=True,
                          text=True, env=_env())
    assert done.returncode == 0 and "--cpu" in done.stdout and "latency" in done.stdout


def test_cpu_mode_measures_every_layer(tmp_path, monkeypatch):
    monkeypatch.setattr(op_overhead, "per_call_us", lambda fns, **_: [float(i + 1) for i in range(len(fns))])
    monkeypatch.setattr(op_overhead, "_import_jagflash", lambda: __import__("jagflash"))
    op_overhead.cpu_main(op_overhead.parse_args(["--cpu", "--out", str(tmp_path)]))
    saved = json.loads((tmp_path / "op_overhead.json").read_text())
    calls = [r["call"] for r in saved["rows"]]
    assert calls[0].startswith("C jagflash_fwd") and "torch.ops.jagflash_c.fwd (the binding)" in calls
    assert "jagged_attention + autograd.grad" in calls and [r["us"] for r in saved["rows"]] == list(
        map(float, range(1, len(calls) + 1)))
