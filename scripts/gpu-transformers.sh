#!/usr/bin/env bash
# On the GPU machine (no network, no transformers of its own to rely on), from a repo copy with the
# carried build and the carried wheels of scripts/transformers-wheels.sh: installs transformers
# from the wheels into /tmp/tf-site (pip --no-index --no-deps --target: nothing fetched, nothing of
# the machine's own environment changed), then runs
#   1. python/tests/test_transformers_integration.py (its CUDA cases: bf16 models with head dim 64
#      on the Hopper kernels, checked to be served by them) and test_examples_train.py;
#   2. examples/train_llm_packed.py with its GPU defaults (--progress none).
# Logs go to $OUT (or ./gpu-logs): transformers-install.log, transformers-pytest.log,
# train-llm-packed.log; a short summary is printed last.
#   usage: scripts/gpu-transformers.sh [build-dir or folder holding libjagflash.so]
#   WHEELS=DIR (default: .wheels in the repo, the folder transformers-wheels.sh filled);
#   EXAMPLE_ARGS="..." goes to train_llm_packed.py (e.g. "--steps 10").
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=lib/python-env.sh
source "$root/scripts/lib/python-env.sh"
# shellcheck source=lib/steps.sh
source "$root/scripts/lib/steps.sh"
wheels="$(cd "${WHEELS:-$root/.wheels}" && pwd)" || { echo "no wheels folder: run scripts/transformers-wheels.sh and carry it"; exit 1; }
site=/tmp/tf-site

install_wheels() {
  rm -rf "$site"
  if "$python" -m pip --version >/dev/null 2>&1; then
    "$python" -m pip install --no-index --no-deps --find-links "$wheels" --target "$site" -r "$wheels/requirements.txt"
  else
    # No pip: unpack the wheels this Python takes (a wheel is a zip of what goes on sys.path).
    "$python" - "$wheels" "$site" <<'EOF'
import pathlib, sys, zipfile
from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename
wheels, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
supported = list(sys_tags())
for line in (wheels / "requirements.txt").read_text().split():
    name, version = line.split("==")
    best = None
    for path in wheels.glob("*.whl"):
        n, v, _, tags = parse_wheel_filename(path.name)
        ranks = [supported.index(t) for t in tags if t in supported]
        if n == name.replace("_", "-").lower() and str(v) == version and ranks and (best is None or min(ranks) < best[0]):
            best = (min(ranks), path)
    if best is None:
        sys.exit(f"no wheel of {line} for this Python")
    zipfile.ZipFile(best[1]).extractall(site)
    print("unpacked", best[1].name)
EOF
  fi
}
export -f install_wheels
export python wheels site
step "install transformers" transformers-install.log 120 bash -c install_wheels
export PYTHONPATH="$site:$PYTHONPATH"  # before the machine's own packages: this transformers, not theirs
if ! "$python" -c 'import transformers, torch; print("transformers", transformers.__version__, "from", transformers.__file__, "| torch", torch.__version__, "|", torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' \
  >>"$out/transformers-install.log" 2>&1; then
  tail -n 20 "$out/transformers-install.log"
  echo "==== summary: transformers does not import from $site (log: $out/transformers-install.log)"
  print_summary
  exit 1
fi
tail -n 1 "$out/transformers-install.log"

step "pytest transformers" transformers-pytest.log 300 "$python" -m pytest -rs -q -p no:cacheprovider \
  python/tests/test_transformers_integration.py python/tests/test_examples_train.py
# shellcheck disable=SC2086
step "train_llm_packed.py" train-llm-packed.log 300 "$python" examples/train_llm_packed.py --progress none \
  ${EXAMPLE_ARGS:-}

echo "==== logs in $out"
echo "---- pytest"
grep -E "^(FAILED|ERROR|SKIPPED)" "$out/transformers-pytest.log" | head -20
tail -n 1 "$out/transformers-pytest.log"
echo "---- train_llm_packed.py"
tail -n 8 "$out/train-llm-packed.log"
echo "==== summary"
print_summary
summary_passed
