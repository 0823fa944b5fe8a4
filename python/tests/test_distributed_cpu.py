"""jagflash in PyTorch distributed training on the CPU (gloo, the C++ reference): examples/
test_train_ddp.py under torchrun with 2 processes, and in one process (world size 1) with the
varlen_attn peer's code path. The script's own checks are what is asserted: after one step the
DDP and FSDP2 gradients equal a single process's over every rank's batch (and, with 2 ranks, a
rank's unaveraged gradient does not: the check can fail), and training lowers the loss. The same
script runs on 2 GPUs (scripts/gpu-ddp.sh); here the two runs take 10-15 s."""
import json
import os
import subprocess
import sys

import pytest

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
# A hung collective must not hold CI: both runs take seconds.
TIMEOUT_S = 180


def run_script(script, args, ranks, tmp_path):
    """Runs examples/<script> on the CPU with `ranks` processes (torchrun when more than one);
    returns (exit status, output, the JSON report's records)."""
    report = tmp_path / "report.jsonl"
    command = [sys.executable]
    if ranks > 1:
        command += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    command += [os.path.join(EXAMPLES, script), "--device", "cpu", "--report-json", str(report), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
    output = done.stdout + done.stderr
    records = [json.loads(line) for line in report.read_text().splitlines()] if report.exists() else []
    return done.returncode, output, records


def by_check(records):
    return {r["check"]: r for r in records if r.get("kind") == "check"}


@pytest.mark.parametrize("ranks, attention", [(2, "jagflash"), (1, "varlen_attn")])
def test_ddp_and_fsdp2_gradients_equal_one_process(tmp_path, ranks, attention):
    rc, output, records = run_script("test_train_ddp.py", ["--attention", attention, "--steps", "6",
                                                           "--fsdp2-steps", "6"], ranks, tmp_path)
    assert rc == 0, output[-4000:]
    checks = by_check(records)
    assert set(checks) == {"env", "grad ddp", "grad fsdp2", "train ddp", "train fsdp2"}, output[-4000:]
    for name, record in checks.items():
        assert record["ok"], f"{name}: {record['detail_per_rank']}"
        assert record["world_size"] == ranks
    for mode in ("ddp", "fsdp2"):
        grad = checks[f"grad {mode}"]
        assert grad["max_rel_diff"] <= 1e-5, grad["detail"]
        if ranks > 1:  # the control: without the all-reduce the gradients would be far off
            assert "unaveraged local grad would give" in grad["detail"], grad["detail"]
        train = checks[f"train {mode}"]
        assert len(train["tokens_per_s_per_rank"]) == ranks and min(train["tokens_per_s_per_rank"]) > 0
    if attention == "varlen_attn":
        assert checks["grad ddp"]["attention"] == "varlen_attn (on jagflash's CPU kernels)"

