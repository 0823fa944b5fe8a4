"""bench/trace_fwd.py (the summary of a -DJAGFLASH_FWD_TRACE build's clock stamps) on a
synthetic log whose phase lengths are known."""
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import trace_fwd  # noqa: E402

PHASES = [10, 200, 300, 40, 50]  # barrier wait, S latency, softmax, P V wait, rescale+cvt
GAP = 7                          # end of one block to the top of the next


def synthetic_log(path, offset):
    lines = ["some other output"]
    for wg in (0, 1):
        t = 1000 + wg * offset
        for blk in range(12):
            stamps = [t]
            for length in PHASES:
                stamps.append(stamps[-1] + length + (blk % 3 if wg == 0 else 0))  # noise on wg 0
            lines.append(f"TRACE wg {wg} blk {blk} : " + " ".join(str(s) for s in stamps))
            t = stamps[-1] + GAP
    path.write_text("\n".join(lines) + "\n")


def test_summary_gives_phase_medians_period_and_offset(tmp_path, capsys):
    log = tmp_path / "trace.txt"
    synthetic_log(log, offset=123)
    assert trace_fwd.main(["trace_fwd.py", str(log)]) == 0
    out = capsys.readouterr().out
    wg1 = next(line for line in out.splitlines() if line.startswith("warpgroup 1"))
    assert "barrier wait 10, S latency 200, softmax 300, P V wait 40, rescale+cvt 50" in wg1
    assert f"period {sum(PHASES) + GAP}" in wg1
    assert "issue offset wg1 - wg0:" in out
    # wg 0 has +0..2 per phase on top; its median per phase is +1.
    wg0 = next(line for line in out.splitlines() if line.startswith("warpgroup 0"))
    assert "S latency 201" in wg0


def test_no_trace_lines_is_an_error(tmp_path, capsys):
    log = tmp_path / "empty.txt"
    log.write_text("nothing here\n")
    assert trace_fwd.main(["trace_fwd.py", str(log)]) == 1
    assert "no TRACE lines" in capsys.readouterr().out
