"""bench/registry_step.py end to end on the CPU (its smoke test): the block's training step with
jagflash's kernels registered for CPU tensors, the table it prints. The GPU run (PyTorch's kernel
next to jagflash activated) uses the same code with CUDA events."""
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "registry_step.py"


def test_cpu_smoke_run_prints_the_table():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--scale", "64", "--masks", "causal", "--warmup", "0",
         "--iters", "1"],
        capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any("pytorch skipped: aten::_flash_attention_forward has no CPU kernel" in line for line in lines)
    rows = [line for line in lines if line.startswith("| causal |")]
    assert [row.split(" | ")[1] for row in rows] == ["jagflash", "jagflash, device check"]
