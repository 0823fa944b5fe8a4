#!/usr/bin/env python3
"""Checks the SASS of the built Hopper forward and backward kernels (no GPU needed):

  1. the wgmma are not serialized: ptxas answers some code shapes (a divergent wgmma wait, a
     non-wgmma instruction touching accumulators while a wgmma batch is in flight) by waiting
     after every HGMMA, which takes away the GEMMs' overlap, a loss no other test sees (figures:
     bench/NOTES.md, "Figures moved out of code comments"). Serialized code has a
     WARPGROUP.DEPBAR per HGMMA; ours has about one per GEMM (8 HGMMAs);
  2. the consumers' GEMM loop never touches local memory: no LDL/STL between the first and the
     last HGMMA of the consumer path (from the consumers' USETMAXREG.TRY_ALLOC to the producer's
     USETMAXREG.DEALLOC; the producer, one thread with few registers, may spill: its code follows
     the DEALLOC), and at most TILE_SPILLS around it (a tile's counters kept in local memory
     between tiles: the D = 64 backward's 128-row tiles fill the 240 registers, and a few loads a
     tile cost nothing beside its steps);
  3. no empty wgmma group (an HGMMA on gdesc[URZ]): ptxas emits one for a commit it cannot
     attach to a real GEMM, e.g. one committed after a conditional GEMM; the wait that follows
     then also waits for the GEMM meant to keep running (it can silently disable the mainloop's
     intra-warpgroup overlap, as bench/NOTES.md records);
  4. the instructions the design relies on are there: HGMMA, USETMAXREG, UTMALDG (TMA loads),
     MUFU.EX2 without the denormal fix-up around it (FSETP ... -126); in the backward also the
     bulk reduce-add of the dQ partials into the fp32 accumulator (cp.reduce.async.bulk: an
     opcode starting with UBLKRED, or UTMAREDG for its tensor form);
  5. the backward's instruction budget (BUDGETS, by object name): its static instructions and
     R2UR (general-to-uniform register moves; at most one or two a GEMM once the GEMMs'
     descriptors live on the uniform datapath, where rebuilt in general registers they took four
     an HGMMA) at or below what the default kernels hold now, so that what the loop has lost does
     not come back unseen (issue 52: FA3's D = 128 backward holds 1,720 instructions, 49 R2UR).

In hopper_fwd_* objects the functions named *forward_kernel* are checked; in hopper_bwd_* objects
those named *backward_kernel* (the main kernel), never the preprocess/postprocess kernels, which
have no tensor-core code.

    usage: check_sass.py CUOBJDUMP OBJECT...   (objects named neither hopper_fwd_* nor
                                                hopper_bwd_* are ignored)
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


# Object name marker -> (function name marker, whether the kernel must show a bulk reduce-add).
KINDS = {
    "hopper_fwd_": ("forward_kernel", False),
    "hopper_bwd_": ("backward_kernel", True),
}
# The budgets of the default backward kernels (either dtype): object name ending -> (static
# instructions, R2UR) at most, in the main kernel: what they hold now, a ratchet towards FA3's
# (cuobjdump of ../shared/peers/fa3's cubins: D = 128 1,720-2,888 instructions with 49-88 R2UR,
# D = 64 2,848-3,576 with 55-75, over its variants). At D = 64 most R2UR are the loader's TMA
# issues (one thread), not the consumers' GEMMs; its 128-row steps take twice the elementwise code
# a step for half the steps. The steps that issue the previous step's dQ (mainloop_bwd.cuh's step)
# have the dS store, the dQ GEMM and its hand-over in two branches (a previous dQ or none) and once
# more in the tile's last dQ after the loop: two GEMM sites more, each with its descriptors' moves
# (figures: bench/NOTES.md, "Figures moved out of code comments" and "the two warpgroups out of
# lockstep").
BUDGETS = {
    "hopper_bwd_bf16_hd128.cu.o": (6900, 100),
    "hopper_bwd_fp16_hd128.cu.o": (6900, 100),
    "hopper_bwd_bf16_hd64.cu.o": (5250, 85),
    "hopper_bwd_fp16_hd64.cu.o": (5250, 85),
}
# LDL/STL allowed in the consumer path outside its GEMM loop (rule 2).
TILE_SPILLS = 16
# Kernels of a backward object with no tensor-core code: never checked.
SKIPPED = ("preprocess", "postprocess")


def kind_of(obj):
    """The KINDS key of an object file's name, or None."""
    base = obj.rsplit("/", 1)[-1]
    return next((k for k in KINDS if k in base), None)


def is_checked(kind, name):
    marker = KINDS[kind][0]
    return marker in name and not any(skip in name for skip in SKIPPED)


def consumer_range(opcodes):
    """[lo, hi) of the consumers' code: from their USETMAXREG.TRY_ALLOC to the producer's
    USETMAXREG.DEALLOC after it (the producer's code follows the DEALLOC), or to the end when the
    producer's DEALLOC comes first. None without both."""
    alloc = next((i for i, op in enumerate(opcodes) if op.startswith("USETMAXREG.TRY_ALLOC")), None)
    if alloc is None or not any(op.startswith("USETMAXREG.DEALLOC") for op in opcodes):
        return None
    dealloc = next((i for i, op in enumerate(opcodes) if i > alloc and op.startswith("USETMAXREG.DEALLOC")),
                   len(opcodes))
    return alloc, dealloc


def budget_of(obj):
    """The (instructions, R2UR) budget of an object's main kernel, or None."""
    base = obj.rsplit("/", 1)[-1]
    return next((b for suffix, b in BUDGETS.items() if base.endswith(suffix)), None)


def check_kernel(name, body, bulk_reduce=False, budget=None):
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
    consumer = consumer_range(opcodes)
    if consumer is None:
        problems.append("no USETMAXREG alloc/dealloc pair")
    else:
        lo, hi = consumer
        gemms = [i for i in range(lo, hi) if opcodes[i].startswith("HGMMA")]
        local = [i for i in range(lo, hi) if opcodes[i].startswith(("LDL", "STL"))]
        in_loop = [i for i in local if gemms and gemms[0] < i < gemms[-1]]
        if in_loop:
            problems.append(f"consumers' GEMM loop uses local memory ({len(in_loop)} LDL/STL, e.g. {body[in_loop[0]]})")
        if len(local) - len(in_loop) > TILE_SPILLS:
            problems.append(f"consumer path uses local memory outside its GEMM loop {len(local) - len(in_loop)} "
                            f"times (at most {TILE_SPILLS}), e.g. {body[local[0]]}")
    if not any(op.startswith("UTMALDG") for op in opcodes):
        problems.append("no TMA load (UTMALDG)")
    if not any(op.startswith("MUFU.EX2") for op in opcodes):
        problems.append("no MUFU.EX2")
    denormal_fixups = sum(1 for ins in body if ins.startswith("FSETP") and "-126" in ins)
    if denormal_fixups > 4:
        problems.append(f"{denormal_fixups} exp2 denormal fix-ups (FSETP x, -126): exp2f instead of ex2.approx.ftz")
    if bulk_reduce and not any(op.startswith(("UBLKRED", "UTMAREDG")) for op in opcodes):
        problems.append("no bulk reduce-add (UBLKRED/UTMAREDG): dQ partials not added by cp.reduce.async.bulk")
    if budget is not None:
        most, most_r2ur = budget
        r2ur = sum(op.startswith("R2UR") for op in opcodes)
        if len(opcodes) > most:
            problems.append(f"{len(opcodes)} instructions, over the budget of {most}")
        if r2ur > most_r2ur:
            problems.append(f"{r2ur} R2UR, over the budget of {most_r2ur} (descriptors built in general registers?)")
    return hgmma, depbar, problems


def check_listing(kind, sass, label, budget=None):
    """Checks the kernels of one object's listing: (checked, failed, report lines)."""
    checked = failed = 0
    lines = []
    for name, body in functions(sass):
        if not is_checked(kind, name):
            continue
        checked += 1
        hgmma, depbar, problems = check_kernel(name, body, bulk_reduce=KINDS[kind][1], budget=budget)
        status = "FAIL" if problems else "ok"
        r2ur = sum(1 for ins in body if re.sub(r"^@!?U?P\w+\s+", "", ins).startswith("R2UR"))
        lines.append(f"{status:4s} {label} {name[:110]}: {hgmma} HGMMA, {depbar} DEPBAR, {len(body)} instructions, "
                     f"{r2ur} R2UR"
                     + "".join(f"\n     - {p}" for p in problems))
        failed += bool(problems)
    return checked, failed, lines


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
        "a tile's spills around the GEMM loop": (good[:2] + ["STL [R1+0x4], R0"] * TILE_SPILLS + good[2:], 0),
        "too many spills around the GEMM loop": (good[:2] + ["STL [R1+0x4], R0"] * (TILE_SPILLS + 1) + good[2:], 1),
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

    # The backward: the same checks plus the bulk reduce-add, on the main kernel only. Its
    # producer may come first in the code (DEALLOC, producer, TRY_ALLOC, consumers).
    def object_listing(kernels):
        lines = []
        for fname, ops in kernels:
            lines.append(f"  Function : {fname}")
            lines += [f"  /*{i * 16:04x}*/  {op} ;" for i, op in enumerate(ops)]
        return "\n".join(lines)

    main = "_ZN8jagflash7kernels3bwd15backward_kernelI4TestEEvv"
    pre = "_ZN8jagflash7kernels3bwd26backward_preprocess_kernelI4TestEEvv"
    post = "_ZN8jagflash7kernels3bwd27backward_postprocess_kernelI4TestEEvv"
    # Names that hold the main kernel's marker too: skipped all the same.
    pre2 = "_ZN8jagflash7kernels3bwd26preprocess_backward_kernelI4TestEEvv"
    post2 = "_ZN8jagflash7kernels3bwd27postprocess_backward_kernelI4TestEEvv"
    light = ["LDG.E.128 R4, desc[UR4][R2.64]", "FFMA R1, R4, R5, R1", "STG.E [R6.64], R1", "EXIT"]
    reduce = "UBLKRED.G.S.ADD.F32.RN.BULK_GROUP [UR8], [UR4], UR6"
    bwd_good = good + [reduce]
    producer_first = (["USETMAXREG.DEALLOC.CTAPOOL 0x18", "STL [R1], R2", "UTMALDG.2D [UR8], [UR4]", reduce,
                       "USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xf0", "WARPGROUP.ARRIVE"]
                      + ["HGMMA.64x128x16.F32.BF16 R24"] * 8 + ["WARPGROUP.DEPBAR.LE gsb0, 0x0", "MUFU.EX2 R1, R2"])
    bwd_cases = {
        "backward good (pre/postprocess skipped)": ([(pre, light), (main, bwd_good), (post, light)], 1, 0),
        "backward good, *process_backward_kernel skipped": ([(pre2, light), (main, bwd_good), (post2, light)], 1, 0),
        "backward tensor-form reduce": ([(main, good + ["UTMAREDG.2D.ADD [UR8], [UR4]"])], 1, 0),
        "backward producer first": ([(main, producer_first)], 1, 0),
        "backward without bulk reduce": ([(pre, light), (main, good), (post, light)], 1, 1),
        "backward consumer spill": ([(main, bwd_good[:3] + ["LDL R0, [R1+0x8]"] + bwd_good[3:])], 1, 1),
        "backward consumer spill, producer first": ([(main, producer_first[:7] + ["STL [R1+0x4], R0"]
                                                      + producer_first[7:])], 1, 1),
        "backward tile spill after the loop, producer first": ([(main, producer_first + ["STL [R1+0x4], R0"])], 1, 0),
        "backward serialized": ([(main, good[:2] + serialized + good[11:] + [reduce])], 1, 1),
        "backward no TMA": ([(main, [op for op in bwd_good if not op.startswith("UTMALDG")])], 1, 1),
        "backward object without its main kernel": ([(pre, light), (post, light)], 0, 0),
    }
    # The budget: over it in instructions or in R2UR fails, at it passes.
    budget_cases = {
        "backward within its budget": (bwd_good, (len(bwd_good), 1), 0),
        "backward over its instruction budget": (bwd_good, (len(bwd_good) - 1, 1), 1),
        "backward over its R2UR budget": (bwd_good + ["R2UR UR8, R2", "@!P0 R2UR UR9, R3"], (100, 1), 1),
    }
    for label, (ops, budget, want_failed) in budget_cases.items():
        checked, failed, lines = check_listing("hopper_bwd_", object_listing([(main, ops)]), label, budget)
        if (checked, failed) != (1, want_failed):
            print(f"self-test {label}: expected 1 checked / {want_failed} failed, got {checked} / {failed}"
                  + "".join(f"\n  {line}" for line in lines))
            ok = False
    if budget_of("x/generated/hopper_bwd_fp16_hd128.cu.o") != BUDGETS["hopper_bwd_fp16_hd128.cu.o"] or \
            budget_of("x/generated/hopper_bwd_bf16_hd128_softcap.cu.o") is not None:
        print("self-test: budgets found for the wrong objects")
        ok = False
    for label, (kernels, want_checked, want_failed) in bwd_cases.items():
        checked, failed, lines = check_listing("hopper_bwd_", object_listing(kernels), label)
        if (checked, failed) != (want_checked, want_failed):
            print(f"self-test {label}: expected {want_checked} checked / {want_failed} failed, got {checked} / {failed}"
                  + "".join(f"\n  {line}" for line in lines))
            ok = False
    # A forward object's kernels need no bulk reduce; a forward kernel in it is not a backward one.
    checked, failed, _ = check_listing("hopper_fwd_", object_listing([("_Z14forward_kernelI4TestE", good)]), "fwd")
    if (checked, failed) != (1, 0):
        print(f"self-test forward object: expected 1 checked / 0 failed, got {checked} / {failed}")
        ok = False
    if [kind_of(o) for o in ("a/hopper_fwd_bf16_hd64.cu.o", "b/hopper_bwd_fp16_hd128.cu.o", "c/oracle_bf16_hd64.cu.o")] \
            != ["hopper_fwd_", "hopper_bwd_", None]:
        print("self-test: object kinds misread")
        ok = False
    print("check_sass self-test:", "ok" if ok else "FAILED")
    return 0 if ok else 1


def main(argv):
    if len(argv) == 2 and argv[1] == "--self-test":
        return self_test()
    if len(argv) < 3:
        print(__doc__)
        return 2
    cuobjdump, objects = argv[1], [o for o in argv[2:] if kind_of(o)]
    if not os.path.isfile(cuobjdump):
        print(f"check_sass: cuobjdump not found at {cuobjdump!r}: run scripts/setup.sh (it installs it under .deps/)")
        return 1
    # cuobjdump runs nvdisasm for -sass: the one installed next to it.
    env = dict(os.environ, NVDISASM_PATH=os.path.dirname(os.path.abspath(cuobjdump)))
    if not objects:
        print("check_sass: no hopper_fwd_* or hopper_bwd_* object among the arguments (was sm_90a built?)")
        return 1
    failed = checked = 0
    checked_by_kind = {}
    for obj in objects:
        kind = kind_of(obj)
        sass = subprocess.run([cuobjdump, "-sass", obj], capture_output=True, text=True, check=True, env=env).stdout
        n, bad, lines = check_listing(kind, sass, obj.rsplit("/", 1)[-1], budget=budget_of(obj))
        for line in lines:
            print(line)
        checked_by_kind[kind] = checked_by_kind.get(kind, 0) + n
        checked += n
        failed += bad
    for kind, n in checked_by_kind.items():
        if n == 0:
            # A renamed kernel the check no longer sees must not pass as a clean one.
            print(f"check_sass: no {KINDS[kind][0]} found in the {kind}* objects")
            failed += 1
    print(f"check_sass: {checked} kernels, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
