// MoeLayer: a runtime (moekit/runtime.h) that holds one layer.
#include "moekit/layer.h"

#include "moekit/runtime.h"

namespace moekit {

std::int64_t first_local_expert(const ParallelConfig& parallel, const MoeProblem& problem, int rank) {
  return parallel.ep == 1 ? 0 : static_cast<std::int64_t>(rank) * problem.E_local;
}

struct MoeLayer::Impl {
  MoeRuntime runtime;
  int layer;
  Impl(const ModelConfig& model, const ParallelConfig& parallel, const LayerOptions& options,
       const LayerWeights& weights, Communicator& comm)
      : runtime(model, parallel, options, comm), layer(runtime.add_layer(weights)) {}
};

MoeLayer::MoeLayer(const ModelConfig& model, const ParallelConfig& parallel, const LayerOptions& options,
                   const LayerWeights& weights, Communicator& comm)
    : impl_(std::make_unique<Impl>(model, parallel, options, weights, comm)) {}

MoeLayer::~MoeLayer() = default;

void MoeLayer::forward(const std::uint16_t* hidden, const float* router_logits, std::int64_t num_tokens,
                       std::uint16_t* output, Stream stream) {
  impl_->runtime.forward(impl_->layer, hidden, router_logits, num_tokens, output, stream);
}

void MoeLayer::enqueue(const std::uint16_t* hidden, const float* router_logits, std::int64_t num_tokens,
                       std::uint16_t* output, Stream stream, const StageObserver& observer,
                       std::int64_t max_tokens_any_rank) {
  impl_->runtime.enqueue(impl_->layer, hidden, router_logits, num_tokens, output, stream, observer,
                         max_tokens_any_rank);
}

void MoeLayer::check_status(Stream stream) {
  impl_->runtime.check_status(stream);
}

const MoeProblem& MoeLayer::problem() const {
  return impl_->runtime.problem();
}
const std::optional<MoeProblem>& MoeLayer::shared_problem() const {
  return impl_->runtime.shared_problem();
}
const WorkspacePlan& MoeLayer::plan() const {
  return impl_->runtime.plan();
}
std::int64_t MoeLayer::allocated_workspace_bytes() const {
  return impl_->runtime.allocated_workspace_bytes();
}
const StepStats& MoeLayer::last_step() const {
  return impl_->runtime.last_step();
}

}  // namespace moekit
