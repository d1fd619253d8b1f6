// Synthetic weights, bias and tokens (synthetic/synthetic.h).
#include "synthetic/synthetic.h"

#include <cmath>

#include "cpu/quant.h"
#include "moekit/check.h"
#include "moekit/limits.h"
#include "moekit/recipe.h"

namespace moekit::synthetic {
namespace {

void fill_normal(std::vector<float>& v, SplitMix rng, float stddev) {
  for (auto& x : v) x = rng.normal() * stddev;
}

}  // namespace

ModelConfig tiny_model(bool grouped) {
  ModelConfig m;
  m.name = grouped ? "tiny-grouped" : "tiny-softmax";
  m.model_type = "test";
  m.hidden_size = 256;
  m.moe_intermediate_size = 128;
  m.num_experts = 16;
  m.topk = 4;
  m.num_layers = m.num_moe_layers = 1;
  m.activation = Activation::kSilu;
  if (grouped) {
    m.scoring = Scoring::kSigmoid;
    m.has_score_correction_bias = true;
    m.n_group = 4;
    m.topk_group = 2;
    m.renormalize_epsilon = 1e-20;
    m.routed_scaling_factor = 2.5;
    m.num_shared_experts = 1;  // DeepSeek-style: one shared expert of the routed experts' size
    m.shared_intermediate_size = m.moe_intermediate_size;
  }
  return m;
}

namespace {

// problem.E_local experts, local expert e drawn as global expert global(e).
template <class Global>
HostExpertWeights draw_experts(const MoeProblem& p, std::int64_t first_expert, const Global& global, std::uint64_t seed,
                               cpu::ThreadPool& pool) {
  // The bytes first (the threads' fp32 matrices too), against the host's memory: a problem of sizes
  // within the limits can still be past the machine.
  const std::int64_t need = limits::checked_add(
      expert_weight_bytes(p), limits::checked_mul(4 * p.N, p.K * pool.num_threads(), "the threads' fp32 matrices"),
      "synthetic weights");
  limits::require_memory(need, limits::host_memory_bytes(),
                         fmt::format("seeded synthetic weights of {} experts ({})", p.E_local, p.describe()),
                         "host memory", "use fewer experts (--num-experts) or more ranks");
  HostExpertWeights w;
  w.problem = p;
  w.first_expert = first_expert;
  const std::int64_t N = p.N, K = p.K, I = p.I();
  const std::int64_t s1 = numerics::weight_scale_count(p.quant, N, K), s2 = numerics::weight_scale_count(p.quant, K, I);
  const std::int64_t wb = dtype_size(recipe_info(p.quant).weight_dtype);  // FP8 codes 1 byte, bf16 2
  w.w1.resize(static_cast<std::size_t>(p.E_local * N * K * wb));
  w.w2.resize(static_cast<std::size_t>(p.E_local * K * I * wb));
  w.w1_scale.resize(static_cast<std::size_t>(p.E_local * s1));
  w.w2_scale.resize(static_cast<std::size_t>(p.E_local * s2));
  pool.parallel_for(p.E_local, [&](std::int64_t e0, std::int64_t e1) {
    std::vector<float> tmp;
    for (std::int64_t e = e0; e < e1; ++e) {
      const auto g = static_cast<std::uint64_t>(global(e));
      tmp.resize(static_cast<std::size_t>(N * K));
      fill_normal(tmp, stream(seed, Purpose::kW1, g), 1.0f / std::sqrt(static_cast<float>(K)));
      cpu::store_weight(p.quant, tmp.data(), N, K, w.w1.data() + e * N * K * wb, w.w1_scale.data() + e * s1);
      tmp.resize(static_cast<std::size_t>(K * I));
      fill_normal(tmp, stream(seed, Purpose::kW2, g), 1.0f / std::sqrt(static_cast<float>(I)));
      cpu::store_weight(p.quant, tmp.data(), K, I, w.w2.data() + e * K * I * wb, w.w2_scale.data() + e * s2);
    }
  });
  if (p.expert_bias) {
    w.w1_bias.resize(static_cast<std::size_t>(p.E_local * N));
    w.w2_bias.resize(static_cast<std::size_t>(p.E_local * K));
    for (std::int64_t e = 0; e < p.E_local; ++e) {
      const auto g = static_cast<std::uint64_t>(global(e));
      SplitMix r = stream(seed, Purpose::kExpertBias, g);
      for (std::int64_t i = 0; i < N; ++i) w.w1_bias[static_cast<std::size_t>(e * N + i)] = 0.1f * r.normal();
      for (std::int64_t i = 0; i < K; ++i) w.w2_bias[static_cast<std::size_t>(e * K + i)] = 0.1f * r.normal();
    }
  }
  return w;
}

}  // namespace

HostExpertWeights make_expert_weights(const MoeProblem& p, std::int64_t first_expert, std::uint64_t seed,
                                      cpu::ThreadPool& pool) {
  return draw_experts(
      p, first_expert, [first_expert](std::int64_t e) { return first_expert + e; }, seed, pool);
}

HostExpertWeights make_slot_weights(const MoeProblem& p, const ExpertPlacement& placement, std::int64_t first_slot,
                                    std::uint64_t seed, cpu::ThreadPool& pool) {
  MOEKIT_CHECK(first_slot >= 0 && first_slot + p.E_local <= placement.num_physical(),
               "make_slot_weights: slots [{}, {}) are not all in the placement's {} slots", first_slot,
               first_slot + p.E_local, placement.num_physical());
  const auto global = [&](std::int64_t e) {
    return static_cast<std::int64_t>(placement.physical_to_logical[static_cast<std::size_t>(first_slot + e)]);
  };
  return draw_experts(p, -1, global, seed, pool);
}

ExpertBank::ExpertBank(const MoeProblem& problem, std::uint64_t seed, cpu::ThreadPool& pool)
    : one_(problem), seed_(seed), pool_(pool) {
  one_.E_local = 1;
}

void ExpertBank::adopt(const HostExpertWeights& w) {
  MOEKIT_CHECK(w.first_expert >= 0, "ExpertBank: slot weights (first_expert -1) are not a range of experts to adopt");
  MOEKIT_CHECK(w.problem.N == one_.N && w.problem.K == one_.K && w.problem.quant == one_.quant,
               "ExpertBank: adopted weights (N = {}, K = {}) are not of this bank's problem (N = {}, K = {})",
               w.problem.N, w.problem.K, one_.N, one_.K);
  const ExpertWeightsView v = w.view();
  for (std::int64_t e = 0; e < v.E_local; ++e) views_[w.first_expert + e] = v.expert(e);
}

ExpertWeightsView ExpertBank::expert(std::int64_t g) {
  MOEKIT_CHECK(g >= 0 && g < one_.E, "ExpertBank: expert {} is outside [0, E = {})", g, one_.E);
  auto it = views_.find(g);
  if (it != views_.end()) return it->second;
  const auto& w = owned_.emplace(g, make_expert_weights(one_, g, seed_, pool_)).first->second;
  return views_[g] = w.view();
}

HostSharedExperts make_shared_experts(const ModelConfig& model, const MoeProblem& routed, std::uint64_t seed,
                                      cpu::ThreadPool& pool) {
  HostSharedExperts s;
  s.problem = shared_experts_problem(model, routed);
  if (!s.problem) return s;
  s.experts = make_expert_weights(*s.problem, kSharedExpertIndex, seed, pool);
  if (model.shared_expert_gate) {
    SplitMix r = stream(seed, Purpose::kSharedGate, 0);
    const float stddev = 1.0f / std::sqrt(static_cast<float>(routed.K));
    s.gate.resize(static_cast<std::size_t>(routed.K));
    for (auto& g : s.gate) g = numerics::bf16_encode(stddev * r.normal());
  }
  return s;
}

void HostSharedExperts::set(LayerWeights& weights) const {
  if (!problem) return;
  weights.shared_experts = experts.view();
  weights.shared_expert_gate = gate.empty() ? nullptr : gate.data();
}

void HostSharedExperts::set(LayerWeights& weights, DeviceCopies& copies) const {
  if (!problem) return;
  weights.shared_experts = experts.view(copies);
  weights.shared_expert_gate = gate.empty() ? nullptr : copies.put(gate, "shared_expert_gate");
}

std::vector<float> make_routing_bias(std::int64_t E, std::uint64_t seed) {
  std::vector<float> bias(static_cast<std::size_t>(E));
  SplitMix rng = stream(seed, Purpose::kRoutingBias, 0);
  for (auto& b : bias) b = 0.1f * rng.normal();
  return bias;
}

Tokens make_tokens(std::int64_t K, std::int64_t E, std::int64_t first_token, std::int64_t count, std::uint64_t seed) {
  MOEKIT_CHECK(count >= 0 && first_token >= 0, "make_tokens: first_token = {}, count = {}", first_token, count);
  Tokens t;
  t.hidden.resize(static_cast<std::size_t>(count * K));
  t.logits.resize(static_cast<std::size_t>(count * E));
  for (std::int64_t i = 0; i < count; ++i) {
    const auto g = static_cast<std::uint64_t>(first_token + i);
    SplitMix h = stream(seed, Purpose::kHidden, g), l = stream(seed, Purpose::kLogits, g);
    for (std::int64_t c = 0; c < K; ++c)
      t.hidden[static_cast<std::size_t>(i * K + c)] = numerics::bf16_encode(h.normal());
    for (std::int64_t e = 0; e < E; ++e) t.logits[static_cast<std::size_t>(i * E + e)] = 2.0f * l.normal();
  }
  return t;
}

}  // namespace moekit::synthetic
