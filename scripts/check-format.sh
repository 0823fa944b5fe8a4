#!/usr/bin/env bash
# Checks that our C, C++ and CUDA sources are formatted as .clang-format says, with the pinned
# clang-format (deps.env; scripts/setup.sh installs it). Lists every file that is not.
#   usage: scripts/check-format.sh CLANG_FORMAT           check the sources
#          scripts/check-format.sh CLANG_FORMAT --fix     reformat them in place
#          scripts/check-format.sh CLANG_FORMAT --self-test
#   --self-test: the check must fail on a misformatted file and pass on its formatted version.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
clang_format="${1:?usage: check-format.sh CLANG_FORMAT [--fix|--self-test]}"
mode="${2:-check}"
[ -x "$clang_format" ] || { echo "check-format: $clang_format not found (run scripts/setup.sh)" >&2; exit 2; }

if [ "$mode" = --self-test ]; then
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  cp "$root/.clang-format" "$tmp/"
  printf 'int  f( int x ){return x+1;}\n' >"$tmp/bad.cpp"
  if "$clang_format" --dry-run --Werror "$tmp/bad.cpp" 2>/dev/null; then
    echo "check-format self-test: a misformatted file passed" >&2; exit 1
  fi
  "$clang_format" -i "$tmp/bad.cpp"
  "$clang_format" --dry-run --Werror "$tmp/bad.cpp" || {
    echo "check-format self-test: the formatted file failed" >&2; exit 1; }
  echo "check-format self-test: ok"
  exit 0
fi

cd "$root"
# Sources of this project only (not .deps/, build folders or the virtual environment); the
# CMake templates (*.cu.in) hold @PLACEHOLDERS@ that are not C++ until configured.
mapfile -t files < <(find src include tests tools bench/micro examples -type f \
  \( -name '*.cpp' -o -name '*.hpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' \) 2>/dev/null | sort)
[ ${#files[@]} -gt 0 ] || { echo "check-format: no sources found under $root" >&2; exit 2; }
if [ "$mode" = --fix ]; then
  "$clang_format" -i "${files[@]}"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  "$clang_format" --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "check-format: ${#bad[@]} of ${#files[@]} files differ from .clang-format (fix: scripts/check-format.sh $clang_format --fix):"
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "check-format: ${#files[@]} files formatted"
