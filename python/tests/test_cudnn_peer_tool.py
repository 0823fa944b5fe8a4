"""cuDNN's ragged forward as a benchmark peer (bench/peers.py CudnnRagged, compare.py's
check_then_profile and kernel timing, the rows and notes report.py and sweep.py render) without a
GPU: the kernel time taken from profiler events, the reasons a run or a case skips it, its
nested-tensor wrapping run through torch's math backend on the CPU (the same code path up to the
backend torch picks), and the table rows. The cuDNN kernels themselves only run on the H200."""
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent
from torch.nn.attention import SDPBackend

from jagflash import _lib

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import compare  # noqa: E402
import peers  # noqa: E402
import report  # noqa: E402
import sweep  # noqa: E402

CPU = torch.device("cpu")


def _event(name, us, device_type=DeviceType.CUDA, start=0.0, **extra):
    return FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=start + us, device_type=device_type,
                         **extra)


def _kernels(*durations_us):
    """A profiled call's events: the kernels given, plus what is not a kernel and must not count."""
    events = [_event(f"kernel{i}", us, start=10.0 * i) for i, us in enumerate(durations_us)]
    events += [_event("aten::_cudnn_attention_forward", 40000.0, DeviceType.CPU),  # the host's graph build
               _event("cudaLaunchKernel", 5.0, DeviceType.CPU),
               _event("Memcpy HtoD (Pageable -> Device)", 7.0), _event("Memset (Device)", 3.0),
               _event("my_range", 900.0, is_user_annotation=True)]
    return events


def _inputs(lengths, causal=False, head_dim=64, heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(sum(lengths), heads, head_dim, generator=g).to(torch.bfloat16) for _ in range(4))
    return peers.Inputs(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout,
                        peers.offsets_of(lengths, CPU), lengths, causal, 128)


def _math_peer(inputs):
    """CudnnRagged with torch's math backend: its wrapping (jagged views, [B, H, j, D], the packed
    output) on the CPU, where torch has no cuDNN."""
    return peers.CudnnRagged(inputs, backend=SDPBackend.MATH)


@pytest.fixture
def fake_profiler(monkeypatch):
    """compare._profiled_events replaced: each profiled call runs fn and gets the next kernel
    durations (us) from the list it returns."""
    durations = []

    def profiled(fn, device):
        fn()
        return _kernels(*durations.pop(0))

    monkeypatch.setattr(compare, "_profiled_events", profiled)
    return durations


def test_kernel_time_sums_the_cuda_kernels_of_the_call_and_nothing_else():
    ms, names = compare.kernel_time_ms(_kernels(1500.0, 20.0, 480.0))
    assert ms == pytest.approx(2.0)  # 1.5 + 0.02 + 0.48 ms; no copy, fill, range or host event
    assert names == ["kernel0", "kernel2", "kernel1"]  # longest first
    ms, names = compare.kernel_time_ms(_kernels(10.0, 10.0) + [_event("kernel0", 30.0, start=500.0)])
    assert ms == pytest.approx(0.05) and names == ["kernel0", "kernel1"]  # one name launched twice: summed


def test_kernel_time_refuses_a_profile_without_kernels():
    # The real profiler, on the CPU: the API compare.py calls exists and records no CUDA kernel here.
    events = compare._profiled_events(lambda: torch.ones(64, 64) @ torch.ones(64, 64), CPU)
    assert any(e.name == "aten::mm" for e in events)
    with pytest.raises(RuntimeError, match="no CUDA kernel"):
        compare.kernel_time_ms(events)
    with pytest.raises(RuntimeError, match="CUPTI"):
        compare.kernel_time_ms(_kernels()[2:])  # copies and ranges only


def test_measure_kernels_takes_the_median_of_one_call_per_profile(fake_profiler):
    calls = []
    fake_profiler += [[1000.0], [3000.0, 10.0], [2000.0]]
    kernel_ms, wall_ms, names = compare.measure_kernels(lambda: calls.append(1), CPU, warmup=2, iters=3)
    assert kernel_ms == pytest.approx(2.0) and wall_ms >= 0.0 and names == ["kernel0"]
    assert len(calls) == 2 + 3 and fake_profiler == []  # two wall-clock warm-ups, three profiled calls
    fake_profiler += [[], [4000.0], []]  # sessions without a kernel are left out
    assert compare.measure_kernels(lambda: None, CPU, warmup=0, iters=3)[0] == pytest.approx(4.0)
    fake_profiler += [[], []]
    with pytest.raises(RuntimeError, match="no CUDA kernel"):
        compare.measure_kernels(lambda: None, CPU, warmup=0, iters=2)


def test_a_run_skips_cudnn_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv(peers.CUDNN_NESTED_ENV, raising=False)
    assert "=None in the environment" in peers.cudnn_ragged_unavailable("cuda")
    compare.skip_unavailable(compare.parse_args(["--device", "cpu"]), {"impls": [], "skipped": {}})
    assert peers.CUDNN_NESTED_ENV not in os.environ  # a run without cuDNN leaves torch's default alone

    args = compare.parse_args(["--device", "cpu", "--impls", "jagflash", "cuDNN_ragged"])
    meta = {"impls": list(args.impls), "skipped": {}}
    compare.skip_unavailable(args, meta)
    assert os.environ[peers.CUDNN_NESTED_ENV] == "1"  # set for torch before anything runs
    assert args.impls == ["jagflash"] and meta["impls"] == ["jagflash"]
    assert meta["skipped"] == {"cuDNN ragged": "needs a CUDA device"}

    monkeypatch.setenv(peers.CUDNN_NESTED_ENV, "0")  # the user's value is kept, and reported
    args = compare.parse_args(["--device", "cpu", "--impls", "jagflash", "cuDNN_ragged"])
    meta = {"impls": list(args.impls), "skipped": {}}
    compare.skip_unavailable(args, meta)
    assert meta["skipped"]["cuDNN ragged"].startswith("TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED='0' in the environment")


def test_a_case_skips_cudnn_where_its_mask_or_head_dim_differs():
    assert peers.causal_alignment_skip(False, [3, 5], [4, 5]) is None  # no mask: no alignment
    assert peers.causal_alignment_skip(True, [3, 5], [3, 5]) is None  # Lq == Lk: top-left is bottom-right
    reason = peers.causal_alignment_skip(True, [3, 5, 7], [3, 6, 8])
    assert reason.startswith("causal with Lq != Lk in 2 sequence(s)") and "top-left" in reason
    assert peers.causal_alignment_skip(True, [3, 5], [3]) is not None
    for head_dim in (100, 256):
        with pytest.raises(peers.Skip, match=f"multiples of 8 up to 128, not {head_dim}"):
            peers.make(peers.CUDNN, _inputs([3, 5], head_dim=head_dim))
    assert isinstance(peers.make(peers.CUDNN, _inputs([3, 5], causal=True, head_dim=128)), peers.CudnnRagged)


def test_nested_wrapping_matches_jagflash_on_the_cpu():
    lengths = [1, 7, 30, 2]
    x = _inputs(lengths)
    impl = _math_peer(x)
    # [B, H, j, D] views of the packed buffers, no copy; the lengths known without a device read.
    assert impl.q.shape[:2] == (4, 2) and impl.q.shape[-1] == 64 and impl.q.is_nested
    assert impl.q.transpose(1, 2).values().data_ptr() == x.q.data_ptr()
    assert impl.q._maybe_max_seqlen == 30 and impl.q._maybe_min_seqlen == 1
    out = impl.forward()
    assert out.shape == x.q.shape and out.dtype == torch.bfloat16 and not out.requires_grad
    expected = peers.Jagflash(x).forward()
    assert compare.normalised_error(out, expected) < 1e-2, "seed 0"
    with pytest.raises(NotImplementedError, match="forward peer only"):
        impl.backward(out)
    with pytest.raises(NotImplementedError):
        impl.step()


def test_check_then_profile_times_a_forward_that_matches(fake_profiler):
    x = _inputs([5, 17, 9], seed=1)
    reference = ("jagflash", peers.Jagflash(x).forward().detach())
    fake_profiler += [[700.0, 50.0], [800.0, 50.0], [600.0, 50.0]]
    args = compare.parse_args(["--device", "cpu", "--warmup", "1", "--iters", "3"])
    timed = compare.check_then_profile(_math_peer(x), reference, CPU, args)
    assert timed["fwd_ms"] == pytest.approx(0.75) and timed["timer"] == "profiler"
    assert timed["bwd_ms"] is None and timed["grads"] == () and timed["checked_against"] == "jagflash"
    assert 0.0 <= timed["max_abs_err"] < 0.05 and timed["wall_ms"] >= 0.0
    assert timed["kernels"] == ["kernel0", "kernel1"] and timed["kernel_count"] == 2

    row, result = compare.case_row(peers.CUDNN, timed, flops=3e9, reference=(reference[1],))
    assert row["fwd_ms"] == pytest.approx(0.75) and row["fwd_tflops"] == pytest.approx(4.0)
    assert "bwd_tflops" not in row and row["timer"] == "profiler" and row["kernels"] == ["kernel0", "kernel1"]
    assert row["kernel_count"] == 2 and "[kernel time, 2 kernel(s), longest kernel0;" in compare._progress(
        {**row, "dist": "short", "mask": "none", "head_dim": 64}, 1.0)
    assert row["max_abs_err"] == pytest.approx(timed["max_abs_err"]) and not row["mismatch"]
    assert len(result) == 1  # out only: no gradients to compare
    assert compare.case_row(peers.CUDNN, timed, 3e9, None)[0]["max_abs_err"] == timed["max_abs_err"]


def test_check_then_profile_skips_a_wrong_output_untimed(fake_profiler):
    x = _inputs([5, 17, 9], seed=2)
    args = compare.parse_args(["--device", "cpu"])
    good = peers.Jagflash(x).forward().detach()
    wrong = compare.check_then_profile(_math_peer(x), ("jagflash", good + 0.5), CPU, args)
    assert isinstance(wrong, peers.Skip) and fake_profiler == []  # never profiled
    assert str(wrong).startswith("output differs from jagflash's: max abs error 0.5") and "not timed" in str(wrong)

    class NaNs:
        def forward(self):
            return torch.full_like(good, math.nan)

    assert "max abs error nan" in str(compare.check_then_profile(NaNs(), ("FA3 varlen", good), CPU, args))
    skipped = compare.check_then_profile(NaNs(), None, CPU, args)
    assert isinstance(skipped, peers.Skip) and "no other implementation's output" in str(skipped)
    fwd_less = compare.parse_args(["--device", "cpu", "--parts", "bwd"])
    assert "times no forward" in str(compare.check_then_profile(NaNs(), ("jagflash", good), CPU, fwd_less))


def test_check_then_profile_says_why_torch_refused(fake_profiler):
    class Refused:
        def forward(self):
            warnings.warn("Flash attention has been runtime disabled.")
            warnings.warn("Experimental cuDNN SDPA nested tensor support is not enabled.")
            raise RuntimeError("No viable backend for scaled_dot_product_attention was found.")

    class Broken:
        def forward(self):
            raise ValueError("CUDNN_STATUS_EXECUTION_FAILED")

    args = compare.parse_args(["--device", "cpu"])
    reference = ("jagflash", torch.zeros(3))
    skipped = compare.check_then_profile(Refused(), reference, CPU, args)
    assert isinstance(skipped, peers.Skip)
    assert str(skipped) == ("torch found no backend for the case (Experimental cuDNN SDPA nested tensor support is "
                            "not enabled.; Flash attention has been runtime disabled.)")
    error = compare.check_then_profile(Broken(), reference, CPU, args)
    assert isinstance(error, ValueError) and not isinstance(error, peers.Skip)  # an error row, tolerated


def test_time_case_checks_and_profiles_cudnn_after_the_forwards(monkeypatch, fake_profiler):
    x = _inputs([5, 17, 9], seed=3)
    real_make = peers.make

    def make(name, inputs, compile_flex=True):
        return _math_peer(inputs) if name == peers.CUDNN else real_make(name, inputs)

    monkeypatch.setattr(peers, "make", make)
    fake_profiler += [[500.0], [500.0]]
    args = compare.parse_args(["--device", "cpu", "--impls", "cuDNN_ragged", "jagflash", "--iters", "2",
                               "--warmup", "1", "--fwd-calls", "1", "--bwd-calls", "1"])
    timed = compare.time_case(args.impls, x, CPU, args)
    assert list(timed) == ["cuDNN ragged", "jagflash"] and fake_profiler == []
    assert timed["jagflash"]["bwd_ms"] is not None  # jagflash's backward still timed
    assert timed["cuDNN ragged"]["fwd_ms"] == pytest.approx(0.5) and timed["cuDNN ragged"]["bwd_ms"] is None
    assert timed["cuDNN ragged"]["checked_against"] == "jagflash"  # jagflash first, whatever the order
    row, _ = compare.case_row(peers.CUDNN, timed["cuDNN ragged"], 1e9, None)
    assert row["timer"] == "profiler" and "error" not in row and "skipped" not in row

    monkeypatch.setattr(peers, "make", real_make)  # the real one: D = 100 is a skip, not an error
    odd = compare.time_case(args.impls, _inputs([5, 17, 9], head_dim=100), CPU,
                            compare.parse_args(["--device", "cpu", "--parts", "fwd", "--iters", "1", "--warmup", "0",
                                                "--impls", "jagflash", "cuDNN_ragged"]))
    row, _ = compare.case_row(peers.CUDNN, odd["cuDNN ragged"], 1e9, None)
    assert row == {"impl": "cuDNN ragged", "skipped": "torch's nested cuDNN path takes head dims that are "
                                                      "multiples of 8 up to 128, not 100"}


def _rows():
    """uniform1k none D = 128: cuDNN timed, ahead of jagflash; short causal D = 64: cuDNN wrong."""
    def row(impl, dist, mask, d, fwd, bwd=None, **extra):
        r = {"impl": impl, "dist": dist, "mask": mask, "head_dim": d, "fwd_ms": 1.0, "fwd_tflops": fwd}
        if bwd:
            r.update(bwd_ms=1.0, bwd_tflops=bwd)
        r.update(extra)
        if fwd is None:
            del r["fwd_ms"], r["fwd_tflops"]
        return r

    cudnn = dict(timer="profiler", wall_ms=31.4, kernels=["cudnn_sdpa_fprop"], checked_against="jagflash")
    return [row("jagflash", "uniform1k", "none", 128, 570.0, 400.0),
            row("FA3 varlen", "uniform1k", "none", 128, 550.0, 430.0, max_err=0.004, max_abs_err=0.01),
            row("cuDNN ragged", "uniform1k", "none", 128, 600.0, fwd_ms=0.9, max_err=0.003, max_abs_err=0.0078,
                **cudnn),
            row("jagflash", "short", "causal", 64, 80.0, 50.0),
            row("cuDNN ragged", "short", "causal", 64, None,
                skipped="output differs from jagflash's: max abs error 3.1, normalised 0.9 (tolerance 0.05); "
                        "not timed")]


def test_report_renders_the_cudnn_column_its_caption_and_its_skips():
    rows = _rows()
    text = report.table(rows)
    assert text.splitlines()[0].endswith("| FlexAttention | cuDNN ragged | jagflash / best peer |")
    assert ("| uniform1k | none | 128 | 570.0 / 400.0 | — | 550.0 / 430.0 | — | — | 600.0 / —³ | "
            "0.950 / 0.930 |") in text
    assert "| short | causal | 64 | 80.0 / 50.0 | — | — | — | — | skipped⁴ | — / — |" in text
    assert "cuDNN ragged" not in report.table([r for r in rows if r["impl"] != "cuDNN ragged"])

    meta = {"date": "2026-12-02", "commit": "abc1234", "command": "python bench/compare.py", "gpu": "NVIDIA H200",
            "torch": "2.11.0", "cuda": "13.0", "cudnn": 91900, "triton": "3.6.0", "python": "3.12.3",
            "jagflash": "0.1.0", "dtype": "bf16", "heads": 16, "dists": ["uniform1k", "short"], "seed": 1,
            "scale_note": "", "iters": 5, "warmup": 2, "budget_s": 1.0, "fwd_calls": 4, "bwd_calls": 2,
            "order": "interleaved", "timer": "CUDA events", "mismatch_tol": 0.05, "parts": ["fwd"], "skipped": {}}
    section = report.markdown(meta, rows, "c.png", [])
    assert ("- ³ cuDNN ragged: torch's nested-tensor SDPA (jagged q, k, v as [B, H, j, D]) with "
            "TORCH_CUDNN_SDPA_NESTED_TENSOR_ENABLED=1 and sdpa_kernel(CUDNN_ATTENTION), cuDNN 91900; forward only "
            "(its ragged backward returns wrong dq / dk in torch 2.11, PyTorch PR 186142). Its time is the sum of "
            "the CUDA kernel times of one call in torch.profiler, the median of 5 calls") in section
    assert ("spends tens of ms on the host (here 31.4–31.4 ms a call on the wall clock, against 0.90–0.90 ms"
            in section)
    assert ("checked against jagflash's before it was timed: max abs error at most 0.0078 (uniform1k/none/D128)"
            in section)
    assert ("- ⁴ cuDNN ragged skipped on short/causal/D64: output differs from jagflash's: max abs error 3.1, "
            "normalised 0.9 (tolerance 0.05); not timed") in section
    no_cudnn = report.markdown(meta, [r for r in rows if r["impl"] != "cuDNN ragged"], "c.png", [])
    assert "³" not in no_cudnn and "⁴" not in no_cudnn


def test_sweep_renders_the_forward_against_cudnn():
    def row(case, impl, fwd=None, **extra):
        r = {"case": case, "length": int(case[7:]), "batch": 1, "head_dim": 128, "mask": "causal", "impl": impl}
        if fwd:
            r.update(fwd_ms=1.0, fwd_tflops=fwd)
        r.update(extra)
        return r

    rows = [row("uniform8192", "jagflash", 545.0), row("uniform8192", "cuDNN ragged", 590.0, timer="profiler",
                                                      wall_ms=40.0, max_abs_err=0.0039, kernels=["cudnn_fprop"]),
            row("uniform16384", "jagflash", 555.0), row("uniform16384", "cuDNN ragged", skipped="needs a reason")]
    meta = {"date": "2026-12-02", "commit": "abc1234", "command": "python bench/sweep.py --parts fwd",
            "gpu": "NVIDIA H200", "torch": "2.11.0", "cuda": "13.0", "cudnn": 91900, "heads": 16, "tokens": 131072,
            "bwd_calls": 2, "iters": 5, "impls": ["jagflash", "cuDNN ragged"], "skipped": {}, "variants": {}}
    assert sweep.table(meta, rows, "fwd", peers.CUDNN).splitlines()[-1] == (
        "| 128 | causal | 545 / 590 (0.92) | 555 / skipped⁴ |")
    section = sweep.markdown(meta, rows, None)
    assert "Forward, jagflash / cuDNN ragged³ (ratio):" in section
    assert "- ³ cuDNN ragged: torch's nested-tensor SDPA" in section
    assert "max abs error at most 0.0039 (uniform8192/causal/D128)" in section
    assert "- ⁴ cuDNN ragged skipped on uniform16384/causal/D128: needs a reason" in section
    assert "SKIPPED needs a reason" in sweep.progress(rows[-1])
    assert ("[kernel time, 1 kernel(s), longest cudnn_fprop; 40.0 ms a call on the wall clock]"
            in sweep.progress(rows[1]))


def test_sweep_time_case_profiles_cudnn(monkeypatch, fake_profiler):
    real_make = peers.make
    monkeypatch.setattr(peers, "make", lambda name, inputs: (
        _math_peer(inputs) if name == peers.CUDNN else real_make(name, inputs)))
    fake_profiler.append([250.0])
    args = sweep.parse_args(["--device", "cpu", "--impls", "jagflash", "cuDNN_ragged", "--parts", "fwd",
                             "--iters", "1", "--warmup", "0", "--fwd-calls", "1"])
    timed = sweep.time_case(args, _inputs([32, 32, 32], seed=4), CPU)
    assert timed["cuDNN ragged"]["fwd_ms"] == pytest.approx(0.25) and timed["jagflash"]["fwd_ms"] >= 0.0
    assert timed["cuDNN ragged"]["max_abs_err"] < 0.05


def _run(script, tmp_path, *extra):
    env = dict(os.environ, JAGFLASH_LIBRARY=str(_lib.library_path()), JAGFLASH_COMMIT="test")
    cmd = [sys.executable, str(BENCH / script), "--device", "cpu", "--impls", "jagflash", "cuDNN_ragged",
           "--iters", "1", "--warmup", "0", "--out", str(tmp_path), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_compare_and_sweep_note_cudnn_skipped_without_a_gpu(tmp_path):
    done = _run("compare.py", tmp_path, "--scale", "32", "--max-batch", "4", "--dists", "short", "--head-dims", "64",
                "--masks", "none", "--parts", "fwd")
    assert "compare.py: cuDNN ragged skipped: needs a CUDA device" in done.stdout
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["meta"]["skipped"] == {"cuDNN ragged": "needs a CUDA device"}
    assert [r["impl"] for r in saved["rows"]] == ["jagflash"]
    assert "- cuDNN ragged not in this run: needs a CUDA device." in (tmp_path / "compare.md").read_text()

    _run("sweep.py", tmp_path, "--tokens", "64", "--lengths", "32", "--head-dims", "64", "--masks", "none",
         "--own", "--parts", "fwd")
    assert "Skipped: cuDNN ragged (needs a CUDA device)" in (tmp_path / "sweep.md").read_text()
