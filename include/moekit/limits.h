// moekit's limits on untrusted input, in one place: every size a config.json, a checkpoint's index,
// a safetensors header or a command-line flag can give is bounded here, and every product of them
// is overflow-checked before it is used (checked_mul). The bytes a command will allocate are computed
// first and refused past the machine's memory (require_memory). The config reader, the checkpoint
// loader, the planner and the CLI all read these; docs/FEATURES.md lists them.
#pragma once

#include <cstdint>
#include <string_view>

namespace moekit::limits {

// ---- A model (config.json). Generous for every published MoE model, small enough that no product
// of them overflows 64 bits before the memory check refuses it.
inline constexpr std::int64_t kMaxHiddenSize = 1 << 17;              // K (DeepSeek-V3: 7168)
inline constexpr std::int64_t kMaxIntermediateSize = 1 << 17;        // I (DeepSeek-V3: 2048; Mixtral-8x22B: 16384)
inline constexpr std::int64_t kMaxSharedIntermediateSize = 1 << 20;  // the shared experts' width (n_shared x I)
inline constexpr std::int64_t kMaxExperts = 1 << 14;                 // E (Qwen3-Next: 512, Kimi-K2: 384)
inline constexpr std::int64_t kMaxTopk = 64;                         // num_experts_per_tok (DeepSeek-V3: 8)
inline constexpr std::int64_t kMaxLayers = 1 << 12;    // num_hidden_layers, and every layer index (DeepSeek-V3: 61)
inline constexpr std::int64_t kMaxSlotsPerExpert = 4;  // redundant experts: E_local * ep <= 4 E (DeepSeek: 1.125-2)
// swigluoai's parameters (moekit/types.h: SwigluOaiParams), each finite and in (0, bound]: the clamp
// within fp16's range (gpt-oss: 7); alpha, the gate's scale inside the sigmoid (gpt-oss: 1.702, the
// constant of x * sigmoid(1.702 x) ~ gelu(x)), far past which sigmoid(alpha * g) is a step for all
// but the smallest gates: a broken config, not a model.
inline constexpr double kMaxSwigluLimit = 65504.0;
inline constexpr double kMaxSwigluAlpha = 1024.0;

// ---- Files. A file is read only when it is a regular file (a symlink to one is followed) and no
// larger than its limit; JSON nests no deeper than kMaxJsonDepth and names no key twice.
inline constexpr std::int64_t kMaxConfigBytes = 16 << 20;     // config.json (DeepSeek-V3's: 1.7 KB)
inline constexpr std::int64_t kMaxIndexBytes = 64 << 20;      // model.safetensors.index.json (DeepSeek-V3's: 8.9 MB)
inline constexpr std::int64_t kMaxHeaderBytes = 100'000'000;  // a safetensors header (the format's own reader's)
inline constexpr int kMaxJsonDepth = 64;                      // config.json and the index (they nest 2-5)
inline constexpr int kMaxTensorRank = 32;                     // dimensions of one safetensors tensor

// ---- The command line and a run.
inline constexpr std::int64_t kMaxRanks = 1024;             // --dp, --ep, --ranks
inline constexpr std::int64_t kMaxInProcessRanks = 256;     // --dp as threads of one process
inline constexpr std::int64_t kMaxTokensPerRank = 1 << 20;  // --tokens-per-rank, --max-tokens-per-rank, --tokens
inline constexpr int kMaxThreads = 1024;                    // --threads, and a ThreadPool
inline constexpr std::int64_t kMaxSteps = 1 << 20;          // --steps, --iters

// a * b, or a moekit::Error naming `what` and both factors when it overflows 64 bits.
std::int64_t checked_mul(std::int64_t a, std::int64_t b, std::string_view what);
std::int64_t checked_add(std::int64_t a, std::int64_t b, std::string_view what);

// The bytes this process may allocate on the host: the machine's memory, or less where the process
// is limited (RLIMIT_AS, RLIMIT_DATA, the cgroup's memory.max).
std::int64_t host_memory_bytes();
// Raises moekit::Error when `need` bytes of `what` exceed `have` bytes of `where` (e.g. "host
// memory", "--gpu-memory"), naming both figures and `fix`.
void require_memory(std::int64_t need, std::int64_t have, std::string_view what, std::string_view where,
                    std::string_view fix);

}  // namespace moekit::limits
