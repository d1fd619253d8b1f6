#!/usr/bin/env bash
# The main job: installs dependencies, builds, and runs moekit's headline command on this machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "${MOEKIT_JOBS:-$(nproc)}" --target moekit
# The upstream report's case: DeepSeek-V3, DP 32, 16 local experts, 256 tokens per rank.
./build/src/moekit plan --model deepseek-v3 --dp 32 --ep 32 --max-tokens-per-rank 256 --local-experts 16 \
  --gpu-memory 141GiB
