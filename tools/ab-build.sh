#!/usr/bin/env bash
# A/B of a code change, built on the GPU machine: B is the carried tree, A the same tree with PATCH
# reversed (`git diff BASE -- files > PATCH` here, PATCH carried as an untracked file). A is built
# first, then B (the second build recompiles only what PATCH touches), staged in .gpu-a/ and .gpu-b/;
# then tools/ab-env.sh compares them: B's tests and memcheck, the rates and the layer A/B/A/B.
#   run(command='bash tools/ab-build.sh ab.patch ["M:m_e ..."] [-- extra commands on B]', carry=[".gpusrc"])
# Extra commands run after the build of B, with .gpu holding B (e.g. another GPU test).
# B last, so build-gpu/ ends built from the tree: the device's copy keeps the files' own times, and a
# later call on the warm machine would not rebuild a file whose A objects are newer than it (a round
# built A last once measured A's kernel under B's name).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
patch_file=$1; shift
cases="8192:512 8192:1024 8192:300"
if (($#)) && [[ $1 != -- ]]; then cases=$1; shift; fi
[[ ${1:-} == -- ]] && shift
targets="test_batched_experts bench_gpu_experts moekit ${AB_TARGETS:-}"
[[ -f $patch_file ]] || { echo "ab-build: no patch $patch_file" >&2; exit 2; }
t0=$SECONDS
mapfile -t touched < <(sed -n 's|^+++ b/||p' "$patch_file")
patch -R -p1 --no-backup-if-mismatch < "$patch_file" > /dev/null || { echo "ab-build: the patch does not reverse" >&2; exit 2; }
bash scripts/gpu-build.sh --targets "bench_gpu_experts moekit" > "$OUT/build_a.log" 2>&1
rc=$?
echo "build A (PATCH reversed) rc=$rc $((SECONDS - t0)) s"; tail -2 "$OUT/gpu-build.txt"; cp "$OUT/gpu-build.txt" "$OUT/gpu-build-a.txt"
((rc == 0)) || { patch -p1 --no-backup-if-mismatch < "$patch_file" > /dev/null; echo "ab-build: A did not build" >&2; exit 4; }
rm -rf .gpu-a && cp -rL .gpu .gpu-a  # .gpu holds links into build-gpu: copy the files
patch -p1 --no-backup-if-mismatch < "$patch_file" > /dev/null || { echo "ab-build: the patch does not re-apply" >&2; exit 2; }
touch "${touched[@]}"  # newer than A's objects
bash scripts/gpu-build.sh --targets "$targets" "$@" > "$OUT/build_b.log" 2>&1
rc=$?
echo "build B (the tree) + its commands rc=$rc $((SECONDS - t0)) s"; tail -5 "$OUT/gpu-build.txt"
# gpu-build.sh exits 4 when the build fails (.gpu then holds nothing new); another code is a command's.
((rc != 4)) || { echo "ab-build: B did not build" >&2; exit 4; }
rm -rf .gpu-b && cp -rL .gpu .gpu-b
BIN_A=.gpu-a BIN_B=.gpu-b bash tools/ab-env.sh MOEKIT_AB=1 "$cases"
echo "ab-build total $((SECONDS - t0)) s"
