"""bench/sweep.py and bench/ncu_metrics.py without a GPU: the options, our own batches, the bars
rendered from synthetic rows, the environment a variant sets around its calls, and a tiny CPU run
end to end (the H200 run uses the same code with CUDA events)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import ncu_metrics  # noqa: E402
import sweep  # noqa: E402


def test_variant_option_parses_and_refuses_malformed_text():
    assert sweep.parse_variant("plain:A=0,B=1") == ("plain", {"A": "0", "B": "1"})
    for bad in ("plain", "plain:", ":A=1", "plain:A", "plain:=1"):
        with pytest.raises(SystemExit):
            sweep.parse_variant(bad)


def test_impl_names_take_underscores_for_spaces():
    args = sweep.parse_args(["--impls", "jagflash", "FA3_varlen"])
    assert args.impls == ["jagflash", "FA3 varlen"]


def test_own_batches_hit_the_token_count_and_are_what_they_say():
    doc = sweep.own_lengths("docpack", 131072)
    bi = sweep.own_lengths("bimodal", 131072)
    assert sum(doc) == 131072 and sum(bi) == 131072
    assert all(0 < n <= 8192 for n in doc) and max(doc) > 2000
    assert set(bi[:-1]) <= {32, 4096} and bi.count(4096) >= 10
    assert sweep.own_lengths("docpack", 131072) == doc  # a fixed seed: the same batch every run


def test_environment_is_set_around_a_call_and_restored():
    os.environ.pop("JAGFLASH_SWEEP_TEST", None)
    os.environ["JAGFLASH_SWEEP_KEEP"] = "kept"
    with sweep.environment_set({"JAGFLASH_SWEEP_TEST": "1", "JAGFLASH_SWEEP_KEEP": "changed"}):
        assert os.environ["JAGFLASH_SWEEP_TEST"] == "1"
        assert os.environ["JAGFLASH_SWEEP_KEEP"] == "changed"
    assert "JAGFLASH_SWEEP_TEST" not in os.environ
    assert os.environ.pop("JAGFLASH_SWEEP_KEEP") == "kept"


def _row(length, d, mask, impl, bwd):
    return {"case": f"uniform{length}", "length": length, "batch": 1, "head_dim": d, "mask": mask,
            "impl": impl, "bwd_ms": 1.0, "bwd_tflops": bwd}


def test_bars_say_which_points_miss():
    rows = [_row(4096, 128, "none", "jagflash", 560), _row(4096, 128, "none", "FA3 varlen", 540),
            _row(8192, 128, "none", "jagflash", 500), _row(8192, 128, "none", "FA3 varlen", 600)]
    bars = sweep.bars(rows)
    assert "NOT MET (uniform8192 D128 none 0.83)" in bars[0]
    assert "NOT MET (L=8192 500)" in bars[1]
    assert "NOT MET (D128 none 4096->8192: 560->500)" in bars[2]
    good = [_row(4096, 128, "none", "jagflash", 600), _row(4096, 128, "none", "FA3 varlen", 590)]
    assert all(b.endswith("MET") for b in sweep.bars(good))


def test_variants_table_takes_the_part_that_was_measured():
    meta = {"impls": ["jagflash", "FA3 varlen", "jagflash bn160"]}
    rows = [{"case": "uniform8192", "head_dim": 128, "mask": "none", "impl": "jagflash", "fwd_tflops": 600.0},
            {"case": "uniform8192", "head_dim": 128, "mask": "none", "impl": "jagflash bn160",
             "fwd_tflops": 630.0}]
    fwd = sweep.variants_table(meta, rows, "fwd")
    assert fwd.splitlines()[-1] == "| uniform8192 | 128 | none | 600 | 630 (1.05) |"
    assert sweep.variants_table(meta, rows, "bwd") == ""  # a --parts fwd run: no backward table
    assert sweep.variants_table({"impls": ["jagflash"]}, rows, "fwd") == ""  # no variant


def test_a_tiny_cpu_run_writes_its_rows_and_tables(tmp_path):
    env = dict(os.environ)
    cmd = [sys.executable, str(BENCH / "sweep.py"), "--device", "cpu", "--tokens", "96", "--lengths", "32", "48",
           "--head-dims", "64", "--masks", "causal", "--own", "bimodal", "--impls", "jagflash", "--iters", "1",
           "--warmup", "0", "--variant", "plain:JAGFLASH_BWD_L2_GROUP_MB=0", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    saved = json.loads((tmp_path / "sweep.json").read_text())
    cases = {(r["case"], r["impl"]) for r in saved["rows"]}
    assert cases == {(c, i) for c in ("uniform32", "uniform48", "bimodal") for i in ("jagflash", "jagflash plain")}
    assert all(r.get("bwd_tflops", 0) > 0 and r.get("fwd_tflops", 0) > 0 for r in saved["rows"])
    assert all(r["max_err"] < 1e-6 for r in saved["rows"] if r["impl"] == "jagflash plain")
    assert "| 64 | causal |" in (tmp_path / "sweep.md").read_text()
    assert "bar >= 1.0x FA3 on every uniform point: no FA3 in this run" in done.stdout


def test_ncu_metrics_reads_the_raw_page(tmp_path, capsys):
    for name, duration, stall in (("a", "10.5", "1.25"), ("b", "20.0", "0.50")):
        (tmp_path / f"{name}_raw.csv").write_text(
            '"ID","Kernel Name","gpu__time_duration.sum",'
            '"smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"\n'
            '"","","usecond","ratio"\n'
            f'"0","kernel","{duration}","{stall}"\n')
    ncu_metrics.main([str(tmp_path / "a_raw.csv"), str(tmp_path / "b_raw.csv")])
    out = capsys.readouterr().out
    assert "10.5" in out and "20.0" in out
    assert "wait" in out and "1.250" in out and "0.500" in out
