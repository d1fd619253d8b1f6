#!/usr/bin/env bash
# Builds moekit ON the GPU machine (all of its cores) from the carried source tree and .gpusrc/
# (scripts/gpu-pack.sh), stages the binaries in .gpu/ where scripts/gpu-check.sh and
# tools/gpu-experiments.sh read them, then runs the asked-for commands, timing each step. One device
# call is one experiment: edit here, then
#   run(command='bash scripts/gpu-build.sh --targets "bench_gpu_experts" "bash scripts/gpu-check.sh experts"',
#       carry=[".gpusrc"])
# Options: --targets "t1 t2 ..." (default: everything gpu-check.sh runs; `all` for every target),
# --python (the Python module too; implied by the default targets), --jobs N (default: nproc).
# build-gpu/ stays on a warm machine between calls, so a second call rebuilds only what changed.
# Timings of every step: $OUT/gpu-build.txt, with the tree's fingerprint (the device copy's git HEAD
# is not the tree's): `bash scripts/gpu-build.sh --fingerprint` here prints the same for this tree.
set -uo pipefail
cd "$(dirname "$0")/.."
# A fingerprint of the sources the build reads: every file under them (no git: the device's copy of
# the repository's index may be older than its tree), the same here and there for the same files.
fingerprint() {
  find CMakeLists.txt pyproject.toml cmake include src tests bench python models -type f ! -path '*/__pycache__/*' \
    ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-12
}
[[ ${1:-} == --fingerprint ]] && { fingerprint; exit 0; }

OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

# The binaries scripts/gpu-check.sh runs, in its .gpu/ layout.
gpu_check_targets=(test_batched_experts test_fp8_device test_activation_kernels test_grouped_gemm_sixteen_bit test_backend_ops test_layer_devices
  test_layer_multi_gpu test_runtime test_redundant_experts bench_gpu_experts bench_weight_stream bench_gemm_sixteen_bit moekit _moekit)
targets=("${gpu_check_targets[@]}")
jobs=$(nproc)
commands=()
while (($#)); do
  case $1 in
    --targets) read -r -a targets <<< "$2"; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    --python) targets+=(_moekit); shift ;;
    --) shift; commands+=("$@"); break ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    -*) echo "gpu-build: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) commands+=("$1"); shift ;;
  esac
done

log="$OUT/gpu-build.txt"
t_start=$SECONDS
step() { printf '%-34s %6d s  %s\n' "$1" "$2" "${3:-}" | tee -a "$log"; }
{ echo "gpu-build on $(hostname), $(nproc) cores, $(date -u +%FT%TZ)";
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null;
  echo "tree fingerprint $(fingerprint) (scripts/gpu-build.sh --fingerprint on a checkout prints its own)"; } \
  | tee "$log"

# --- Dependencies: unpacked once per machine (a warm machine keeps /tmp) -------------------------
deps=/tmp/moekit-deps
[[ -f .gpusrc/deps.tar.xz ]] || { echo "gpu-build: .gpusrc/deps.tar.xz missing: run scripts/gpu-pack.sh here and carry .gpusrc" >&2; exit 2; }
t=$SECONDS
if ! cmp -s .gpusrc/deps.tar.xz "$deps/deps.tar.xz" 2>/dev/null; then
  rm -rf "$deps" && mkdir -p "$deps" && xz -dc .gpusrc/deps.tar.xz | tar -C "$deps" -xf - && cp .gpusrc/deps.tar.xz "$deps/"
fi
if ! cmake --version 2>/dev/null | grep -qE 'version (3\.(2[5-9]|3[0-9])|[4-9]\.)' || ! command -v ninja >/dev/null; then
  ls .gpusrc/wheels/*.whl >/dev/null 2>&1 || { echo "gpu-build: no cmake >= 3.25 or ninja here: scripts/gpu-pack.sh --build-tools" >&2; exit 2; }
  python3 -m pip install -q --no-index --no-deps --target "$deps/tools" .gpusrc/wheels/*.whl
  export PATH="$deps/tools/bin:$PATH" PYTHONPATH="$deps/tools${PYTHONPATH:+:$PYTHONPATH}"
fi
step "dependencies" $((SECONDS - t)) "$(cmake --version | head -1), ninja $(ninja --version)"

# --- Configure and build ---------------------------------------------------------------------------
python_module=OFF
[[ " ${targets[*]} " == *" _moekit "* || " ${targets[*]} " == *" all "* ]] && python_module=ON
t=$SECONDS
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=ON -DMOEKIT_TESTS=ON -DMOEKIT_BENCH=ON \
  -DMOEKIT_PYTHON=$python_module -DCUTLASS_DIR="$deps/cutlass" -DCMAKE_PREFIX_PATH="$deps/prefix" \
  -DPython_EXECUTABLE="$(command -v python3)" > "$OUT/configure.log" 2>&1
rc=$?
step "configure" $((SECONDS - t)) "rc $rc"
((rc == 0)) || { tail -30 "$OUT/configure.log"; exit 3; }
t=$SECONDS
build_targets=("${targets[@]}")
[[ " ${targets[*]} " == *" all "* ]] && build_targets=()
cmake --build build-gpu -j "$jobs" ${build_targets:+--target "${build_targets[@]}"} > "$OUT/build.log" 2>&1
rc=$?
step "build (${#build_targets[@]} targets, -j $jobs)" $((SECONDS - t)) "rc $rc, $(grep -c '^\[' "$OUT/build.log") steps"
((rc == 0)) || { grep -E 'error|Error' "$OUT/build.log" | head -30; exit 4; }

# --- Stage .gpu/ (the layout gpu-check.sh reads) -------------------------------------------------
rm -rf .gpu && mkdir -p .gpu/lib
for f in build-gpu/tests/cuda/test_batched_experts build-gpu/tests/cuda/test_fp8_device build-gpu/tests/cuda/test_activation_kernels \
  build-gpu/tests/cuda/test_grouped_gemm_sixteen_bit build-gpu/bench/cuda/bench_gemm_sixteen_bit \
  build-gpu/tests/test_backend_ops build-gpu/tests/test_layer_devices build-gpu/tests/test_runtime \
  build-gpu/tests/test_redundant_experts build-gpu/tests/test_layer_multi_gpu build-gpu/bench/cuda/bench_gpu_experts \
  build-gpu/bench/cuda/bench_weight_stream build-gpu/src/moekit; do
  [[ -x $f ]] && ln -s "$PWD/$f" .gpu/
done
[[ -e .gpu/moekit ]] && ln -s moekit .gpu/moekit-mpi
cp -L "$deps"/prefix/lib/x86_64-linux-gnu/libfmt.so.* .gpu/lib/ 2>/dev/null
[[ -d build-gpu/python/moekit ]] && mkdir -p .gpu/python && ln -s "$PWD/build-gpu/python/moekit" .gpu/python/moekit
[[ -d .gpusrc/python-wheels ]] && ln -s "$PWD/.gpusrc/python-wheels" .gpu/wheels
echo "tree fingerprint $(fingerprint)" > .gpu/COMMIT
step "built and staged" $((SECONDS - t_start))

# --- The asked-for commands ----------------------------------------------------------------------
status=0
for c in "${commands[@]}"; do
  t=$SECONDS
  echo "== $c"
  OUT=$OUT bash -c "$c"
  rc=$?
  status=$((status | rc))
  step "command rc $rc" $((SECONDS - t)) "$c"
done
step "total" $((SECONDS - t_start))
exit $status
