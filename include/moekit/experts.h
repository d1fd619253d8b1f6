// The Experts seam: the experts' input in one activation format -> W1 -> activation -> FP8 -> W2,
// on one device. An implementation declares its workspace (declare: the one declaration the planner
// and the runtime share), says which problems it cannot run and why (unsupported), and runs a step
// on a stream over the regions the Workspace bound.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "moekit/memory.h"
#include "moekit/problem.h"
#include "moekit/weights.h"
#include "moekit/workspace.h"

namespace moekit {

// The experts' input as the prepare step left it, on the experts' device.
//   Batched:  a1q (E_local, M, K) FP8, a1q_scale (activation_scale_shape({E_local, M})),
//             expert_num_tokens (E_local) int32 m_e, and the output buffer (E_local, M, K) bf16 whose
//             valid rows the experts write. Rows >= m_e are padding: never read into a result,
//             never written. The CUDA experts never read expert_num_tokens on the host.
//   Standard: a1q (num_tokens, K) FP8 in token order, a1q_scale, topk_ids (num_tokens, topk) local
//             expert ids (-1: not on this rank); the experts permute, compute and leave one output
//             row per (token, slot) in their workspace.
struct ExpertsInput {
  const std::uint8_t* a1q = nullptr;
  const float* a1q_scale = nullptr;
  const std::int32_t* expert_num_tokens = nullptr;  // batched
  const std::int32_t* topk_ids = nullptr;           // standard
  // Standard: rows of a1q. Batched: the tokens this rank fed the step; with one dispatcher it bounds
  // the rows any expert can hold, which bounds the GEMM launches the experts need (the counts
  // themselves stay on the device).
  std::int64_t num_tokens = 0;
  std::uint16_t* output = nullptr;  // batched
  // Batched, several dispatchers: the most tokens any of them fed this step, when the caller knows it
  // (0: not known, max_tokens_per_rank). It bounds the rows an expert can hold, and so the GEMM
  // launches, as num_tokens does with one dispatcher (plan::step_tokens_per_rank). An expert holding
  // more rows than the bound allows is skipped and raised as an error by check_status (on every device).
  std::int64_t max_tokens_any_rank = 0;
};

// Where the finalize finds each (token, slot)'s expert output row of K bf16 values.
struct ExpertsOutput {
  const std::uint16_t* rows = nullptr;
  // Standard: (num_tokens * topk) row of each (token, slot), -1 for none. Batched: nullptr (the
  // prepare/finalize that dispatched the rows knows where they went).
  const std::int32_t* row_of = nullptr;
};

class Experts {
 public:
  virtual ~Experts() = default;
  virtual std::string_view name() const = 0;  // the registry name, e.g. "batched-fp8"
  virtual Device device() const = 0;
  virtual ActivationFormat format() const = 0;
  // Empty when the implementation runs `problem`; otherwise why not and what to use instead.
  virtual std::string unsupported(const MoeProblem& problem) const = 0;
  // The choices it makes for a step of `tokens_per_rank` tokens per dispatcher (e.g. its GEMM
  // configs), printable: a pure function of the problem. Empty when it has none to report.
  virtual std::string describe_config(const MoeProblem& problem, std::int64_t tokens_per_rank) const = 0;
  // Declares the experts' workspace regions (count only or, in a Workspace, bound by name).
  virtual void declare(const MoeProblem& problem, WorkspaceBuilder& builder) const = 0;
  // One step on `stream` (the CPU ignores it). `workspace` must have been planned for `problem`.
  virtual ExpertsOutput run(const MoeProblem& problem, const ExpertsInput& input, const ExpertWeightsView& weights,
                            Workspace& workspace, Stream stream) = 0;
  // After a step: raises moekit::Error for what the device flagged during it (an expert_num_tokens
  // outside [0, M], or past the rows the step's tokens allow (ExpertsInput::max_tokens_any_rank):
  // that expert ran with 0 rows, nothing was written past them). Synchronizes the stream. The CPU
  // records the same errors in run() and raises them here too (the first one until read).
  virtual void check_status(Workspace& workspace, Stream stream) = 0;
};

}  // namespace moekit
