#!/usr/bin/env bash
# One whole round on the GPU machine, from the binaries scripts/gpu-bundle.sh built into .gpu/:
#   tests: machine facts, the SASS check for FP8 wgmma (QGMMA), the GPU tests, the backend-ops
#          harness and the layer on every device, compute-sanitizer memcheck and racecheck on
#          reduced cases;
#   bench: `moekit bench layer` (DeepSeek-V3, 256 experts on the GPU, both formats) with the
#          PyTorch layer (eager, torch.compile) in the same round, and the experts benchmark.
# `bash scripts/gpu-check.sh tests|bench` runs one part (default: both). Logs and results in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BIN=.gpu
part=${1:-all}
run() { LD_LIBRARY_PATH="$PWD/$BIN/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"; }
commit=$(head -1 $BIN/COMMIT)
{ echo "commit $(cat $BIN/COMMIT | tr '\n' ' ')"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv; } \
  | tee "$OUT/machine.txt"

if [[ $part == all || $part == tests ]]; then
  echo "== SASS: FP8 tensor-core instructions in the experts"
  cuobjdump --dump-sass $BIN/test_batched_experts > /tmp/sass.txt
  grep -oE 'QGMMA[.A-Z0-9x]*' /tmp/sass.txt | sort | uniq -c | tee -a "$OUT/machine.txt"

  echo "== GPU tests"
  run $BIN/test_batched_experts > "$OUT/tests.log" 2>&1
  tests_rc=$?
  run $BIN/test_backend_ops --gtest_brief=1 >> "$OUT/tests.log" 2>&1
  ops_rc=$?
  run $BIN/test_layer_devices >> "$OUT/tests.log" 2>&1
  layer_rc=$?
  grep -E 'FAILED|PASSED|SKIPPED|Failure|tests ran' "$OUT/tests.log" | tail -30

  echo "== compute-sanitizer (reduced cases)"
  : > "$OUT/sanitizer.log"
  san_rc=0
  for tool in memcheck racecheck; do
    run compute-sanitizer --tool $tool --error-exitcode 9 $BIN/test_layer_devices \
      --gtest_filter='Cases/LayerOnDevice.MatchesTheCpuLayer/tiny_*_per_token_silu_T37:Devices/LayerEveryDevice.*/cuda' \
      >> "$OUT/sanitizer.log" 2>&1 || san_rc=$((san_rc | $?))
  done
  run compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test_batched_experts \
    --gtest_filter='BatchedExpertsGpuContract.*' >> "$OUT/sanitizer.log" 2>&1 || san_rc=$((san_rc | $?))
  run compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test_backend_ops \
    --gtest_filter='*cuda_router*T37*:*cuda_prepare_finalize*T13*:*DispatchErrors*' >> "$OUT/sanitizer.log" 2>&1 \
    || san_rc=$((san_rc | $?))
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/sanitizer.log"
  echo "tests rc=$tests_rc backend_ops rc=$ops_rc layer rc=$layer_rc sanitizer rc=$san_rc" | tee -a "$OUT/machine.txt"
fi

if [[ $part == all || $part == bench ]]; then
  echo "== layer benchmark"
  run $BIN/moekit bench layer --format json > /tmp/layer.json 2> "$OUT/bench_layer.log"
  run $BIN/moekit bench layer --iters 20 --tokens 128,512 2>> "$OUT/bench_layer.log" | tee "$OUT/bench_layer_table.txt"
  PYTHONUNBUFFERED=1 timeout 420 python3 bench/torch_layer.py /tmp/layer.json "$OUT/layer_results.json" \
    "$OUT/layer_plot.png" "$commit" 2>&1 | tee "$OUT/layer_baseline.log"
fi
