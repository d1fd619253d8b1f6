// The Router seam on the CPU: the routing kernels of cpu/routing.cpp on host memory.
#include "cpu/backend.h"
#include "cpu/routing.h"
#include "moekit/check.h"

namespace moekit::cpu {
namespace {

class CpuRouter final : public Router {
 public:
  explicit CpuRouter(const RoutingConfig& config) : config_(config) { validate_routing(config_); }
  std::string_view name() const override { return "topk"; }
  Device device() const override { return Device::kCpu; }
  const RoutingConfig& config() const override { return config_; }
  void declare(const MoeProblem& p, WorkspaceBuilder& b) const override { declare_router_output(p, b); }
  RouterOutput route(const MoeProblem& p, const float* logits, std::int64_t num_tokens, const float* bias,
                     Workspace& ws, Stream) override {
    ws.require(p, "the cpu router");
    MOEKIT_CHECK(num_tokens >= 0 && num_tokens <= p.max_tokens_per_rank,
                 "route: {} tokens exceed max_tokens_per_rank = {}: chunk the step", num_tokens, p.max_tokens_per_rank);
    const RouterOutput out{ws.get<std::int32_t>("topk_ids"), ws.get<float>("topk_weights")};
    cpu::route(config_, logits, num_tokens, bias, out.topk_ids, out.topk_weights);
    return out;
  }
  RouterOutput route_shared(const MoeProblem& p, const std::uint16_t* hidden, std::int64_t num_tokens,
                            const std::uint16_t* gate, Workspace& ws, Stream) override {
    ws.require(p, "the cpu router (shared experts)");
    MOEKIT_CHECK(p.E == 1 && p.topk == 1 && num_tokens >= 0 && num_tokens <= p.max_tokens_per_rank,
                 "route_shared: {} tokens of a one-expert problem with max_tokens_per_rank = {}, got {}", num_tokens,
                 p.max_tokens_per_rank, p.describe());
    const RouterOutput out{ws.get<std::int32_t>("topk_ids"), ws.get<float>("topk_weights")};
    cpu::route_shared(hidden, num_tokens, p.K, gate, out.topk_ids, out.topk_weights);
    return out;
  }
  void check_status(Workspace&, Stream) override {}

 private:
  RoutingConfig config_;
};

}  // namespace

std::unique_ptr<Router> make_router(const RoutingConfig& config, const ExecContext&) {
  return std::make_unique<CpuRouter>(config);
}

}  // namespace moekit::cpu
