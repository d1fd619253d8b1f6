#!/usr/bin/env bash
# A/B of a code change, built on the GPU machine: B is the carried tree, A the same tree with PATCH
# reversed (`git diff BASE -- files > PATCH` here, PATCH carried as an untracked file). Both are built
# by scripts/gpu-build.sh (the second build recompiles only what PATCH touches), staged in .gpu-b/ and
# .gpu-a/, then tools/ab-env.sh compares them: B's tests and memcheck, the rates and the layer A/B/A/B.
#   run(command='bash tools/ab-build.sh ab.patch ["M:m_e ..."] [-- extra commands on .gpu-b]', carry=[".gpusrc"])
# Extra commands run after the build of B with .gpu holding B (e.g. another GPU test).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
patch_file=$1; shift
cases=${1:-"8192:512 8192:1024 8192:300"}; (($#)) && shift
[[ ${1:-} == -- ]] && shift
targets="test_batched_experts bench_gpu_experts moekit ${AB_TARGETS:-}"
[[ -f $patch_file ]] || { echo "ab-build: no patch $patch_file" >&2; exit 2; }
t0=$SECONDS
bash scripts/gpu-build.sh --targets "$targets" "$@" > "$OUT/build_b.log" 2>&1
echo "build B (the tree) + its commands rc=$? $((SECONDS - t0)) s"; tail -5 "$OUT/gpu-build.txt"
rm -rf .gpu-b && cp -rL .gpu .gpu-b  # .gpu holds links into build-gpu: copy the files
patch -R -p1 --no-backup-if-mismatch < "$patch_file" > /dev/null || { echo "ab-build: the patch does not reverse" >&2; exit 2; }
bash scripts/gpu-build.sh --targets "bench_gpu_experts moekit" > "$OUT/build_a.log" 2>&1
echo "build A (PATCH reversed) rc=$? $((SECONDS - t0)) s"; tail -2 "$OUT/gpu-build.txt"
patch -p1 --no-backup-if-mismatch < "$patch_file" > /dev/null
rm -rf .gpu-a && cp -rL .gpu .gpu-a
BIN_A=.gpu-a BIN_B=.gpu-b bash tools/ab-env.sh MOEKIT_AB=1 "$cases"
echo "ab-build total $((SECONDS - t0)) s"
