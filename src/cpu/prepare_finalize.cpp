// The PrepareFinalize seam on the CPU.
// all-to-all (batched format, any number of ranks): every (token, slot) pair travels as one record
// (header + FP8 row + its scales) to the rank owning its expert and lands in that expert's (M, K)
// buffer, rows in (source rank, record) order; its bf16 result travels back and the source sums the
// top-k results in slot order in fp32 and rounds once, so the output is bit-identical however the
// tokens are spread over ranks. Record buffers are host staging of the communicator, sized per step.
// local (standard format, ep == 1): quantize in place; the experts permute; combine their rows.
#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "cpu/backend.h"
#include "cpu/combine.h"
#include "cpu/quant.h"
#include "moekit/check.h"

namespace moekit::cpu {
namespace {

constexpr std::int64_t kRecordHeader = 16;  // int32 token, slot, local expert, pad

void check_ids(const MoeProblem& p, const PrepareArgs& a) {
  MOEKIT_CHECK(a.num_tokens >= 0 && a.num_tokens <= p.max_tokens_per_rank,
               "prepare: {} tokens exceed max_tokens_per_rank = {}: chunk the step", a.num_tokens,
               p.max_tokens_per_rank);
  for (std::int64_t i = 0; i < a.num_tokens * p.topk; ++i)
    MOEKIT_CHECK(a.topk_ids[i] >= -1 && a.topk_ids[i] < p.E,
                 "prepare: topk_ids[{}][{}] = {} is outside [0, E = {}) (or -1: none): the router produced an invalid "
                 "expert",
                 i / p.topk, i % p.topk, a.topk_ids[i], p.E);
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
    MOEKIT_CHECK(comm_->size() * p.E_local == p.E,
                 "all-to-all: {} ranks x E_local = {} do not hold the E = {} experts (one expert, one rank)",
                 comm_->size(), p.E_local, p.E);
    check_ids(p, a);
    const std::int64_t K = p.K, M = p.M, topk = p.topk, E_local = p.E_local, tc = a.num_tokens;
    const std::int64_t spr = activation_scales_per_row(p.quant, K);
    const int P = comm_->size();
    tok_q_.resize(static_cast<std::size_t>(p.max_tokens_per_rank * K));
    tok_scale_.resize(static_cast<std::size_t>(activation_scale_count(p.quant, p.max_tokens_per_rank, K)));
    quantize_activation(p.quant, a.hidden, tc, K, K, tok_q_.data(), K, tok_scale_.data());

    // (token, slot) records grouped by destination rank, in (token, slot) order.
    const std::int64_t rb = (kRecordHeader + K + 4 * spr + 15) / 16 * 16;
    send_count_.assign(static_cast<std::size_t>(P), 0);
    recv_count_.assign(static_cast<std::size_t>(P), 0);
    for (std::int64_t i = 0; i < tc * topk; ++i)
      if (a.topk_ids[i] >= 0) ++send_count_[static_cast<std::size_t>(a.topk_ids[i] / E_local)];
    comm_->all_to_all_counts(send_count_, recv_count_);
    send_off_.assign(static_cast<std::size_t>(P), 0);
    recv_off_.assign(static_cast<std::size_t>(P), 0);
    total_recv_ = 0;
    for (int r = 0; r < P; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      send_off_[ur] = r == 0 ? 0 : send_off_[ur - 1] + send_count_[ur - 1];
      recv_off_[ur] = total_recv_;
      total_recv_ += recv_count_[ur];
    }
    send_buf_.resize(static_cast<std::size_t>(tc * topk * rb));
    recv_buf_.resize(static_cast<std::size_t>(total_recv_ * rb));
    std::vector<std::int64_t> fill(send_off_);
    pair_record_.resize(static_cast<std::size_t>(tc * topk));  // record index of each pair at its destination
    for (std::int64_t i = 0; i < tc * topk; ++i) {
      const std::int32_t e = a.topk_ids[i];
      if (e < 0) {
        pair_record_[static_cast<std::size_t>(i)] = -1;  // routed nowhere: no record, skipped by the combine
        continue;
      }
      const std::int64_t idx = fill[static_cast<std::size_t>(e / E_local)]++;
      pair_record_[static_cast<std::size_t>(i)] = idx;
      std::byte* rec = send_buf_.data() + idx * rb;
      const std::int32_t header[4] = {static_cast<std::int32_t>(i / topk), static_cast<std::int32_t>(i % topk),
                                      static_cast<std::int32_t>(e % E_local), 0};
      std::memcpy(rec, header, sizeof(header));
      std::memcpy(rec + kRecordHeader, tok_q_.data() + (i / topk) * K, static_cast<std::size_t>(K));
      std::memcpy(rec + kRecordHeader + K, tok_scale_.data() + (i / topk) * spr, static_cast<std::size_t>(4 * spr));
    }
    comm_->all_to_all_v(send_buf_.data(), times(send_count_, rb), times(send_off_, rb), recv_buf_.data(),
                        times(recv_count_, rb), times(recv_off_, rb));

    // Scatter into (E_local, M, K): rows in (source rank, record) order.
    auto* a1q = ws.get<fp8_t>("a1q");
    auto* a1q_scale = ws.get<float>("a1q_scale");
    auto* counts = ws.get<std::int32_t>("expert_num_tokens");
    std::fill(counts, counts + E_local, 0);
    recv_row_.resize(static_cast<std::size_t>(total_recv_));  // le * M + row of each record
    for (std::int64_t j = 0; j < total_recv_; ++j) {
      const std::byte* rec = recv_buf_.data() + j * rb;
      std::int32_t header[4];
      std::memcpy(header, rec, sizeof(header));
      const std::int32_t le = header[2];
      MOEKIT_CHECK(le >= 0 && le < E_local, "dispatch record {} names local expert {} outside [0, {})", j, le, E_local);
      const std::int64_t row = counts[le]++;
      MOEKIT_CHECK(row < M, "expert {} received more than M = {} rows: dispatch capacity exceeded", le, M);
      recv_row_[static_cast<std::size_t>(j)] = le * M + row;
      std::memcpy(a1q + (le * M + row) * K, rec + kRecordHeader, static_cast<std::size_t>(K));
      std::memcpy(a1q_scale + (le * M + row) * spr, rec + kRecordHeader + K, static_cast<std::size_t>(4 * spr));
    }
    // Per-tensor (dp == 1 only): one scale per expert tensor, the rank's own.
    if (p.quant == QuantScheme::kPerTensor)
      for (std::int64_t le = 0; le < E_local; ++le) a1q_scale[le] = tok_scale_[0];
    return {a1q, a1q_scale, counts, nullptr, tc, ws.get<bf16_t>("expert_output")};
  }

  void check_status(Workspace&, Stream) override {}

  void finalize(const MoeProblem& p, const FinalizeArgs& a, Workspace& ws, Stream) override {
    ws.require(p, "all-to-all finalize");
    const std::int64_t K = p.K, topk = p.topk, tc = a.num_tokens, ret = 2 * K;
    // Results travel back in the order their records came.
    back_buf_.resize(static_cast<std::size_t>(total_recv_ * ret));
    pool_->parallel_for(total_recv_, [&](std::int64_t j0, std::int64_t j1) {
      for (std::int64_t j = j0; j < j1; ++j)
        std::memcpy(back_buf_.data() + j * ret, a.experts.rows + recv_row_[static_cast<std::size_t>(j)] * K,
                    static_cast<std::size_t>(ret));
    });
    ret_buf_.resize(static_cast<std::size_t>(tc * topk * ret));
    comm_->all_to_all_v(back_buf_.data(), times(recv_count_, ret), times(recv_off_, ret), ret_buf_.data(),
                        times(send_count_, ret), times(send_off_, ret));
    // ret_buf_ holds one row per record, in the order the pairs were sent: the combine reads each
    // pair's row through its record index (-1: none).
    pair_row_.resize(static_cast<std::size_t>(tc * topk));
    for (std::int64_t i = 0; i < tc * topk; ++i)
      pair_row_[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(pair_record_[static_cast<std::size_t>(i)]);
    combine_topk(tc, topk, K, a.topk_weights, reinterpret_cast<const bf16_t*>(ret_buf_.data()), pair_row_.data(),
                 a.output, *pool_);
  }

 private:
  static std::vector<std::int64_t> times(std::vector<std::int64_t> v, std::int64_t bytes) {
    for (auto& x : v) x *= bytes;
    return v;
  }

  ThreadPool* pool_;
  Communicator* comm_;
  std::vector<fp8_t> tok_q_;
  std::vector<float> tok_scale_;
  // Kept across chunks and steps: resize() stops allocating once each has reached its largest size.
  std::vector<std::byte> send_buf_, recv_buf_, back_buf_, ret_buf_;
  std::vector<std::int64_t> send_count_, recv_count_, send_off_, recv_off_, recv_row_, pair_record_;
  std::int64_t total_recv_ = 0;
  std::vector<std::int32_t> pair_row_;
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
    MOEKIT_CHECK(p.E_local == p.E, "the local prepare/finalize holds every expert (ep == 1); E_local = {} of E = {}",
                 p.E_local, p.E);
    check_ids(p, a);
    auto* a1q = ws.get<fp8_t>("a1q");
    auto* a1q_scale = ws.get<float>("a1q_scale");
    quantize_activation(p.quant, a.hidden, a.num_tokens, p.K, p.K, a1q, p.K, a1q_scale);
    return {a1q, a1q_scale, nullptr, a.topk_ids, a.num_tokens, nullptr};
  }

  void check_status(Workspace&, Stream) override {}

  void finalize(const MoeProblem& p, const FinalizeArgs& a, Workspace& ws, Stream) override {
    ws.require(p, "local finalize");
    MOEKIT_CHECK(pool_ != nullptr, "the local finalize runs on a thread pool");
    combine_topk(a.num_tokens, p.topk, p.K, a.topk_weights, a.experts.rows, a.experts.row_of, a.output, *pool_);
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
