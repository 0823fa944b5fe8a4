"""bench/sustained.py's reading of nvidia-smi's samples (the GPU-only timing itself runs on the H200)."""
import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import sustained  # noqa: E402


def test_medians_skip_lines_nvidia_smi_could_not_fill():
    lines = ["1980, 612.5", "1590, 683.0", "[N/A], 650.0", "1695, 569.1", "1700", ""]
    clock, power = sustained.median_clock_power(lines)
    assert clock == 1695.0
    assert power == 612.5


def test_no_samples_gives_nan():
    clock, power = sustained.median_clock_power(["[N/A], [N/A]"])
    assert math.isnan(clock) and math.isnan(power)
