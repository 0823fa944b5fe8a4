#!/usr/bin/env python3
"""The device images the library carries, read with cuobjdump (no GPU needed).

    check_images.py CUOBJDUMP --ptx 80 --sass=90a --library libjagflash.so OBJECT...

- The portable objects (the GPU oracle's instantiations and the offsets check: the device code of
  every non-Hopper call) each hold PTX for compute_<ptx>, and SASS for every --sass target.
- The Hopper kernels' objects hold no PTX (only sm_90a can run them).
- With --sass= (none: a JAGFLASH_PTX_ONLY build) the library holds no SASS at all and only
  compute_<ptx> PTX: whatever GPU loads it, the driver must compile that PTX, so a run on an
  H200 runs what an A100 or B200 runs.
"""
import argparse
import re
import subprocess
import sys
from pathlib import Path


def listing(cuobjdump, kind, path):
    """Names cuobjdump --list-elf / --list-ptx gives for path ('' lists nothing)."""
    r = subprocess.run([cuobjdump, f"--list-{kind}", str(path)], capture_output=True, text=True)
    text = r.stdout + r.stderr
    if r.returncode != 0 and "does not contain device code" not in text:
        sys.exit(f"check_images: cuobjdump --list-{kind} {path} failed: {text.strip()}")
    return re.findall(rf"{kind.upper()} file\s+\d+:\s*(\S+)", text)


def arch_of(name):
    m = re.search(r"\.(sm_\d+[a-z]?)\.(?:cubin|ptx)$", name)
    return m.group(1) if m else name


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cuobjdump")
    ap.add_argument("--ptx", required=True, help="compute capability of the portable PTX, e.g. 80")
    ap.add_argument("--sass", default="", help="comma-separated SASS targets of the build, e.g. 90a")
    ap.add_argument("--library", required=True)
    ap.add_argument("objects", nargs="*")
    a = ap.parse_intermixed_args()
    ptx = f"sm_{a.ptx}"
    sass = [f"sm_{t}" for t in a.sass.split(",") if t]
    errors = []

    portable = [Path(o) for o in a.objects if re.search(r"(oracle_\w+_hd\d+|offsets_check_device)\.cu\.o$", o)]
    hopper = [Path(o) for o in a.objects if re.search(r"hopper_(fwd|bwd)_\w+\.cu\.o$", o)]
    if not any("offsets_check" in p.name for p in portable) or not any("oracle_" in p.name for p in portable):
        errors.append(f"expected the oracle and offsets-check objects among {len(a.objects)} objects")
    for obj in portable:
        ptxs = [arch_of(n) for n in listing(a.cuobjdump, "ptx", obj)]
        elfs = [arch_of(n) for n in listing(a.cuobjdump, "elf", obj)]
        if ptx not in ptxs:
            errors.append(f"{obj.name}: no compute_{a.ptx} PTX (PTX: {ptxs or 'none'})")
        for target in sass:
            if target not in elfs:
                errors.append(f"{obj.name}: no {target} SASS (SASS: {elfs or 'none'})")
        if not sass and elfs:
            errors.append(f"{obj.name}: SASS {elfs} in a PTX-only build")
    for obj in hopper:
        ptxs = listing(a.cuobjdump, "ptx", obj)
        if ptxs:
            errors.append(f"{obj.name}: a Hopper kernel object carries PTX {ptxs}")

    lib_elfs = [arch_of(n) for n in listing(a.cuobjdump, "elf", a.library)]
    lib_ptxs = [arch_of(n) for n in listing(a.cuobjdump, "ptx", a.library)]
    if not sass:
        if lib_elfs:
            errors.append(f"PTX-only library holds SASS: {sorted(set(lib_elfs))}")
        if not lib_ptxs or set(lib_ptxs) != {ptx}:
            errors.append(f"PTX-only library: expected compute_{a.ptx} PTX only, found {sorted(set(lib_ptxs))}")
    elif ptx not in lib_ptxs:
        errors.append(f"library holds no compute_{a.ptx} PTX (found {sorted(set(lib_ptxs)) or 'none'})")

    print(f"check_images: {len(portable)} portable objects, {len(hopper)} Hopper objects; library: "
          f"{len(lib_elfs)} SASS images {sorted(set(lib_elfs))}, {len(lib_ptxs)} PTX {sorted(set(lib_ptxs))}")
    for e in errors:
        print("FAIL:", e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
