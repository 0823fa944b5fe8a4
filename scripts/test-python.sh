#!/usr/bin/env bash
# The Python package's tests on this machine: a virtualenv (.venv/, or $JAGFLASH_VENV) with the
# pinned torch and pytest (deps.env), `pip install .` (which builds libjagflash.so into build/, or
# brings an existing build up to date, and the PyTorch binding against the venv's torch, and ships
# both in the package), then pytest on python/tests.
# Without a GPU the CUDA tests are reported as skipped. Run after scripts/test.sh to reuse its build.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# shellcheck disable=SC1091
source deps.env
venv="${JAGFLASH_VENV:-$root/.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
t0=$SECONDS
scripts/venv-install-torch.sh "$venv" "$TORCH_PIP_VERSION"
"$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir \
  "pytest==$PYTEST_PIP_VERSION" "numpy==$NUMPY_PIP_VERSION" "transformers==$TRANSFORMERS_PIP_VERSION"
echo "test-python: torch $TORCH_PIP_VERSION, pytest and transformers $TRANSFORMERS_PIP_VERSION ready in $((SECONDS - t0)) s"
# The compiled PyTorch binding with warnings as errors, as the C++ build in scripts/test.sh.
JAGFLASH_BINDING_WERROR=1 "$venv/bin/pip" install --quiet --disable-pip-version-check --no-cache-dir .
# From the tests' folder, so `import jagflash` is the installed package, not python/jagflash.
cd "$root/python/tests"
"$venv/bin/python" -c 'import jagflash; print("test-python: jagflash from", jagflash.library_path())'
exec "$venv/bin/python" -m pytest -rs -q -p no:cacheprovider .
