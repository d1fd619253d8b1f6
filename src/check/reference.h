// The float64 reference of the layer, for checked runs and tests, apart from the product path: it
// recomputes routing and quantization on the host from the same inputs (both are exact, so the
// reference sees the layer's own FP8 operands) and evaluates every (token, expert) row in double:
// dequantized a1q row -> W1 (rounded to bf16, as the recipe stores w1_out) -> activation -> the same
// FP8 requantization of the activation (mirrored in double) -> W2 -> weighted sum over the top-k.
// The unquantized recipe (bf16) quantizes nothing: the bf16 tokens and weights as they are, W1's
// output and the activation's rounded to bf16 where the recipe stores them (w1_out, act), the rest
// in double.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "cpu/thread_pool.h"
#include "moekit/model.h"
#include "moekit/problem.h"
#include "moekit/recipe.h"
#include "moekit/router.h"
#include "moekit/weights.h"
#include "numerics/fp8.h"

namespace moekit::check {

// How far another device's layer (or experts) may be from the CPU's on the same inputs and weights,
// relative (||device - cpu|| / ||cpu||); `moekit run --check`, the tests and the harness read these.
// Two correct implementations differ where their bf16 W1 outputs sit an ulp apart: the activation's
// FP8 code computed from such a value flips (2^-4 relative steps), ~1.5e-2 measured. Per-tensor
// scales add one more step: one scale over a slab (the standard format's every row, the batched
// format's expert) follows its largest activation value, and where that value's W1 input is an ulp
// apart the scale moves (relu2 squares it: up to 2 x 2^-7) and every code of the slab re-rounds:
// 3.3e-2 measured (H200, tiny with relu2, 600 tokens, standard format; tests/backend_ops'
// StandardPerTensorScale isolates it stage by stage). Indexing or scaling bugs give O(1) errors.
// Each recipe's figure is its row's device_vs_cpu_tolerance (moekit/recipe.h).
constexpr double device_vs_cpu_tolerance(QuantScheme quant) {
  return recipe_info(quant).device_vs_cpu_tolerance;
}

// W1 -> bf16 rounding -> activation of one row through one expert (a view with E_local = 1), in
// double: act has I values.
// a1q_row: K elements of the recipe's operand dtype (FP8 codes with their scales, or bf16 values).
void activation_ref(const MoeProblem& p, const ExpertWeightsView& expert, const std::uint8_t* a1q_row,
                    const float* a1q_row_scale, double* act);
// FP8 requantization of one activation row as the kernels do it (per 1x128 group or per row from
// the row's amax; per-tensor with the given tensor scale) -> W2, in double: y has K values.
void w2_ref(const MoeProblem& p, const ExpertWeightsView& expert, const double* act, float per_tensor_scale, double* y);

struct LayerError {
  double err_sq = 0, norm_sq = 0;  // sums over outputs of (out - ref)^2 and ref^2
  std::int64_t nan_outputs = 0;
  double relative() const;
};

// The reference of one rank's tokens, fed chunk by chunk as the layer splits them (per-tensor
// scales span a chunk: one tensor per expert in the batched format, all rows in the standard one).
class LayerReference {
 public:
  using WeightsOf = std::function<ExpertWeightsView(std::int64_t global_expert)>;
  LayerReference(const ModelConfig& model, const MoeProblem& problem, const float* routing_bias, WeightsOf weights_of,
                 cpu::ThreadPool& pool);

  // The step's shared experts (shared_experts_problem) and their gate ((K) bf16 or nullptr): their
  // rows, weighted 1 or sigmoid(hidden . gate), join the sum.
  void set_shared(const MoeProblem& shared, const ExpertWeightsView& weights, const std::uint16_t* gate);

  // Adds the error of `output` (T, K) bf16 for tokens (T, K) / logits (T, E), in chunks of `chunk`.
  void add(const std::uint16_t* hidden, const float* logits, std::int64_t T, std::int64_t chunk,
           const std::uint16_t* output);
  const LayerError& error() const { return error_; }

 private:
  void add_chunk(const std::uint16_t* hidden, const float* logits, std::int64_t T, const std::uint16_t* output);
  // Rows of `p`'s experts for each (token, slot) of `ids` (T * p.topk): y (T * topk, K) in double.
  std::vector<double> expert_rows(const MoeProblem& p, std::int64_t T, const std::vector<std::int32_t>& ids,
                                  const std::vector<ExpertWeightsView>& expert_of, const std::vector<std::uint8_t>& q,
                                  const std::vector<float>& qs);

  MoeProblem problem_;
  std::optional<MoeProblem> shared_;
  ExpertWeightsView shared_weights_;
  const std::uint16_t* shared_gate_ = nullptr;
  RoutingConfig routing_;
  std::vector<float> bias_;
  WeightsOf weights_of_;
  cpu::ThreadPool& pool_;
  LayerError error_;
};

}  // namespace moekit::check
