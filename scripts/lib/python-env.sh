# Shared by the GPU scripts that run Python (sourced, with $root set and the build folder as $1):
# the package from the checkout, the library from the carried build, logs under $OUT.
build="$(cd "${1:-$root/build}" && pwd)"
out="${OUT:-$root/gpu-logs}"
python="${PYTHON:-python3}"
mkdir -p "$out"
cd "$root" || exit 1
export PYTHONPATH="$root/python${PYTHONPATH:+:$PYTHONPATH}"
export JAGFLASH_LIBRARY="$build/libjagflash.so"
