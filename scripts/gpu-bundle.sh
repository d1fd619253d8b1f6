#!/usr/bin/env bash
# Builds the GPU test and benchmark binaries HERE (the GPU machine has none of the Debian dev
# packages) into .gpu/, with the one shared library they need that the GPU image lacks (libfmt) and
# the commit they were built from, and the Python package built for the GPU machine's Python 3.12.
# Then: device run with carry [".gpu"] and
#   bash scripts/gpu-check.sh
# BUNDLE=cpp builds the C++ binaries of the one build only (its CLI, MPI linked, serves as both
# moekit and moekit-mpi): no Python package, minutes instead of the three CUDA builds.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
# One build (CUDA, NCCL, MPI): the tests and benchmarks link no MPI; the CLI does (for `mpirun -np 2
# moekit-mpi run --device cuda ...`; the GPU image has Open MPI 4.1); an MPI-free CLI for the rest.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
targets=(test_batched_experts test_fp8_device test_activation_kernels test_backend_ops test_layer_devices
  test_layer_multi_gpu test_runtime test_redundant_experts bench_gpu_experts bench_weight_stream moekit)
cmake --build build -j "$(nproc)" --target "${targets[@]}"
rm -rf .gpu && mkdir -p .gpu/lib
cp build/tests/cuda/test_batched_experts build/tests/cuda/test_fp8_device build/tests/cuda/test_activation_kernels \
  build/tests/test_backend_ops build/tests/test_layer_devices build/tests/test_runtime \
  build/tests/test_redundant_experts build/tests/test_layer_multi_gpu build/bench/cuda/bench_gpu_experts \
  build/bench/cuda/bench_weight_stream .gpu/
cp build/src/moekit .gpu/moekit-mpi
cp -L /usr/lib/x86_64-linux-gnu/libfmt.so.9 .gpu/lib/
finish() {
  { git rev-parse HEAD; git status --porcelain | grep -q . && echo "(with uncommitted changes)" || true; } > .gpu/COMMIT
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  du -sh .gpu
}
if [[ ${BUNDLE:-all} == cpp ]]; then
  cp build/src/moekit .gpu/moekit
  finish
  exit 0
fi
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=ON -DMOEKIT_MPI=OFF >/dev/null
cmake --build build-gpu -j "$(nproc)" --target moekit
cp build-gpu/src/moekit .gpu/
# The Python package for the GPU machine's Python 3.12 (torch there): CUDA compiled in, MPI off.
py=${MOEKIT_GPU_PYTHON:-}
for c in /root/.pyenv/versions/3.12*/bin/python python3.12; do
  [[ -z $py ]] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && py=$c
done
[[ -n $py ]] || { echo "gpu-bundle: no Python 3.12 here (the GPU machine's); set MOEKIT_GPU_PYTHON" >&2; exit 1; }
"$py" -m pip install -q nanobind==2.9.2 numpy
cmake -S . -B build-py312 -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=ON -DMOEKIT_MPI=OFF -DMOEKIT_PYTHON=ON \
  -DPython_EXECUTABLE="$py" >/dev/null
cmake --build build-py312 -j "$(nproc)" --target _moekit
mkdir -p .gpu/python && cp -r build-py312/python/moekit .gpu/python/
# transformers (the version install-deps.sh pins) and its dependencies for Python 3.12, for the
# parity tests on the GPU (gpu-check.sh parity): the GPU image has torch and numpy, not this version.
mkdir -p .gpu/wheels
"$py" -m pip download -q "transformers==5.24.0" pytest --python-version 3.12 --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .gpu/wheels
rm -f .gpu/wheels/numpy-*.whl
finish
