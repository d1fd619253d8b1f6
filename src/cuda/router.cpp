// The Router seam on the GPU, host side: the router output regions, its status words, the launch
// of cuda/router.cu. Mirrors src/cpu/router.cpp; ids and weights equal the CPU's bit for bit.
#include <fmt/format.h>

#include "cuda/backend.h"
#include "cuda/launch.h"
#include "moekit/check.h"

namespace moekit::cuda {
namespace {

class CudaRouter final : public Router {
 public:
  explicit CudaRouter(const RoutingConfig& config) : config_(config) {
    validate_routing(config_);
    MOEKIT_CHECK(config_.num_experts <= kMaxRouteExperts && config_.topk <= 32 && config_.n_group <= 32,
                 "the CUDA router takes E <= {}, topk <= 32 and n_group <= 32; got E = {}, topk = {}, n_group = {}",
                 kMaxRouteExperts, config_.num_experts, config_.topk, config_.n_group);
  }
  std::string_view name() const override { return "topk"; }
  Device device() const override { return Device::kCuda; }
  const RoutingConfig& config() const override { return config_; }
  void declare(const MoeProblem& p, WorkspaceBuilder& b) const override {
    declare_router_output(p, b);
    b.add({"router_status",
           DType::kInt32,
           {kStatusWords},
           Stage::kPrepare,
           Stage::kFinalize,
           "device error flags (a NaN logit): kept across steps until check_status reads them",
           true});
  }
  RouterOutput route(const MoeProblem& p, const float* logits, std::int64_t num_tokens, const float* bias,
                     Workspace& ws, Stream stream) override {
    ws.require(p, "the cuda router");
    MOEKIT_CHECK(num_tokens >= 0 && num_tokens <= p.max_tokens_per_rank,
                 "route: {} tokens exceed max_tokens_per_rank = {}: chunk the step", num_tokens, p.max_tokens_per_rank);
    MOEKIT_CHECK(config_.num_experts == p.E && config_.topk == p.topk,
                 "the router was built for E = {}, topk = {}; the problem has E = {}, topk = {}", config_.num_experts,
                 config_.topk, p.E, p.topk);
    const RouterOutput out{ws.get<std::int32_t>("topk_ids"), ws.get<float>("topk_weights")};
    launch_route(config_, logits, num_tokens, bias, out.topk_ids, out.topk_weights,
                 ws.get<std::int32_t>("router_status"), stream);
    return out;
  }
  RouterOutput route_shared(const MoeProblem& p, const std::uint16_t* hidden, std::int64_t num_tokens,
                            const std::uint16_t* gate, Workspace& ws, Stream stream) override {
    ws.require(p, "the cuda router (shared experts)");
    MOEKIT_CHECK(p.E == 1 && p.topk == 1 && num_tokens >= 0 && num_tokens <= p.max_tokens_per_rank,
                 "route_shared: {} tokens of a one-expert problem with max_tokens_per_rank = {}, got {}", num_tokens,
                 p.max_tokens_per_rank, p.describe());
    const RouterOutput out{ws.get<std::int32_t>("topk_ids"), ws.get<float>("topk_weights")};
    launch_route_shared(hidden, num_tokens, p.K, gate, out.topk_ids, out.topk_weights, stream);
    return out;
  }
  void check_status(Workspace& ws, Stream stream) override {
    check_status_words(ws.get<std::int32_t>("router_status"), "the cuda router", ws.problem().M, ws.problem().E,
                       stream);
  }

 private:
  RoutingConfig config_;
};

}  // namespace

std::unique_ptr<Router> make_router(const RoutingConfig& config, const ExecContext&) {
  return std::make_unique<CudaRouter>(config);
}

}  // namespace moekit::cuda
