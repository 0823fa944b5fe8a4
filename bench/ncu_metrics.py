#!/usr/bin/env python3
"""Prints a few ncu metrics of several reports side by side (the raw page, exported with
`ncu -i REP --page raw --csv`, one file per report): what limits a backward kernel (issue 24):
tensor-pipe activity, L2 reductions and hit rate, DRAM traffic, shared-memory bank conflicts,
and the warp stall reasons per issued instruction. Used by scripts/gpu-profile.sh.

    python bench/ncu_metrics.py A_raw.csv B_raw.csv ...
"""
import csv
import sys
from pathlib import Path

# (label, metric name prefix): the first column whose name starts with the prefix is shown.
METRICS = [
    ("duration (us)", "gpu__time_duration.sum"),
    ("SM clock (MHz)", "smsp__cycles_elapsed.avg.per_second"),
    ("tensor pipe active % (hmma)", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("tensor pipe active % (gmma)", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("issue slots busy %", "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    ("L2 hit rate %", "lts__t_sector_hit_rate.pct"),
    ("L2 reduction sectors", "lts__t_sectors_op_red.sum"),
    ("L2 atomic sectors", "lts__t_sectors_op_atom.sum"),
    ("L2 throughput %", "lts__t_sectors.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM read bytes", "dram__bytes_read.sum"),
    ("DRAM write bytes", "dram__bytes_write.sum"),
    ("DRAM throughput %", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("smem bank conflicts (ld)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"),
    ("smem bank conflicts (st)", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"),
    ("smem wavefronts (lsu)", "l1tex__data_pipe_lsu_wavefronts_mem_shared.sum"),
    ("L1/shared throughput %", "l1tex__throughput.avg.pct_of_peak_sustained_active"),
    ("shared bank reads %", "l1tex__data_bank_reads.avg.pct_of_peak_sustained_elapsed"),
    ("shared bank writes %", "l1tex__data_bank_writes.avg.pct_of_peak_sustained_elapsed"),
    ("instructions executed", "smsp__inst_executed.sum"),
    ("registers / thread", "launch__registers_per_thread"),
    ("grid size", "launch__grid_size"),
]
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def read(path):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    header_at = next(i for i, r in enumerate(rows) if "Kernel Name" in r or "ID" in r)
    header, data = rows[header_at], rows[header_at + 1:]
    # The raw page has a units row after the header, then one row per profiled kernel: take the last.
    data = [r for r in data if len(r) == len(header) and r[0] not in ("", "ID")]
    return dict(zip(header, data[-1])) if data else {}


def value(rec, prefix):
    for k, v in rec.items():
        if k.startswith(prefix):
            return v
    return "-"


def main(paths):
    recs = [read(p) for p in paths]
    names = [Path(p).name.replace("_raw.csv", "") for p in paths]
    width = max(len(n) for n in names) + 2
    print("metric".ljust(36) + "".join(n.rjust(width) for n in names))
    for label, prefix in METRICS:
        print(label.ljust(36) + "".join(str(value(r, prefix)).rjust(width) for r in recs))
    stalls = sorted({k[len(STALL_PREFIX):-len(STALL_SUFFIX)] for r in recs for k in r
                     if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX) and "not_issued" not in k})

    def stall(r, s):
        try:
            return float(r.get(STALL_PREFIX + s + STALL_SUFFIX, "nan").replace(",", ""))
        except ValueError:
            return float("nan")

    ranked = sorted(stalls, key=lambda s: -max(stall(r, s) for r in recs))
    print("stalls per issued instruction:")
    for s in ranked[:12]:
        print(("  " + s).ljust(36) + "".join(f"{stall(r, s):.3f}".rjust(width) for r in recs))


if __name__ == "__main__":
    main(sys.argv[1:])
