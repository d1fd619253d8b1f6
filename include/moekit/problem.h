// The experts' problem (M, N, K, topk, E, E_local, activation, quant), derived from a model and a
// parallel layout, validated where it enters. Every workspace plan is a function of this alone.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "moekit/model.h"
#include "moekit/types.h"

namespace moekit {

struct MoeProblem {
  ActivationFormat format = ActivationFormat::kBatchedExperts;
  // Token capacity of the experts' input. Batched: max_tokens_per_rank * num_dispatchers (already
  // global: never multiply it by num_dispatchers again). Standard: max_tokens_per_rank.
  std::int64_t M = 0;
  std::int64_t N = 0;  // W1 output width: 2*I gated, I otherwise
  std::int64_t K = 0;  // hidden size
  std::int64_t topk = 0;
  std::int64_t E = 0;        // routed experts in the model
  std::int64_t E_local = 0;  // experts held by this rank
  Activation activation = Activation::kSilu;
  QuantScheme quant = QuantScheme::kPerTokenPerChannel;
  std::int64_t max_tokens_per_rank = 0;
  std::int64_t num_dispatchers = 1;  // D
  // The recipe's W1 output: false, W1 into bf16 w1_out, then the activation kernel; true, the fused
  // W1 (where fuse_w1_runs): W1's fp32 output goes straight into the activation and its 1x128
  // quantization, no w1_out (DeepSeek-V3 DP 32: 1.26 -> 0.27 GiB). make_problem's default where
  // fuse_w1_runs. Every device and the float64 reference follow it (plan::fuses_w1).
  bool fuse_w1 = false;
  // Expert biases on W1 and W2 (ModelConfig::expert_bias: gpt-oss), in the weights view.
  bool expert_bias = false;
  // swigluoai's clamp and alpha (ModelConfig::swiglu); the other activations ignore them. Each finite,
  // in (0, its bound] (validate_swiglu).
  SwigluOaiParams swiglu;
  // The GPU GEMMs' sum over K (moekit/types.h): precise unless the request asks for fast
  // (--accumulation fast), which block128 refuses.
  Accumulation accumulation = Accumulation::kPrecise;

  std::int64_t I() const { return activation_out_dim(activation, N); }
  bool operator==(const MoeProblem&) const = default;
  std::string describe() const;
};

// Whether the fused W1 runs the scheme: block128 with an activation whose W1 rows pair whole 1x128
// output groups (all but swigluoai's interleaved rows).
// There it is make_problem's recipe, in both formats (one recipe, the same numbers in both):
// DeepSeek-V3 DP 32's batched experts 1.26 -> 0.27 GiB, for 1.01-1.07x the unfused step's time on
// the H200 (docs/PERF.md). The standard format's w1_out shares its bytes with w2_out, so there it
// saves nothing (and w1_small adds 16 MiB). A request may ask for either recipe (--fuse-w1 /
// --no-fuse-w1).
bool fuse_w1_runs(QuantScheme quant, Activation activation);

// Builds and validates the problem; raises moekit::Error naming the bad value and the fix. fuse_w1:
// the request's choice of recipe (--fuse-w1 / --no-fuse-w1), else fuse_w1_runs; asking for the
// fused recipe where it cannot run is an error.
MoeProblem make_problem(const ModelConfig& model, const ParallelConfig& parallel, ActivationFormat format,
                        QuantScheme quant);
MoeProblem make_problem(const ModelConfig& model, const ParallelConfig& parallel, ActivationFormat format,
                        QuantScheme quant, Activation activation, std::optional<bool> fuse_w1 = std::nullopt,
                        Accumulation accumulation = Accumulation::kPrecise);
// The shared experts of a layer whose routed experts run `routed`: one MLP of
// model.shared_intermediate_size (a family's several shared experts are one wider MLP) over this
// rank's own tokens, as one expert in the standard format (E = E_local = topk = 1, M =
// max_tokens_per_rank, one dispatcher: every rank holds it), with the routed problem's activation,
// FP8 scheme and W1 recipe. nullopt when the model has none. Raises moekit::Error naming
// shared_intermediate_size when the scheme cannot run that size.
std::optional<MoeProblem> shared_experts_problem(const ModelConfig& model, const MoeProblem& routed);

// Checks a problem built by hand (tests, bindings): the same rules as make_problem.
void validate_problem(const MoeProblem& problem);

}  // namespace moekit
