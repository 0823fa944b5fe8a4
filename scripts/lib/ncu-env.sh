# Shared by the ncu scripts, gpu-profile.sh and gpu-pipes.sh (sourced, with $root set and the build
# folder as $1): the library from the build folder, logs under $OUT, FA3's prebuilt copy (carried
# as .fa3/) first on PYTHONPATH. Not python-env.sh: that one also changes into $root, resolves the
# build folder (which must then exist) and puts python/ on PYTHONPATH; these scripts never did
# (bench/profile_bwd.py, which both run under ncu, puts python/ on sys.path itself).
build="${1:-$root/build}"
out="${OUT:-$root/gpu-logs}"
mkdir -p "$out"
export JAGFLASH_LIBRARY="$build/libjagflash.so"
[ -d "$root/.fa3" ] && export PYTHONPATH="$root/.fa3:${PYTHONPATH:-}"
