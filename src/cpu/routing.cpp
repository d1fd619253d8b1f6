// Routing on the CPU: route() scores in fp32 (bit for bit what the GPU router computes), route_ref()
// in fp64; both share one templated selection so they differ only in the precision of the scores.
#include "cpu/routing.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "moekit/check.h"
#include "numerics/fp8.h"
#include "numerics/routing.h"

namespace moekit::cpu {
namespace {

// fp32 scores use the device-independent exp of numerics/routing.h (the GPU router computes the same
// bits); the float64 reference uses std::exp.
float exp_of(float x) {
  return numerics::exp_f32<numerics::HostMath>(x);
}
double exp_of(double x) {
  return std::exp(x);
}
float sigmoid_of(float x) {
  return numerics::sigmoid_f32<numerics::HostMath>(x);
}
double sigmoid_of(double x) {
  return 1.0 / (1.0 + std::exp(-x));
}

// Selection order: higher score first, equal scores to the lower expert index. Strict weak order,
// so std::partial_sort gives the same result as a full stable sort would.
template <typename T>
struct ByScore {
  const T* score;
  bool operator()(std::int32_t a, std::int32_t b) const { return score[a] != score[b] ? score[a] > score[b] : a < b; }
};

// Scratch reused across tokens: one allocation per call, not per token.
template <typename T>
struct Scratch {
  std::vector<T> score;   // p (softmax) or s (sigmoid): the weights' source
  std::vector<T> choice;  // what selection ranks: s, or c = s + bias with a correction bias
  std::vector<T> group;   // group scores
  std::vector<std::int32_t> idx;
  std::vector<std::int32_t> group_idx;
};

template <typename T>
void route_token(const RoutingConfig& cfg, const float* x, std::int64_t t, const float* bias, Scratch<T>& w,
                 std::int32_t* ids, T* weights) {
  const std::int64_t E = cfg.num_experts;
  const std::int64_t K = cfg.topk;
  for (std::int64_t e = 0; e < E; ++e)
    MOEKIT_CHECK(!std::isnan(x[e]),
                 "routing: router logit of token {} (expert {}) is NaN; the hidden state or "
                 "the router weights upstream are corrupt",
                 t, e);

  // Scores.
  if (cfg.scoring == Scoring::kSoftmax) {
    T max_logit = static_cast<T>(x[0]);
    for (std::int64_t e = 1; e < E; ++e) max_logit = std::max(max_logit, static_cast<T>(x[e]));
    MOEKIT_CHECK(std::isfinite(max_logit), "routing: token {} has max router logit {}; softmax needs a finite maximum",
                 t, static_cast<double>(max_logit));
    T sum = 0;
    for (std::int64_t e = 0; e < E; ++e) {
      w.score[static_cast<std::size_t>(e)] = exp_of(static_cast<T>(x[e]) - max_logit);
      sum += w.score[static_cast<std::size_t>(e)];
    }
    for (std::int64_t e = 0; e < E; ++e) w.score[static_cast<std::size_t>(e)] /= sum;
  } else {
    for (std::int64_t e = 0; e < E; ++e) w.score[static_cast<std::size_t>(e)] = sigmoid_of(static_cast<T>(x[e]));
  }
  for (std::int64_t e = 0; e < E; ++e) {
    const auto i = static_cast<std::size_t>(e);
    w.choice[i] = w.score[i] + (cfg.correction_bias && bias != nullptr ? static_cast<T>(bias[e]) : T{0});
  }

  // Candidates: every expert, or only those of the topk_group best groups.
  w.idx.clear();
  if (cfg.n_group > 1) {
    const std::int64_t group_size = E / cfg.n_group;
    for (std::int64_t g = 0; g < cfg.n_group; ++g) {
      // Group score: its largest c (max), or the sum of its 2 largest (top-2 sum; the one largest if
      // a group has one expert).
      T first = -std::numeric_limits<T>::infinity(), second = first;
      for (std::int64_t e = g * group_size; e < (g + 1) * group_size; ++e) {
        const T v = w.choice[static_cast<std::size_t>(e)];
        if (v > first) {
          second = first;
          first = v;
        } else if (v > second) {
          second = v;
        }
      }
      w.group[static_cast<std::size_t>(g)] =
          cfg.group_score == GroupScore::kTop2Sum && group_size >= 2 ? first + second : first;
      w.group_idx[static_cast<std::size_t>(g)] = static_cast<std::int32_t>(g);
    }
    std::partial_sort(w.group_idx.begin(), w.group_idx.begin() + cfg.topk_group, w.group_idx.end(),
                      ByScore<T>{w.group.data()});
    for (std::int64_t j = 0; j < cfg.topk_group; ++j) {
      const std::int64_t g = w.group_idx[static_cast<std::size_t>(j)];
      for (std::int64_t e = g * group_size; e < (g + 1) * group_size; ++e)
        w.idx.push_back(static_cast<std::int32_t>(e));
    }
  } else {
    for (std::int64_t e = 0; e < E; ++e) w.idx.push_back(static_cast<std::int32_t>(e));
  }
  std::partial_sort(w.idx.begin(), w.idx.begin() + K, w.idx.end(), ByScore<T>{w.choice.data()});

  // Weights: the uncorrected score of each chosen expert.
  T sum = 0;
  for (std::int64_t k = 0; k < K; ++k) {
    ids[k] = w.idx[static_cast<std::size_t>(k)];
    weights[k] = w.score[static_cast<std::size_t>(ids[k])];
    sum += weights[k];
  }
  if (cfg.renormalize) {
    // DeepSeek-V3 and GLM add 1e-20 to the denominator (renormalize_epsilon); the GPU adds it in fp32.
    const T denom =
        cfg.renormalize_epsilon > 0 ? sum + static_cast<T>(static_cast<float>(cfg.renormalize_epsilon)) : sum;
    for (std::int64_t k = 0; k < K; ++k) weights[k] /= denom;
  }
  if (cfg.routed_scaling_factor != 1.0) {
    const T scale = static_cast<T>(cfg.routed_scaling_factor);
    for (std::int64_t k = 0; k < K; ++k) weights[k] *= scale;
  }
}

template <typename T>
void route_impl(const RoutingConfig& cfg, const float* logits, std::int64_t num_tokens, const float* bias,
                std::int32_t* topk_ids, T* topk_weights) {
  validate_routing(cfg);
  MOEKIT_CHECK(num_tokens >= 0, "routing: num_tokens = {} must be >= 0", num_tokens);
  if (num_tokens == 0) return;
  MOEKIT_CHECK(logits != nullptr && topk_ids != nullptr && topk_weights != nullptr,
               "routing: {} tokens need non-null logits, topk_ids and topk_weights (got {}, {}, {})", num_tokens,
               static_cast<const void*>(logits), static_cast<const void*>(topk_ids),
               static_cast<const void*>(topk_weights));
  if (cfg.correction_bias && bias != nullptr) {
    for (std::int64_t e = 0; e < cfg.num_experts; ++e)
      MOEKIT_CHECK(std::isfinite(bias[e]), "routing: e_score_correction_bias[{}] = {} must be finite", e, bias[e]);
  }

  const auto E = static_cast<std::size_t>(cfg.num_experts);
  Scratch<T> w;
  w.score.resize(E);
  w.choice.resize(E);
  w.group.resize(static_cast<std::size_t>(cfg.n_group));
  w.group_idx.resize(static_cast<std::size_t>(cfg.n_group));
  w.idx.reserve(E);
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    route_token<T>(cfg, logits + t * cfg.num_experts, t, bias, w, topk_ids + t * cfg.topk, topk_weights + t * cfg.topk);
  }
}

}  // namespace

void route(const RoutingConfig& config, const float* logits, std::int64_t num_tokens, const float* bias,
           std::int32_t* topk_ids, float* topk_weights) {
  route_impl<float>(config, logits, num_tokens, bias, topk_ids, topk_weights);
}

void route_ref(const RoutingConfig& config, const float* logits, std::int64_t num_tokens, const float* bias,
               std::int32_t* topk_ids, double* topk_weights) {
  route_impl<double>(config, logits, num_tokens, bias, topk_ids, topk_weights);
}

}  // namespace moekit::cpu

namespace moekit::cpu {

void route_shared(const std::uint16_t* hidden, std::int64_t num_tokens, std::int64_t K, const std::uint16_t* gate,
                  std::int32_t* topk_ids, float* topk_weights) {
  using Math = numerics::HostMath;
  constexpr int kLanes = numerics::kSharedGateLanes;
  for (std::int64_t t = 0; t < num_tokens; ++t) {
    topk_ids[t] = 0;
    if (gate == nullptr) {
      topk_weights[t] = 1.0f;
      continue;
    }
    float lanes[kLanes] = {};
    const std::uint16_t* h = hidden + t * K;
    for (std::int64_t c = 0; c < K; ++c)
      lanes[c % kLanes] = numerics::shared_gate_lane<Math>(lanes[c % kLanes], numerics::bf16_decode(h[c]),
                                                           numerics::bf16_decode(gate[c]));
    topk_weights[t] = numerics::sigmoid_f32<Math>(numerics::shared_gate_reduce<Math>(lanes));
  }
}

}  // namespace moekit::cpu
