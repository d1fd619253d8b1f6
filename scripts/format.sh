#!/usr/bin/env bash
# Formats (default) or checks (--check) every C++/CUDA source with the repo's .clang-format.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files -co --exclude-standard -- '*.h' '*.cpp' '*.cu' '*.cuh')
if [[ ${1:-} == --check ]]; then
  clang-format --dry-run --Werror "${files[@]}"
  echo "format: ${#files[@]} files clean" >&2
else
  clang-format -i "${files[@]}"
fi
