#!/usr/bin/env bash
# Builds and runs every test on this machine: dependencies, the formatting check, the release build
# (with the CUDA backend compiled when nvcc exists; GPU tests report SKIPPED without a device; the
# Python module and its pytest suite, python.pytest), `pip install .`'s wheel (CPU-only) and the
# same pytest suite against it, the
# CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer.
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=${MOEKIT_JOBS:-$(nproc)}

bash scripts/install-deps.sh --tests
bash scripts/format.sh --check

echo "== release build (build/)" >&2
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=AUTO -DMOEKIT_PYTHON=ON -DMOEKIT_WERROR=ON \
  >/dev/null
cmake --build build -j "$jobs"
(cd build && ctest --output-on-failure -j "$jobs")

echo "== pip install . (a CPU-only wheel as a user builds it: no tests, no -Werror, CPU level x86-64-v3) and tests/python against the installed package" >&2
rm -rf build-wheel && mkdir -p build-wheel
python3 -m pip wheel . --no-deps -q -w build-wheel -C cmake.define.MOEKIT_CUDA=OFF -C build-dir=build-wheel/build
python3 -m pip install -q --no-deps --target build-wheel/site build-wheel/moekit-*.whl
PYTHONPATH=build-wheel/site MOEKIT_CLI="$PWD/build/src/moekit" python3 -m pytest -q -rs -p no:cacheprovider tests/python

echo "== ASan + UBSan build, CPU only (build-asan/)" >&2
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEKIT_SANITIZE=ON -DMOEKIT_CUDA=OFF \
  -DMOEKIT_WERROR=ON >/dev/null
cmake --build build-asan -j "$jobs"
(cd build-asan && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j "$jobs")
