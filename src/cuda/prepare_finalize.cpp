// The PrepareFinalize seam on one GPU, host side; the kernels are cuda/dispatch.cu. Mirrors
// src/cpu/prepare_finalize.cpp, whose rows and values it reproduces bit for bit.
// scatter (batched format, dp == ep == 1): a device row map places every (token, slot) pair in its
// expert's (M, K) buffer in (token, slot) order, the tokens are quantized straight into those rows
// (no per-token copy in between), and the combine sums each token's rows back in slot order.
// local (standard format, ep == 1): quantize in place; the experts permute; combine their rows.
#include "cuda/backend.h"
#include "cuda/launch.h"
#include "moekit/check.h"

namespace moekit::cuda {
namespace {

void declare_quant_scratch(const MoeProblem& p, WorkspaceBuilder& b) {
  b.add({"tensor_amax",
         DType::kInt32,
         {1},
         Stage::kPrepare,
         Stage::kPrepare,
         "per-tensor quantization: the tensor's amax (float bits, integer max: order-free)"});
  (void)p;
}

QuantizeLaunch quantize(const MoeProblem& p, const PrepareArgs& a, Workspace& ws, const std::int32_t* pair_row,
                        std::int64_t scale_tensors) {
  QuantizeLaunch q;
  q.quant = p.quant;
  q.hidden = a.hidden;
  q.tokens = a.num_tokens;
  q.K = p.K;
  q.topk = static_cast<int>(p.topk);
  q.pair_row = pair_row;
  q.q = ws.get<std::uint8_t>("a1q");
  q.scales = ws.get<float>("a1q_scale");
  q.scale_tensors = scale_tensors;
  q.amax_scratch = reinterpret_cast<std::uint32_t*>(ws.get<std::int32_t>("tensor_amax"));
  return q;
}

void check_tokens(const MoeProblem& p, const PrepareArgs& a) {
  MOEKIT_CHECK(a.num_tokens >= 0 && a.num_tokens <= p.max_tokens_per_rank,
               "prepare: {} tokens exceed max_tokens_per_rank = {}: chunk the step", a.num_tokens,
               p.max_tokens_per_rank);
}

class Scatter final : public PrepareFinalize {
 public:
  std::string_view name() const override { return "scatter"; }
  Device device() const override { return Device::kCuda; }
  ActivationFormat format() const override { return ActivationFormat::kBatchedExperts; }
  void declare(const MoeProblem& p, WorkspaceBuilder& b) const override {
    declare_experts_io(p, b);
    b.add({"pair_row",
           DType::kInt32,
           {p.max_tokens_per_rank, p.topk},
           Stage::kPrepare,
           Stage::kFinalize,
           "row of each (token, slot) in the experts' (E_local * M) rows, -1 for none: the combine's map"});
    declare_quant_scratch(p, b);
    b.add({"row_map_tiles",
           DType::kInt32,
           {row_map_scratch_ints(p.max_tokens_per_rank * p.topk, p.E_local)},
           Stage::kPrepare,
           Stage::kPrepare,
           "the row map's per-tile counts and first ranks per expert"});
    b.add({"dispatch_status",
           DType::kInt32,
           {kStatusWords},
           Stage::kPrepare,
           Stage::kFinalize,
           "device error flags (expert ids out of range, rows over M), read after the step"});
  }

  ExpertsInput prepare(const MoeProblem& p, const PrepareArgs& a, Workspace& ws, Stream stream) override {
    ws.require(p, "scatter prepare (cuda)");
    MOEKIT_CHECK(p.E_local == p.E && p.num_dispatchers == 1,
                 "the single-GPU scatter holds every expert of one rank (dp == ep == 1); E_local = {} of E = {}, {} "
                 "dispatchers",
                 p.E_local, p.E, p.num_dispatchers);
    MOEKIT_CHECK(p.E_local <= kMaxRowMapExperts, "the CUDA scatter maps at most {} experts, the problem has {}",
                 kMaxRowMapExperts, p.E_local);
    check_tokens(p, a);
    auto* status = ws.get<std::int32_t>("dispatch_status");
    auto* pair_row = ws.get<std::int32_t>("pair_row");
    auto* counts = ws.get<std::int32_t>("expert_num_tokens");
    clear_status_words(status, stream);
    launch_row_map(a.topk_ids, a.num_tokens * p.topk, static_cast<int>(p.topk), static_cast<int>(p.E_local), false, p.M,
                   pair_row, counts, nullptr, ws.get<std::int32_t>("row_map_tiles"), status, stream);
    launch_quantize_tokens(quantize(p, a, ws, pair_row, p.E_local), stream);
    return {ws.get<std::uint8_t>("a1q"),           ws.get<float>("a1q_scale"), counts, nullptr, a.num_tokens,
            ws.get<std::uint16_t>("expert_output")};
  }

  void finalize(const MoeProblem& p, const FinalizeArgs& a, Workspace& ws, Stream stream) override {
    ws.require(p, "scatter finalize (cuda)");
    launch_combine(ws.get<std::int32_t>("pair_row"), a.topk_weights, a.num_tokens, static_cast<int>(p.topk), p.K,
                   a.experts.rows, a.output, stream);
  }

  void check_status(Workspace& ws, Stream stream) override {
    check_status_words(ws.get<std::int32_t>("dispatch_status"), "scatter (cuda)", ws.problem().M, ws.problem().E,
                       stream);
  }
};

class Local final : public PrepareFinalize {
 public:
  std::string_view name() const override { return "local"; }
  Device device() const override { return Device::kCuda; }
  ActivationFormat format() const override { return ActivationFormat::kStandard; }
  void declare(const MoeProblem& p, WorkspaceBuilder& b) const override {
    declare_experts_io(p, b);
    declare_quant_scratch(p, b);
  }

  ExpertsInput prepare(const MoeProblem& p, const PrepareArgs& a, Workspace& ws, Stream stream) override {
    ws.require(p, "local prepare (cuda)");
    MOEKIT_CHECK(p.E_local == p.E, "the local prepare/finalize holds every expert (ep == 1); E_local = {} of E = {}",
                 p.E_local, p.E);
    check_tokens(p, a);
    launch_quantize_tokens(quantize(p, a, ws, nullptr, 1), stream);
    return {ws.get<std::uint8_t>("a1q"), ws.get<float>("a1q_scale"), nullptr, a.topk_ids, a.num_tokens, nullptr};
  }

  void finalize(const MoeProblem& p, const FinalizeArgs& a, Workspace& ws, Stream stream) override {
    ws.require(p, "local finalize (cuda)");
    launch_combine(a.experts.row_of, a.topk_weights, a.num_tokens, static_cast<int>(p.topk), p.K, a.experts.rows,
                   a.output, stream);
  }

  void check_status(Workspace&, Stream) override {}  // the standard experts validate the ids
};

}  // namespace

std::unique_ptr<PrepareFinalize> make_scatter(const ExecContext&) {
  return std::make_unique<Scatter>();
}

std::unique_ptr<PrepareFinalize> make_local(const ExecContext&) {
  return std::make_unique<Local>();
}

}  // namespace moekit::cuda
