#!/usr/bin/env bash
# A maintainer's round on the GPU machine, from the binaries scripts/gpu-build.sh built there into
# .gpu/ (`bash scripts/gpu-build.sh "bash scripts/gpu-check.sh tests"`). Logs and results in $OUT; NVLink multicast stays off
# (NCCL_NVLS_ENABLE=0 and friends, below).
#   tests:   machine facts, the SASS check for FP8 wgmma (QGMMA), the GPU tests (experts, activation,
#            backend ops, the layer on every device, the runtime and redundant experts, the NCCL
#            transports at one rank), compute-sanitizer memcheck and racecheck on reduced cases.
#   bench:   `moekit bench layer` (DeepSeek-V3, 256 experts on the GPU, both formats) with the PyTorch
#            layer (eager, torch.compile) in the same round.
#   experts: the experts benchmark (DeepSeek-V3 shapes, E_local = 16, per-token and block128) with
#            PyTorch's grouped-GEMM pipeline in the same round.
#   python:  the Python package with torch (tests/python), vLLM's fused-MoE grids on the GPU with
#            moekit and both references, tests/parity on the GPU (transformers' wheels from the bundle);
#            PY_PARTS="tests vllm parity" picks among them; PY_TESTS (pytest arguments, word-split:
#            paths and a -k of one word, default tests/python),
#            VLLM_K (a pytest -k selection of the grids) and SHARED_BENCH=0 (no shared-expert bench after
#            parity) narrow a round.
#   bf16:    the bf16 recipe: `moekit bench layer --quant bf16` (DeepSeek-V3 and Qwen3-30B-A3B, every
#            expert on the GPU) against its floor (cuBLASLt's bf16 rate, 2-byte weights) and PyTorch's bf16
#            layer (eager, torch.compile) in the same round; the grouped 16-bit GEMMs against cuBLASLt bf16.
#            SIXTEEN_BIT_QUANTS="bf16 fp16" runs the fp16 recipe the same way (default bf16).
#   ep:      (2+ GPUs) expert parallelism on NCCL: the multi-GPU tests, the whole layer on 2 GPUs
#            checked against the CPU, `moekit bench dispatch` with the PyTorch baselines.
# `bash scripts/gpu-check.sh [all|tests|bench|experts|python|bf16|ep]` (all: tests and bench).
# Experiments (profiles, config sweeps, A/B rounds) live in tools/gpu-experiments.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BIN=.gpu
part=${1:-all}
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
# NCCL's device API is inlined into moekit's kernels: load the NCCL they were compiled against
# (2.28.9, PyTorch's nvidia-nccl-cu13 wheel here), not the system's.
NCCL_LIB=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null)
run() { LD_LIBRARY_PATH="$PWD/$BIN/lib${NCCL_LIB:+:$NCCL_LIB}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$@"; }
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
  # moekit's block GEMM unclustered too (what runs where the device holds no cluster of two).
  MOEKIT_BLOCK_CLUSTER=1 run $BIN/test_batched_experts >> "$OUT/tests.log" 2>&1 || tests_rc=$((tests_rc | $?))
  run $BIN/test_fp8_device >> "$OUT/tests.log" 2>&1 || tests_rc=$((tests_rc | $?))
  run $BIN/test_activation_kernels >> "$OUT/tests.log" 2>&1 || tests_rc=$((tests_rc | $?))
  run $BIN/test_grouped_gemm_sixteen_bit >> "$OUT/tests.log" 2>&1 || tests_rc=$((tests_rc | $?))
  run $BIN/test_backend_ops --gtest_brief=1 >> "$OUT/tests.log" 2>&1
  ops_rc=$?
  run $BIN/test_layer_devices >> "$OUT/tests.log" 2>&1
  layer_rc=$?
  # The NCCL transports at one rank (with 2+ GPUs the `ep` part runs the rest of this binary).
  [[ -x $BIN/test_layer_multi_gpu ]] && { run $BIN/test_layer_multi_gpu --gtest_filter='*OneGpu*' >> "$OUT/tests.log" 2>&1 \
    || layer_rc=$((layer_rc | $?)); }
  grep -E 'FAILED|PASSED|SKIPPED|Failure|tests ran' "$OUT/tests.log" | tail -30

  echo "== compute-sanitizer (reduced cases)"
  : > "$OUT/sanitizer.log"
  san_rc=0
  for tool in memcheck racecheck; do
    run compute-sanitizer --tool $tool --error-exitcode 9 $BIN/test_layer_devices \
      --gtest_filter='Cases/LayerOnDevice.MatchesTheCpuLayer/tiny_*_silu_T37:Devices/LayerEveryDevice.*/cuda' \
      >> "$OUT/sanitizer.log" 2>&1 || san_rc=$((san_rc | $?))
  done
  run compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test_batched_experts \
    --gtest_filter='BatchedExpertsGpuContract*' >> "$OUT/sanitizer.log" 2>&1 || san_rc=$((san_rc | $?))
  run compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test_backend_ops \
    --gtest_filter='*cuda_router*T37*:*cuda_prepare_finalize*T13*:*DispatchErrors*' >> "$OUT/sanitizer.log" 2>&1 \
    || san_rc=$((san_rc | $?))
  # NCCL's communicator init probes the device with API calls that fail by design (no kernel image
  # for its own collectives, cuMemCreate handle types): memory errors only.
  [[ -x $BIN/test_layer_multi_gpu ]] && { run compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    $BIN/test_layer_multi_gpu --gtest_filter='Cases/OneGpuNccl.*:OneGpuNcclGraphs.*' >> "$OUT/sanitizer.log" 2>&1 \
    || san_rc=$((san_rc | $?)); }
  grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$OUT/sanitizer.log"
  echo "tests rc=$tests_rc backend_ops rc=$ops_rc layer rc=$layer_rc sanitizer rc=$san_rc" | tee -a "$OUT/machine.txt"
  echo "== one runtime, many layers; redundant experts"
  run timeout 200 $BIN/test_runtime > "$OUT/runtime_tests.log" 2>&1
  runtime_rc=$?
  run timeout 200 $BIN/test_redundant_experts >> "$OUT/runtime_tests.log" 2>&1
  redundant_rc=$?
  grep -E 'FAILED|PASSED|SKIPPED|Failure|tests ran|relative difference|EPLB' "$OUT/runtime_tests.log" | tail -30
  : > "$OUT/runtime_sanitizer.log"
  san_rc=0
  for t in "test_runtime --gtest_filter=RuntimeOnGpu.*" "test_redundant_experts --gtest_filter=RedundantExpertsGpu.*"; do
    # shellcheck disable=SC2086
    run timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/$t >> "$OUT/runtime_sanitizer.log" 2>&1 \
      || san_rc=$((san_rc | $?))
  done
  grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/runtime_sanitizer.log" | tail -8
  echo "== moekit run --local-experts on the GPU (DeepSeek-V3 shapes, 32 experts in 64 slots), checked"
  run timeout 200 $BIN/moekit run --device cuda --dp 1 --ep 1 --model deepseek-v3 --num-experts 32 --local-experts 64 \
    --tokens-per-rank 48 --steps 3 --check 2>&1 | grep -v "^moekit run: building" | tail -8 | tee "$OUT/runtime_run.log"
  echo "runtime rc=$runtime_rc redundant rc=$redundant_rc memcheck rc=$san_rc" | tee -a "$OUT/machine.txt"
fi

if [[ $part == all || $part == bench ]]; then
  echo "== layer benchmark"
  run $BIN/moekit bench layer --format json > /tmp/layer.json 2> "$OUT/bench_layer.log"
  run $BIN/moekit bench layer --iters 20 --tokens 128,512 2>> "$OUT/bench_layer.log" | tee "$OUT/bench_layer_table.txt"
  PYTHONUNBUFFERED=1 timeout 420 python3 bench/torch_layer.py /tmp/layer.json "$OUT/layer_results.json" \
    "$OUT/layer_plot.png" "$commit" 2>&1 | tee "$OUT/layer_baseline.log"
fi

if [[ $part == bf16 ]]; then
 for q in ${SIXTEEN_BIT_QUANTS:-bf16}; do
  echo "== the $q recipe: the layer against its floor and PyTorch's $q layer"
  for model in ${BF16_MODELS:-deepseek-v3 qwen3-30b-a3b}; do
    # DeepSeek-V3's batched workspace at T = 8192 in bf16 (256 experts x 8192 rows x 2-byte rows) is
    # 80.3 GiB beside 22.5 GB of weights: past an H100 (the layer says so and names the fix).
    tokens=1,8,32,128,512,2048,8192
    [[ $model == deepseek-v3 ]] && tokens=1,8,32,128,512,2048
    run timeout 240 $BIN/moekit bench layer --model "$model" --quant $q --tokens "${BF16_TOKENS:-$tokens}" \
      --iters 20 --format json > "/tmp/layer_${q}_$model.json" 2>> "$OUT/bench_$q.log"
    echo "moekit bench layer $model $q rc=$?" | tee -a "$OUT/machine.txt"
    PYTHONUNBUFFERED=1 timeout 300 python3 bench/torch_layer.py "/tmp/layer_${q}_$model.json" \
      "$OUT/layer_${q}_$model.json" "$OUT/layer_${q}_$model.png" "$commit" 2>&1 | tee -a "$OUT/bench_$q.txt"
  done
  echo "== the grouped 16-bit GEMMs (DeepSeek-V3 shapes, E_local 16) against cuBLASLt $q"
  run timeout 200 $BIN/bench_gemm_sixteen_bit "$OUT/gemm_$q.json" --dtype $q --case 256 --case 512 --case 1024 2>&1 \
    | tee -a "$OUT/bench_$q.txt" | grep -E "ceilings|m_e"
 done
fi

if [[ $part == experts ]]; then
  echo "== experts benchmark (per-token and block128) and the PyTorch pipeline"
  run timeout 400 $BIN/bench_gpu_experts /tmp/experts.json > "$OUT/bench_experts.log" 2>&1
  grep -E "^(device|ceilings)|selected" "$OUT/bench_experts.log"
  PYTHONUNBUFFERED=1 timeout 150 python3 bench/torch_baseline.py /tmp/experts.json "$OUT/experts_results.json" \
    "$OUT/experts_plot.png" "$commit" 2>&1 | tee "$OUT/experts_baseline.log"
  echo "== the rule planned for M = 8192 rows (its empty launches) against its one busy config alone"
  # block128's busy configs past 64 rows: cooperative-128x128 (W1) and block-128x256 (W2, k <= 2048)
  for q in per-token:swapab-128x32,swapab-128x64,pingpong-64x256 \
    block128:swapab-128x32,swapab-128x64,cooperative-128x128,block-128x256; do
    for m_e in 8 64 128; do
      run timeout 120 $BIN/bench_gpu_experts /tmp/empty.json --case 8192 $m_e --max-rows 8192 --quant ${q%%:*} \
        --configs ${q#*:} 2>&1 | grep -E "^(per-token|block128) " | tee -a "$OUT/empty_launches.txt"
    done
  done
fi

if [[ $part == python ]]; then
  # PY_PARTS picks among "tests vllm parity" (each a few minutes; default all three).
  py_parts=" ${PY_PARTS:-tests vllm parity} "
fi
if [[ $part == python && $py_parts == *" tests "* ]]; then
  echo "== the Python package with torch ($(python3 -c 'import torch; print(torch.__version__)'))"
  PYTHONPATH="$PWD/$BIN/python" MOEKIT_CLI="$PWD/$BIN/moekit" MOEKIT_PY_RESULTS="$OUT/python_results.json" \
    PYTHONUNBUFFERED=1 run timeout 500 python3 -m pytest -q -rs -s -p no:cacheprovider ${PY_TESTS:-tests/python} 2>&1 \
    | tee "$OUT/python_tests.log" | grep -vE '^\s*$' | tail -40
  echo "python tests rc=${PIPESTATUS[0]}" | tee -a "$OUT/machine.txt"
fi
if [[ $part == python && $py_parts == *" vllm "* ]]; then
  echo "== vLLM's fused-MoE test grids, the whole grid on the GPU (moekit, vLLM's reference and float64)"
  PYTHONPATH="$PWD/$BIN/python" MOEKIT_VLLM_DEVICE=cuda PYTHONUNBUFFERED=1 run timeout 540 python3 -m pytest -q -rs -s \
    -p no:cacheprovider tests/python/test_vllm_grids.py ${VLLM_K:+-k "$VLLM_K"} 2>&1 | tee "$OUT/vllm_grid.log" \
    | grep -vE '^\s*$' | tail -40
  echo "vllm grid rc=${PIPESTATUS[0]}" | tee -a "$OUT/machine.txt"
fi
if [[ $part == python && $py_parts == *" parity "* ]]; then
  if [[ -d $BIN/wheels ]]; then
    echo "== tests/parity on the GPU: the CUDA layer against transformers' MoE blocks (wheels from gpu-pack.sh --python-wheels)"
    site=$(mktemp -d)
    python3 -m pip install -q --no-deps --no-index --target "$site" $BIN/wheels/*.whl
    PYTHONPATH="$site:$PWD/$BIN/python" MOEKIT_PARITY_DEVICE=cuda PYTHONUNBUFFERED=1 run timeout 400 python3 -m pytest \
      -q -s -p no:cacheprovider tests/parity 2>&1 | grep -v ExpertsInterface | tee "$OUT/parity_cuda.log" | tail -70
    echo "== the layer with and without its shared expert (DeepSeek-V3, block128, the modes alternated)"
    for order in $( ((${SHARED_BENCH:-1})) && echo on,off off,on); do
      run timeout 150 $BIN/moekit bench layer --experts batched-fp8 --tokens 1,8,128,512,2048,8192 \
        --shared-experts $order --iters 50 2>/dev/null | grep fused | tee -a "$OUT/bench_shared.txt"
    done
  fi
fi

if [[ $part == ep ]]; then
  echo "== expert parallelism on NCCL ($(nvidia-smi -L | wc -l) GPUs)"
  nvidia-smi topo -m | head -4 | tee -a "$OUT/machine.txt"
  echo "NCCL library: $NCCL_LIB" | tee -a "$OUT/machine.txt"
  run timeout 300 $BIN/test_layer_multi_gpu --gtest_filter=-TwoGpusFaults.* > "$OUT/ep_tests.log" 2>&1
  ep_rc=$?
  run timeout 90 $BIN/test_layer_multi_gpu --gtest_filter=TwoGpusFaults.* >> "$OUT/ep_tests.log" 2>&1
  fault_rc=$?
  grep -E 'FAILED|PASSED|SKIPPED|Failure|tests ran|GPUs vs 1|bit-identical|silent peer' "$OUT/ep_tests.log" | tail -40
  echo "== the whole layer on 2 GPUs, checked against float64 and the CPU (in-process ranks, then mpirun)"
  run timeout 120 $BIN/moekit run --device cuda --dp 2 --ep 2 --comm in-process --model deepseek-v3 --num-experts 32 \
    --tokens-per-rank 24 --steps 3 --check 2>&1 | tail -7 | tee "$OUT/ep_run.log"
  run timeout 120 mpirun --allow-run-as-root -np 2 -x LD_LIBRARY_PATH -x NCCL_NVLS_ENABLE -x NVSHMEM_DISABLE_NVLS \
    -x TORCH_SYMM_MEM_DISABLE_MULTICAST $BIN/moekit-mpi run --device cuda --dp 2 --ep 2 --model qwen3-30b-a3b \
    --tokens-per-rank 64 --steps 3 --check 2>&1 | grep -v "^moekit run: building" | tail -9 | tee -a "$OUT/ep_run.log"
  echo "ep tests rc=$ep_rc fault tests rc=$fault_rc" | tee -a "$OUT/machine.txt"
  echo "== bench dispatch (DeepSeek-V3, 256 experts, top-8) and the PyTorch baselines"
  run timeout 240 $BIN/moekit bench dispatch --iters 40 --format json > "$OUT/dispatch.json" 2> "$OUT/bench_dispatch.log"
  python3 - "$OUT/dispatch.json" <<'PY' | tee "$OUT/bench_dispatch_table.txt"
import json, sys
d = json.load(open(sys.argv[1]))
print(f"moekit bench dispatch ({d['dispatch']}, {d['device']}, peer {d['peer_gbs']:.0f} GB/s, graph replay, max over ranks)")
print(f"{'routing':<8} {'T':>5} {'disp us':>8} {'p99':>7} {'comb us':>8} {'p99':>7} {'round us':>9} {'p99':>7} {'disp MB':>8} {'GB/s':>6} {'comb MB':>8} {'GB/s':>6} {'buffers MB':>10} {'pipelined: disp':>15} {'comb':>6} {'round':>6}")
for r in d["rows"]:
    g1 = r["dispatch_bytes"] / (r["dispatch_us"][0] * 1e3); g2 = r["combine_bytes"] / (r["combine_us"][0] * 1e3)
    print(f"{r['routing']:<8} {r['T']:>5} {r['dispatch_us'][0]:>8.1f} {r['dispatch_us'][1]:>7.1f} {r['combine_us'][0]:>8.1f} "
          f"{r['combine_us'][1]:>7.1f} {r['round_trip_us'][0]:>9.1f} {r['round_trip_us'][1]:>7.1f} {r['dispatch_bytes']/1e6:>8.2f} "
          f"{g1:>6.0f} {r['combine_bytes']/1e6:>8.2f} {g2:>6.0f} {r['buffer_bytes']/2**20:>10.1f} "
          f"{r['dispatch_us_pipelined'][0]:>15.1f} {r['combine_us_pipelined'][0]:>6.1f} {r['round_trip_us_pipelined'][0]:>6.1f}")
PY
  PYTHONUNBUFFERED=1 timeout 240 python3 bench/torch_dispatch.py "$OUT/dispatch.json" "$OUT/dispatch_results.json" \
    "$commit" 2>&1 | tail -20 | tee "$OUT/dispatch_baseline.log"
fi


# The device tool brings back at most 8 files from $OUT, in name order: every log of the round in one
# archive whose name sorts first.
tar czf "/tmp/00-round.tgz" -C "$OUT" . && mv /tmp/00-round.tgz "$OUT/00-round.tgz" && echo "== logs: $OUT/00-round.tgz"
