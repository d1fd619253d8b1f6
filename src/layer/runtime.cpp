// The runtime as a composition of its seams (moekit/runtime.h): it validates the layout, picks the
// implementations from the registry, allocates the one workspace from plan_layer, validates each
// registered layer's weights (and uploads its expert placement), and runs Router -> placement ->
// prepare -> experts -> finalize per chunk of a layer's step. Nothing here computes.
#include "moekit/runtime.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <exception>
#include <limits>
#include <string>
#include <vector>

#include "cpu/placement.h"
#include "cpu/thread_pool.h"
#include "cuda/placement.h"
#include "moekit/check.h"
#include "moekit/registry.h"
#include "numerics/fp8.h"
#include "numerics/scales.h"
#include "plan/gemm_config.h"

namespace moekit {
namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// A registered layer: its weights and, with redundant experts, its placement where the step reads
// it: one small buffer on the runtime's device, load counts (uint64, E_physical) then the replica
// tables (int32, E + 1 and E_physical), at fixed addresses for the layer's lifetime.
struct LayerState {
  LayerWeights weights;                        // weights.placement points at `placement`
  std::unique_ptr<ExpertPlacement> placement;  // null: slot = expert
  DeviceBuffer tables;
  plan::PlacementTables view;
};

// An error raised inside a step, said again with where it was raised: the runtime's layer and the
// seam (router, prepare, experts, finalize, shared experts); layer < 0 when not known.
[[noreturn]] void rethrow_at(const Error& e, int layer, std::string_view seam) {
  std::string_view m = e.what();
  if (m.starts_with("moekit: ")) m.remove_prefix(8);
  throw Error(layer >= 0 ? fmt::format("moekit: layer {}, seam {}: {}", layer, seam, m)
                         : fmt::format("moekit: seam {}: {}", seam, m),
              e.where());
}

// The first non-finite bf16 (fp16: fp16) value of n, or -1: its exponent bits all set.
std::int64_t first_non_finite_16(const std::uint16_t* v, std::int64_t n, bool fp16 = false) {
  const std::uint16_t exponent = fp16 ? 0x7C00u : 0x7F80u;
  for (std::int64_t i = 0; i < n; ++i)
    if ((v[i] & exponent) == exponent) return i;
  return -1;
}

}  // namespace

struct MoeRuntime::Impl {
  LayerOptions options;
  ModelConfig model;
  Communicator& comm;
  ParallelConfig parallel;
  MoeProblem problem;
  cpu::ThreadPool pool;
  std::unique_ptr<Memory> memory;     // the device's allocator
  std::unique_ptr<Memory> symmetric;  // the transport's (NCCL's symmetric memory), for the workspace
  std::vector<LayerState> layers;     // registered layers, by index (their tables in `memory`)
  std::unique_ptr<Router> router;
  std::unique_ptr<PrepareFinalize> prepare_finalize;
  std::unique_ptr<Experts> experts;
  bool collective_chunks = false;  // the prepare/finalize is collective: every rank runs as many chunks
  WorkspacePlan plan;              // unguarded: what `moekit plan` prints
  std::unique_ptr<Workspace> workspace;
  StepStats stats;
  // The shared experts (when the step has them): their own seams over their section of the one
  // workspace, on a second stream forked from the step's.
  std::optional<MoeProblem> shared_problem;
  std::unique_ptr<Router> shared_router;
  std::unique_ptr<PrepareFinalize> shared_prepare_finalize;
  std::unique_ptr<Experts> shared_experts;
  std::unique_ptr<Workspace> shared_workspace;  // a part of `workspace`
  std::unique_ptr<StreamFork> fork;

  Impl(const ModelConfig& m, const ParallelConfig& par, const LayerOptions& opt, Communicator& c)
      : options(opt), model(m), comm(c), parallel(par), pool(std::max(1, opt.num_threads)) {
    MOEKIT_CHECK(comm.size() == parallel.dp,
                 "the communicator has {} ranks but dp = {}: run with --dp {} or mpirun -np {}", comm.size(),
                 parallel.dp, comm.size(), parallel.dp);
    MOEKIT_CHECK(parallel.ep == parallel.dp || parallel.ep == 1,
                 "ep = {} with dp = {}: the layer runs ep == dp (experts spread over all ranks) or ep == 1 (every "
                 "rank holds every expert)",
                 parallel.ep, parallel.dp);
    // The device's allocator first: a GPU runtime where moekit was built without CUDA, or where no
    // device is present, is refused here, naming which, before any seam is made.
    memory = make_memory(options.device);
    const ExpertsEntry& entry = find_experts(options.experts, options.device);
    problem = make_problem(model, parallel, entry.format, options.quant, options.activation.value_or(model.activation),
                           options.fuse_w1, options.accumulation);
    if (numerics::activation_scale_per_tensor(problem.quant))
      MOEKIT_CHECK(parallel.dp == 1,
                   "per-tensor activation scales are per rank, and rows from {} ranks cannot share one: use --quant "
                   "per-token or block128 with dp > 1",
                   parallel.dp);
    const PrepareFinalizeEntry* pf =
        find_prepare_finalize(options.device, entry.format, parallel.ep, options.prepare_finalize);
    MOEKIT_CHECK(pf != nullptr || options.prepare_finalize.empty(),
                 "no prepare/finalize '{}' runs the {} format on {} with ep = {}: moekit has {}",
                 options.prepare_finalize, format_name(entry.format), device_name(options.device), parallel.ep,
                 prepare_finalize_names(options.device, entry.format, parallel.ep));
    MOEKIT_CHECK(pf != nullptr, "no prepare/finalize runs the {} format on {} with ep = {}{}",
                 format_name(entry.format), device_name(options.device), parallel.ep,
                 entry.format == ActivationFormat::kStandard ? ": the standard format runs with ep == 1; use the "
                                                               "batched format (batched-fp8) for expert parallelism"
                                                             : "");
    const RouterEntry* router_entry = find_router(options.device);
    MOEKIT_CHECK(router_entry != nullptr, "no router runs on {}: use --device cpu", device_name(options.device));
    const RoutingConfig routing = routing_config(model);
    if (options.shared_experts) shared_problem = shared_experts_problem(model, problem);

    const ExecContext ctx{&pool, &comm};
    router = router_entry->make(routing, ctx);
    prepare_finalize = pf->make(ctx);
    experts = entry.make(ctx);
    collective_chunks = pf->multi_rank;
    plan = plan_layer(problem, entry, parallel.ep, 0, pf->name, shared_problem);
    const std::int64_t guard_bytes = options.checked ? options.guard_bytes : 0;
    WorkspacePlan allocated =
        options.checked ? plan_layer(problem, entry, parallel.ep, guard_bytes, pf->name, shared_problem) : plan;
    // Ranks that exchange data must have planned the same layer: a transport stores at its own
    // region offsets in its peers' workspaces. Agreed before anything is allocated or registered.
    if (collective_chunks) require_same_plan(allocated);
    // Symmetric memory for NCCL's device-initiated transport, the device's allocator otherwise.
    symmetric = prepare_finalize->workspace_memory();
    // One allocation, once, at the maximum size; never grown on the hot path.
    workspace = std::make_unique<Workspace>(std::move(allocated), symmetric ? *symmetric : *memory);
    if (options.checked) workspace->poison(nullptr);
    prepare_finalize->attach(*workspace, nullptr);
    if (shared_problem) {
      const ExecContext local{&pool, nullptr};
      shared_router = router_entry->make(RoutingConfig{1, 1}, local);
      shared_prepare_finalize =
          find_prepare_finalize(options.device, ActivationFormat::kStandard, 1, kSharedPrepareFinalize)->make(local);
      shared_experts = find_experts(kSharedExpertsImpl, options.device).make(local);
      shared_workspace =
          workspace->part(plan_shared_experts(*shared_problem, options.device, guard_bytes), kSharedExpertsSection);
      fork = make_stream_fork(options.device);
    }
  }

  // The shared experts' weights are there exactly when the step computes them, in their problem's
  // shape; the gate exactly when the model has one.
  void validate_layer(const LayerWeights& weights) const {
    validate_weights(weights.experts, problem, options.device);
    MOEKIT_CHECK(!model.has_score_correction_bias || weights.e_score_correction_bias != nullptr,
                 "model '{}' routes with e_score_correction_bias: pass LayerWeights::e_score_correction_bias ({} fp32 "
                 "values on the {})",
                 model.name, problem.E, device_name(options.device));
    validate_shared_weights(weights);
  }

  void validate_shared_weights(const LayerWeights& weights) const {
    const bool has = shared_problem.has_value();
    const ExpertWeightsView& w = weights.shared_experts;
    if (!has) {
      MOEKIT_CHECK(w.w1 == nullptr && w.w2 == nullptr && weights.shared_expert_gate == nullptr,
                   "LayerWeights holds shared experts, but {}: drop them",
                   model.shared_intermediate_size == 0
                       ? fmt::format("model '{}' ({}) has none", model.name, model.model_type)
                       : std::string("LayerOptions::shared_experts is false (the caller runs them)"));
      return;
    }
    MOEKIT_CHECK(
        w.w1 != nullptr,
        "model '{}' ({}) has shared experts (shared_intermediate_size = {}): pass LayerWeights::shared_experts "
        "(one expert, N = {}, K = {}), or set LayerOptions::shared_experts = false to run the routed experts "
        "only",
        model.name, model.model_type, model.shared_intermediate_size, shared_problem->N, shared_problem->K);
    try {
      validate_weights(w, *shared_problem, options.device);
    } catch (const Error& e) {
      MOEKIT_FAIL("the shared experts' weights (LayerWeights::shared_experts): {}", e.what());
    }
    MOEKIT_CHECK(
        (weights.shared_expert_gate != nullptr) == model.shared_expert_gate,
        "model '{}' ({}) {}: {} LayerWeights::shared_expert_gate", model.name, model.model_type,
        model.shared_expert_gate ? "gates its shared experts (shared_expert_gate)" : "has no shared expert gate",
        model.shared_expert_gate ? fmt::format("pass {} bf16 values as", shared_problem->K) : "drop");
  }

  // Expert slots over the ranks: E without redundant experts.
  std::int64_t num_slots() const { return problem.E_local * parallel.ep; }

  // A layer's placement: the given one (validated), the round-robin default where the ranks hold
  // more slots than E, or none.
  std::unique_ptr<ExpertPlacement> resolve_placement(const LayerWeights& weights) const {
    const std::int64_t slots = num_slots();
    if (weights.placement != nullptr) {
      const ExpertPlacement& given = *weights.placement;
      MOEKIT_CHECK(given.num_logical == problem.E && given.num_physical() == slots,
                   "the placement (LayerWeights::placement) puts {} experts in {} slots; this runtime's ranks hold E = "
                   "{} experts in {} slots (E_local = {} x ep = {}): make it with {} slots",
                   given.num_logical, given.num_physical(), problem.E, slots, problem.E_local, parallel.ep, slots);
      // Derived again: the caller's replica tables are not trusted to match its map.
      return std::make_unique<ExpertPlacement>(make_placement(problem.E, given.physical_to_logical));
    }
    if (auto d = default_placement(problem.E, slots)) return std::make_unique<ExpertPlacement>(std::move(*d));
    return nullptr;
  }

  // A validated layer, its placement's tables uploaded.
  LayerState make_layer(const LayerWeights& weights) {
    validate_layer(weights);
    LayerState state;
    state.placement = resolve_placement(weights);
    state.weights = weights;
    state.weights.placement = state.placement.get();
    const std::int64_t slots = num_slots();
    if (state.placement) {
      // (E_physical) uint64 counts, then (E + 1) + (E_physical) int32: at DeepSeek-V3's 512 slots, 6 KiB.
      state.tables = DeviceBuffer(*memory, slots * 8 + (problem.E + 1 + slots) * 4, "expert placement tables");
      auto* base = state.tables.as<std::byte>();
      state.view.load = reinterpret_cast<unsigned long long*>(base);
      state.view.replica_offsets = reinterpret_cast<std::int32_t*>(base + slots * 8);
      state.view.replica_slots = state.view.replica_offsets + problem.E + 1;
      state.view.num_logical = problem.E;
      state.view.num_physical = slots;
      upload_placement(state, nullptr);
    }
    return state;
  }

  // The replica tables where the step reads them (state.view, laid out by make_layer), and the load
  // counts zeroed; after the work enqueued on `stream`.
  void upload_placement(const LayerState& state, Stream stream) {
    const ExpertPlacement& pl = *state.placement;
    const plan::PlacementTables& v = state.view;
    memory->fill(v.load, 0, v.num_physical * 8, stream);
    memory->from_host(const_cast<std::int32_t*>(v.replica_offsets), pl.replica_offsets.data(), (v.num_logical + 1) * 4,
                      stream);
    memory->from_host(const_cast<std::int32_t*>(v.replica_slots), pl.replica_slots.data(), v.num_physical * 4, stream);
  }

  // The router's logical ids -> slot ids in place, by the replica rule; token_base = the chunk's
  // first token in the call + this rank.
  void place_experts(const LayerState& state, std::int32_t* ids, std::int64_t num_tokens, std::int64_t token_base,
                     Stream stream) const {
    if (options.device == Device::kCuda)
      cuda::launch_place_experts(ids, num_tokens, problem.topk, token_base, state.view, stream);
    else
      cpu::place_experts(ids, num_tokens, problem.topk, token_base, state.view);
  }

  // Every rank's plan (problem, regions, offsets, sizes, guard bands) hashes the same, or every rank
  // raises moekit::Error.
  void require_same_plan(const WorkspacePlan& p) const {
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the plan's description
    auto mix = [&h](std::string_view s) {
      for (const char c : s) h = (h ^ static_cast<unsigned char>(c)) * 1099511628211ull;
    };
    mix(problem.describe());
    mix(p.name);
    for (const auto& r : p.regions) mix(fmt::format("{}:{}:{};", r.name, r.offset, r.bytes));
    mix(fmt::format("{}:{}", p.total_bytes, p.guards.size()));
    const auto mine = static_cast<std::int64_t>(h >> 1);  // non-negative: -mine never overflows
    const std::int64_t highest = comm.all_reduce_max(mine), lowest = -comm.all_reduce_max(-mine);  // both, always
    const bool same = highest == mine && lowest == mine;
    MOEKIT_CHECK(same,
                 "rank {} planned a different layer than another rank ({}, {} bytes{}): every rank must build it with "
                 "the same model, parallel layout, experts, quantization, dispatch and checked mode",
                 comm.rank(), problem.describe(), p.total_bytes, p.guards.empty() ? "" : ", guard bands");
  }

  // max_tokens_any_rank: the most tokens any rank feeds this step (0: not known), for the experts.
  // first_token: the chunk's first token in the call (the replica rule's token index).
  void run_chunk(int index, const LayerState& layer, const std::uint16_t* hidden, const float* logits, std::int64_t tc,
                 std::uint16_t* out, Stream stream, const MoeLayer::StageObserver& observe,
                 std::int64_t max_tokens_any_rank, std::int64_t first_token) {
    const LayerWeights& weights = layer.weights;
    Workspace& ws = *workspace;
    if (options.checked) ws.poison(stream);  // padding rows and every region NaN
    auto stage = [&](std::string_view name, double& ms, auto&& fn) {
      const auto t0 = Clock::now();
      auto result = [&] {
        try {
          return fn();
        } catch (const Error& e) {
          rethrow_at(e, index, name);
        }
      }();
      ms += ms_since(t0);
      if (observe) observe(name, stream);
      return result;
    };
    if (observe) observe("start", stream);
    // The shared experts first, on the side stream: they need nothing from the routed step, which
    // then overlaps them. On the CPU they simply run first.
    RouterOutput shared;
    ExpertsOutput shared_rows;
    if (shared_problem) {
      const auto t0 = Clock::now();
      Workspace& sws = *shared_workspace;
      const Stream side = fork->fork(stream);
      try {
        shared = shared_router->route_shared(*shared_problem, hidden, tc, weights.shared_expert_gate, sws, side);
        const ExpertsInput sin = shared_prepare_finalize->prepare(
            *shared_problem, {hidden, shared.topk_ids, shared.topk_weights, tc}, sws, side);
        shared_rows = shared_experts->run(*shared_problem, sin, weights.shared_experts, sws, side);
      } catch (const Error& e) {
        rethrow_at(e, index, "shared experts");
      }
      stats.shared_ms += ms_since(t0);
    }
    const RouterOutput routed = stage("route", stats.route_ms, [&] {
      const RouterOutput r = router->route(problem, logits, tc, weights.e_score_correction_bias, ws, stream);
      if (layer.placement) place_experts(layer, r.topk_ids, tc, first_token + comm.rank(), stream);
      return r;
    });
    ExpertsInput in = stage("prepare", stats.prepare_ms, [&] {
      return prepare_finalize->prepare(problem, {hidden, routed.topk_ids, routed.topk_weights, tc}, ws, stream);
    });
    in.max_tokens_any_rank = max_tokens_any_rank;
    const ExpertsOutput rows =
        stage("experts", stats.experts_ms, [&] { return experts->run(problem, in, weights.experts, ws, stream); });
    stage("finalize", stats.finalize_ms, [&] {
      prepare_finalize->finalize(problem, {routed.topk_weights, tc, rows, out}, ws, stream);
      if (shared_problem) {  // the routed output, then the shared experts' rows added to it
        fork->join(stream);
        shared_prepare_finalize->finalize(*shared_problem, {shared.topk_weights, tc, shared_rows, out, true},
                                          *shared_workspace, stream);
      }
      return 0;
    });
  }

  // Where a non-finite value in a layer's output entered, for the message: the hidden states (the
  // input), the layer's weights (the router's correction bias, the routed or the shared experts'
  // codes, scales and biases), or none of them: then a row the step must not read reached a result
  // (a bug). Reads them back from the device, expert by expert: an error path.
  std::string locate_non_finite(const LayerState& state, const std::uint16_t* hidden, std::int64_t T, Stream stream) {
    const std::int64_t K = problem.K;
    std::vector<std::uint16_t> h(static_cast<std::size_t>(T * K));
    memory->to_host(h.data(), hidden, T * K * 2, stream);
    if (const std::int64_t i = first_non_finite_16(h.data(), T * K); i >= 0)
      return fmt::format("the input: hidden state of token {} column {} is {} (before the router)", i / K, i % K,
                         numerics::bf16_decode(h[static_cast<std::size_t>(i)]));
    auto floats = [&](const float* p, std::int64_t n) -> std::int64_t {
      if (p == nullptr || n == 0) return -1;
      std::vector<float> v(static_cast<std::size_t>(n));
      memory->to_host(v.data(), p, n * 4, stream);
      for (std::int64_t i = 0; i < n; ++i)
        if (!std::isfinite(v[static_cast<std::size_t>(i)])) return i;
      return -1;
    };
    // n weight elements in the recipe's dtype: FP8 codes (NaN: 0x7F / 0xFF) or bf16 / fp16 values.
    auto codes = [&](const std::uint8_t* p, std::int64_t n, DType dtype) -> std::int64_t {
      if (dtype != DType::kFp8E4m3) {
        std::vector<std::uint16_t> v(static_cast<std::size_t>(n));
        memory->to_host(v.data(), p, 2 * n, stream);
        return first_non_finite_16(v.data(), n, dtype == DType::kFp16);
      }
      std::vector<std::uint8_t> v(static_cast<std::size_t>(n));
      memory->to_host(v.data(), p, n, stream);
      for (std::int64_t i = 0; i < n; ++i)
        if ((v[static_cast<std::size_t>(i)] & 0x7Fu) == 0x7Fu) return i;
      return -1;
    };
    if (const std::int64_t i = floats(state.weights.e_score_correction_bias, problem.E); i >= 0)
      return fmt::format("seam router: e_score_correction_bias[{}] is not finite (the layer's weights)", i);
    auto scan_experts = [&](const ExpertWeightsView& w, std::string_view seam) -> std::string {
      for (std::int64_t e = 0; e < w.E_local; ++e) {
        const ExpertWeightsView x = w.expert(e);
        const DType dtype = recipe_info(w.quant).weight_dtype;
        const bool fp8 = dtype == DType::kFp8E4m3;
        const std::pair<const char*, std::int64_t> found[] = {
            {fp8 ? "W1 code" : "W1 value", codes(x.w1, w.N * w.K, dtype)},
            {fp8 ? "W2 code" : "W2 value", codes(x.w2, w.K * w.I, dtype)},
            {"W1 scale", floats(x.w1_scale, w.w1_scale_stride())},
            {"W2 scale", floats(x.w2_scale, w.w2_scale_stride())},
            {"W1 bias", floats(x.w1_bias, x.w1_bias ? w.N : 0)},
            {"W2 bias", floats(x.w2_bias, x.w2_bias ? w.K : 0)}};
        for (const auto& [what, i] : found)
          if (i >= 0)
            return fmt::format("seam {}: local expert {}'s {} {} is not finite (the layer's weights)", seam, e, what,
                               i);
      }
      return {};
    };
    if (std::string where = scan_experts(state.weights.experts, "experts"); !where.empty()) return where;
    if (shared_problem && state.weights.shared_experts.w1 != nullptr)
      if (std::string where = scan_experts(state.weights.shared_experts, "shared experts"); !where.empty())
        return where;
    return "no input or weight: every hidden state and weight is finite, so a row the step must not read (padding, "
           "a poisoned workspace or an unwritten row) reached a result in the experts or finalize seam: a bug, "
           "please report it";
  }

  LayerState& layer(int index) {
    MOEKIT_CHECK(index >= 0 && static_cast<std::size_t>(index) < layers.size(),
                 "layer {} is not registered with this runtime: it holds {} layer{} (add_layer returns 0 to {})", index,
                 layers.size(), layers.size() == 1 ? "" : "s",
                 layers.empty() ? std::string("-") : std::to_string(layers.size() - 1));
    return layers[static_cast<std::size_t>(index)];
  }
  const LayerState& layer(int index) const { return const_cast<Impl*>(this)->layer(index); }

  // In pipeline order, so the first cause is the one reported. Every seam reads (and so clears) its
  // flags before the first error is raised: the flags persist until read, and a later check must
  // not report what this one's error caused downstream.
  // layer: the runtime's layer whose step was the last enqueued (-1: not known).
  void check_status(Stream stream, int layer = -1) {
    std::exception_ptr first;
    auto check = [&](std::string_view seam, auto&& seam_check) {
      try {
        try {
          seam_check();
        } catch (const Error& e) {
          rethrow_at(e, layer, seam);
        }
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    };
    // The transport first: a broken expert-parallel group (a silent or failed peer) outranks any
    // error of the step's data, which that failure may have caused.
    check("prepare-finalize", [&] { prepare_finalize->check_status(*workspace, stream); });
    check("router", [&] { router->check_status(*workspace, stream); });
    check("experts", [&] { experts->check_status(*workspace, stream); });
    if (shared_problem) {
      check("shared experts", [&] { shared_router->check_status(*shared_workspace, stream); });
      check("shared experts", [&] { shared_prepare_finalize->check_status(*shared_workspace, stream); });
      check("shared experts", [&] { shared_experts->check_status(*shared_workspace, stream); });
    }
    if (first) std::rethrow_exception(first);
    if (options.checked) workspace->verify_guards(stream);
  }
};

MoeRuntime::MoeRuntime(const ModelConfig& model, const ParallelConfig& parallel, const LayerOptions& options,
                       Communicator& comm)
    : impl_(std::make_unique<Impl>(model, parallel, options, comm)) {}

MoeRuntime::~MoeRuntime() = default;

int MoeRuntime::add_layer(const LayerWeights& weights) {
  Impl& s = *impl_;
  MOEKIT_CHECK(s.layers.size() < static_cast<std::size_t>(std::numeric_limits<int>::max()),
               "a runtime holds at most {} layers", std::numeric_limits<int>::max());
  s.layers.push_back(s.make_layer(weights));
  return static_cast<int>(s.layers.size() - 1);
}

const ExpertPlacement* MoeRuntime::placement(int layer) const {
  return impl_->layer(layer).placement.get();
}

std::vector<std::int64_t> MoeRuntime::expert_load(int layer, Stream stream) {
  Impl& s = *impl_;
  const LayerState& state = s.layer(layer);
  MOEKIT_CHECK(state.placement != nullptr,
               "layer {} has no expert placement, so its step counts no load: register it with one "
               "(LayerWeights::placement; round_robin_placement(E, E) is the identity)",
               layer);
  const std::int64_t slots = state.view.num_physical;
  std::vector<unsigned long long> counts(static_cast<std::size_t>(slots));
  s.memory->to_host(counts.data(), state.view.load, slots * 8, stream);
  s.memory->fill(state.view.load, 0, slots * 8, stream);
  return {counts.begin(), counts.end()};
}

void MoeRuntime::replace_layer(int layer, const LayerWeights& weights, Stream stream) {
  Impl& s = *impl_;
  LayerState& state = s.layer(layer);
  s.validate_layer(weights);  // before anything changes
  std::unique_ptr<ExpertPlacement> placement = s.resolve_placement(weights);
  MOEKIT_CHECK((placement != nullptr) == (state.placement != nullptr),
               "replace_layer: layer {} was registered {} placement; the new weights come {} one: a layer keeps "
               "whether it counts its load",
               layer, state.placement ? "with a" : "without a", placement ? "with" : "without");
  state.weights = weights;
  if (state.placement) {
    // The step reads the old tables' addresses (a captured graph too): the new placement goes there.
    state.placement = std::move(placement);
    s.upload_placement(state, stream);
  }
  state.weights.placement = state.placement.get();
}

int MoeRuntime::num_layers() const {
  return static_cast<int>(impl_->layers.size());
}

const LayerWeights& MoeRuntime::layer_weights(int layer) const {
  return impl_->layer(layer).weights;
}

void MoeRuntime::forward(int layer, const std::uint16_t* hidden, const float* router_logits, std::int64_t num_tokens,
                         std::uint16_t* output, Stream stream) {
  Impl& s = *impl_;
  const LayerState& state = s.layer(layer);
  MOEKIT_CHECK(num_tokens >= 0, "num_tokens = {} must be >= 0", num_tokens);
  MOEKIT_CHECK(num_tokens == 0 || (hidden && router_logits && output),
               "hidden, router_logits and output must be non-null for {} tokens", num_tokens);
  const auto t_start = Clock::now();
  s.stats = StepStats{};
  s.stats.tokens = num_tokens;
  const std::int64_t chunk = s.parallel.max_tokens_per_rank, K = s.problem.K, E = s.problem.E;
  // A collective prepare/finalize needs every rank in every chunk, however many tokens it has; the
  // most tokens of any rank also bounds each chunk's rows an expert can hold (its GEMM launches).
  const std::int64_t most = s.collective_chunks ? s.comm.all_reduce_max(num_tokens) : num_tokens;
  const std::int64_t chunks = (most + chunk - 1) / chunk;
  s.stats.chunks = chunks;
  if (s.options.checked && num_tokens > 0) s.memory->fill(output, 0xFF, num_tokens * K * 2, stream);
  for (std::int64_t c = 0; c < chunks; ++c) {
    const std::int64_t t0 = std::min(num_tokens, c * chunk);
    const std::int64_t tc = std::min(chunk, num_tokens - t0);
    s.run_chunk(layer, state, hidden + t0 * K, router_logits + t0 * E, tc, output + t0 * K, stream, {},
                std::min(chunk, most - c * chunk), t0);
    s.check_status(stream, layer);
  }
  if (s.options.checked) check_output(layer, hidden, num_tokens, output, stream);
  s.stats.total_ms = ms_since(t_start);
}

void MoeRuntime::enqueue(int layer, const std::uint16_t* hidden, const float* router_logits, std::int64_t num_tokens,
                         std::uint16_t* output, Stream stream, const MoeLayer::StageObserver& observer,
                         std::int64_t max_tokens_any_rank) {
  Impl& s = *impl_;
  const LayerState& state = s.layer(layer);
  MOEKIT_CHECK(num_tokens >= 0 && num_tokens <= s.problem.max_tokens_per_rank,
               "enqueue: {} tokens; one step holds 0 to max_tokens_per_rank = {}: use forward() to chunk larger steps",
               num_tokens, s.problem.max_tokens_per_rank);
  MOEKIT_CHECK(num_tokens == 0 || (hidden && router_logits && output),
               "hidden, router_logits and output must be non-null for {} tokens", num_tokens);
  plan::step_tokens_per_rank(s.problem, num_tokens, max_tokens_any_rank);  // raises for a bad declaration
  s.run_chunk(layer, state, hidden, router_logits, num_tokens, output, stream, observer, max_tokens_any_rank, 0);
}

void MoeRuntime::check_status(Stream stream) {
  impl_->check_status(stream);
}

void MoeRuntime::check_output(int layer, const std::uint16_t* hidden, std::int64_t num_tokens,
                              const std::uint16_t* output, Stream stream) {
  Impl& s = *impl_;
  const LayerState& state = s.layer(layer);
  if (num_tokens <= 0) return;
  const std::int64_t K = s.problem.K;
  std::vector<std::uint16_t> host(static_cast<std::size_t>(num_tokens * K));
  s.memory->to_host(host.data(), output, num_tokens * K * 2, stream);
  const std::int64_t bad = first_non_finite_16(host.data(), num_tokens * K);
  if (bad < 0) return;
  const float v = numerics::bf16_decode(host[static_cast<std::size_t>(bad)]);
  MOEKIT_FAIL("layer {}: output of token {} column {} is {}; it entered at {}", layer, bad / K, bad % K,
              std::isnan(v) ? "NaN"
              : v > 0       ? "+Inf"
                            : "-Inf",
              s.locate_non_finite(state, hidden, num_tokens, stream));
}

const MoeProblem& MoeRuntime::problem() const {
  return impl_->problem;
}
const std::optional<MoeProblem>& MoeRuntime::shared_problem() const {
  return impl_->shared_problem;
}
const WorkspacePlan& MoeRuntime::plan() const {
  return impl_->plan;
}
std::int64_t MoeRuntime::allocated_workspace_bytes() const {
  return impl_->workspace->bytes();
}
const StepStats& MoeRuntime::last_step() const {
  return impl_->stats;
}

}  // namespace moekit
