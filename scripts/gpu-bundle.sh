#!/usr/bin/env bash
# Builds the GPU round's binaries HERE (the GPU machine has none of the Debian dev packages) into
# .gpu/: the tests, the benchmarks, the CLI (MPI linked: `moekit` alone, `mpirun -np 2 moekit-mpi`
# for ranks on GPUs; the GPU image has Open MPI 4.1) and the Python package for the GPU machine's
# Python 3.12, all from ONE build (build-gpu/: each CUDA file compiled once), with the one shared
# library the GPU image lacks (libfmt) and the commit they were built from. Then: device run with
# the bundle carried, and `bash scripts/gpu-check.sh`.
# BUNDLE=cpp leaves out the Python package and the transformers wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
py=${MOEKIT_GPU_PYTHON:-}
for c in /root/.pyenv/versions/3.12*/bin/python python3.12; do
  [[ -z $py ]] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && py=$c
done
[[ -n $py ]] || { echo "gpu-bundle: no Python 3.12 here (the GPU machine's); set MOEKIT_GPU_PYTHON" >&2; exit 1; }
"$py" -m pip install -q nanobind==2.9.2 numpy
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=ON -DMOEKIT_PYTHON=ON \
  -DPython_EXECUTABLE="$py" >/dev/null
targets=(test_batched_experts test_fp8_device test_activation_kernels test_backend_ops test_layer_devices
  test_layer_multi_gpu test_runtime test_redundant_experts bench_gpu_experts bench_weight_stream moekit)
[[ ${BUNDLE:-all} == cpp ]] || targets+=(_moekit)
cmake --build build-gpu -j "$(nproc)" --target "${targets[@]}"
rm -rf .gpu && mkdir -p .gpu/lib
cp build-gpu/tests/cuda/test_batched_experts build-gpu/tests/cuda/test_fp8_device \
  build-gpu/tests/cuda/test_activation_kernels build-gpu/tests/test_backend_ops build-gpu/tests/test_layer_devices \
  build-gpu/tests/test_runtime build-gpu/tests/test_redundant_experts build-gpu/tests/test_layer_multi_gpu \
  build-gpu/bench/cuda/bench_gpu_experts build-gpu/bench/cuda/bench_weight_stream build-gpu/src/moekit .gpu/
ln -s moekit .gpu/moekit-mpi
cp -L /usr/lib/x86_64-linux-gnu/libfmt.so.9 .gpu/lib/
if [[ ${BUNDLE:-all} != cpp ]]; then
  mkdir -p .gpu/python && cp -r build-gpu/python/moekit .gpu/python/
  # transformers (the version install-deps.sh pins) and its dependencies for Python 3.12, for the
  # parity tests on the GPU (gpu-check.sh python): the GPU image has torch and numpy, not this version.
  mkdir -p .gpu/wheels
  "$py" -m pip download -q "transformers==5.24.0" pytest --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/wheels
  rm -f .gpu/wheels/numpy-*.whl
fi
{ git rev-parse HEAD; git status --porcelain | grep -q . && echo "(with uncommitted changes)" || true; } > .gpu/COMMIT
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
du -sh .gpu
