#!/usr/bin/env bash
# Builds and runs every test on this machine: dependencies, the formatting check, the release build
# (with the CUDA backend compiled when nvcc exists; GPU tests report SKIPPED without a device; the
# Python module and its pytest suite, python.pytest), `pip install .`'s wheel (CPU-only) and the
# same pytest suite against it, the CPU tests again under AddressSanitizer + UndefinedBehaviorSanitizer,
# and a bounded fuzz run of the untrusted input (config.json, the index, a safetensors header:
# libFuzzer under clang with ASan + UBSan, MOEKIT_FUZZ_SECONDS, 60 by default; without libFuzzer the
# seeded mutation loop under ASan). Both builds' ctest run the hostile-input suite
# (tests/cli/hostile_inputs.cpp); its counts and the fuzz run's print at the end.
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

fuzz_seconds=${MOEKIT_FUZZ_SECONDS:-60}
libfuzzer_probe='extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }'
if command -v clang++ >/dev/null &&
  echo "$libfuzzer_probe" | clang++ -x c++ -fsanitize=fuzzer - -o /dev/null 2>/dev/null; then
  echo "== fuzzing config.json, the index and a safetensors header: libFuzzer + ASan + UBSan, ${fuzz_seconds} s (build-fuzz/)" >&2
  cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo -DMOEKIT_FUZZ=ON \
    -DMOEKIT_CUDA=OFF -DMOEKIT_TESTS=OFF -DMOEKIT_BENCH=OFF -DMOEKIT_MPI=OFF -DMOEKIT_PYTHON=OFF >/dev/null
  cmake --build build-fuzz -j "$jobs" --target fuzz_untrusted_input
  mkdir -p build-fuzz/corpus
  # A crash, a leak, a sanitizer's finding or an input neither accepted nor refused by name stops it
  # (non-zero exit) and leaves the input in build-fuzz/crash-*.
  ASAN_OPTIONS=detect_leaks=1 build-fuzz/tests/fuzz/fuzz_untrusted_input -max_total_time="$fuzz_seconds" -seed=1 \
    -timeout=10 -rss_limit_mb=4096 -dict=tests/fuzz/json.dict -artifact_prefix=build-fuzz/ build-fuzz/corpus \
    tests/fuzz/seeds 2>build-fuzz/libfuzzer.log >build-fuzz/fuzz-counts.txt || {
    tail -40 build-fuzz/libfuzzer.log >&2
    exit 1
  }
  fuzz_how="libFuzzer ($(grep -o 'Done [0-9]* runs in [0-9]* second(s)' build-fuzz/libfuzzer.log | tail -1))"
else
  echo "== fuzzing: no libFuzzer here; the seeded mutation loop under ASan + UBSan, ${fuzz_seconds} s" >&2
  mkdir -p build-fuzz
  ASAN_OPTIONS=detect_leaks=1 build-asan/tests/fuzz/fuzz_untrusted_input_loop --seconds "$fuzz_seconds" --seed 1 \
    tests/fuzz/seeds >build-fuzz/fuzz-counts.txt
  fuzz_how="the seeded mutation loop"
fi

echo "== untrusted input: the hostile-input suite (ctest cli.hostile_inputs) and the fuzz run" >&2
for b in build build-asan; do
  grep -h -A2 '^hostile inputs:' "$b/Testing/Temporary/LastTest.log" | sed "s|^|  $b: |" >&2
done
sed "s|^|  $fuzz_how: |" build-fuzz/fuzz-counts.txt | grep 'inputs tried' >&2
