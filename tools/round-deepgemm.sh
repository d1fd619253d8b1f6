#!/usr/bin/env bash
# The prefill round with DeepGEMM beside moekit, in one device call (issue 55): moekit builds in the
# background while DeepGEMM builds, runs its own tests and its benchmark (the team's anchor harness
# as extended on 2026-12-06 with variant F and DG_BENCH_ARGS: ../shared/anchors/deepgemm/ does not
# have them; the extended copy lives with DeepGEMM's sources in the ignored .peer-src/, DG_SCRIPTS =
# the harness, DG_SRC = the sources laid out as its README says), then moekit's
# rates and the layer (tools/round-rates.sh), the GPU alone each time. Results in $OUT: DeepGEMM's
# deepgemm_new.{txt,json}, moekit's rates.{log,json} and layer_*.json, everything else in 00-round.tgz.
#   run(command='bash tools/round-deepgemm.sh', carry=[".gpusrc/deps.tar.xz", ".peer-src"])
# VARIANTS picks the harness's DeepGEMM builds (F: its setup.py build run with the compiler's
# libstdc++ preloaded, the one that runs on the GPU image; docs/PERF.md).
set -uo pipefail
cd "$(dirname "$0")/.."
FINAL=${OUT:-$PWD/gpu-out}; OUT=$FINAL/r; mkdir -p "$OUT"
DG_SRC=${DG_SRC:-$PWD/.peer-src/DG-new} DG_SCRIPTS=${DG_SCRIPTS:-$PWD/.peer-src/scripts}
budget=${ROUND_BUDGET_S:-570}
t0=$SECONDS
(bash scripts/gpu-build.sh --jobs 10 --targets "bench_gpu_experts moekit" > "$OUT/moekit-build.log" 2>&1
 echo "moekit build rc=$? at $((SECONDS - t0)) s" >> "$OUT/moekit-build.log") &
bpid=$!
mkdir -p "$OUT/dg"
DG_BENCH_ARGS="--ms 8,64,256,512,1024" DG_SRC=$DG_SRC DG_SCRIPTS=$DG_SCRIPTS VARIANTS="${VARIANTS:-F}" OUT=$OUT/dg \
  timeout 430 bash "$DG_SCRIPTS/run.sh" > /dev/null 2>&1
echo "deepgemm rc=$? at $((SECONDS - t0)) s"
grep -E "build . rc|own tests|benchmarked" "$OUT/dg/run.log" | tail -10
wait $bpid; tail -3 "$OUT/moekit-build.log"
left=$((budget - (SECONDS - t0)))
if grep -q "moekit build rc=0" "$OUT/moekit-build.log"; then
  echo "moekit rates with ${left} s left"
  ((left > 60)) && OUT=$OUT timeout $left bash tools/round-rates.sh
else
  echo "moekit did not build: no rates (build.log in 00-round.tgz)"
fi
echo "total $((SECONDS - t0)) s"
cp "$OUT"/dg/deepgemm_new.txt "$OUT"/dg/deepgemm_new.json "$OUT"/rates.log "$OUT"/rates.json "$OUT"/layer_*.json "$FINAL"/ 2>/dev/null
tar czf "$FINAL/00-round.tgz" -C "$OUT" . && rm -rf "$OUT"
head -40 "$FINAL/deepgemm_new.txt" 2>/dev/null
