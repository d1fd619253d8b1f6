#!/usr/bin/env bash
# One whole round on the GPU machine, from the binaries scripts/gpu-bundle.sh built into .gpu/:
# machine facts, the GPU tests, compute-sanitizer memcheck on a reduced case, the SASS check for
# FP8 wgmma (QGMMA), the benchmark and the PyTorch baseline. Logs and results land in $OUT.
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
# The activation kernels' SASS, for the instruction budget (docs/PERF.md).
awk '/Function : /{f = ($0 ~ /activation_quant/)} f' /tmp/sass.txt | head -20000 > "$OUT/activation_sass.txt"

echo "== GPU tests"
run $BIN/test_batched_experts 2>&1 | tee "$OUT/tests.log" | grep -E 'rel err|OK|FAILED|PASSED|SKIPPED|Failure|Expected|Which' | tail -60
tests_rc=${PIPESTATUS[0]}

echo "== compute-sanitizer memcheck (reduced case)"
run compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test_batched_experts \
  --gtest_filter='BatchedExpertsGpuContract.*' > "$OUT/sanitizer.log" 2>&1
san_rc=$?
tail -5 "$OUT/sanitizer.log"

echo "== benchmark"
run $BIN/bench_gpu_experts /tmp/bench_raw.json 2>&1 | tee "$OUT/bench.log"
PYTHONUNBUFFERED=1 python3 bench/torch_baseline.py /tmp/bench_raw.json "$OUT/results.json" "$OUT/bench_plot.png" \
  "$commit" 2>&1 | tee "$OUT/baseline.log"
echo "tests rc=$tests_rc sanitizer rc=$san_rc" | tee -a "$OUT/machine.txt"
