#!/usr/bin/env bash
# Experiments on the GPU machine (not a maintainer's round: that is scripts/gpu-check.sh), from the
# binaries scripts/gpu-build.sh built there into .gpu/. Logs in $OUT; NVLink multicast stays off.
#   fused:   block128's experts (the fused W1 and the unfused configs) against the CPU, memcheck on
#            the fused plan, the experts benchmark per-token and block128.
#   graphs:  the captured step (graph tests, memcheck), the experts benchmark eager and replayed,
#            `moekit bench layer` with and without --fuse-w1, the Python ops on the GPU.
#   routing: `moekit bench layer` (block128) under the model's routing and uniform routing, fused and
#            not, alternated twice.
#   decode:  ncu's time of every kernel of one T = 1 step, the layer at T = 1-128 alternated twice,
#            memcheck on the row map and scatter; each against $BIN/moekit-base (an older build) when
#            present.
#   configs: bench_gpu_experts on the configs $CONFIGS (names of plan/gemm_config.h) at $CASES
#            ("M:m_e ..."), $QUANT, E_local $EXPERTS, $ROUNDS rounds; GRAPH_PARTS=1, BASELINE=config;
#            the SM clock and power meanwhile in configs_clocks.csv.
#   profile: ncu on the block128 GEMMs of $PROFILE_CONFIGS at M = 8192, m_e in $PROFILE_ME: speed of
#            light, warp states, source counters (tools/ncu_stalls.py), SASS, the TMA weight stream.
#   ep-layer: (2+ GPUs) the whole layer expert-parallel under graph replay from Python (torchrun).
#   layer:   the layer on every device and the backend-ops harness alone.
# `bash tools/gpu-experiments.sh <part>`.
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
  [[ -n ${CONFIGS:-} ]] || { echo "gpu-experiments.sh configs: set CONFIGS to config names of plan/gemm_config.h, e.g. CONFIGS=pingpong-64x256,cooperative-128x128" >&2; exit 2; }
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
        python3 tools/ncu_stalls.py "$OUT/ncu_source_${config}_me${m_e}_w$gemm.csv" \
          | tee "$OUT/ncu_stalls_${config}_me${m_e}_w$gemm.txt" | head -40
      done
    done
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

if [[ $part == layer ]]; then
  echo "== the layer on every device (test_layer_devices) and the backend ops"
  run timeout 400 $BIN/test_layer_devices > "$OUT/layer_tests.log" 2>&1
  layer_rc=$?
  run timeout 150 $BIN/test_backend_ops --gtest_brief=1 >> "$OUT/layer_tests.log" 2>&1
  ops_rc=$?
  grep -E 'FAILED|PASSED|SKIPPED|Failure|tests ran' "$OUT/layer_tests.log" | tail -30
  echo "layer rc=$layer_rc backend_ops rc=$ops_rc" | tee -a "$OUT/machine.txt"
fi


# The device tool brings back at most 8 files from $OUT, in name order: every log of the round in one
# archive whose name sorts first.
tar czf "/tmp/00-round.tgz" -C "$OUT" . && mv /tmp/00-round.tgz "$OUT/00-round.tgz" && echo "== logs: $OUT/00-round.tgz"
