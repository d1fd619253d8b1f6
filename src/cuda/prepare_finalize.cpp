// The PrepareFinalize seam on one GPU, host side; the kernels are cuda/dispatch.cu. Mirrors
// src/cpu/prepare_finalize.cpp, whose rows and values it reproduces bit for bit.
// scatter (batched format, dp == ep == 1): a device row map places every (token, slot) pair in its
// expert's (M, K) buffer in (token, slot) order, the tokens are quantized straight into those rows
// (no per-token copy in between), and the combine sums each token's rows back in slot order.
// local (standard format, ep == 1): quantize in place; the experts permute; combine their rows.
// nccl, nccl-reference (batched format, ranks on GPUs): the tokens quantized once, each sent once to
// every rank holding any of its experts and fanned out there into (E_local, M, K) in the order one GPU
// gives the same global tokens; the owner's partial sums come back (cuda/ep_launch.h, nccl/ep.cu).
#include <cstdlib>
#include <memory>
#include <string>

#include "cuda/backend.h"
#include "cuda/ep_launch.h"
#include "cuda/launch.h"
#include "moekit/check.h"
#include "moekit/recipe.h"
#include "numerics/scales.h"
#include "plan/ep_layout.h"
#include "plan/experts_recipe.h"

namespace moekit::cuda {
namespace {

// The CUDA dispatches quantize to FP8 as they scatter (or copy bf16 rows, the unquantized recipe): a
// recipe without CUDA kernels (RecipeInfo::cuda_experts) is refused when it is declared, with what to
// run instead (the experts refuse it the same way).
void require_cuda_recipe(std::string_view who, const MoeProblem& p) {
  const std::string why = plan::recipe_unsupported(who, Device::kCuda, p);
  MOEKIT_CHECK(why.empty(), "{}", why);
}

// a1q's scales, or null for a recipe without activation scales (bf16: no a1q_scale region).
float* a1q_scale(Workspace& ws) {
  return has_activation_scales(recipe_info(ws.problem().quant)) ? ws.get<float>("a1q_scale") : nullptr;
}

void declare_quant_scratch(const MoeProblem& p, WorkspaceBuilder& b) {
  require_cuda_recipe("the CUDA prepare/finalize", p);
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
  q.q = reinterpret_cast<std::uint8_t*>(ws.get<std::byte>("a1q"));
  q.scales = a1q_scale(ws);
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
           "device error flags (expert ids out of range, rows over M): kept across steps until check_status reads "
           "them",
           true});
  }

  ExpertsInput prepare(const MoeProblem& p, const PrepareArgs& a, Workspace& ws, Stream stream) override {
    ws.require(p, "scatter prepare (cuda)");
    // E_local above E: the slots of redundant experts (moekit/placement.h), ids already slots.
    MOEKIT_CHECK(p.E_local >= p.E && p.num_dispatchers == 1,
                 "the single-GPU scatter holds every expert of one rank (dp == ep == 1); E_local = {} of E = {}, {} "
                 "dispatchers",
                 p.E_local, p.E, p.num_dispatchers);
    MOEKIT_CHECK(p.E_local <= kMaxRowMapExperts, "the CUDA scatter maps at most {} experts, the problem has {}",
                 kMaxRowMapExperts, p.E_local);
    check_tokens(p, a);
    auto* status = ws.get<std::int32_t>("dispatch_status");
    auto* pair_row = ws.get<std::int32_t>("pair_row");
    auto* counts = ws.get<std::int32_t>("expert_num_tokens");
    launch_row_map(a.topk_ids, a.num_tokens * p.topk, static_cast<int>(p.topk), static_cast<int>(p.E_local), false, p.M,
                   pair_row, counts, nullptr, ws.get<std::int32_t>("row_map_tiles"), status, stream);
    launch_quantize_tokens(quantize(p, a, ws, pair_row, p.E_local), stream);
    return {reinterpret_cast<std::uint8_t*>(ws.get<std::byte>("a1q")),
            a1q_scale(ws),
            counts,
            nullptr,
            a.num_tokens,
            ws.get<std::uint16_t>("expert_output")};
  }

  void finalize(const MoeProblem& p, const FinalizeArgs& a, Workspace& ws, Stream stream) override {
    ws.require(p, "scatter finalize (cuda)");
    MOEKIT_CHECK(!a.accumulate, "the scatter finalize writes its output; it does not accumulate into it");
    launch_combine(ws.get<std::int32_t>("pair_row"), a.topk_weights, a.num_tokens, static_cast<int>(p.topk), p.K,
                   a.experts.rows, a.output, stream, false, recipe_info(p.quant).output_dtype, a.output_dtype);
  }

  void check_status(Workspace& ws, Stream stream) override {
    // The scatter's ids are this rank's experts or, with redundant experts, its slots: E_local of them.
    check_status_words(ws.get<std::int32_t>("dispatch_status"), "scatter (cuda)", ws.problem().M, ws.problem().E_local,
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
    MOEKIT_CHECK(p.E_local >= p.E, "the local prepare/finalize holds every expert (ep == 1); E_local = {} of E = {}",
                 p.E_local, p.E);
    check_tokens(p, a);
    launch_quantize_tokens(quantize(p, a, ws, nullptr, 1), stream);
    return {reinterpret_cast<std::uint8_t*>(ws.get<std::byte>("a1q")),
            a1q_scale(ws),
            nullptr,
            a.topk_ids,
            a.num_tokens,
            nullptr};
  }

  void finalize(const MoeProblem& p, const FinalizeArgs& a, Workspace& ws, Stream stream) override {
    ws.require(p, "local finalize (cuda)");
    launch_combine(a.experts.row_of, a.topk_weights, a.num_tokens, static_cast<int>(p.topk), p.K, a.experts.rows,
                   a.output, stream, a.accumulate, recipe_info(p.quant).output_dtype, a.output_dtype);
  }

  void check_status(Workspace&, Stream) override {}  // the standard experts validate the ids
};

// Expert parallelism over NCCL. Device-initiated (`nccl`): the kernels store records and partials
// into the peers' symmetric windows and signal flags there: no host synchronization, capturable.
// Reference (`nccl-reference`): grouped ncclSend/ncclRecv, the counts exchanged first and read on the
// host; the oracle of the first and its fallback where NVLink load/store does not reach every peer.
class NcclAllToAll final : public PrepareFinalize {
 public:
  NcclAllToAll(const ExecContext& ctx, bool device_initiated) : comm_(ctx.comm), device_(device_initiated) {
    const char* env = std::getenv("MOEKIT_EP_TIMEOUT_MS");
    if (env != nullptr) {
      char* end = nullptr;
      const long long ms = std::strtoll(env, &end, 10);
      MOEKIT_CHECK(end != env && *end == '\0' && ms > 0,
                   "MOEKIT_EP_TIMEOUT_MS = '{}' must be a positive number of milliseconds", env);
      timeout_ms_ = ms;
    }
  }
  std::string_view name() const override { return device_ ? "nccl" : "nccl-reference"; }
  Device device() const override { return Device::kCuda; }
  ActivationFormat format() const override { return ActivationFormat::kBatchedExperts; }

  void declare(const MoeProblem& p, WorkspaceBuilder& b) const override {
    const std::int64_t P = p.num_dispatchers, mt = p.max_tokens_per_rank, K = p.K, topk = p.topk;
    require_cuda_recipe(name(), p);
    const std::int64_t rb = plan::ep_record(p.quant, K, topk).bytes, pairs = P * mt * topk;
    declare_experts_io(p, b);
    b.add({"ep_token_destinations",
           DType::kInt64,
           {mt},
           Stage::kPrepare,
           Stage::kFinalize,
           "bit r: the token went to rank r; the final sum adds those ranks' partials in rank order"});
    if (!device_) {
      b.add({"ep_send_index",
             DType::kInt32,
             {mt, P},
             Stage::kPrepare,
             Stage::kFinalize,
             "each token's index among the tokens sent to each rank (-1: none): where its partial comes back"});
      b.add({"ep_send_count", DType::kInt32, {P}, Stage::kPrepare, Stage::kFinalize, "tokens sent to each rank"});
      b.add({"ep_send",
             DType::kUint8,
             {P, mt, rb},
             Stage::kPrepare,
             Stage::kPrepare,
             "records packed per destination for ncclSend (header, the row in the recipe's dtype, scales)"});
      b.add({"ep_recv_count", DType::kInt32, {P}, Stage::kPrepare, Stage::kFinalize, "records from each source"});
    }
    b.add({"ep_recv",
           DType::kUint8,
           {P, mt, rb},
           Stage::kPrepare,
           Stage::kFinalize,
           device_ ? "records stored here by each source's kernels at [source][token] (symmetric window): one per "
                     "token with an expert here, whatever its number of experts here; epoch-stamped"
                   : "records received from each source (ncclRecv), in its send order",
           device_});
    b.add({"ep_recv_ids",
           DType::kInt32,
           {pairs},
           Stage::kPrepare,
           Stage::kPrepare,
           "local expert of each received (record, slot), -1: none: the row map's input"});
    b.add({"ep_pair_row",
           DType::kInt32,
           {pairs},
           Stage::kPrepare,
           Stage::kFinalize,
           "row of each received (record, slot) in (E_local * M): the fan-out's and the combine's map"});
    b.add({"row_map_tiles",
           DType::kInt32,
           {row_map_scratch_ints(pairs, p.E_local)},
           Stage::kPrepare,
           Stage::kPrepare,
           "the row map's per-tile counts and first ranks per expert"});
    if (device_) {
      b.add({"ep_combine_recv",
             DType::kFp32,
             {mt, plan::ep_max_destinations(topk, P), K},
             Stage::kPrepare,
             Stage::kFinalize,
             "partial sums of each token from each destination rank, stored by the owners",
             true});
      b.add({"ep_flags",
             DType::kInt64,
             {plan::kEpPhases, P, plan::kEpCtas},
             Stage::kPrepare,
             Stage::kFinalize,
             "dispatch, combine and teardown arrival flags, set by each peer's CTAs (epochs)",
             true});
      b.add({"ep_epochs",
             DType::kInt64,
             {plan::kEpPhases, plan::kEpCtas},
             Stage::kPrepare,
             Stage::kFinalize,
             "this rank's step count per CTA and phase: what the flags must reach",
             true});
      b.add({"ep_broken",
             DType::kInt32,
             {kEpBrokenWords},
             Stage::kPrepare,
             Stage::kFinalize,
             "sticky failure word (why, phase, peer, CTA): once set, every later signal is poisoned and every "
             "step raises",
             true});
    } else {
      b.add({"ep_combine_send",
             DType::kFp32,
             {P, mt, K},
             Stage::kFinalize,
             Stage::kFinalize,
             "partial sums of the received records, by source, for ncclSend"});
      b.add({"ep_combine_recv",
             DType::kFp32,
             {P, mt, K},
             Stage::kFinalize,
             Stage::kFinalize,
             "partial sums from each owner rank, by the tokens' send index"});
    }
    b.add({"dispatch_status",
           DType::kInt32,
           {kStatusWords},
           Stage::kPrepare,
           Stage::kFinalize,
           "device error flags (expert ids, corrupt records, silent peers): kept across steps until check_status "
           "reads them",
           true});
  }

  std::unique_ptr<Memory> workspace_memory() override {
    require_comm();
    if (group_ == nullptr) group_ = make_nccl_group(*comm_);
    return device_ ? make_symmetric_memory(group_) : nullptr;
  }

  void attach(Workspace& ws, Stream stream) override {
    require_comm();
    if (group_ == nullptr) group_ = make_nccl_group(*comm_);
    if (!device_) {
      connect_nccl_peers(*group_, stream);  // connections now, while every rank is here
      return;
    }
    // Zero flags and epochs, and the records (a stale header never carries a live epoch).
    for (const char* name : {"ep_flags", "ep_epochs", "ep_broken", "ep_recv"}) {
      const Region& r = ws.plan().region(name);
      ws.memory().fill(ws.base() + r.offset, 0, r.bytes, stream);
    }
    ws.memory().synchronize(stream);
    set_ep_teardown(*group_, step(ws.problem(), nullptr, nullptr, 0, ws));
    comm_->barrier();  // no peer signals before every rank's flags are zero
  }

  ExpertsInput prepare(const MoeProblem& p, const PrepareArgs& a, Workspace& ws, Stream stream) override {
    ws.require(p, device_ ? "nccl prepare" : "nccl-reference prepare");
    check_problem(p);
    check_tokens(p, a);
    MOEKIT_CHECK(group_ != nullptr, "{}: the layer attaches the transport before its first step", name());
    MOEKIT_CHECK(
        comm_->size() == p.num_dispatchers && p.E_local * comm_->size() >= p.E,
        "{}: {} ranks with D = {}, E_local = {}, E = {}: every rank dispatches and holds E_local expert slots, "
        "E or more in all",
        name(), comm_->size(), p.num_dispatchers, p.E_local, p.E);
    MOEKIT_CHECK(a.num_tokens == 0 || (a.hidden && a.topk_ids && a.topk_weights),
                 "{} prepare: hidden, topk_ids and topk_weights must be non-null for {} tokens (the owner applies the "
                 "weights before the combine)",
                 name(), a.num_tokens);
    EpStep s = step(p, a.topk_ids, a.topk_weights, a.num_tokens, ws);
    s.hidden = a.hidden;
    launch_ep_dispatch(s, *group_, device_, stream);
    return {s.a1q, s.a1q_scale, s.expert_num_tokens, nullptr, a.num_tokens, ws.get<std::uint16_t>("expert_output")};
  }

  void finalize(const MoeProblem& p, const FinalizeArgs& a, Workspace& ws, Stream stream) override {
    ws.require(p, device_ ? "nccl finalize" : "nccl-reference finalize");
    MOEKIT_CHECK(!a.accumulate, "the nccl finalizes write their output; they do not accumulate into it");
    MOEKIT_CHECK(a.output_dtype == DType::kBf16, "the nccl finalizes write bf16 (the layer's output), not {}",
                 dtype_name(a.output_dtype));
    EpStep s = step(p, nullptr, a.topk_weights, a.num_tokens, ws);
    s.expert_output = a.experts.rows;
    s.output = a.output;
    launch_ep_combine(s, *group_, device_, stream);
  }

  void check_status(Workspace& ws, Stream stream) override {
    auto* status = ws.get<std::int32_t>("dispatch_status");
    // The sticky failure word first: no other error of the step hides it, no step clears it.
    static_assert(kEpBrokenWords == kStatusWords, "read_status_words reads kStatusWords words");
    if (device_) {
      std::int32_t b[kEpBrokenWords] = {};
      read_status_words(ws.get<std::int32_t>("ep_broken"), b, stream);
      if (b[0] != 0) {
        const char* phase = b[1] == 0 ? "dispatch" : b[1] == 1 ? "combine" : "teardown";
        const std::string why =
            b[0] == kEpBrokenTimeout
                ? fmt::format(
                      "rank {} did not signal the {} within the timeout (CTA {}): it died, raised, or runs "
                      "another step",
                      b[2], phase, b[3])
                : fmt::format("rank {} signalled in the {} that it had failed (CTA {}): its data is not used", b[2],
                              phase, b[3]);
        if (group_ != nullptr) abort_nccl_group(*group_, why);
        MOEKIT_FAIL(
            "nccl (cuda): {}. This expert-parallel group is broken for good: every later step raises. The NCCL "
            "communicator is aborted; rebuild the layer on every rank (MOEKIT_EP_TIMEOUT_MS sets the timeout)",
            why);
      }
    }
    std::int32_t w[kStatusWords] = {};
    read_status_words(status, w, stream);
    if (w[0] == kStatusPeerTimeout && group_ != nullptr)
      abort_nccl_group(*group_, "rank " + std::to_string(w[2]) + " did not signal");
    // The transports' ids are expert slots of every rank (E_local each; E without redundant experts).
    check_status_words(status, device_ ? "nccl (cuda)" : "nccl-reference (cuda)", ws.problem().M,
                       ws.problem().E_local * comm_->size(), stream);
  }

 private:
  void require_comm() const {
    MOEKIT_CHECK(comm_ != nullptr, "{} runs over a communicator of the layer's ranks (MPI or in-process)", name());
  }

  void check_problem(const MoeProblem& p) const {
    MOEKIT_CHECK(!numerics::activation_scale_per_tensor(p.quant),
                 "{}: per-tensor activation scales are per rank and rows from several ranks cannot share one: use "
                 "--quant per-token or block128",
                 name());
    MOEKIT_CHECK(p.num_dispatchers <= plan::kMaxEpRanks, "{}: {} ranks; the NCCL transports take at most {}", name(),
                 p.num_dispatchers, plan::kMaxEpRanks);
    MOEKIT_CHECK(p.topk <= plan::kMaxEpTopk, "{}: topk = {}; the NCCL transports take at most {}", name(), p.topk,
                 plan::kMaxEpTopk);
    MOEKIT_CHECK(p.max_tokens_per_rank <= 65535,
                 "{}: max_tokens_per_rank = {}; the NCCL transports take at most 65535 per step: chunk the step",
                 name(), p.max_tokens_per_rank);
    MOEKIT_CHECK(p.K % 16 == 0, "{}: K = {} must be a multiple of 16 (16-byte row copies)", name(), p.K);
    MOEKIT_CHECK(p.E_local <= kMaxRowMapExperts, "{}: E_local = {}; the row map takes at most {}", name(), p.E_local,
                 kMaxRowMapExperts);
  }

  EpStep step(const MoeProblem& p, const std::int32_t* ids, const float* weights, std::int64_t tokens,
              Workspace& ws) const {
    EpStep s;
    s.rank = comm_->rank();
    s.ranks = comm_->size();
    s.tokens = tokens;
    s.max_tokens = p.max_tokens_per_rank;
    s.K = p.K;
    s.topk = p.topk;
    s.E_local = p.E_local;
    s.M = p.M;
    s.quant = p.quant;
    s.topk_ids = ids;
    s.topk_weights = weights;
    s.recv = ws.get<std::byte>("ep_recv");
    s.token_destinations = ws.get<std::int64_t>("ep_token_destinations");
    s.recv_ids = ws.get<std::int32_t>("ep_recv_ids");
    s.pair_row = ws.get<std::int32_t>("ep_pair_row");
    s.row_map_tiles = ws.get<std::int32_t>("row_map_tiles");
    s.a1q = reinterpret_cast<std::uint8_t*>(ws.get<std::byte>("a1q"));
    s.a1q_scale = a1q_scale(ws);
    s.expert_num_tokens = ws.get<std::int32_t>("expert_num_tokens");
    s.combine_recv = ws.get<float>("ep_combine_recv");
    s.status = ws.get<std::int32_t>("dispatch_status");
    s.timeout_ns = timeout_ms_ * 1000000;
    const WorkspacePlan& plan = ws.plan();
    s.recv_offset = plan.region("ep_recv").offset;
    s.combine_recv_offset = plan.region("ep_combine_recv").offset;
    if (device_) {
      s.flags = reinterpret_cast<std::uint64_t*>(ws.get<std::int64_t>("ep_flags"));
      s.epochs = reinterpret_cast<std::uint64_t*>(ws.get<std::int64_t>("ep_epochs"));
      s.broken = ws.get<std::int32_t>("ep_broken");
      s.flags_offset = plan.region("ep_flags").offset;
    } else {
      s.send_index = ws.get<std::int32_t>("ep_send_index");
      s.send_count = ws.get<std::int32_t>("ep_send_count");
      s.recv_count = ws.get<std::int32_t>("ep_recv_count");
      s.send = ws.get<std::byte>("ep_send");
      s.combine_send = ws.get<float>("ep_combine_send");
    }
    return s;
  }

  Communicator* comm_;
  bool device_;
  long long timeout_ms_ = 10000;
  std::shared_ptr<NcclGroup> group_;
};

}  // namespace

std::unique_ptr<PrepareFinalize> make_nccl_device(const ExecContext& ctx) {
  return std::make_unique<NcclAllToAll>(ctx, true);
}

std::unique_ptr<PrepareFinalize> make_nccl_reference(const ExecContext& ctx) {
  return std::make_unique<NcclAllToAll>(ctx, false);
}

std::unique_ptr<PrepareFinalize> make_scatter(const ExecContext&) {
  return std::make_unique<Scatter>();
}

std::unique_ptr<PrepareFinalize> make_local(const ExecContext&) {
  return std::make_unique<Local>();
}

}  // namespace moekit::cuda
