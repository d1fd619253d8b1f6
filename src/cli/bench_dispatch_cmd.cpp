// `moekit bench dispatch`: the expert-parallel transport alone (the prepare/finalize seam of the
// batched format over NCCL), one rank per GPU (in-process threads, or mpirun processes): dispatch,
// combine and the round trip, each captured in a CUDA graph and replayed (device-initiated tier) or
// run eagerly (reference tier, which reads counts on the host), median and p99 over --iters, the max
// over ranks. Routing: uniform (each token's top-k distinct experts drawn at random) or skewed (every
// token's experts on rank 0). Reports the bytes that cross to other GPUs, their rate against NCCL's
// measured point-to-point bandwidth in the same run, and the transport's buffer bytes.
// Dispatch alone and combine alone are replayed back to back without the other phase's handshake,
// so a peer may overwrite records this rank is still reading: their data is racy (only their time
// is reported); the round trip is the layer's own pattern.
#include <fmt/format.h>

#include <algorithm>
#include <ctime>
#include <iostream>
#include <mutex>
#include <random>

#include "ceilings/ceilings.h"
#include "cli/commands.h"
#include "cuda/backend.h"
#include "cuda/device_info.h"
#include "cuda/ep_launch.h"
#include "cuda/launch.h"
#include "moekit/check.h"
#include "moekit/registry.h"
#include "plan/ep_layout.h"
#include "synthetic/synthetic.h"

namespace moekit::cli {
namespace {

struct Timing {
  double median_us = 0, p99_us = 0;
};

struct DispatchRow {
  std::string routing;
  std::int64_t T = 0;
  Timing dispatch, combine, round_trip;  // each replay synchronized on the host before the next
  // Replays enqueued back to back (per-replay events, one synchronization at the end): what an engine
  // that launches ahead sees; no host launch skew between the ranks. Graph replay only.
  Timing dispatch_pipelined, combine_pipelined, round_trip_pipelined;
  double dispatch_bytes = 0, combine_bytes = 0;  // crossing to other GPUs, the max over ranks
  std::int64_t buffer_bytes = 0;                 // the transport's regions (prepare-finalize section)
};

// Top-k distinct experts per token: uniform over all, or among rank 0's; positive weights.
void make_routing(const std::string& routing, std::int64_t T, std::int64_t E, std::int64_t E_local, std::int64_t topk,
                  std::uint64_t seed, std::vector<std::int32_t>& ids, std::vector<float>& wts) {
  std::mt19937_64 rng(seed);
  const std::int64_t pool = routing == "skewed" ? E_local : E;
  ids.assign(static_cast<std::size_t>(T * topk), -1);
  wts.assign(ids.size(), 0.0f);
  std::vector<std::int32_t> all(static_cast<std::size_t>(pool));
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t e = 0; e < pool; ++e) all[static_cast<std::size_t>(e)] = static_cast<std::int32_t>(e);
    for (std::int64_t k = 0; k < topk; ++k) {
      const auto j =
          static_cast<std::size_t>(k) + static_cast<std::size_t>(rng() % static_cast<std::uint64_t>(pool - k));
      std::swap(all[static_cast<std::size_t>(k)], all[j]);
      ids[static_cast<std::size_t>(t * topk + k)] = all[static_cast<std::size_t>(k)];
      wts[static_cast<std::size_t>(t * topk + k)] = 0.05f + static_cast<float>(rng() % 1000) / 4000.0f;
    }
  }
}

Timing time_graph(const std::function<void(void*)>& enqueue, void* stream, int iters, bool graph) {
  std::vector<double> us;
  std::unique_ptr<cuda::Graph> g;
  if (graph) g = std::make_unique<cuda::Graph>(enqueue, stream);
  auto run = [&] {
    if (g)
      g->replay(stream);
    else
      enqueue(stream);
  };
  for (int i = 0; i < 5; ++i) run();
  cuda::Event a, b;
  for (int i = 0; i < iters; ++i) {
    a.record(stream);
    run();
    b.record(stream);
    us.push_back(1e3 * b.ms_since(a));
  }
  return {percentile(us, 0.5), percentile(us, 0.99)};
}

// The same graph replayed `iters` times back to back, an event between replays, one synchronization.
Timing time_graph_pipelined(const std::function<void(void*)>& enqueue, void* stream, int iters) {
  cuda::Graph g(enqueue, stream);
  for (int i = 0; i < 5; ++i) g.replay(stream);
  std::vector<std::unique_ptr<cuda::Event>> events;
  for (int i = 0; i <= iters; ++i) events.push_back(std::make_unique<cuda::Event>());
  events[0]->record(stream);
  for (int i = 0; i < iters; ++i) {
    g.replay(stream);
    events[static_cast<std::size_t>(i) + 1]->record(stream);
  }
  std::vector<double> us;
  for (int i = 0; i < iters; ++i)
    us.push_back(1e3 * events[static_cast<std::size_t>(i) + 1]->ms_since(*events[static_cast<std::size_t>(i)]));
  return {percentile(us, 0.5), percentile(us, 0.99)};
}

}  // namespace

int bench_dispatch_command(const DispatchBenchRequest& req) {
  MOEKIT_CHECK(cuda::available() && cuda::nccl_built(),
               "moekit bench dispatch measures the NCCL transports: it needs CUDA devices and a build with NCCL");
  MOEKIT_CHECK(!req.tokens.empty() && *std::min_element(req.tokens.begin(), req.tokens.end()) >= 1,
               "--tokens needs counts >= 1");
  ModelConfig model = load_model(req.model);
  if (req.num_experts > 0) model.num_experts = req.num_experts;
  const QuantScheme quant = choose_quant(model, req.quant).quant;
  const int ranks = req.ranks > 0 ? req.ranks : cuda::device_count();
  // One rank runs the transport's kernels on one GPU with no peer: their chain's own cost.
  MOEKIT_CHECK(ranks >= 1 && ranks <= cuda::device_count(), "bench dispatch runs 1 to {} ranks (one a GPU); {} given",
               cuda::device_count(), ranks);
  std::vector<DispatchRow> rows;
  double peer_gbs = 0;
  std::mutex mutex;
  const bool device_initiated = req.dispatch == "nccl";
  run_in_process(ranks, [&](Communicator& comm) {
    const int r = comm.rank();
    cuda::use_device_of_rank(r);
    void* stream = cuda::create_stream();
    {
      auto group = cuda::make_nccl_group(comm);
      const double gbs = cuda::measure_peer_gbs(*group, stream);
      if (r == 0) peer_gbs = gbs;
    }
    const auto& entry = find_experts("batched-fp8", Device::kCuda);
    const PrepareFinalizeEntry* pfe =
        find_prepare_finalize(Device::kCuda, ActivationFormat::kBatchedExperts, ranks, req.dispatch);
    MOEKIT_CHECK(pfe != nullptr, "--dispatch {}: moekit has {}", req.dispatch,
                 prepare_finalize_names(Device::kCuda, ActivationFormat::kBatchedExperts, ranks));
    for (const std::string& routing : req.routing) {
      for (const std::int64_t T : req.tokens) {
        const std::int64_t mt = req.max_tokens_per_rank > 0 ? req.max_tokens_per_rank : T;
        const MoeProblem p =
            make_problem(model, ParallelConfig{ranks, ranks, mt, 0}, ActivationFormat::kBatchedExperts, quant);
        if (r == 0) std::cerr << fmt::format("bench dispatch: {} {} T = {}\n", req.dispatch, routing, T);
        auto pf = pfe->make({nullptr, &comm});
        std::unique_ptr<Memory> memory = pf->workspace_memory();
        if (memory == nullptr) memory = make_memory(Device::kCuda);
        const WorkspacePlan plan = plan_layer(p, entry, ranks, 0, req.dispatch);
        Workspace ws(plan, *memory);
        pf->attach(ws, stream);
        std::vector<std::int32_t> ids;
        std::vector<float> wts;
        make_routing(routing, T, p.E, p.E_local, p.topk, req.seed + static_cast<std::uint64_t>(r), ids, wts);
        const synthetic::Tokens tok = synthetic::make_tokens(p.K, 1, r * T, T, req.seed);
        const auto dev_memory = make_memory(Device::kCuda);
        DeviceCopies copies(*dev_memory);
        const PrepareArgs args{copies.put(tok.hidden, "hidden"), copies.put(ids, "ids"), copies.put(wts, "weights"), T};
        DeviceBuffer out(*dev_memory, 2 * T * p.K, "output");
        const ExpertsInput in = pf->prepare(p, args, ws, stream);
        ceilings::fill_random_bytes(in.output, static_cast<std::size_t>(p.E_local * p.M * p.K * 2), req.seed, true);
        const FinalizeArgs fin{
            wts.empty() ? nullptr : args.topk_weights, T, {in.output, nullptr}, out.as<std::uint16_t>()};
        pf->finalize(p, fin, ws, stream);
        pf->check_status(ws, stream);
        DispatchRow row;
        row.routing = routing;
        row.T = T;
        auto prepare = [&](void* s) { pf->prepare(p, args, ws, s); };
        auto finalize = [&](void* s) { pf->finalize(p, fin, ws, s); };
        auto both = [&](void* s) {
          pf->prepare(p, args, ws, s);
          pf->finalize(p, fin, ws, s);
        };
        row.dispatch = time_graph(prepare, stream, req.iters, device_initiated);
        row.combine = time_graph(finalize, stream, req.iters, device_initiated);
        row.round_trip = time_graph(both, stream, req.iters, device_initiated);
        if (device_initiated) {
          comm.barrier();
          row.dispatch_pipelined = time_graph_pipelined(prepare, stream, req.iters);
          comm.barrier();
          row.combine_pipelined = time_graph_pipelined(finalize, stream, req.iters);
          comm.barrier();
          row.round_trip_pipelined = time_graph_pipelined(both, stream, req.iters);
        }
        pf->check_status(ws, stream);
        // Bytes to other GPUs: a record per (token, other destination rank), an fp32 partial back.
        const plan::EpRecord rec = plan::ep_record(p.quant, p.K, p.topk);
        std::int64_t remote = 0;
        for (std::int64_t t = 0; t < T; ++t) {
          std::uint64_t mask = 0;
          for (std::int64_t k = 0; k < p.topk; ++k)
            mask |= std::uint64_t{1} << (ids[static_cast<std::size_t>(t * p.topk + k)] / p.E_local);
          mask &= ~(std::uint64_t{1} << r);
          remote += __builtin_popcountll(mask);
        }
        const double mine[14] = {row.dispatch.median_us,
                                 row.dispatch.p99_us,
                                 row.combine.median_us,
                                 row.combine.p99_us,
                                 row.round_trip.median_us,
                                 row.round_trip.p99_us,
                                 static_cast<double>(remote * rec.bytes),
                                 static_cast<double>(remote * p.K * 4),
                                 row.dispatch_pipelined.median_us,
                                 row.dispatch_pipelined.p99_us,
                                 row.combine_pipelined.median_us,
                                 row.combine_pipelined.p99_us,
                                 row.round_trip_pipelined.median_us,
                                 row.round_trip_pipelined.p99_us};
        double worst[14];
        for (int i = 0; i < 14; ++i) worst[i] = comm.all_reduce_max(mine[i]);
        row.dispatch = {worst[0], worst[1]};
        row.combine = {worst[2], worst[3]};
        row.round_trip = {worst[4], worst[5]};
        row.dispatch_bytes = worst[6];
        row.combine_bytes = worst[7];
        row.dispatch_pipelined = {worst[8], worst[9]};
        row.combine_pipelined = {worst[10], worst[11]};
        row.round_trip_pipelined = {worst[12], worst[13]};
        // The experts' input and output regions (an unquantized recipe has no a1q_scale).
        const auto* a1q_scale = plan.find_region("a1q_scale");
        row.buffer_bytes = plan.section_bytes("prepare-finalize") - plan.region("a1q").bytes -
                           (a1q_scale != nullptr ? a1q_scale->bytes : 0) - plan.region("expert_num_tokens").bytes -
                           plan.region("expert_output").bytes;
        if (r == 0) {
          std::lock_guard lock(mutex);
          rows.push_back(row);
        }
      }
    }
    cuda::destroy_stream(stream);
  });

  const std::time_t now = std::time(nullptr);
  char date[32];
  std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const cuda::DeviceInfo info = cuda::device_info(0);
  if (req.format == "json") {
    nlohmann::json j;
    j["benchmark"] = "dispatch";
    j["dispatch"] = req.dispatch;
    j["device"] = fmt::format("{} x {}", ranks, info.name);
    j["date"] = date;
    j["model"] = model.name;
    j["E"] = model.num_experts;
    j["topk"] = model.topk;
    j["K"] = model.hidden_size;
    j["quant"] = quant_name(quant);
    j["ranks"] = ranks;
    j["peer_gbs"] = peer_gbs;
    j["rows"] = nlohmann::json::array();
    for (const auto& r : rows)
      j["rows"].push_back(
          {{"routing", r.routing},
           {"T", r.T},
           {"dispatch_us", {r.dispatch.median_us, r.dispatch.p99_us}},
           {"combine_us", {r.combine.median_us, r.combine.p99_us}},
           {"round_trip_us", {r.round_trip.median_us, r.round_trip.p99_us}},
           {"dispatch_us_pipelined", {r.dispatch_pipelined.median_us, r.dispatch_pipelined.p99_us}},
           {"combine_us_pipelined", {r.combine_pipelined.median_us, r.combine_pipelined.p99_us}},
           {"round_trip_us_pipelined", {r.round_trip_pipelined.median_us, r.round_trip_pipelined.p99_us}},
           {"dispatch_bytes", r.dispatch_bytes},
           {"combine_bytes", r.combine_bytes},
           {"buffer_bytes", r.buffer_bytes}});
    std::cout << j.dump(2) << "\n";
    return 0;
  }
  std::cout << fmt::format(
      "moekit bench dispatch: {} over {} x {}, {} (E = {}, top-{}, K = {}, {}), {} ({}), max over ranks\n",
      req.dispatch, ranks, info.name, model.name, model.num_experts, model.topk, model.hidden_size, quant_name(quant),
      device_initiated ? "graph replay" : "eager (counts read on the host)", fmt::format("{} iterations", req.iters));
  if (peer_gbs > 0)
    std::cout << fmt::format("ceiling: NCCL send/recv rank -> next rank {:.0f} GB/s (256 MiB)\n", peer_gbs);
  else
    std::cout << "one rank: no peer, no bytes cross; the times are the transport's kernels on one GPU\n";
  std::cout << fmt::format("{:<8} {:>5} {:>16} {:>16} {:>16} {:>10} {:>8} {:>10} {:>8} {:>10} {:>20}\n", "routing", "T",
                           "dispatch us p99", "combine us p99", "round us p99", "disp MB", "GB/s", "comb MB", "GB/s",
                           "buffers", "pipelined d / c / r");
  for (const auto& r : rows) {
    auto rate = [](double bytes, double us) { return us > 0 ? bytes / (us * 1e3) : 0.0; };
    std::cout << fmt::format(
        "{:<8} {:>5} {:>8.1f} {:>7.1f} {:>8.1f} {:>7.1f} {:>8.1f} {:>7.1f} {:>10.2f} {:>8.1f} {:>10.2f} {:>8.1f} "
        "{:>10} {:>6.1f} {:>6.1f} {:>6.1f}\n",
        r.routing, r.T, r.dispatch.median_us, r.dispatch.p99_us, r.combine.median_us, r.combine.p99_us,
        r.round_trip.median_us, r.round_trip.p99_us, r.dispatch_bytes / 1e6,
        rate(r.dispatch_bytes, r.dispatch.median_us), r.combine_bytes / 1e6, rate(r.combine_bytes, r.combine.median_us),
        human_bytes(r.buffer_bytes), r.dispatch_pipelined.median_us, r.combine_pipelined.median_us,
        r.round_trip_pipelined.median_us);
  }
  std::cout << "MB: bytes one rank sends to other GPUs (records: header + the row in the recipe's dtype + its scales; "
               "partials: fp32 rows); "
               "buffers: the transport's own regions beside the experts' input/output; pipelined: medians of replays "
               "enqueued back to back (no host synchronization between them; graph replay only)\n";
  return 0;
}

}  // namespace moekit::cli
