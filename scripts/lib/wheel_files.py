"""Copies files out of downloaded wheels (setup.sh installs pinned tools and headers this way,
without pip installing the packages).

usage: wheel_files.py WHEEL_DIR DEST RULE...
  RULE is MEMBER=>OUT, OUT relative to DEST:
    a MEMBER ending in "/" copies the whole tree under that prefix into the folder OUT;
    any other MEMBER copies the one member whose path ends with it to the file OUT (executable).
Every rule must match in one of the wheels, or nothing is trusted and the script fails.
"""
import glob
import os
import shutil
import sys
import zipfile


def main(wheel_dir, dest, rules):
    wheels = sorted(glob.glob(os.path.join(wheel_dir, "*.whl")))
    if not wheels:
        sys.exit(f"wheel_files: no wheel in {wheel_dir}")
    matched = set()
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            names = [n for n in z.namelist() if not n.endswith("/")]
            for rule in rules:
                member, out = rule.split("=>")
                if member.endswith("/"):
                    picked = [(n, os.path.join(out, n[len(member):])) for n in names if n.startswith(member)]
                else:
                    picked = [(n, out) for n in names if n.endswith(member)][:1]
                for name, target in picked:
                    path = os.path.join(dest, target)
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with z.open(name) as src, open(path, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    if not member.endswith("/"):
                        os.chmod(path, 0o755)
                if picked:
                    matched.add(rule)
    missing = [r for r in rules if r not in matched]
    if missing:
        sys.exit(f"wheel_files: nothing in {', '.join(map(os.path.basename, wheels))} matches {missing}")


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
