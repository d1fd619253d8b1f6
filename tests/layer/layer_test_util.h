// Shared helpers of the layer tests: small synthetic models and a runner that spreads one global
// token set over N in-process ranks and returns the outputs in global token order.
#pragma once

#include <cstdint>
#include <vector>

#include "cpu/numerics.h"
#include "cpu/random.h"
#include "moekit/layer.h"

namespace moekit::testing {

inline ModelConfig tiny_model(bool grouped) {
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
    m.routed_scaling_factor = 2.5;
  }
  return m;
}

struct GlobalTokens {
  std::vector<std::uint16_t> hidden;
  std::vector<float> logits;
};

inline GlobalTokens make_tokens(const ModelConfig& m, std::int64_t n, std::uint64_t seed) {
  GlobalTokens g;
  g.hidden.resize(static_cast<std::size_t>(n * m.hidden_size));
  g.logits.resize(static_cast<std::size_t>(n * m.num_experts));
  for (std::int64_t t = 0; t < n; ++t) {
    cpu::SplitMix h = cpu::stream(seed, 4, static_cast<std::uint64_t>(t));
    cpu::SplitMix l = cpu::stream(seed, 5, static_cast<std::uint64_t>(t));
    for (std::int64_t c = 0; c < m.hidden_size; ++c)
      g.hidden[static_cast<std::size_t>(t * m.hidden_size + c)] = cpu::bf16_encode(h.normal());
    for (std::int64_t e = 0; e < m.num_experts; ++e)
      g.logits[static_cast<std::size_t>(t * m.num_experts + e)] = 2.0f * l.normal();
  }
  return g;
}

struct LayoutResult {
  std::vector<std::uint16_t> output;  // global token order
  double ref_err_sq = 0, ref_norm_sq = 0;
  std::int64_t workspace_bytes = 0;
};

// Runs `steps` forwards; rank r owns tokens [offset_r, offset_r + counts[r]).
inline LayoutResult run_layout(const ModelConfig& m, const GlobalTokens& g, const std::vector<std::int64_t>& counts,
                               std::int64_t ep, std::int64_t max_tokens_per_rank, const LayerOptions& opt,
                               int steps = 1) {
  const int P = static_cast<int>(counts.size());
  std::int64_t total = 0;
  std::vector<std::int64_t> offset;
  for (auto c : counts) {
    offset.push_back(total);
    total += c;
  }
  LayoutResult res;
  res.output.assign(static_cast<std::size_t>(total * m.hidden_size), 0);
  std::vector<double> err(static_cast<std::size_t>(P)), norm(static_cast<std::size_t>(P));
  run_in_process(P, [&](Communicator& comm) {
    const int r = comm.rank();
    MoeLayer layer(m, ParallelConfig{P, ep, max_tokens_per_rank, 0}, opt, comm);
    const std::int64_t o = offset[static_cast<std::size_t>(r)], n = counts[static_cast<std::size_t>(r)];
    for (int s = 0; s < steps; ++s)
      layer.forward(g.hidden.data() + o * m.hidden_size, g.logits.data() + o * m.num_experts, n,
                    res.output.data() + o * m.hidden_size);
    err[static_cast<std::size_t>(r)] = layer.last_step().ref_err_sq;
    norm[static_cast<std::size_t>(r)] = layer.last_step().ref_norm_sq;
    if (r == 0) res.workspace_bytes = layer.plan().total_bytes;
  });
  for (int r = 0; r < P; ++r) {
    res.ref_err_sq += err[static_cast<std::size_t>(r)];
    res.ref_norm_sq += norm[static_cast<std::size_t>(r)];
  }
  return res;
}

}  // namespace moekit::testing
