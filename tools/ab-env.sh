#!/usr/bin/env bash
# A/B of an experiment switched by an environment variable (e.g. MOEKIT_BLOCK_CLUSTER=1), from the
# binaries scripts/gpu-build.sh staged in .gpu/, in one process tree on one GPU: test_batched_experts
# under B, compute-sanitizer on one of them under B, then the experts' rates and the
# layer at prefill, A and B alternated twice. Usage (on the GPU machine):
#   bash tools/ab-env.sh VAR=value ["M:m_e ..."]
# BIN_A / BIN_B (default .gpu): each side's binaries, for builds compared (tools/ab-build.sh); VAR=value
# may then be MOEKIT_AB=1, which nothing reads.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}
BIN_A=${BIN_A:-.gpu} BIN_B=${BIN_B:-.gpu}
ab=$1
cases=${2:-"8192:512 8192:1024 8192:300"}
case_args=()
for c in $cases; do case_args+=(--case "${c%%:*}" "${c##*:}"); done
t0=$SECONDS
echo "== tests under $ab"
env "$ab" timeout 240 $BIN_B/test_batched_experts --gtest_brief=1 > "$OUT/tests_b.log" 2>&1
echo "test_batched_experts ($ab) rc=$? $((SECONDS - t0)) s"
grep -E 'FAILED|PASSED|SKIPPED  \]|Failure' "$OUT/tests_b.log" | head -20
env "$ab" timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $BIN_B/test_batched_experts \
  --gtest_filter='BatchedExpertsGpuContract.FusedW1PlanHasNoW1Out' > "$OUT/sanitizer_b.log" 2>&1
echo "memcheck ($ab) rc=$? $((SECONDS - t0)) s"
grep -E 'ERROR SUMMARY' "$OUT/sanitizer_b.log"
for round in 1 2; do
  for side in A B; do
    envs=(); B=$BIN_A; [[ $side == B ]] && envs=("$ab") && B=$BIN_B
    env "${envs[@]}" timeout 200 $B/bench_gpu_experts "$OUT/rates_${side}$round.json" --quant block128 "${case_args[@]}" \
      > "$OUT/rates_${side}$round.log" 2>&1
    echo "-- rates $side (${envs[*]:-baseline}) round $round rc=$? $((SECONDS - t0)) s"
    grep -E "^(device|ceilings)|selected|stages" "$OUT/rates_${side}$round.log" | cut -c1-220
  done
done
for side in A B; do
  envs=(); B=$BIN_A; [[ $side == B ]] && envs=("$ab") && B=$BIN_B
  env "${envs[@]}" timeout 150 $B/moekit bench layer --experts batched-fp8 --quant block128 --tokens 512,2048,8192 \
    --iters 20 > "$OUT/layer_$side.txt" 2>&1
  echo "-- layer block128 $side (${envs[*]:-baseline}) rc=$? $((SECONDS - t0)) s"
  cut -c1-200 "$OUT/layer_$side.txt" | tail -8
done
