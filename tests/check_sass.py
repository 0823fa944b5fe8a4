#!/usr/bin/env python3
"""Checks the SASS of the built Hopper forward kernels (no GPU needed):

  1. the wgmma are not serialized: ptxas answers some code shapes (a divergent wgmma wait, a
     non-wgmma instruction touching accumulators while a wgmma batch is in flight) by waiting
     after every HGMMA, which cost the ping-pong kernel 20% for three sessions unnoticed
     (bench/NOTES.md). Serialized code has a WARPGROUP.DEPBAR per HGMMA; ours has about one per
     GEMM (8 HGMMAs);
  2. the consumer path never touches local memory: no LDL/STL between the consumers'
     USETMAXREG.TRY_ALLOC and the producer's USETMAXREG.DEALLOC (the producer, one thread with
     few registers, may spill: its code follows the DEALLOC);
  3. no empty wgmma group (an HGMMA on gdesc[URZ]): ptxas emits one for a commit it cannot
     attach to a real GEMM, e.g. one committed after a conditional GEMM; the wait that follows
     then also waits for the GEMM meant to keep running (this silently disabled the mainloop's
     intra-warpgroup overlap until session 8, bench/NOTES.md);
  4. the instructions the design relies on are there: HGMMA, USETMAXREG, UTMALDG (TMA loads),
     MUFU.EX2 without the denormal fix-up around it (FSETP ... -126).

    usage: check_sass.py CUOBJDUMP OBJECT...   (objects not named hopper_fwd_* are ignored)
           check_sass.py --self-test          (the checks fail on planted faults)
"""
import os
import re
import subprocess
import sys


def functions(sass):
    """(name, [instruction text, ...]) for every function in a cuobjdump -sass listing."""
    current, body = None, []
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            if current:
                yield current, body
            current, body = m.group(1), []
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m and current:
            body.append(m.group(1))
    if current:
        yield current, body


def check_kernel(name, body):
    problems = []
    opcodes = [re.sub(r"^@!?U?P\w+\s+", "", ins).split()[0] for ins in body]
    hgmma = sum(op.startswith("HGMMA") for op in opcodes)
    depbar = sum(op.startswith("WARPGROUP.DEPBAR") for op in opcodes)
    if hgmma == 0:
        problems.append("no HGMMA")
    elif depbar * 2 > hgmma:
        problems.append(f"wgmma serialized: {depbar} WARPGROUP.DEPBAR for {hgmma} HGMMA")
    empty_groups = sum(1 for op, ins in zip(opcodes, body) if op.startswith("HGMMA") and "gdesc[URZ]" in ins)
    if empty_groups:
        problems.append(f"{empty_groups} empty wgmma group(s) (HGMMA on gdesc[URZ]): a wait there covers the GEMM before it")
    alloc = next((i for i, op in enumerate(opcodes) if op.startswith("USETMAXREG.TRY_ALLOC")), None)
    dealloc = next((i for i, op in enumerate(opcodes) if op.startswith("USETMAXREG.DEALLOC")), None)
    if alloc is None or dealloc is None:
        problems.append("no USETMAXREG alloc/dealloc pair")
    else:
        lo, hi = sorted((alloc, dealloc))
        local = [body[i] for i in range(lo, hi) if opcodes[i].startswith(("LDL", "STL"))]
        if local:
            problems.append(f"consumer path uses local memory ({len(local)} LDL/STL, e.g. {local[0]})")
    if not any(op.startswith("UTMALDG") for op in opcodes):
        problems.append("no TMA load (UTMALDG)")
    if not any(op.startswith("MUFU.EX2") for op in opcodes):
        problems.append("no MUFU.EX2")
    denormal_fixups = sum(1 for ins in body if ins.startswith("FSETP") and "-126" in ins)
    if denormal_fixups > 4:
        problems.append(f"{denormal_fixups} exp2 denormal fix-ups (FSETP x, -126): exp2f instead of ex2.approx.ftz")
    return hgmma, depbar, problems


def self_test():
    """The checks fail where they must, on small synthetic listings."""
    def listing(ops):
        return "\n".join(["  Function : _Z14forward_kernelI4TestE"] +
                         [f"  /*{i * 16:04x}*/  {op} ;" for i, op in enumerate(ops)])

    good = (["USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xa0", "WARPGROUP.ARRIVE"] + ["HGMMA.64x128x16.F32.BF16 R24"] * 8
            + ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R1, R2", "USETMAXREG.DEALLOC.CTAPOOL 0x38",
               "STL [R1], R2", "UTMALDG.2D [UR8], [UR4]"])
    serialized = [op for hg in ["HGMMA.64x128x16.F32.BF16 R24"] * 8 for op in (hg, "WARPGROUP.DEPBAR.LE gsb0, 0x0")]
    cases = {
        "good": (good, 0),
        "serialized": (good[:2] + serialized + good[11:], 1),
        "consumer spill": (good[:3] + ["STL [R1+0x4], R0"] + good[3:], 1),
        "exp2f fix-ups": (good + ["FSETP.GEU.AND P0, PT, R3, -126, PT"] * 8, 1),
        "no TMA": (good[:-1], 1),
        "empty group": (good[:11] + ["WARPGROUP.ARRIVE", "HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ, !UPT, gsb0",
                                     "WARPGROUP.DEPBAR.LE gsb0, 0x1"] + good[11:], 1),
    }
    ok = True
    for label, (ops, want_problems) in cases.items():
        (name, body), = functions(listing(ops))
        problems = check_kernel(name, body)[2]
        if bool(problems) != bool(want_problems):
            print(f"self-test {label}: expected {'problems' if want_problems else 'none'}, got {problems}")
            ok = False
    print("check_sass self-test:", "ok" if ok else "FAILED")
    return 0 if ok else 1


def main(argv):
    if len(argv) == 2 and argv[1] == "--self-test":
        return self_test()
    if len(argv) < 3:
        print(__doc__)
        return 2
    cuobjdump, objects = argv[1], [o for o in argv[2:] if "hopper_fwd_" in o]
    if not os.path.isfile(cuobjdump):
        print(f"check_sass: cuobjdump not found at {cuobjdump!r}: run scripts/setup.sh (it installs it under .deps/)")
        return 1
    # cuobjdump runs nvdisasm for -sass: the one installed next to it.
    env = dict(os.environ, NVDISASM_PATH=os.path.dirname(os.path.abspath(cuobjdump)))
    if not objects:
        print("check_sass: no hopper_fwd_* object among the arguments (was sm_90a built?)")
        return 1
    failed = checked = 0
    for obj in objects:
        sass = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True, check=True, env=env).stdout
        for name, body in functions(sass):
            if "forward_kernel" not in name:
                continue
            checked += 1
            hgmma, depbar, problems = check_kernel(name, body)
            status = "FAIL" if problems else "ok"
            print(f"{status:4s} {obj.rsplit('/', 1)[-1]} {name[:110]}: {hgmma} HGMMA, {depbar} DEPBAR"
                  + ("".join(f"\n     - {p}" for p in problems)))
            failed += bool(problems)
    if checked == 0:
        print("check_sass: no forward_kernel found in the objects")
        return 1
    print(f"check_sass: {checked} kernels, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
