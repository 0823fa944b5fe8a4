#!/usr/bin/env python3
"""Executed instructions of a kernel by opcode, from ncu's source page (`ncu -i REP --page source
--csv --print-source sass`, gzipped or not), side by side for several reports: where one kernel
issues more work than another (scripts/gpu-profile.sh writes the pages). Prints the opcodes with
the most executed warp instructions, in millions, and each kernel's total.

    python bench/sass_mix.py A_sass.csv.gz B_sass.csv.gz ... [--top 30]
"""
import argparse
import csv
import gzip
import io
import re
from collections import Counter
from pathlib import Path


def mix(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        text = f.read()
    rows = list(csv.reader(io.StringIO(text)))
    at = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    head = rows[at]
    src, executed = head.index("Source"), head.index("Instructions Executed")
    counts = Counter()
    for r in rows[at + 1:]:
        if len(r) <= executed or not r[executed].replace(",", "").isdigit():
            continue
        m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", r[src])
        if m:
            counts[m.group(2)] += int(r[executed].replace(",", ""))
    return counts


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("pages", nargs="+")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    mixes = [mix(p) for p in args.pages]
    names = [Path(p).name.split("_")[0] for p in args.pages]
    total = Counter()
    for m in mixes:
        total.update(m)
    print("opcode".ljust(16) + "".join(n.rjust(12) for n in names) + "   (M warp instructions executed)")
    for op, _ in total.most_common(args.top):
        print(op.ljust(16) + "".join(f"{m[op] / 1e6:12.2f}" for m in mixes))
    print("total".ljust(16) + "".join(f"{sum(m.values()) / 1e6:12.2f}" for m in mixes))


if __name__ == "__main__":
    main()
