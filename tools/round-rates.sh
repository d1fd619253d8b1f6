#!/usr/bin/env bash
# The prefill rate round (issue 55's measurements): the experts' GEMM rates at m_e 512 / 1024 for both
# recipes and the layer at prefill, from the binaries scripts/gpu-build.sh staged in .gpu/, ceilings
# measured in the same process. Usage (on the GPU machine): bash tools/round-rates.sh [tests]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export LD_LIBRARY_PATH=$PWD/.gpu/lib:${LD_LIBRARY_PATH:-}
B=.gpu
t0=$SECONDS
if [[ ${1:-} == tests ]]; then
  timeout 150 $B/test_batched_experts --gtest_brief=1 > $OUT/tests.log 2>&1; echo "test_batched_experts rc=$? $((SECONDS-t0)) s"
  timeout 150 $B/test_backend_ops --gtest_brief=1 >> $OUT/tests.log 2>&1; echo "test_backend_ops rc=$? $((SECONDS-t0)) s"
  grep -E 'FAILED|PASSED|SKIPPED  \]' $OUT/tests.log | head -20
fi
timeout 240 $B/bench_gpu_experts $OUT/rates.json --case 8192 512 --case 8192 1024 > $OUT/rates.log 2>&1
echo "rates rc=$? $((SECONDS-t0)) s"
grep -E "^(device|ceilings|one read)|selected|stages" $OUT/rates.log | cut -c1-250
# The layer as JSON (committed with the round: the floor beside every row), printed as a table.
for q in block128 per-token; do
  timeout 150 $B/moekit bench layer --experts batched-fp8 --quant $q --tokens 512,2048,8192 --iters 20 --format json \
    > $OUT/layer_$q.json 2> $OUT/layer_$q.err
  echo "layer $q rc=$? $((SECONDS-t0)) s"
  python3 - $OUT/layer_$q.json <<'PY' || tail -5 $OUT/layer_$q.err
import json, sys
j = json.load(open(sys.argv[1]))
print(f"{j['device']}, {j['quant']}, ceilings {j['ceilings']['copy_gbs']:.0f} GB/s, {j['ceilings']['fp8_tflops']:.0f} TFLOP/s")
for r in j["rows"]:
    print(f"  {r['experts']:14s} T {r['T']:5d}  {r['median_ms']:8.4f} ms  p99 {r['p99_ms']:8.4f}  floor {r['floor_ms']:7.4f}"
          f"  x floor {r['median_ms'] / r['floor_ms']:5.2f}  experts {r['stages_ms'].get('experts', 0):7.4f} ms")
PY
done
