#!/usr/bin/env bash
# One whole round on the GPU machine, from the binaries scripts/gpu-bundle.sh built into .gpu/:
#   tests: machine facts, the SASS check for FP8 wgmma (QGMMA), the GPU tests, the backend-ops
#          harness and the layer on every device, the NCCL transports at one rank, compute-sanitizer memcheck and racecheck on
#          reduced cases;
#   bench: `moekit bench layer` (DeepSeek-V3, 256 experts on the GPU, both formats) with the
#          PyTorch layer (eager, torch.compile) in the same round.
#   experts: the experts benchmark (DeepSeek-V3 shapes, E_local = 16, per-token and block128) with
#          PyTorch's grouped-GEMM pipeline in the same round.
#   ep:    (2+ GPUs) expert parallelism on NCCL: the multi-GPU tests, the whole layer on 2 GPUs
#          checked against the CPU, `moekit bench dispatch` with the PyTorch baselines.
#   ep-layer: (2+ GPUs) the whole layer expert-parallel under graph replay from Python
#          (bench/ep_layer.py under torchrun) against the experts alone + `moekit bench dispatch`.
#   fused: block128's experts (the fused W1 next to the unfused configs) against the CPU,
#          compute-sanitizer on the fused plan, the experts benchmark per-token and block128.
#   configs: the experts' GPU tests, then bench_gpu_experts on the configs $CONFIGS (comma-separated
#          names of plan/gemm_config.h) and the rule, scaling $QUANT, cases $CASES ("M:m_e ..."),
#          E_local $EXPERTS, $ROUNDS rounds; GRAPH_PARTS=1 adds each step's parts replayed from their
#          own graphs (--graph-parts); BASELINE=config prints every variant as ratios to that config
#          measured in the same rounds (--baseline: compare builds by these, not by raw ms); the SM
#          clock and power meanwhile in configs_clocks.csv.
#   layer: the layer on every device (test_layer_devices) and the backend-ops harness.
#   runtime: one runtime for many layers (test_runtime) and redundant experts (test_redundant_experts:
#          one GPU holding every expert twice, a CUDA graph replaying a replaced placement), both
#          under memcheck, and `moekit run --local-experts` on the GPU checked against float64.
#   python: the Python package with torch (tests/python: CPU tests, test_gpu.py, and with 2 GPUs
#          expert parallelism under torchrun), the ops' host overhead in python_results.json.
#   graphs: the captured step (test_batched_experts' graph tests, memcheck on them), the experts
#          benchmark (eager and graph replay), `moekit bench layer` with and without --fuse-w1, the
#          Python ops on the GPU (test_gpu.py's op tests, fuse_w1 among them).
#   routing: `moekit bench layer` (block128, 256 experts) under the model's routing and under uniform
#          routing, fused and --no-fuse-w1, alternated twice.
#   vllm:  tests/python/test_vllm_grids.py, the whole grid with moekit and both references on the GPU.
#   parity: tests/parity on the GPU (transformers' wheels from gpu-bundle.sh), and `moekit bench
#          layer --shared-experts on,off`.
#   decode: a decode step's small kernels: ncu's time of every kernel of one step at T = 1 (block128
#          and per-token, uniform routing), the layer at T = 1 / 8 / 32 / 128 alternated twice, the
#          row map and scatter cases of the backend ops under memcheck; each against
#          $BIN/moekit-base (an older build) when present.
#   profile: ncu on the block128 grouped GEMMs of the configs in $PROFILE_CONFIGS (default
#          cooperative-128x128,block-128x256) at M = 8192, m_e in $PROFILE_ME (default 256): their W1
#          and W2 launches in table order, speed of light, warp states, source counters; the SASS of
#          moekit's block GEMM kernels; how fast TMA alone streams the weights (bench_weight_stream).
# `bash scripts/gpu-check.sh tests|bench|experts|fused|layer|runtime|vllm|ep|ep-layer|python|parity|graphs|routing|decode|profile|configs` runs one part (default: tests and bench). Logs and
# results in $OUT. NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and friends, below).
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
  run $BIN/test_fp8_device >> "$OUT/tests.log" 2>&1 || tests_rc=$((tests_rc | $?))
  run $BIN/test_activation_kernels >> "$OUT/tests.log" 2>&1 || tests_rc=$((tests_rc | $?))
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
fi

if [[ $part == all || $part == bench ]]; then
  echo "== layer benchmark"
  run $BIN/moekit bench layer --format json > /tmp/layer.json 2> "$OUT/bench_layer.log"
  run $BIN/moekit bench layer --iters 20 --tokens 128,512 2>> "$OUT/bench_layer.log" | tee "$OUT/bench_layer_table.txt"
  PYTHONUNBUFFERED=1 timeout 420 python3 bench/torch_layer.py /tmp/layer.json "$OUT/layer_results.json" \
    "$OUT/layer_plot.png" "$commit" 2>&1 | tee "$OUT/layer_baseline.log"
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

if [[ $part == fused ]]; then
  echo "== block128 experts (the fused W1 and the unfused configs), compute-sanitizer, block128 benchmark"
  run timeout 300 $BIN/test_batched_experts --gtest_filter='*block128*:BatchedExpertsGpuContract.*' \
    > "$OUT/fused_tests.log" 2>&1
  fused_rc=$?
  run timeout 60 $BIN/test_fp8_device >> "$OUT/fused_tests.log" 2>&1 || fused_rc=$((fused_rc | $?))
  grep -E 'FAILED|PASSED|SKIPPED|Failure|tests ran|fused' "$OUT/fused_tests.log" | tail -40
  run timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test_batched_experts \
    --gtest_filter='BatchedExpertsGpuContract.FusedW1PlanHasNoW1Out' > "$OUT/fused_sanitizer.log" 2>&1
  fused_san_rc=$?
  grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/fused_sanitizer.log"
  run timeout 300 $BIN/bench_gpu_experts /tmp/experts.json --quant per-token,block128 > "$OUT/bench_fused.log" 2>&1
  grep -vE "^\s+(stages|activation)" "$OUT/bench_fused.log"
  cp /tmp/experts.json "$OUT/bench_fused.json" 2>/dev/null
  echo "fused tests rc=$fused_rc sanitizer rc=$fused_san_rc" | tee -a "$OUT/machine.txt"
fi

if [[ $part == graphs ]]; then
  echo "== the captured step (graph tests), memcheck, experts + layer benchmarks"
  run timeout 200 $BIN/test_batched_experts --gtest_filter='*Graph*:BatchedExpertsGpuContract.*' \
    > "$OUT/graph_tests.log" 2>&1
  graph_rc=$?
  grep -E 'FAILED|PASSED|SKIPPED|Failure|tests ran' "$OUT/graph_tests.log" | tail -20
  run timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test_batched_experts \
    --gtest_filter='*GraphReplayFollowsTheCounts*' > "$OUT/graph_sanitizer.log" 2>&1
  graph_san_rc=$?
  grep -E 'ERROR SUMMARY|PASSED|FAILED' "$OUT/graph_sanitizer.log"
  if [[ -d $BIN/python ]]; then
    PYTHONPATH="$PWD/$BIN/python" MOEKIT_CLI="$PWD/$BIN/moekit" PYTHONUNBUFFERED=1 run timeout 200 python3 -m pytest \
      -q -rs -p no:cacheprovider tests/python/test_gpu.py -k "op" 2>&1 | tail -6 | tee "$OUT/graph_python.log"
  fi
  run timeout 300 $BIN/bench_gpu_experts /tmp/experts.json --quant per-token,block128 > "$OUT/bench_graphs.log" 2>&1
  grep -vE "^\s+(stages|activation)" "$OUT/bench_graphs.log"
  cp /tmp/experts.json "$OUT/bench_graphs.json" 2>/dev/null
  for fuse in --no-fuse-w1 --fuse-w1; do
    run timeout 120 $BIN/moekit bench layer --quant block128 --iters 20 --tokens 128,512 $fuse 2>&1 \
      | tee -a "$OUT/bench_layer_graphs.txt" | tail -8
  done
  echo "graph tests rc=$graph_rc sanitizer rc=$graph_san_rc" | tee -a "$OUT/machine.txt"
fi

if [[ $part == routing ]]; then
  echo "== layer: model and uniform routing, fused (default) and --no-fuse-w1, alternated twice"
  for round in 1 2; do
    for routing in model uniform; do
      for fuse in --fuse-w1 --no-fuse-w1; do
        echo "-- round $round --routing $routing $fuse" | tee -a "$OUT/routing_layer.txt"
        run timeout 150 $BIN/moekit bench layer --quant block128 --iters 20 --tokens 1,32,128,512 --routing $routing \
          $fuse 2>/dev/null | tee -a "$OUT/routing_layer.txt" | grep -E "^(batched|standard)"
      done
    done
  done
fi

if [[ $part == decode ]]; then
  bins=moekit
  [[ -x $BIN/moekit-base ]] && bins="moekit-base moekit"
  echo "== decode: every kernel of a T = 1 step (ncu, median over the profiled steps, us): $bins"
  for b in $bins; do
    for q in block128 per-token; do
      run timeout 240 ncu --metrics gpu__time_duration.sum --csv --launch-skip 80 --launch-count 40 $BIN/$b bench layer \
        --quant $q --tokens 1 --iters 20 --experts batched-fp8 --routing uniform > "$OUT/decode_ncu_${b}_$q.csv" 2>/dev/null
      echo "-- $b $q" | tee -a "$OUT/decode_kernels.txt"
      python3 - "$OUT/decode_ncu_${b}_$q.csv" <<'PY' | tee -a "$OUT/decode_kernels.txt"
import csv, statistics, sys
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 14 and r[12] == "gpu__time_duration.sum"]
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
ks = [(r[4].replace("(anonymous namespace)::", "")[:70], float(r[14].replace(",", "")) * scale.get(r[13], 1.0))
      for r in rows]
# One step = the kernels from one route kernel to the next: medians by position in the step.
starts = [i for i, (n, _) in enumerate(ks) if "route" in n]
steps = [ks[a:b] for a, b in zip(starts, starts[1:])]
steps = [s for s in steps if len(s) == len(steps[0])] if steps else []
total = 0.0
for j in range(len(steps[0]) if steps else 0):
    m = statistics.median(s[j][1] for s in steps); total += m
    print(f"  {steps[0][j][0]:70s} {m:8.1f} us")
print(f"  {'sum of medians (' + str(len(steps)) + ' steps)':70s} {total:8.1f} us")
PY
    done
  done
  echo "== decode: the layer (uniform routing, graph replay), alternated twice"
  for round in 1 2; do
    for b in $bins; do
      for q in block128 per-token; do
        echo "-- round $round $b $q" | tee -a "$OUT/decode_layer.txt"
        run timeout 150 $BIN/$b bench layer --quant $q --iters 50 --tokens 1,8,32,128 --routing uniform 2>/dev/null \
          | tee -a "$OUT/decode_layer.txt" | grep -E "^(batched|standard)"
      done
    done
  done
  echo "== decode: memcheck on the row map, scatter and combine cases"
  run compute-sanitizer --tool memcheck --error-exitcode 9 $BIN/test_backend_ops \
    --gtest_filter='*cuda_prepare_finalize*' > "$OUT/decode_sanitizer.log" 2>&1
  echo "decode memcheck rc=$?" | tee -a "$OUT/machine.txt"
  grep -E "ERROR SUMMARY|PASSED|FAILED" "$OUT/decode_sanitizer.log" | tail -4
fi

if [[ $part == configs ]]; then
  [[ -n ${CONFIGS:-} ]] || { echo "gpu-check.sh configs: set CONFIGS to config names of plan/gemm_config.h, e.g. CONFIGS=pingpong-64x256,cooperative-128x128" >&2; exit 2; }
  echo "== configs: the experts' tests, then $CONFIGS (${QUANT:-per-token}) at M:m_e in ${CASES:-8192:256}, E_local = ${EXPERTS:-16}, ${ROUNDS:-2} rounds"
  run timeout 400 $BIN/test_batched_experts --gtest_filter='Models/BatchedExpertsGpu.*' > "$OUT/configs_tests.log" 2>&1
  echo "experts tests rc=$?" | tee -a "$OUT/machine.txt"
  grep -E 'FAILED|PASSED|Failure' "$OUT/configs_tests.log" | tail -8
  # The SM clock, power and throttle reasons every 50 ms while the benchmark runs (configs_clocks.csv):
  # whether a variant's time moved with the clock.
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_event_reasons.active \
    --format=csv -lms 50 > "$OUT/configs_clocks.csv" 2>&1 &
  smi_pid=$!
  for round in $(seq ${ROUNDS:-2}); do
    for c in ${CASES:-8192:256}; do
      echo "-- round $round M m_e $c" | tee -a "$OUT/configs.txt"
      run timeout 120 $BIN/bench_gpu_experts /tmp/configs.json --experts ${EXPERTS:-16} --quant ${QUANT:-per-token} \
        --case ${c%%:*} ${c#*:} --configs $CONFIGS ${GRAPH_PARTS:+--graph-parts} ${BASELINE:+--baseline $BASELINE} 2>&1 \
        | tee -a "$OUT/configs.txt" | grep -E "^(per-token|block128|per-tensor|ceilings)|replayed alone|graph parts| vs "
    done
  done
  kill $smi_pid 2>/dev/null
  sed -n '2,$p' "$OUT/configs_clocks.csv" | awk -F', ' '{print $2, $6}' | sort | uniq -c | sort -rn | head -12
fi

if [[ $part == layer ]]; then
  echo "== the layer on every device (test_layer_devices) and the backend ops"
  run timeout 400 $BIN/test_layer_devices > "$OUT/layer_tests.log" 2>&1
  layer_rc=$?
  run timeout 150 $BIN/test_backend_ops --gtest_brief=1 >> "$OUT/layer_tests.log" 2>&1
  ops_rc=$?
  grep -E 'FAILED|PASSED|SKIPPED|Failure|tests ran' "$OUT/layer_tests.log" | tail -30
  echo "layer rc=$layer_rc backend_ops rc=$ops_rc" | tee -a "$OUT/machine.txt"
fi

if [[ $part == runtime ]]; then
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

if [[ $part == python ]]; then
  echo "== the Python package with torch ($(python3 -c 'import torch; print(torch.__version__)'))"
  PYTHONPATH="$PWD/$BIN/python" MOEKIT_CLI="$PWD/$BIN/moekit" MOEKIT_PY_RESULTS="$OUT/python_results.json" \
    PYTHONUNBUFFERED=1 run timeout 500 python3 -m pytest -q -rs -s -p no:cacheprovider tests/python 2>&1 \
    | tee "$OUT/python_tests.log" | grep -vE '^\s*$' | tail -40
  echo "python tests rc=${PIPESTATUS[0]}" | tee -a "$OUT/machine.txt"
fi

if [[ $part == vllm ]]; then
  echo "== vLLM's fused-MoE test grids, the whole grid on the GPU (moekit, vLLM's reference and float64)"
  PYTHONPATH="$PWD/$BIN/python" MOEKIT_VLLM_DEVICE=cuda PYTHONUNBUFFERED=1 run timeout 540 python3 -m pytest -q -rs -s \
    -p no:cacheprovider tests/python/test_vllm_grids.py 2>&1 | tee "$OUT/vllm_grid.log" | grep -vE '^\s*$' | tail -40
  echo "vllm grid rc=${PIPESTATUS[0]}" | tee -a "$OUT/machine.txt"
fi

if [[ $part == parity ]]; then
  echo "== tests/parity on the GPU: the CUDA layer against transformers' MoE blocks (wheels from gpu-bundle.sh)"
  site=$(mktemp -d)
  python3 -m pip install -q --no-deps --no-index --target "$site" $BIN/wheels/*.whl
  PYTHONPATH="$site:$PWD/$BIN/python" MOEKIT_PARITY_DEVICE=cuda PYTHONUNBUFFERED=1 run timeout 400 python3 -m pytest \
    -q -s -p no:cacheprovider tests/parity 2>&1 | grep -v ExpertsInterface | tee "$OUT/parity_cuda.log" | tail -70
  echo "== the layer with and without its shared expert (DeepSeek-V3, block128, the modes alternated)"
  for order in on,off off,on; do
    run timeout 150 $BIN/moekit bench layer --experts batched-fp8 --tokens 1,8,128,512,2048,8192 \
      --shared-experts $order --iters 50 2>/dev/null | grep fused | tee -a "$OUT/bench_shared.txt"
  done
fi

if [[ $part == ep-layer ]]; then
  echo "== the whole layer on $(nvidia-smi -L | wc -l) GPUs under graph replay (bench/ep_layer.py, torchrun)"
  [[ -f $OUT/dispatch.json ]] || run timeout 240 $BIN/moekit bench dispatch --iters 40 --format json \
    > "$OUT/dispatch.json" 2> "$OUT/bench_dispatch.log"
  PYTHONPATH="$PWD/$BIN/python" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 run timeout 400 python3 -m torch.distributed.run \
    --nproc-per-node "$(nvidia-smi -L | wc -l)" bench/ep_layer.py "$OUT/dispatch.json" "$OUT/ep_layer_results.json" \
    "$commit" 32 128 512 2>&1 | grep -v "^\*\*\*\|OMP_NUM_THREADS" | tee "$OUT/ep_layer.log" | tail -12
fi

if [[ $part == profile ]]; then
  [[ -x $BIN/bench_weight_stream ]] && run timeout 60 $BIN/bench_weight_stream 4 6 | tee "$OUT/weight_stream.txt"
  configs=${PROFILE_CONFIGS:-cooperative-128x128,block-128x256}
  cuobjdump --dump-sass $BIN/bench_gpu_experts 2>/dev/null \
    | awk '/Function : .*block_gemm/{p=1} /Function : /&&!/block_gemm/{p=0} p' > "$OUT/block_gemm_sass.txt"
  echo "SASS lines of the block GEMM kernels: $(wc -l < "$OUT/block_gemm_sass.txt")"
  # The tensor pipe's (wgmma) busy cycles, where this ncu names the metric.
  metrics=$(ncu --query-metrics --chip gh100 2>/dev/null | awk '{print $1}' \
    | grep -xE 'sm__pipe_tensor_op_gmma_cycles_active|sm__pipe_shared_cycles_active|l1tex__data_pipe_lsu_wavefronts_mem_shared' \
    | sed 's/$/.avg.pct_of_peak_sustained_active/' | paste -sd, -)
  echo "extra metrics: ${metrics:-none}"
  for m_e in ${PROFILE_ME:-256}; do
    for config in ${configs//,/ }; do
      # The config runs first (--configs): its first two launches of its kernel are its W1 and W2.
      kernel=device_kernel
      [[ $config == block-* || $config == fused-w1-128x* ]] && kernel=block_gemm
      echo "== ncu: $config at M = 8192, m_e = $m_e (W1, then W2)"
      run timeout 200 ncu --kernel-name regex:$kernel --launch-count 2 ${metrics:+--metrics $metrics} \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section LaunchStats --section SourceCounters \
        $BIN/bench_gpu_experts /tmp/profile.json --case 8192 "$m_e" --quant block128 --configs "$config" \
        > "$OUT/ncu_${config}_me$m_e.txt" 2>&1
      echo "ncu rc=$?"
      grep -E '^  [a-z_:<>]|Duration|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|DRAM Throughput|Executed Ipc A|No Eligible|Warp Cycles Per Issued|Registers Per|Shared Memory Configuration Size|pct_of_peak' \
        "$OUT/ncu_${config}_me$m_e.txt" | cut -c1-150
      [[ $kernel == block_gemm ]] || continue
      # Where moekit's kernel waits: warp-state samples per SASS instruction of its W1, then its W2.
      for gemm in 1 2; do
        run timeout 200 ncu --kernel-name regex:$kernel --launch-skip $((gemm - 1)) --launch-count 1 \
          --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
          $BIN/bench_gpu_experts /tmp/profile.json --case 8192 "$m_e" --quant block128 --configs "$config" \
          > "$OUT/ncu_source_${config}_me${m_e}_w$gemm.csv" 2>/dev/null
        echo "-- W$gemm"
        python3 scripts/ncu_stalls.py "$OUT/ncu_source_${config}_me${m_e}_w$gemm.csv" \
          | tee "$OUT/ncu_stalls_${config}_me${m_e}_w$gemm.txt" | head -40
      done
    done
  done
fi

# The device tool brings back at most 8 files from $OUT, in name order: every log of the round in one
# archive whose name sorts first.
tar czf "/tmp/00-round.tgz" -C "$OUT" . && mv /tmp/00-round.tgz "$OUT/00-round.tgz" && echo "== logs: $OUT/00-round.tgz"
