#!/usr/bin/env bash
# The main job: installs dependencies, builds, prints the workspace plan of the upstream report's
# case, then runs a DeepSeek-V3-shaped MoE layer (full K = 7168 and I = 2048; 32 of its 256 experts
# to keep the run short) over 4 ranks with the float64 check. With a GPU present the CUDA backend is
# compiled and one GPU runs the layer; without one only the CPU backend is compiled (the test
# command, scripts/test.sh, compiles the CUDA code either way).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
if nvidia-smi -L >/dev/null 2>&1; then cuda=AUTO; else cuda=OFF; fi
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMOEKIT_CUDA=$cuda >/dev/null
cmake --build build -j "${MOEKIT_JOBS:-$(nproc)}" --target moekit
# DeepSeek-V3 runs its checkpoint's recipe, block128 FP8 (--quant auto; bf16 checkpoints run bf16).
./build/src/moekit plan --model deepseek-v3 --dp 32 --ep 32 --max-tokens-per-rank 256 --local-experts 16 \
  --gpu-memory 141GiB
if [[ $cuda == AUTO ]]; then
  ./build/src/moekit run --model deepseek-v3 --num-experts 32 --dp 1 --tokens-per-rank 32 --steps 2 --check
else
  ./build/src/moekit run --model deepseek-v3 --num-experts 32 --dp 4 --tokens-per-rank 8 --steps 2 --check
fi
