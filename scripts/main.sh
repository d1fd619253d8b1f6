#!/usr/bin/env bash
# The main job: installs dependencies, builds, prints the workspace plan of the upstream report's
# case, then runs a DeepSeek-V3-shaped MoE layer (full K = 7168 and I = 2048; 32 of its 256 experts
# to keep the run short) over 4 ranks with the float64 check (4 ranks run on the CPU backend; one GPU
# runs dp = 1: see the README).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "${MOEKIT_JOBS:-$(nproc)}" --target moekit
./build/src/moekit plan --model deepseek-v3 --dp 32 --ep 32 --max-tokens-per-rank 256 --local-experts 16 \
  --gpu-memory 141GiB
./build/src/moekit run --model deepseek-v3 --num-experts 32 --dp 4 --tokens-per-rank 8 --steps 2 --check
