#!/usr/bin/env bash
# Downloads (pip download, nothing installed) Hugging Face transformers at deps.env's
# TRANSFORMERS_PIP_VERSION and the few packages it needs at import time that the GPU machine may
# lack, as wheels into DIR, with DIR/requirements.txt pinning them: what scripts/gpu-transformers.sh
# installs there with no network (pip install --no-index --no-deps --find-links DIR
# --target /tmp/tf-site -r DIR/requirements.txt).
#   usage: scripts/transformers-wheels.sh DIR
#   PYTHON_VERSIONS="3.11 3.12" (the default): the Pythons to fetch binary wheels for. The CPU
#   machine runs 3.11; the GPU machine's python3 was seen as 3.12 (README, "Python 3.12 on the
#   H200"). Pure-Python and abi3 wheels serve both; pyyaml and regex come once per version.
#
# Left out on purpose (48 MB with them, 22 MB without; transformers itself is 14 MB):
# - what the GPU machine has with torch and pytest: numpy, filelock, fsspec, typing_extensions
#   (packaging too, but it is kept: 140 kB, and transformers checks its version at import);
# - what `import transformers` and models built from configs never import: the CLIs (typer, click,
#   rich, pydantic and theirs), the hub-kernels loader (kernels), the Xet downloader (hf_xet).
#   huggingface_hub imports httpx2 and with it httpcore2, anyio, h11, idna and truststore at
#   import time, so those stay.
# gpu-transformers.sh installs with --no-deps, so the left-out ones are not asked for. Checked on
# the CPU machine: installed from DIR with --target into an environment holding only torch's and
# pytest's packages (python -S, no pip: the unzip fallback), test_transformers_integration.py,
# test_examples_train.py and examples/train_llm_packed.py pass through scripts/gpu-transformers.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
[ $# = 1 ] || { echo "usage: $0 DIR" >&2; exit 2; }
dir="$1"
python="${PYTHON:-python3}"
version="$(sed -n 's/^TRANSFORMERS_PIP_VERSION=//p' "$root/deps.env")"
[ -n "$version" ] || { echo "no TRANSFORMERS_PIP_VERSION in deps.env" >&2; exit 1; }
# Distribution names (normalised: lower case, "_" for "-") of the wheels kept.
keep="transformers huggingface_hub tokenizers safetensors regex pyyaml tqdm packaging httpx2 httpcore2 anyio h11
idna truststore"

mkdir -p "$dir"
all="$(mktemp -d)"
trap 'rm -rf "$all"' EXIT
for py in ${PYTHON_VERSIONS:-3.11 3.12}; do
  # The whole dependency tree for this Python on manylinux x86_64, resolved by pip; then only
  # the kept names are copied.
  "$python" -m pip download -q --only-binary=:all: --implementation cp --python-version "$py" \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$all/$py" "transformers==$version"
  for wheel in "$all/$py"/*.whl; do
    name="$(basename "$wheel" | cut -d- -f1 | tr 'A-Z-' 'a-z_')"
    # shellcheck disable=SC2086  # $keep: one name a word
    if printf '%s\n' $keep | grep -qx "$name"; then
      cp -n "$wheel" "$dir/"
    fi
  done
done
# One pinned line per kept distribution (every Python resolved the same versions, or pip's
# install would have to choose: checked here).
reqs="$(for wheel in "$dir"/*.whl; do basename "$wheel" | cut -d- -f1,2 | tr '-' '='; done | sed 's/=/==/' | sort -u)"
if [ "$(printf '%s\n' "$reqs" | cut -d= -f1 | uniq -d)" != "" ]; then
  echo "different versions resolved per Python:" >&2; printf '%s\n' "$reqs" >&2; exit 1
fi
printf '%s\n' "$reqs" >"$dir/requirements.txt"
missing="$(for n in $keep; do grep -qix "$n==.*" "$dir/requirements.txt" || echo "$n"; done)"
[ -z "$missing" ] || { echo "not downloaded: $missing" >&2; exit 1; }
ls -l "$dir"
echo "transformers-wheels: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
