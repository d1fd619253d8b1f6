// Seeded synthetic inputs of a layer, the one place they are made: the experts' weights (FP8 or bf16), the
// routing bias, the tokens and router logits. Every value is a function of (seed, purpose, global
// index), so any spread of experts and tokens over ranks draws the same numbers. Nothing is ever
// downloaded: moekit runs on random, seeded weights.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

#include "cpu/thread_pool.h"
#include "moekit/layer.h"
#include "moekit/memory.h"
#include "moekit/model.h"
#include "moekit/placement.h"
#include "moekit/problem.h"
#include "moekit/weights.h"
#include "synthetic/random.h"

namespace moekit::synthetic {

// A small model for tests and examples (K = 256, I = 128, 16 experts, top-4, silu): softmax
// routing, or DeepSeek-style grouped sigmoid routing with a correction bias (4 groups, top-2 groups,
// routed scaling 2.5) and one shared expert of I = 128.
ModelConfig tiny_model(bool grouped);

using moekit::HostExpertWeights;

// Experts [first_expert, first_expert + problem.E_local): normal(0, 1/sqrt(K)) W1 and normal(0,
// 1/sqrt(I)) W2, quantized with problem.quant (or rounded to bf16 for the bf16 recipe); with
// problem.expert_bias, 0.1 * normal biases.
HostExpertWeights make_expert_weights(const MoeProblem& problem, std::int64_t first_expert, std::uint64_t seed,
                                      cpu::ThreadPool& pool);
// Redundant experts: slots [first_slot, first_slot + problem.E_local) of `placement`, each with the
// weights make_expert_weights draws for its logical expert (first_expert is -1: not a range).
HostExpertWeights make_slot_weights(const MoeProblem& problem, const ExpertPlacement& placement,
                                    std::int64_t first_slot, std::uint64_t seed, cpu::ThreadPool& pool);

// Every global expert on demand (generated once, kept), or views of weights already made.
class ExpertBank {
 public:
  ExpertBank(const MoeProblem& problem, std::uint64_t seed, cpu::ThreadPool& pool);
  void adopt(const HostExpertWeights& weights);  // must outlive the bank
  ExpertWeightsView expert(std::int64_t global_expert);

 private:
  MoeProblem one_;  // E_local = 1
  std::uint64_t seed_;
  cpu::ThreadPool& pool_;
  std::map<std::int64_t, ExpertWeightsView> views_;
  std::map<std::int64_t, HostExpertWeights> owned_;
};

// The shared experts of a step (shared_experts_problem), drawn as the routed experts are from the
// global expert index kSharedExpertIndex, and the model's shared_expert_gate: normal(0, 1/sqrt(K))
// bf16, so sigmoid(hidden . gate) spreads over (0, 1). Empty (no problem) when the step has none.
inline constexpr std::int64_t kSharedExpertIndex = std::int64_t{1} << 40;
struct HostSharedExperts {
  std::optional<MoeProblem> problem;
  HostExpertWeights experts;
  std::vector<std::uint16_t> gate;  // (K) bf16 when the model gates them; else empty
  // Into a layer's weights (on the host, or on the device of `copies`).
  void set(LayerWeights& weights) const;
  void set(LayerWeights& weights, DeviceCopies& copies) const;
};
HostSharedExperts make_shared_experts(const ModelConfig& model, const MoeProblem& routed, std::uint64_t seed,
                                      cpu::ThreadPool& pool);

// e_score_correction_bias of E experts: 0.1 * normal.
std::vector<float> make_routing_bias(std::int64_t E, std::uint64_t seed);

struct Tokens {
  std::vector<std::uint16_t> hidden;  // (count, K) bf16, normal(0, 1)
  std::vector<float> logits;          // (count, E), 2 * normal(0, 1)
};
// Global tokens [first_token, first_token + count).
Tokens make_tokens(std::int64_t K, std::int64_t E, std::int64_t first_token, std::int64_t count, std::uint64_t seed);

}  // namespace moekit::synthetic
