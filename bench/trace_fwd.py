#!/usr/bin/env python3
"""Summarises the clock stamps a -DJAGFLASH_FWD_TRACE build prints (src/kernels/fwd/trace_fwd.cuh).

    usage: trace_fwd.py LOG    (the output of e.g. `jagflash bench --fwd-only --iters 1
                                --warmup 0 --dist onegiant` from a trace build)

Per consumer warpgroup, the median over the first tile's KV blocks (the first and last two
left out) of: the K/V barrier wait, S latency (issue to S ready), softmax, the wait for P V
after the softmax, rescale + conversion, and the period from block to block, in SM clocks;
then the median offset between the two warpgroups' issue times (0: they run in phase).
"""
import statistics
import sys

PHASES = ["barrier wait", "S latency", "softmax", "P V wait", "rescale+cvt"]


def read(path):
    stamps = {}
    for line in open(path):
        if line.startswith("TRACE"):
            f = line.split()
            stamps.setdefault(int(f[2]), {})[int(f[4])] = [int(x) for x in f[6:12]]
    return stamps


def main(argv):
    if len(argv) != 2:
        print(__doc__)
        return 2
    stamps = read(argv[1])
    if not stamps:
        print("no TRACE lines (was the build made with -DJAGFLASH_FWD_TRACE?)")
        return 1
    for wg in sorted(stamps):
        blocks = stamps[wg]
        keys = sorted(blocks)[2:-2]
        cells = [f"{name} {statistics.median(blocks[k][i + 1] - blocks[k][i] for k in keys):.0f}"
                 for i, name in enumerate(PHASES)]
        period = statistics.median(blocks[k + 1][0] - blocks[k][0] for k in keys if k + 1 in blocks)
        print(f"warpgroup {wg} ({len(blocks)} blocks): " + ", ".join(cells) + f", period {period:.0f}")
    if len(stamps) == 2:
        keys = [k for k in sorted(stamps[0])[2:-2] if k in stamps[1]]
        print("issue offset wg1 - wg0:", statistics.median(stamps[1][k][1] - stamps[0][k][1] for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
