// Shared helpers of the layer tests: a runner that spreads one global
// token set over N in-process ranks (each with its seeded synthetic experts) and returns the outputs
// in global token order, with the float64 reference error of them.
#pragma once

#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "check/reference.h"
#include "moekit/layer.h"
#include "moekit/placement.h"
#include "moekit/registry.h"
#include "moekit/runtime.h"
#include "synthetic/synthetic.h"

namespace moekit::testing {

using synthetic::tiny_model;

// Several ranks against one holding every expert: the owner sums its slots of a token before the
// source adds the ranks' partials (fp32), so a token with experts on several ranks may round
// differently in its last bf16 bit (2^-8 relative) where the sum lands near a rounding boundary:
// measured <= 1.4e-5 relative over a whole output (H200, 2 GPUs); any indexing bug gives O(1).
constexpr double kRanksVsOneRank = 1e-3;

inline double relative_difference(const std::vector<std::uint16_t>& a, const std::vector<std::uint16_t>& ref) {
  double err = 0, norm = 0;
  for (std::size_t i = 0; i < a.size() && i < ref.size(); ++i) {
    const double x = numerics::bf16_decode(a[i]), y = numerics::bf16_decode(ref[i]);
    err += (x - y) * (x - y);
    norm += y * y;
  }
  return a.size() != ref.size() ? 1.0 : norm > 0 ? std::sqrt(err / norm) : 0.0;
}

struct LayoutResult {
  std::vector<std::uint16_t> output;  // global token order
  check::LayerError error;            // against the float64 reference (when asked for)
  std::int64_t workspace_bytes = 0;   // rank 0's plan total
  std::int64_t experts_workspace_bytes = 0;
};

// Redundant experts for run_layout: local_experts slots a rank (0: E / ep, none), in `placement`
// (nullptr: the round-robin default); each rank's per-slot load after the steps into `load`.
struct Redundancy {
  std::int64_t local_experts = 0;
  const ExpertPlacement* placement = nullptr;
  std::vector<std::vector<std::int64_t>>* load = nullptr;
};

// Runs `steps` forwards of the layer on the CPU; rank r owns global tokens [offset_r, offset_r +
// counts[r]) of `tokens`. Weights and tokens come from `seed`.
inline LayoutResult run_layout(const ModelConfig& m, const synthetic::Tokens& tokens,
                               const std::vector<std::int64_t>& counts, std::int64_t ep,
                               std::int64_t max_tokens_per_rank, const LayerOptions& opt, std::uint64_t seed,
                               int steps = 1, bool reference = false, const Redundancy& redundancy = {}) {
  const int P = static_cast<int>(counts.size());
  std::int64_t total = 0;
  std::vector<std::int64_t> offset;
  for (auto c : counts) {
    offset.push_back(total);
    total += c;
  }
  const std::int64_t K = m.hidden_size, E = m.num_experts;
  LayoutResult res;
  res.output.assign(static_cast<std::size_t>(total * K), 0);
  const std::vector<float> bias =
      m.has_score_correction_bias ? synthetic::make_routing_bias(E, seed) : std::vector<float>{};
  std::mutex mutex;
  std::vector<synthetic::HostExpertWeights> all_weights;
  MoeProblem problem;
  if (redundancy.load) redundancy.load->assign(static_cast<std::size_t>(P), {});
  run_in_process(P, [&](Communicator& comm) {
    const int r = comm.rank();
    const ParallelConfig par{P, ep, max_tokens_per_rank, redundancy.local_experts};
    const auto& entry = find_experts(opt.experts, opt.device);
    const MoeProblem p = make_problem(m, par, entry.format, opt.quant, opt.activation.value_or(m.activation));
    cpu::ThreadPool pool(1);
    std::optional<ExpertPlacement> placement;
    if (redundancy.local_experts > 0)
      placement = redundancy.placement ? *redundancy.placement : round_robin_placement(E, p.E_local * ep);
    synthetic::HostExpertWeights w =
        placement ? synthetic::make_slot_weights(p, *placement, first_local_expert(par, p, r), seed, pool)
                  : synthetic::make_expert_weights(p, first_local_expert(par, p, r), seed, pool);
    const synthetic::HostSharedExperts shared =
        opt.shared_experts ? synthetic::make_shared_experts(m, p, seed, pool) : synthetic::HostSharedExperts{};
    LayerWeights lw{w.view(), bias.empty() ? nullptr : bias.data()};
    shared.set(lw);
    lw.placement = placement ? &*placement : nullptr;
    MoeRuntime runtime(m, par, opt, comm);
    const int layer = runtime.add_layer(lw);
    const std::int64_t o = offset[static_cast<std::size_t>(r)], n = counts[static_cast<std::size_t>(r)];
    for (int s = 0; s < steps; ++s)
      runtime.forward(layer, tokens.hidden.data() + o * K, tokens.logits.data() + o * E, n, res.output.data() + o * K);
    std::vector<std::int64_t> load;
    if (redundancy.load && runtime.placement(layer)) load = runtime.expert_load(layer);
    std::lock_guard<std::mutex> lock(mutex);
    if (r == 0) {
      res.workspace_bytes = runtime.plan().total_bytes;
      res.experts_workspace_bytes = runtime.plan().section_bytes("experts");
      problem = runtime.problem();
    }
    if (redundancy.load) (*redundancy.load)[static_cast<std::size_t>(r)] = std::move(load);
    if (w.first_expert >= 0) all_weights.push_back(std::move(w));
  });
  if (reference) {
    cpu::ThreadPool pool(2);
    synthetic::ExpertBank bank(problem, seed, pool);
    for (const auto& w : all_weights) bank.adopt(w);
    check::LayerReference ref(
        m, problem, bias.empty() ? nullptr : bias.data(), [&](std::int64_t e) { return bank.expert(e); }, pool);
    const synthetic::HostSharedExperts shared =
        opt.shared_experts ? synthetic::make_shared_experts(m, problem, seed, pool) : synthetic::HostSharedExperts{};
    if (shared.problem)
      ref.set_shared(*shared.problem, shared.experts.view(), shared.gate.empty() ? nullptr : shared.gate.data());
    for (int r = 0; r < P; ++r) {
      const std::int64_t o = offset[static_cast<std::size_t>(r)], n = counts[static_cast<std::size_t>(r)];
      ref.add(tokens.hidden.data() + o * K, tokens.logits.data() + o * E, n, max_tokens_per_rank,
              res.output.data() + o * K);
    }
    res.error = ref.error();
  }
  return res;
}

}  // namespace moekit::testing
