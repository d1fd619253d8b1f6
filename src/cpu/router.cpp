// The Router seam on the CPU: the routing kernels of cpu/routing.cpp on host memory.
#include "cpu/backend.h"
#include "cpu/routing.h"

namespace moekit::cpu {
namespace {

class CpuRouter final : public Router {
 public:
  explicit CpuRouter(const RoutingConfig& config) : config_(config) { validate_routing(config_); }
  std::string_view name() const override { return "topk"; }
  Device device() const override { return Device::kCpu; }
  const RoutingConfig& config() const override { return config_; }
  void route(const float* logits, std::int64_t num_tokens, const float* bias, std::int32_t* topk_ids,
             float* topk_weights, Stream) override {
    cpu::route(config_, logits, num_tokens, bias, topk_ids, topk_weights);
  }

 private:
  RoutingConfig config_;
};

}  // namespace

std::unique_ptr<Router> make_router(const RoutingConfig& config, const ExecContext&) {
  return std::make_unique<CpuRouter>(config);
}

}  // namespace moekit::cpu
