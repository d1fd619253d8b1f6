#!/usr/bin/env bash
# One whole round on the GPU machine, from the binaries scripts/gpu-bundle.sh built into .gpu/:
# machine facts, the SASS check for FP8 wgmma (QGMMA), the GPU tests and the backend-ops harness on
# every device, compute-sanitizer memcheck on reduced cases, the benchmark and the PyTorch
# baseline. Logs and results land in $OUT. `bash scripts/gpu-check.sh tests` stops after the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BIN=.gpu
run() { LD_LIBRARY_PATH="$PWD/$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"; }
commit=$(head -1 $BIN/COMMIT)
{ echo "commit $(cat $BIN/COMMIT | tr '\n' ' ')"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; } \
  | tee "$OUT/machine.txt"

echo "== SASS: FP8 tensor-core instructions in the experts"
cuobjdump --dump-sass $BIN/test_batched_experts > /tmp/sass.txt
grep -oE 'QGMMA[.A-Z0-9x]*' /tmp/sass.txt | sort | uniq -c | tee -a "$OUT/machine.txt"

echo "== GPU tests"
run $BIN/test_batched_experts > "$OUT/tests.log" 2>&1
tests_rc=$?
run $BIN/test_backend_ops --gtest_brief=1 >> "$OUT/tests.log" 2>&1
ops_rc=$?
grep -E 'vs cpu|OK|FAILED|PASSED|SKIPPED|Failure|Expected|Which|tests ran' "$OUT/tests.log" | tail -40

echo "== compute-sanitizer memcheck (reduced cases)"
run compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test_batched_experts \
  --gtest_filter='BatchedExpertsGpuContract.*' > "$OUT/sanitizer.log" 2>&1
san_rc=$?
run compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test_backend_ops \
  --gtest_filter='*cuda_experts_tiny_batched_per_t*ragged*' >> "$OUT/sanitizer.log" 2>&1
san_rc=$((san_rc | $?))
grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/sanitizer.log"
echo "tests rc=$tests_rc backend_ops rc=$ops_rc sanitizer rc=$san_rc" | tee -a "$OUT/machine.txt"
[[ ${1:-} == tests ]] && exit 0

echo "== benchmark"
run $BIN/bench_gpu_experts /tmp/bench_raw.json 2>&1 | tee "$OUT/bench.log"
PYTHONUNBUFFERED=1 python3 bench/torch_baseline.py /tmp/bench_raw.json "$OUT/results.json" "$OUT/bench_plot.png" \
  "$commit" 2>&1 | tee "$OUT/baseline.log"
