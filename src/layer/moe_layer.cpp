// The layer runner on the CPU backend. Batched format: every (token, slot) pair travels as one
// record to the rank owning its expert, lands in that expert's (M, K) buffer, and its bf16 result
// travels back; the source sums the top-k results in slot order in fp32 and rounds once, so the
// output is bit-identical however the tokens are spread over ranks. Standard format (ep == 1):
// each rank holds every expert and permutes its own tokens.
#include "moekit/layer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/experts.h"
#include "cpu/quant.h"
#include "cpu/random.h"
#include "cpu/routing.h"
#include "moekit/check.h"
#include "plan/experts_workspace.h"

namespace moekit {
namespace {

using cpu::bf16_t;
using cpu::fp8_t;
using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

constexpr std::int64_t kRecordHeader = 16;  // int32 token, slot, local expert, pad

}  // namespace

struct MoeLayer::Impl {
  ModelConfig model;
  ParallelConfig parallel;
  LayerOptions options;
  Communicator& comm;
  MoeProblem problem;
  WorkspacePlan plan;    // unguarded: what `moekit plan` prints
  WorkspacePlan placed;  // as allocated (guard bands in checked mode)
  std::vector<std::byte> workspace_storage;
  std::byte* workspace = nullptr;
  plan::BatchedFp8Workspace batched_ws;
  plan::StandardFp8Workspace standard_ws;
  cpu::ThreadPool pool;
  cpu::RoutingConfig routing;
  std::vector<float> bias;
  cpu::ExpertWeights weights;
  std::int64_t first_expert = 0;
  StepStats stats;

  // Buffers outside the workspace (the plan lists them), allocated once at their maximum.
  std::vector<fp8_t> a1q;        // batched: (E_local, M, K); standard: (M, K)
  std::vector<float> a1q_scale;  // batched: per plan; standard: (M, spr)
  std::vector<std::int32_t> expert_num_tokens;
  std::vector<bf16_t> expert_out;  // batched: (E_local, M, K)
  // Per chunk scratch of the source side and the dispatch records.
  std::vector<std::int32_t> topk_ids;
  std::vector<float> topk_weights;
  std::vector<fp8_t> tok_q;  // (max_tokens_per_rank, K)
  std::vector<float> tok_scale;
  // Dispatch and combine records, kept across chunks and steps: resize() stops allocating once each
  // has reached its largest size.
  std::vector<std::byte> send_buf, recv_buf, back_buf, ret_buf;
  std::vector<std::int64_t> recv_row;
  std::vector<bf16_t> pair_out;  // (max_tokens_per_rank * topk, K)
  std::vector<double> pair_ref;  // same, float64 reference (options.reference)

  Impl(const ModelConfig& m, const ParallelConfig& par, const LayerOptions& opt, Communicator& c)
      : model(m), parallel(par), options(opt), comm(c), pool(std::max(1, opt.num_threads)) {
    MOEKIT_CHECK(comm.size() == parallel.dp,
                 "the communicator has {} ranks but dp = {}: run with --ranks {} or "
                 "mpirun -np {}",
                 comm.size(), parallel.dp, parallel.dp, parallel.dp);
    MOEKIT_CHECK(parallel.ep == parallel.dp || parallel.ep == 1,
                 "ep = {} with dp = {}: the CPU layer runs ep == dp (experts spread over all ranks) or ep == 1 "
                 "(every rank holds every expert)",
                 parallel.ep, parallel.dp);
    const Activation act = options.activation.value_or(model.activation);
    problem = make_problem(model, parallel, options.format, options.quant, act);
    MOEKIT_CHECK(problem.E_local * parallel.ep == problem.E,
                 "the layer needs E_local * ep == E, got {} * {} != {} (redundant experts are a planning option only)",
                 problem.E_local, parallel.ep, problem.E);
    if (options.format == ActivationFormat::kStandard)
      MOEKIT_CHECK(parallel.ep == 1,
                   "the standard format runs with ep == 1 here (got ep = {}): use the batched "
                   "format for expert parallelism",
                   parallel.ep);
    if (options.quant == QuantScheme::kPerTensor)
      MOEKIT_CHECK(parallel.dp == 1,
                   "per-tensor activation scales are per rank, and rows from {} ranks cannot "
                   "share one: use --quant per-token or block128 with dp > 1",
                   parallel.dp);
    first_expert = parallel.ep == 1 ? 0 : comm.rank() * problem.E_local;
    routing = cpu::routing_config(model);
    if (model.has_score_correction_bias) {
      bias.resize(static_cast<std::size_t>(problem.E));
      cpu::SplitMix rng = cpu::stream(options.seed, 3, 0);
      for (auto& b : bias) b = 0.1f * rng.normal();
    }
    const std::string backend = options.format == ActivationFormat::kBatchedExperts ? "batched-fp8" : "standard-fp8";
    plan = plan_workspace(backend, problem);
    const std::int64_t guard = options.checked ? options.guard_bytes : 0;
    placed = plan_workspace(backend, problem, guard);
    // One allocation, once, at the maximum size; never grown on the hot path.
    workspace_storage.resize(static_cast<std::size_t>(placed.total_bytes + WorkspaceBuilder::kAlignment));
    auto base = reinterpret_cast<std::uintptr_t>(workspace_storage.data());
    workspace = workspace_storage.data() +
                ((WorkspaceBuilder::kAlignment - base % WorkspaceBuilder::kAlignment) % WorkspaceBuilder::kAlignment);
    WorkspaceBuilder builder(backend, problem, workspace, placed.total_bytes, guard);
    if (options.format == ActivationFormat::kBatchedExperts)
      batched_ws = plan::declare_batched_fp8(problem, builder);
    else
      standard_ws = plan::declare_standard_fp8(problem, builder);
    builder.finish();
    std::memset(workspace, 0xFF, static_cast<std::size_t>(placed.total_bytes));
    for (const auto& g : placed.guards)
      std::memset(workspace + g.offset, WorkspaceBuilder::kGuardByte, static_cast<std::size_t>(g.bytes));

    weights = cpu::make_random_weights(problem, first_expert, options.seed, pool);

    const std::int64_t K = problem.K, M = problem.M, T = parallel.max_tokens_per_rank, topk = problem.topk;
    topk_ids.resize(static_cast<std::size_t>(T * topk));
    topk_weights.resize(static_cast<std::size_t>(T * topk));
    tok_q.resize(static_cast<std::size_t>(T * K));
    tok_scale.resize(static_cast<std::size_t>(cpu::activation_scale_count(problem.quant, T, K)));
    if (options.format == ActivationFormat::kBatchedExperts) {
      a1q.resize(static_cast<std::size_t>(problem.E_local * M * K));
      a1q_scale.resize(
          static_cast<std::size_t>(shape_bytes(plan.region("a1q_scale").shape, DType::kFp32, "a1q_scale") / 4));
      expert_num_tokens.resize(static_cast<std::size_t>(problem.E_local));
      expert_out.resize(static_cast<std::size_t>(problem.E_local * M * K));
      pair_out.resize(static_cast<std::size_t>(T * topk * K));
      if (options.reference) pair_ref.resize(static_cast<std::size_t>(T * topk * K));
    }
  }

  std::int64_t record_bytes() const {
    const std::int64_t spr = cpu::activation_scales_per_row(problem.quant, problem.K);
    return (kRecordHeader + problem.K + 4 * spr + 15) / 16 * 16;
  }
  std::int64_t return_bytes() const { return problem.K * 2 + (options.reference ? problem.K * 8 : 0); }

  void verify_guards() const {
    for (const auto& g : placed.guards) {
      for (std::int64_t i = 0; i < g.bytes; ++i) {
        if (static_cast<std::uint8_t>(workspace[g.offset + i]) != WorkspaceBuilder::kGuardByte) {
          std::string near = "the start";
          for (const auto& r : placed.regions)
            if (r.offset + r.bytes <= g.offset) near = "region '" + r.name + "'";
          MOEKIT_FAIL(
              "checked mode: guard band at offset {} (+{}) was overwritten, just after {}: a kernel wrote "
              "outside its region",
              g.offset, i, near);
        }
      }
    }
  }

  void poison_workspace() {
    for (const auto& r : placed.regions)
      std::memset(workspace + r.offset, 0xFF, static_cast<std::size_t>(r.bytes));  // NaN in fp8/bf16/fp32
  }

  // Routes and quantizes tokens [t0, t0 + tc) of this rank.
  void route_and_quantize(const bf16_t* hidden, const float* logits, std::int64_t tc) {
    cpu::route(routing, logits, tc, bias.empty() ? nullptr : bias.data(), topk_ids.data(), topk_weights.data());
    cpu::quantize_activation(problem.quant, hidden, tc, problem.K, problem.K, tok_q.data(), problem.K,
                             tok_scale.data());
  }

  void forward_batched_chunk(const bf16_t* hidden, const float* logits, std::int64_t tc, bf16_t* out) {
    const std::int64_t K = problem.K, M = problem.M, topk = problem.topk, E_local = problem.E_local;
    const std::int64_t spr = cpu::activation_scales_per_row(problem.quant, K);
    const int P = comm.size();
    auto t0 = Clock::now();
    route_and_quantize(hidden, logits, tc);
    stats.route_quant_ms += ms_since(t0);

    // --- dispatch: (token, slot) records grouped by destination rank, in (token, slot) order.
    t0 = Clock::now();
    const std::int64_t rb = record_bytes();
    std::vector<std::int64_t> send_count(static_cast<std::size_t>(P), 0), recv_count(static_cast<std::size_t>(P));
    for (std::int64_t i = 0; i < tc * topk; ++i)
      ++send_count[static_cast<std::size_t>(topk_ids[static_cast<std::size_t>(i)] / E_local)];
    comm.all_to_all_counts(send_count, recv_count);
    std::vector<std::int64_t> send_off(static_cast<std::size_t>(P), 0), recv_off(static_cast<std::size_t>(P), 0);
    std::int64_t total_recv = 0;
    for (int r = 0; r < P; ++r) {
      const auto ur = static_cast<std::size_t>(r);
      send_off[ur] = r == 0 ? 0 : send_off[ur - 1] + send_count[ur - 1];
      recv_off[ur] = total_recv;
      total_recv += recv_count[ur];
    }
    send_buf.resize(static_cast<std::size_t>(tc * topk * rb));
    recv_buf.resize(static_cast<std::size_t>(total_recv * rb));
    std::vector<std::int64_t> fill(send_off);
    std::vector<std::int64_t> pair_dest_slot(static_cast<std::size_t>(tc * topk));  // record index at its dest
    for (std::int64_t i = 0; i < tc * topk; ++i) {
      const std::int32_t e = topk_ids[static_cast<std::size_t>(i)];
      const auto dest = static_cast<std::size_t>(e / E_local);
      const std::int64_t idx = fill[dest]++;
      pair_dest_slot[static_cast<std::size_t>(i)] = idx;
      std::byte* rec = send_buf.data() + idx * rb;
      const std::int32_t header[4] = {static_cast<std::int32_t>(i / topk), static_cast<std::int32_t>(i % topk),
                                      static_cast<std::int32_t>(e % E_local), 0};
      std::memcpy(rec, header, sizeof(header));
      std::memcpy(rec + kRecordHeader, tok_q.data() + (i / topk) * K, static_cast<std::size_t>(K));
      std::memcpy(rec + kRecordHeader + K, tok_scale.data() + (i / topk) * spr, static_cast<std::size_t>(4 * spr));
    }
    auto bytes = [rb](std::vector<std::int64_t> v) {
      for (auto& x : v) x *= rb;
      return v;
    };
    comm.all_to_all_v(send_buf.data(), bytes(send_count), bytes(send_off), recv_buf.data(), bytes(recv_count),
                      bytes(recv_off));

    // Scatter into (E_local, M, K): rows in (source rank, record) order.
    if (options.checked) {
      std::fill(a1q.begin(), a1q.end(), fp8_t{0xFF});  // padding rows are NaN
      std::fill(a1q_scale.begin(), a1q_scale.end(), std::numeric_limits<float>::quiet_NaN());
      std::fill(expert_out.begin(), expert_out.end(), bf16_t{0xFFFF});
      poison_workspace();
    }
    std::fill(expert_num_tokens.begin(), expert_num_tokens.end(), 0);
    recv_row.resize(static_cast<std::size_t>(total_recv));  // le * M + row of each record
    for (std::int64_t j = 0; j < total_recv; ++j) {
      const std::byte* rec = recv_buf.data() + j * rb;
      std::int32_t header[4];
      std::memcpy(header, rec, sizeof(header));
      const std::int32_t le = header[2];
      MOEKIT_CHECK(le >= 0 && le < E_local, "dispatch record {} names local expert {} outside [0, {})", j, le, E_local);
      const std::int64_t row = expert_num_tokens[static_cast<std::size_t>(le)]++;
      MOEKIT_CHECK(row < M, "expert {} received more than M = {} rows: dispatch capacity exceeded", le, M);
      recv_row[static_cast<std::size_t>(j)] = le * M + row;
      std::memcpy(a1q.data() + (le * M + row) * K, rec + kRecordHeader, static_cast<std::size_t>(K));
      std::memcpy(a1q_scale.data() + (le * M + row) * spr, rec + kRecordHeader + K, static_cast<std::size_t>(4 * spr));
    }
    // Per-tensor (dp == 1 only): one scale per expert tensor, the rank's own.
    if (problem.quant == QuantScheme::kPerTensor)
      for (std::int64_t le = 0; le < E_local; ++le) a1q_scale[static_cast<std::size_t>(le)] = tok_scale[0];
    stats.dispatch_ms += ms_since(t0);

    // --- experts
    t0 = Clock::now();
    cpu::batched_experts(problem, weights, a1q.data(), a1q_scale.data(), expert_num_tokens.data(), expert_out.data(),
                         batched_ws, pool);
    stats.expert_rows += total_recv;
    stats.experts_ms += ms_since(t0);

    // --- combine: results travel back in the order their records came.
    t0 = Clock::now();
    const std::int64_t ret = return_bytes();
    back_buf.resize(static_cast<std::size_t>(total_recv * ret));
    pool.parallel_for(total_recv, [&](std::int64_t j0, std::int64_t j1) {
      for (std::int64_t j = j0; j < j1; ++j) {
        const std::int64_t flat = recv_row[static_cast<std::size_t>(j)];
        std::byte* dst = back_buf.data() + j * ret;
        std::memcpy(dst, expert_out.data() + flat * K, static_cast<std::size_t>(2 * K));
        if (options.reference) {
          const std::int64_t le = flat / M;
          std::vector<double> y(static_cast<std::size_t>(K));
          const float act_scale = problem.quant == QuantScheme::kPerTensor ? batched_ws.act_scale[le] : 0.0f;
          const float* a_scale =
              problem.quant == QuantScheme::kPerTensor ? a1q_scale.data() + le : a1q_scale.data() + flat * spr;
          cpu::expert_row_ref(problem, weights, le, a1q.data() + flat * K, a_scale, y.data(), act_scale);
          std::memcpy(dst + 2 * K, y.data(), static_cast<std::size_t>(8 * K));
        }
      }
    });
    ret_buf.resize(static_cast<std::size_t>(tc * topk * ret));
    auto rbytes = [ret](std::vector<std::int64_t> v) {
      for (auto& x : v) x *= ret;
      return v;
    };
    comm.all_to_all_v(back_buf.data(), rbytes(recv_count), rbytes(recv_off), ret_buf.data(), rbytes(send_count),
                      rbytes(send_off));
    for (std::int64_t i = 0; i < tc * topk; ++i) {
      const std::byte* src = ret_buf.data() + pair_dest_slot[static_cast<std::size_t>(i)] * ret;
      std::memcpy(pair_out.data() + i * K, src, static_cast<std::size_t>(2 * K));
      if (options.reference) std::memcpy(pair_ref.data() + i * K, src + 2 * K, static_cast<std::size_t>(8 * K));
    }
    // Weighted sum in slot order, fp32, one rounding: the formula standard_experts uses too.
    cpu::combine_topk(tc, topk, K, topk_weights.data(), pair_out.data(), nullptr, out, pool);
    if (options.reference) {
      for (std::int64_t t = 0; t < tc; ++t) {
        for (std::int64_t c = 0; c < K; ++c) {
          double ref = 0;
          for (std::int64_t k = 0; k < topk; ++k)
            ref += static_cast<double>(topk_weights[static_cast<std::size_t>(t * topk + k)]) *
                   pair_ref[static_cast<std::size_t>((t * topk + k) * K + c)];
          const double d = static_cast<double>(cpu::bf16_decode(out[t * K + c])) - ref;
          stats.ref_err_sq += d * d;
          stats.ref_norm_sq += ref * ref;
        }
      }
    }
    stats.combine_ms += ms_since(t0);
  }

  void forward_standard_chunk(const bf16_t* hidden, const float* logits, std::int64_t tc, bf16_t* out) {
    const std::int64_t K = problem.K, topk = problem.topk;
    const std::int64_t spr = cpu::activation_scales_per_row(problem.quant, K);
    auto t0 = Clock::now();
    route_and_quantize(hidden, logits, tc);
    stats.route_quant_ms += ms_since(t0);
    t0 = Clock::now();
    if (options.checked) poison_workspace();
    cpu::standard_experts(problem, weights, tc, tok_q.data(), tok_scale.data(), topk_ids.data(), topk_weights.data(),
                          out, standard_ws, pool);
    stats.expert_rows += tc * topk;
    stats.experts_ms += ms_since(t0);
    if (options.reference) {
      std::vector<double> y(static_cast<std::size_t>(K)), ref(static_cast<std::size_t>(K));
      for (std::int64_t t = 0; t < tc; ++t) {
        std::fill(ref.begin(), ref.end(), 0.0);
        for (std::int64_t k = 0; k < topk; ++k) {
          const std::int32_t e = topk_ids[static_cast<std::size_t>(t * topk + k)];
          cpu::expert_row_ref(problem, weights, e, tok_q.data() + t * K, tok_scale.data() + t * spr, y.data(),
                              problem.quant == QuantScheme::kPerTensor ? standard_ws.act_scale[0] : 0.0f);
          for (std::int64_t c = 0; c < K; ++c)
            ref[static_cast<std::size_t>(c)] +=
                static_cast<double>(topk_weights[static_cast<std::size_t>(t * topk + k)]) *
                y[static_cast<std::size_t>(c)];
        }
        for (std::int64_t c = 0; c < K; ++c) {
          const double d = static_cast<double>(cpu::bf16_decode(out[t * K + c])) - ref[static_cast<std::size_t>(c)];
          stats.ref_err_sq += d * d;
          stats.ref_norm_sq += ref[static_cast<std::size_t>(c)] * ref[static_cast<std::size_t>(c)];
        }
      }
    }
  }
};

MoeLayer::MoeLayer(const ModelConfig& model, const ParallelConfig& parallel, const LayerOptions& options,
                   Communicator& comm)
    : impl_(std::make_unique<Impl>(model, parallel, options, comm)) {}

MoeLayer::~MoeLayer() = default;

void MoeLayer::forward(const std::uint16_t* hidden, const float* router_logits, std::int64_t num_tokens,
                       std::uint16_t* output) {
  Impl& s = *impl_;
  MOEKIT_CHECK(num_tokens >= 0, "num_tokens = {} must be >= 0", num_tokens);
  MOEKIT_CHECK(num_tokens == 0 || (hidden && router_logits && output),
               "hidden, router_logits and output must be non-null for {} tokens", num_tokens);
  const auto t_start = Clock::now();
  s.stats = StepStats{};
  s.stats.tokens = num_tokens;
  const std::int64_t chunk = s.parallel.max_tokens_per_rank, K = s.problem.K, E = s.problem.E;
  // Every rank runs the same number of chunks (collectives), however many tokens it has.
  const std::int64_t my_chunks = (num_tokens + chunk - 1) / chunk;
  const std::int64_t chunks =
      s.problem.format == ActivationFormat::kBatchedExperts ? s.comm.all_reduce_max(my_chunks) : my_chunks;
  s.stats.chunks = chunks;
  if (s.options.checked && num_tokens > 0) std::fill(output, output + num_tokens * K, std::uint16_t{0xFFFF});
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t t0 = std::min(num_tokens, c * chunk);
    const std::int64_t tc = std::min(chunk, num_tokens - t0);
    if (s.problem.format == ActivationFormat::kBatchedExperts)
      s.forward_batched_chunk(hidden + t0 * K, router_logits + t0 * E, tc, output + t0 * K);
    else
      s.forward_standard_chunk(hidden + t0 * K, router_logits + t0 * E, tc, output + t0 * K);
    if (s.options.checked) s.verify_guards();
  }
  if (s.options.checked) {
    for (std::int64_t i = 0; i < num_tokens * K; ++i)
      MOEKIT_CHECK(!std::isnan(cpu::bf16_decode(output[i])),
                   "checked mode: output of token {} column {} is NaN: padding, poisoned workspace or an unwritten "
                   "row reached a result",
                   i / K, i % K);
  }
  s.stats.total_ms = ms_since(t_start);
}

const MoeProblem& MoeLayer::problem() const {
  return impl_->problem;
}
const WorkspacePlan& MoeLayer::plan() const {
  return impl_->plan;
}
std::int64_t MoeLayer::allocated_workspace_bytes() const {
  return impl_->placed.total_bytes;
}
const StepStats& MoeLayer::last_step() const {
  return impl_->stats;
}
std::int64_t MoeLayer::first_local_expert() const {
  return impl_->first_expert;
}
const std::vector<float>& MoeLayer::routing_bias() const {
  return impl_->bias;
}

}  // namespace moekit
