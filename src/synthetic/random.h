// Seeded, reproducible random values for weights, tokens and router logits: splitmix64 streams,
// one per (seed, purpose, index), so any layout of ranks draws the same global values.
#pragma once

#include <cstdint>

namespace moekit::synthetic {

// What a stream is for: weights, tokens and logits stay independent of each other. The values are
// part of the reproducibility contract (outputs are compared across versions): never renumber.
enum class Purpose : std::uint64_t {
  kW1 = 1,
  kW2 = 2,
  kRoutingBias = 3,
  kHidden = 4,
  kLogits = 5,
  kExpertTokens = 6,  // tests: tokens written straight into the batched experts' input
  kExpertBias = 8,    // gpt-oss style expert biases
  kExpertCounts = 7,  // tests: expert_num_tokens patterns
  kSharedGate = 9,    // Qwen2-MoE style shared_expert_gate
};

struct SplitMix {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Bell-shaped, unit variance: Irwin-Hall sum of 4 uniforms. Random weights and tokens need a
  // bell shape and reproducibility, not a perfect Gaussian.
  float normal() {
    const std::uint64_t r = next();
    float s = 0;
    for (int i = 0; i < 4; ++i) s += static_cast<float>((r >> (16 * i)) & 0xFFFF) * (1.0f / 65536.0f);
    return (s - 2.0f) * 1.7320508f;  // Var(sum of 4 U(0,1)) = 1/3
  }
};

// The stream for (seed, purpose, index).
inline SplitMix stream(std::uint64_t seed, Purpose purpose, std::uint64_t index) {
  SplitMix m{seed ^ (static_cast<std::uint64_t>(purpose) * 0xD1B54A32D192ED03ull)};
  m.state ^= m.next() + index * 0x9E3779B97F4A7C15ull;
  return m;
}

}  // namespace moekit::synthetic
