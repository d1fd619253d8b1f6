// The PrepareFinalize seam on the CPU.
// all-to-all (batched format, any number of ranks): the semantics of the NCCL transports (plan/
// ep_layout.h), over the communicator. Each token is quantized once and sent once to every rank
// holding any of its experts, as one record (header, FP8 row and scales, or the bf16 row where the
// recipe quantizes nothing); the owner fans it out into
// its experts' (M, K) buffers, rows in (source rank, token, slot) order: the rows one rank holding
// every expert gives the same global tokens. The owner sums its slots of a token first (fp32, slot
// order) and returns one fp32 partial; the source adds the partials in rank order and rounds once.
// So outputs do not depend on how tokens are spread over ranks, and equal one rank's bit for bit
// where a token's experts live on one rank. Record buffers are host staging of the communicator,
// sized per step.
// local (standard format, ep == 1): quantize (or copy bf16) in place; the experts permute; combine their rows.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/backend.h"
#include "cpu/combine.h"
#include "cpu/quant.h"
#include "moekit/check.h"
#include "moekit/recipe.h"
#include "numerics/scales.h"
#include "plan/ep_layout.h"

namespace moekit::cpu {
namespace {

void check_ids(const MoeProblem& p, const PrepareArgs& a) {
  MOEKIT_CHECK(a.num_tokens >= 0 && a.num_tokens <= p.max_tokens_per_rank,
               "prepare: {} tokens exceed max_tokens_per_rank = {}: chunk the step", a.num_tokens,
               p.max_tokens_per_rank);
  for (std::int64_t i = 0; i < a.num_tokens * p.topk; ++i)
    MOEKIT_CHECK(a.topk_ids[i] >= -1 && a.topk_ids[i] < p.E_local,
                 "prepare: topk_ids[{}][{}] = {} is outside [0, E_local = {}) (or -1: none): the router produced an "
                 "invalid expert",
                 i / p.topk, i % p.topk, a.topk_ids[i], p.E_local);
}

class AllToAll final : public PrepareFinalize {
 public:
  explicit AllToAll(const ExecContext& ctx) : pool_(ctx.pool), comm_(ctx.comm) {}
  std::string_view name() const override { return "all-to-all"; }
  Device device() const override { return Device::kCpu; }
  ActivationFormat format() const override { return ActivationFormat::kBatchedExperts; }
  void declare(const MoeProblem& p, WorkspaceBuilder& b) const override { declare_experts_io(p, b); }

  ExpertsInput prepare(const MoeProblem& p, const PrepareArgs& a, Workspace& ws, Stream) override {
    ws.require(p, "all-to-all prepare");
    MOEKIT_CHECK(comm_ != nullptr && pool_ != nullptr, "all-to-all runs over a communicator and a thread pool");
    // Ids are slots: rank r holds [r * E_local, (r + 1) * E_local), E or more of them (redundant
    // experts, moekit/placement.h, make the router's ids slots before the dispatch).
    const std::int64_t slots = comm_->size() * p.E_local;
    MOEKIT_CHECK(slots >= p.E, "all-to-all: {} ranks x E_local = {} hold {} slots, fewer than the E = {} experts",
                 comm_->size(), p.E_local, slots, p.E);
    MOEKIT_CHECK(comm_->size() <= plan::kMaxEpRanks && p.topk <= plan::kMaxEpTopk,
                 "all-to-all: {} ranks and topk = {}; the transport takes at most {} ranks and topk {}", comm_->size(),
                 p.topk, plan::kMaxEpRanks, plan::kMaxEpTopk);
    MOEKIT_CHECK(a.num_tokens >= 0 && a.num_tokens <= p.max_tokens_per_rank,
                 "prepare: {} tokens exceed max_tokens_per_rank = {}: chunk the step", a.num_tokens,
                 p.max_tokens_per_rank);
    MOEKIT_CHECK(a.num_tokens == 0 || a.topk_weights != nullptr,
                 "all-to-all prepare: topk_weights is null; the owner applies them before the combine");
    // Bad data is flagged and dropped, as the NCCL transports do: every rank finishes the step's
    // exchanges (no peer is left waiting in a collective) and check_status() raises on this rank.
    pending_.clear();
    for (std::int64_t i = 0; i < a.num_tokens * p.topk && pending_.empty(); ++i)
      if (a.topk_ids[i] < -1 || a.topk_ids[i] >= slots)
        pending_ = fmt::format(
            "prepare: topk_ids[{}][{}] = {} is outside [0, {}) (or -1: none): the router produced an invalid expert; "
            "that pair was dropped",
            i / p.topk, i % p.topk, a.topk_ids[i],
            slots == p.E ? fmt::format("E = {}", p.E) : fmt::format("{} expert slots", slots));
    const std::int64_t K = p.K, M = p.M, topk = p.topk, E_local = p.E_local, tc = a.num_tokens;
    const plan::EpRecord rl = plan::ep_record(p.quant, K, topk);
    const std::int64_t spr = rl.scales_per_row, rb = rl.bytes, row_bytes = rl.row_bytes;
    const bool scaled = has_activation_scales(recipe_info(p.quant));
    const int P = comm_->size();
    // The tokens as the experts read them: FP8 codes + scales, or bf16 rows (K elements, row_bytes).
    tok_q_.resize(static_cast<std::size_t>(p.max_tokens_per_rank * row_bytes));
    tok_scale_.resize(static_cast<std::size_t>(activation_scale_count(p.quant, p.max_tokens_per_rank, K)));
    store_activation(p.quant, a.hidden, tc, K, K, tok_q_.data(), K, tok_scale_.data());

    // Destinations of each token and its index among the tokens sent to each (token order).
    const auto uP = static_cast<std::size_t>(P);
    send_count_.assign(uP, 0);
    send_index_.assign(static_cast<std::size_t>(tc) * uP, -1);
    for (std::int64_t t = 0; t < tc; ++t)
      for (int r = 0; r < P; ++r)
        if (slot_mask(a, p, t, r) != 0)
          send_index_[static_cast<std::size_t>(t) * uP + static_cast<std::size_t>(r)] =
              send_count_[static_cast<std::size_t>(r)]++;
    recv_count_.assign(uP, 0);
    comm_->all_to_all_counts(send_count_, recv_count_);
    send_off_.assign(uP, 0);
    recv_off_.assign(uP, 0);
    std::int64_t total_send = 0;
    total_recv_ = 0;
    for (std::size_t r = 0; r < uP; ++r) {
      send_off_[r] = total_send;
      total_send += send_count_[r];
      recv_off_[r] = total_recv_;
      total_recv_ += recv_count_[r];
    }
    send_buf_.assign(static_cast<std::size_t>(total_send * rb), std::byte{0});
    recv_buf_.resize(static_cast<std::size_t>(total_recv_ * rb));
    std::vector<std::int32_t> hdr(static_cast<std::size_t>(rl.header_bytes / 4));
    for (std::int64_t t = 0; t < tc; ++t) {
      int ordinal = 0;
      for (int r = 0; r < P; ++r) {
        const std::int64_t idx = send_index_[static_cast<std::size_t>(t) * uP + static_cast<std::size_t>(r)];
        if (idx < 0) continue;
        std::byte* rec = send_buf_.data() + (send_off_[static_cast<std::size_t>(r)] + idx) * rb;
        std::fill(hdr.begin(), hdr.end(), 0);
        const std::int32_t mask = slot_mask(a, p, t, r);
        hdr[plan::kEpHeaderToken] = static_cast<std::int32_t>(t);
        hdr[plan::kEpHeaderSlotMask] = mask;
        hdr[plan::kEpHeaderOrdinal] = ordinal++;
        for (std::int64_t k = 0; k < topk; ++k) {
          const bool here = mask >> k & 1;
          hdr[static_cast<std::size_t>(plan::kEpHeaderExperts + k)] =
              here ? static_cast<std::int32_t>(a.topk_ids[t * topk + k] - r * E_local) : -1;
          const float w = here ? a.topk_weights[t * topk + k] : 0.0f;
          std::memcpy(&hdr[static_cast<std::size_t>(plan::ep_header_weight(topk) + k)], &w, 4);
        }
        std::memcpy(rec, hdr.data(), static_cast<std::size_t>(rl.header_bytes));
        std::memcpy(rec + rl.row_offset, tok_q_.data() + t * row_bytes, static_cast<std::size_t>(row_bytes));
        if (spr > 0)  // an unquantized recipe's rows carry no scales (tok_scale_ is empty)
          std::memcpy(rec + rl.scale_offset, tok_scale_.data() + t * spr, static_cast<std::size_t>(4 * spr));
      }
    }
    comm_->all_to_all_v(send_buf_.data(), times(send_count_, rb), times(send_off_, rb), recv_buf_.data(),
                        times(recv_count_, rb), times(recv_off_, rb));

    // Fan out into (E_local, M, K): rows in (source rank, token, slot) order.
    auto* a1q = reinterpret_cast<std::uint8_t*>(ws.get<std::byte>("a1q"));
    auto* a1q_scale = scaled ? ws.get<float>("a1q_scale") : nullptr;
    auto* counts = ws.get<std::int32_t>("expert_num_tokens");
    std::fill(counts, counts + E_local, 0);
    recv_row_.assign(static_cast<std::size_t>(total_recv_ * topk), -1);  // row of each (record, slot)
    recv_weight_.assign(recv_row_.size(), 0.0f);
    for (std::int64_t j = 0; j < total_recv_; ++j) {
      const std::byte* rec = recv_buf_.data() + j * rb;
      for (std::int64_t k = 0; k < topk; ++k) {
        std::int32_t le = 0;
        std::memcpy(&le, rec + 4 * (plan::kEpHeaderExperts + k), 4);
        std::memcpy(&recv_weight_[static_cast<std::size_t>(j * topk + k)], rec + 4 * (plan::ep_header_weight(topk) + k),
                    4);
        if (le == -1) continue;
        if (le < 0 || le >= E_local) {
          if (pending_.empty())
            pending_ =
                fmt::format("dispatch record {} names local expert {} outside [0, {}): it was dropped", j, le, E_local);
          continue;
        }
        if (counts[le] >= M) {
          if (pending_.empty())
            pending_ = fmt::format(
                "expert {} received more than M = {} rows: dispatch capacity exceeded; the rows past M were dropped",
                le, M);
          continue;
        }
        const std::int64_t row = counts[le]++;
        recv_row_[static_cast<std::size_t>(j * topk + k)] = static_cast<std::int32_t>(le * M + row);
        std::memcpy(a1q + (le * M + row) * row_bytes, rec + rl.row_offset, static_cast<std::size_t>(row_bytes));
        if (spr > 0)
          std::memcpy(a1q_scale + (le * M + row) * spr, rec + rl.scale_offset, static_cast<std::size_t>(4 * spr));
      }
    }
    // Per-tensor (dp == 1 only): one scale per expert tensor, the rank's own.
    if (numerics::activation_scale_per_tensor(p.quant))
      for (std::int64_t le = 0; le < E_local; ++le) a1q_scale[le] = tok_scale_[0];
    return {a1q, a1q_scale, counts, nullptr, tc, ws.get<std::uint16_t>("expert_output")};
  }

  // Raises for what the last prepare flagged (once).
  void check_status(Workspace&, Stream) override {
    if (pending_.empty()) return;
    const std::string why = std::move(pending_);
    pending_.clear();
    MOEKIT_FAIL("{}", why);
  }

  void finalize(const MoeProblem& p, const FinalizeArgs& a, Workspace& ws, Stream) override {
    ws.require(p, "all-to-all finalize");
    MOEKIT_CHECK(!a.accumulate, "the all-to-all finalize writes its output; it does not accumulate into it");
    MOEKIT_CHECK(a.output_dtype == DType::kBf16, "the all-to-all finalize writes bf16 (the layer's output), not {}",
                 dtype_name(a.output_dtype));
    const std::int64_t K = p.K, topk = p.topk, tc = a.num_tokens, ret = 4 * K;
    const int P = comm_->size();
    const auto uP = static_cast<std::size_t>(P);
    // The owner's partial of each received record (its slots, fp32, slot order), back in the order
    // the records came.
    back_buf_.resize(static_cast<std::size_t>(total_recv_ * K));
    combine_topk_fp32(total_recv_, topk, K, recv_weight_.data(), a.experts.rows, recv_row_.data(), back_buf_.data(),
                      *pool_, recipe_info(p.quant).output_dtype);
    std::int64_t total_send = 0;
    for (auto c : send_count_) total_send += c;
    ret_buf_.resize(static_cast<std::size_t>(total_send * K));
    comm_->all_to_all_v(back_buf_.data(), times(recv_count_, ret), times(recv_off_, ret), ret_buf_.data(),
                        times(send_count_, ret), times(send_off_, ret));
    // The source: partials in rank order, one bf16 rounding (a token routed nowhere: 0).
    pool_->parallel_for(tc, [&](std::int64_t t0, std::int64_t t1) {
      std::vector<float> acc(static_cast<std::size_t>(K));
      for (std::int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (std::size_t r = 0; r < uP; ++r) {
          const std::int64_t idx = send_index_[static_cast<std::size_t>(t) * uP + r];
          if (idx < 0) continue;
          const float* part = ret_buf_.data() + (send_off_[r] + idx) * K;
          for (std::int64_t c = 0; c < K; ++c) acc[static_cast<std::size_t>(c)] += part[c];
        }
        for (std::int64_t c = 0; c < K; ++c) a.output[t * K + c] = bf16_encode(acc[static_cast<std::size_t>(c)]);
      }
    });
  }

 private:
  static std::vector<std::int64_t> times(std::vector<std::int64_t> v, std::int64_t bytes) {
    for (auto& x : v) x *= bytes;
    return v;
  }

  // Bit k: slot k of token t routes to an expert rank r holds.
  static std::int32_t slot_mask(const PrepareArgs& a, const MoeProblem& p, std::int64_t t, int r) {
    std::int32_t mask = 0;
    for (std::int64_t k = 0; k < p.topk; ++k) {
      const std::int32_t e = a.topk_ids[t * p.topk + k];
      if (e >= 0 && e / p.E_local == r) mask |= 1 << k;
    }
    return mask;
  }

  ThreadPool* pool_;
  Communicator* comm_;
  std::vector<fp8_t> tok_q_;
  std::vector<float> tok_scale_;
  // Kept across chunks and steps: resize() stops allocating once each has reached its largest size.
  std::vector<std::byte> send_buf_, recv_buf_;
  std::vector<float> back_buf_, ret_buf_, recv_weight_;
  std::vector<std::int64_t> send_count_, recv_count_, send_off_, recv_off_, send_index_;
  std::vector<std::int32_t> recv_row_;
  std::int64_t total_recv_ = 0;
  std::string pending_;  // the first error of the last prepare, raised by check_status
};

class Local final : public PrepareFinalize {
 public:
  explicit Local(const ExecContext& ctx) : pool_(ctx.pool) {}
  std::string_view name() const override { return "local"; }
  Device device() const override { return Device::kCpu; }
  ActivationFormat format() const override { return ActivationFormat::kStandard; }
  void declare(const MoeProblem& p, WorkspaceBuilder& b) const override { declare_experts_io(p, b); }

  ExpertsInput prepare(const MoeProblem& p, const PrepareArgs& a, Workspace& ws, Stream) override {
    ws.require(p, "local prepare");
    MOEKIT_CHECK(p.E_local >= p.E, "the local prepare/finalize holds every expert (ep == 1); E_local = {} of E = {}",
                 p.E_local, p.E);
    check_ids(p, a);
    auto* a1q = reinterpret_cast<std::uint8_t*>(ws.get<std::byte>("a1q"));
    auto* a1q_scale = has_activation_scales(recipe_info(p.quant)) ? ws.get<float>("a1q_scale") : nullptr;
    store_activation(p.quant, a.hidden, a.num_tokens, p.K, p.K, a1q, p.K, a1q_scale);
    return {a1q, a1q_scale, nullptr, a.topk_ids, a.num_tokens, nullptr};
  }

  void check_status(Workspace&, Stream) override {}

  void finalize(const MoeProblem& p, const FinalizeArgs& a, Workspace& ws, Stream) override {
    ws.require(p, "local finalize");
    MOEKIT_CHECK(pool_ != nullptr, "the local finalize runs on a thread pool");
    combine_topk(a.num_tokens, p.topk, p.K, a.topk_weights, a.experts.rows, a.experts.row_of, a.output, *pool_,
                 a.accumulate, recipe_info(p.quant).output_dtype, a.output_dtype);
  }

 private:
  ThreadPool* pool_;
};

}  // namespace

std::unique_ptr<PrepareFinalize> make_all_to_all(const ExecContext& ctx) {
  return std::make_unique<AllToAll>(ctx);
}

std::unique_ptr<PrepareFinalize> make_local(const ExecContext& ctx) {
  return std::make_unique<Local>(ctx);
}

}  // namespace moekit::cpu
