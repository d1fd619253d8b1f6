// The PrepareFinalize seam: dispatch and combine behind one interface. prepare quantizes this
// rank's tokens and moves each (token, expert) pair to the rank that holds the expert, in the
// experts' format; finalize brings every pair's expert output back and sums it into its token with
// the top-k weights (fp32, slot order, one bf16 rounding). Multi-rank implementations are
// collective: every rank calls prepare and finalize in the same order, with 0 tokens if it has none.
// Counts never need the host: expert_num_tokens is a workspace region the experts read on their own
// device, and prepare returns pointers, not counts (docs/DESIGN.md).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "moekit/experts.h"
#include "moekit/memory.h"
#include "moekit/problem.h"
#include "moekit/workspace.h"

namespace moekit {

struct PrepareArgs {
  const std::uint16_t* hidden = nullptr;   // (num_tokens, K) bf16, this rank's tokens
  const std::int32_t* topk_ids = nullptr;  // (num_tokens, topk) global expert ids, -1: routed nowhere (-1: none)
  const float* topk_weights = nullptr;     // (num_tokens, topk); multi-rank ones apply them on the owner
  std::int64_t num_tokens = 0;             // <= max_tokens_per_rank
};

struct FinalizeArgs {
  const float* topk_weights = nullptr;  // the same as prepare's
  std::int64_t num_tokens = 0;
  ExpertsOutput experts;            // what the experts' run returned
  std::uint16_t* output = nullptr;  // (num_tokens, K) bf16, token order
  // Add to the bf16 values already in `output` (the sum starts from them, one rounding): how the
  // shared experts' combine joins the routed output. The local prepare/finalize only; the others
  // raise moekit::Error.
  bool accumulate = false;
  // `output`'s dtype: bf16 (the layer's), or fp16 (an op's fp16 `out`, rounded once from the fp32
  // sums). The local prepare/finalize only; the others raise moekit::Error for fp16.
  DType output_dtype = DType::kBf16;
};

class PrepareFinalize {
 public:
  virtual ~PrepareFinalize() = default;
  virtual std::string_view name() const = 0;
  virtual Device device() const = 0;
  virtual ActivationFormat format() const = 0;
  // The experts' input/output buffers in this format and whatever else it holds.
  virtual void declare(const MoeProblem& problem, WorkspaceBuilder& builder) const = 0;
  virtual ExpertsInput prepare(const MoeProblem& problem, const PrepareArgs& args, Workspace& workspace,
                               Stream stream) = 0;
  virtual void finalize(const MoeProblem& problem, const FinalizeArgs& args, Workspace& workspace, Stream stream) = 0;
  // After a step: raises moekit::Error for what the device flagged (an expert id outside [0, E), a
  // receive over capacity: those pairs were dropped, nothing written out of bounds). Synchronizes
  // the stream. The CPU raises the same errors in prepare().
  virtual void check_status(Workspace& workspace, Stream stream) = 0;
  // Where the layer's one workspace allocation lives: a transport that stores into its peers'
  // workspaces (NCCL's symmetric windows) returns its own allocator; nullptr: the device's. Collective
  // for multi-rank implementations (every rank calls it, then allocates).
  virtual std::unique_ptr<Memory> workspace_memory() { return nullptr; }
  // Once, after the workspace is allocated (and poisoned in checked mode): set up the persistent
  // regions (flags, epochs) and agree with the peers that they are. Collective for multi-rank ones.
  virtual void attach(Workspace& workspace, Stream stream) {
    (void)workspace;
    (void)stream;
  }
};

// The experts' input/output buffers of a format, the part of the declaration every prepare/finalize
// of that format shares (the batched one is what DeepEP low-latency and pplx-style dispatch fill).
void declare_experts_io(const MoeProblem& problem, WorkspaceBuilder& builder);

}  // namespace moekit
