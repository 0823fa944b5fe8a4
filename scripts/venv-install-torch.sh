#!/usr/bin/env bash
# Installs PyPI's torch wheel (with its CUDA libraries: it needs them even to import on a CPU-only
# machine) into a virtualenv one package at a time, without pip's cache.
#
# Why not one `pip install torch`: pip downloads every wheel first and installs them after, and its
# cache keeps a second copy, so the peak disk use is about twice the installed 4.7 GB, more than a
# machine with little free disk has ("No space left on device"). One package at a time the peak is
# what is installed so far plus the one wheel being installed: about the installed size (figures:
# bench/NOTES.md, "Figures moved out of code comments").
#
# usage: scripts/venv-install-torch.sh VENV TORCH_VERSION
set -euo pipefail
venv="$1"
version="$2"
pip=("$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir)

if "$venv/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$version')" \
    2>/dev/null && "$venv/bin/pip" check >/dev/null 2>&1; then
  exit 0
fi
echo "test-python: installing torch $version into $venv package by package; free disk before:"
df -h "$venv" | tail -n 1

"${pip[@]}" --no-deps "torch==$version"
# torch's own requirements (markers evaluated for this machine, extras split so that each
# cuda-toolkit component is its own install), then each of them with its dependencies.
mapfile -t requirements < <("$venv/bin/python" - <<'PY'
import importlib.metadata as metadata
from pip._vendor.packaging.requirements import Requirement

for text in metadata.requires("torch") or []:
    req = Requirement(text)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    spec = str(req.specifier)
    if req.extras:
        for extra in sorted(req.extras):
            print(f"{req.name}[{extra}]{spec}")
    else:
        print(f"{req.name}{spec}")
PY
)
for requirement in "${requirements[@]}"; do
  "${pip[@]}" "$requirement"
done
"$venv/bin/pip" check
echo "test-python: torch $version installed; free disk after:"
df -h "$venv" | tail -n 1
