// `moekit run`: MoE layers over N ranks on one runtime per rank, with seeded synthetic weights (one
// layer) or a Hugging Face checkpoint's (--checkpoint, its MoE layers or --layers A-B), and seeded
// tokens, on the CPU or a GPU (--device); prints per-step time and its stages, tokens/s, the
// workspace (equal to `moekit plan`) and, with --check, each layer's relative error against the
// float64 reference of the same weights (src/check/). Ranks are threads of this process (--comm
// in-process) or MPI processes (mpirun -np N moekit run ...).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <span>
#include <thread>

#include "check/reference.h"
#include "cli/commands.h"
#include "cuda/backend.h"
#include "cuda/device_info.h"
#include "cuda/ep_launch.h"
#include "moekit/check.h"
#include "moekit/checkpoint.h"
#include "moekit/layer.h"
#include "moekit/limits.h"
#include "moekit/placement.h"
#include "moekit/registry.h"
#include "moekit/runtime.h"
#include "numerics/fp8.h"
#include "synthetic/synthetic.h"

namespace moekit::cli {
namespace {

struct RunRequest {
  std::string model = "deepseek-v3";
  std::string checkpoint;  // a Hugging Face checkpoint directory (its config replaces --model)
  std::string layers;      // with --checkpoint: "A-B" or "A" (model layer numbers); empty: every MoE layer
  std::int64_t dp = 4;
  std::int64_t ep = 0;  // 0: dp
  std::int64_t tokens_per_rank = 16;
  std::int64_t max_tokens_per_rank = 0;  // 0: tokens_per_rank
  std::int64_t num_experts = 0;          // 0: the model's
  std::int64_t local_experts = 0;        // 0: E / ep; more: redundant experts in the round-robin placement
  std::string device = "auto";
  std::string experts = "batched-fp8";
  std::string dispatch;        // empty: the default prepare/finalize
  std::string quant = "auto";  // auto: the checkpoint's scheme (choose_quant)
  std::string activation;
  std::optional<bool> fuse_w1;  // nullopt: fused where it runs (fuse_w1_runs)
  std::string accumulation = "precise";
  bool shared_experts = true;  // the model's shared experts in the step (LayerOptions::shared_experts)
  std::int64_t steps = 2;
  bool check = false;
  std::uint64_t seed = 1;
  int threads = 0;  // 0: hardware threads
  std::string comm = "auto";
  std::string output;  // write each rank's last outputs here (raw bf16 bits; ".rank<r>" appended when dp > 1)
  double tolerance = 1e-2;
  std::optional<double> cpu_tolerance;  // nullopt: check::device_vs_cpu_tolerance of the run's scheme
};

// What the ranks of one run leave for the check: every layer's outputs of every rank in global token
// order, and the synthetic weights each rank built (the reference reads them instead of building
// them again; a checkpoint's it loads itself).
struct RunResults {
  std::mutex mutex;
  std::vector<std::vector<std::uint16_t>> output;  // [layer]
  std::vector<synthetic::HostExpertWeights> weights;
  double device_vs_cpu = -1;  // a GPU run's largest relative difference to the CPU layer (-1: not run)
};

// The layers of a run: the checkpoint's MoE layers named by --layers, or none (synthetic weights).
std::vector<std::int64_t> selected_layers(const RunRequest& req, const Checkpoint& ck) {
  const std::vector<std::int64_t>& all = ck.moe_layers();
  MOEKIT_CHECK(!all.empty(), "--checkpoint {}: no MoE layer found (no tensor names a router of model_type '{}')",
               req.checkpoint, ck.model().model_type);
  if (req.layers.empty()) return all;
  std::int64_t a = -1, b = -1;
  const auto dash = req.layers.find('-');
  try {
    std::size_t used = 0;
    a = std::stoll(req.layers.substr(0, dash), &used);
    MOEKIT_CHECK(used == (dash == std::string::npos ? req.layers.size() : dash), "");
    b = dash == std::string::npos ? a : std::stoll(req.layers.substr(dash + 1), &used);
    MOEKIT_CHECK(dash == std::string::npos || used == req.layers.size() - dash - 1, "");
  } catch (const std::exception&) {
    MOEKIT_FAIL("--layers '{}': write A-B or A (model layer numbers)", req.layers);
  }
  std::vector<std::int64_t> out;
  for (const std::int64_t L : all)
    if (L >= a && L <= b) out.push_back(L);
  MOEKIT_CHECK(a <= b && !out.empty(), "--layers {}: no MoE layer of the checkpoint lies there; its MoE layers are {}",
               req.layers, fmt::join(all, ", "));
  return out;
}

// Seeded synthetic weights of one layer in the form a checkpoint's take: experts [first_expert,
// first_expert + E_local), or with a placement the slots from first_expert on.
CheckpointLayer synthetic_layer(const RunRequest& req, const ModelConfig& model, const MoeProblem& p,
                                std::int64_t first_expert, cpu::ThreadPool& pool,
                                const ExpertPlacement* placement = nullptr) {
  CheckpointLayer l;
  l.layer = -1;
  l.experts = placement ? synthetic::make_slot_weights(p, *placement, first_expert, req.seed, pool)
                        : synthetic::make_expert_weights(p, first_expert, req.seed, pool);
  if (model.has_score_correction_bias) l.e_score_correction_bias = synthetic::make_routing_bias(p.E, req.seed);
  if (req.shared_experts) {
    synthetic::HostSharedExperts shared = synthetic::make_shared_experts(model, p, req.seed, pool);
    if (shared.problem) {
      l.shared_experts = std::move(shared.experts);
      l.shared_expert_gate = std::move(shared.gate);
    }
  }
  l.note = "seeded synthetic weights";
  return l;
}

// Every rank's `bytes` bytes at `data` to rank 0, in rank order (`out`: size() * bytes there; the other
// ranks receive nothing). Collective.
void gather_to_root(Communicator& comm, const void* data, std::int64_t bytes, void* out) {
  const auto P = static_cast<std::size_t>(comm.size());
  std::vector<std::int64_t> send_bytes(P, 0), send_off(P, 0), recv_bytes(P, 0), recv_off(P, 0);
  send_bytes[0] = bytes;
  if (comm.rank() == 0)
    for (std::size_t r = 0; r < P; ++r) {
      recv_bytes[r] = bytes;
      recv_off[r] = static_cast<std::int64_t>(r) * bytes;
    }
  comm.all_to_all_v(data, send_bytes, send_off, out, recv_bytes, recv_off);
}

// Redundant experts: every layer's per-slot counts of all steps, summed over the ranks on rank 0,
// printed as the ranks' max/mean load and the max/mean that rebalance_experts' placement would give.
// ep ranks hold the slots (one with ep == 1: every rank holds them all).
void report_load(MoeRuntime& runtime, Communicator& comm, const ExpertPlacement& placement, int num_layers,
                 std::int64_t ep) {
  const auto P = static_cast<std::size_t>(comm.size());
  const std::int64_t slots = placement.num_physical();
  for (int l = 0; l < num_layers; ++l) {
    const std::vector<std::int64_t> mine = runtime.expert_load(l);
    std::vector<std::int64_t> all(comm.rank() == 0 ? P * static_cast<std::size_t>(slots) : 0);
    gather_to_root(comm, mine.data(), slots * 8, all.data());
    if (comm.rank() != 0) continue;
    std::vector<std::int64_t> total(static_cast<std::size_t>(slots), 0);
    for (std::size_t i = 0; i < all.size(); ++i) total[i % static_cast<std::size_t>(slots)] += all[i];
    const std::vector<double> load = logical_load(placement, total);
    const double pairs = std::accumulate(load.begin(), load.end(), 0.0);
    const std::int64_t ranks = ep;
    std::vector<double> per_rank(static_cast<std::size_t>(ranks), 0.0);
    for (std::int64_t s = 0; s < slots; ++s)
      per_rank[static_cast<std::size_t>(s / (slots / ranks))] +=
          static_cast<double>(total[static_cast<std::size_t>(s)]);
    const double measured =
        pairs > 0 ? *std::max_element(per_rank.begin(), per_rank.end()) * static_cast<double>(ranks) / pairs : 1.0;
    const double eplb = pairs > 0 ? rank_imbalance(rebalance_experts(load, slots, 1, 1, ranks), load, ranks) : 1.0;
    std::cout << fmt::format(
        "expert load{}: {} pairs over {} slots; ranks' max/mean {:.3f} measured, {:.3f} with EPLB's placement of "
        "these counts\n",
        num_layers > 1 ? fmt::format(" (layer {})", l) : "", static_cast<std::int64_t>(pairs), slots, measured, eplb);
  }
}

// What a run allocates, computed before anything is: per rank, every layer's local expert weights
// (with the shared experts') and router, the one workspace of the runtime (its guard bands under
// --check), the tokens, logits and outputs, the threads' fp32 matrices while weights are built or
// quantized; a --check adds the whole model's experts of one layer and every rank's outputs. Host
// bytes for all ranks of this process; device bytes for one GPU.
struct RunBytes {
  std::int64_t host = 0, device = 0;
};

RunBytes run_bytes(const RunRequest& req, const ModelConfig& model, const MoeProblem& p, const LayerOptions& opt,
                   const ParallelConfig& par, std::int64_t num_layers, std::int64_t ranks_here, int threads) {
  using limits::checked_add;
  using limits::checked_mul;
  const auto shared = opt.shared_experts ? shared_experts_problem(model, p) : std::nullopt;
  const std::int64_t weights =
      checked_add(expert_weight_bytes(p), shared ? expert_weight_bytes(*shared) : 0, "one layer's weights");
  const ExpertsEntry& entry = find_experts(req.experts, opt.device);
  const WorkspacePlan plan =
      plan_layer(p, entry, par.ep, opt.checked ? opt.guard_bytes : 0, opt.prepare_finalize, shared);
  const std::int64_t T = req.tokens_per_rank, K = p.K, E = p.E;
  std::int64_t per_layer = checked_add(weights, checked_mul(4 * E, K + 1, "the router's fp32 weights"), "layer bytes");
  per_layer = checked_add(per_layer, checked_mul(T, 4 * E + 4 * K, "a layer's logits and outputs"), "layer bytes");
  std::int64_t rank = checked_mul(per_layer, num_layers, "every layer's bytes");
  rank = checked_add(rank, checked_mul(T, 2 * K, "hidden"), "rank bytes");
  const std::int64_t widest = std::max(p.N, shared ? shared->N : 0);
  rank = checked_add(rank, checked_mul(checked_mul(4 * widest, K, "one fp32 matrix"), threads, "threads' matrices"),
                     "rank bytes");
  RunBytes b;
  b.device = checked_add(checked_mul(weights, num_layers, "device weights"), plan.total_bytes, "device bytes");
  b.host = checked_mul(checked_add(rank, opt.device == Device::kCpu ? plan.total_bytes : 0, "rank bytes"), ranks_here,
                       "host bytes of this process's ranks");
  if (req.check) {
    const MoeProblem whole = make_problem(model, ParallelConfig{1, 1, par.max_tokens_per_rank, 0}, p.format, p.quant,
                                          p.activation, p.fuse_w1, p.accumulation);
    b.host = checked_add(b.host, expert_weight_bytes(whole), "the check's experts");
    b.host = checked_add(b.host, checked_mul(checked_mul(req.dp * T, 2 * K, "outputs"), 2 * num_layers, "outputs"),
                         "the check's outputs");
  }
  return b;
}

// Refuses a run whose bytes exceed the host's memory (all of this process's ranks) or one GPU's.
void require_run_memory(const RunBytes& b, const MoeProblem& p, Device device) {
  const std::string what = fmt::format("this run ({})", p.describe());
  const std::string fix =
      "lower --num-experts, --tokens-per-rank or --max-tokens-per-rank, spread the experts over more ranks (--dp), "
      "or run on a larger machine";
  limits::require_memory(b.host, limits::host_memory_bytes(), what + " on the host", "host memory", fix);
  if (device == Device::kCuda) {
    const cuda::DeviceInfo gpu = cuda::device_info(cuda::current_device());
    limits::require_memory(b.device, gpu.global_memory_bytes, what + " on each GPU",
                           fmt::format("GPU {} ({})", gpu.device, gpu.name), fix);
  }
}

Device choose_device(const std::string& requested, ActivationFormat format, std::int64_t ep, std::int64_t ranks) {
  if (requested != "auto") return parse_device(requested);
  // One GPU per rank: the NCCL transports do not share a GPU between ranks.
  const bool gpu_layer = cuda::available() && find_router(Device::kCuda) != nullptr &&
                         find_prepare_finalize(Device::kCuda, format, ep) != nullptr &&
                         (ranks == 1 || cuda::nccl_built()) && cuda::device_count() >= ranks;
  return gpu_layer ? Device::kCuda : Device::kCpu;
}

int run_rank(const RunRequest& req, const ModelConfig& model, Communicator& comm, int threads_per_rank,
             RunResults& results) {
  const bool root = comm.rank() == 0;
  const ParallelConfig par{
      req.dp, req.ep == 0 ? req.dp : req.ep,
      req.max_tokens_per_rank == 0 ? std::max<std::int64_t>(req.tokens_per_rank, 1) : req.max_tokens_per_rank,
      req.local_experts};
  LayerOptions opt;
  opt.experts = req.experts;
  const QuantChoice quant = choose_quant(model, req.quant);
  opt.quant = quant.quant;
  if (!req.activation.empty()) opt.activation = parse_activation(req.activation);
  opt.fuse_w1 = req.fuse_w1;
  opt.accumulation = parse_accumulation(req.accumulation);
  opt.shared_experts = req.shared_experts;
  opt.checked = req.check;
  opt.num_threads = threads_per_rank;
  const ExpertsEntry& entry = find_experts(req.experts, Device::kCpu);
  opt.device = choose_device(req.device, entry.format, par.ep, comm.size());
  opt.prepare_finalize = req.dispatch;
  if (opt.device == Device::kCuda && comm.size() > 1) cuda::use_device_of_rank(comm.rank());  // one GPU per rank
  const MoeProblem p = make_problem(model, par, entry.format, opt.quant, opt.activation.value_or(model.activation),
                                    opt.fuse_w1, opt.accumulation);
  const std::int64_t first = first_local_expert(par, p, comm.rank());
  // Redundant experts: the runtime's default placement (round robin) of the ranks' slots; this
  // rank's slots are [first, first + E_local).
  const std::int64_t slots = p.E_local * par.ep;
  const std::optional<ExpertPlacement> placement = default_placement(p.E, slots);
  std::unique_ptr<Checkpoint> ck;
  std::vector<std::int64_t> wanted;
  if (!req.checkpoint.empty()) {
    ck = std::make_unique<Checkpoint>(req.checkpoint, threads_per_rank);
    wanted = selected_layers(req, *ck);
  }
  // Every byte the run will allocate, against the machine's memory, before any is (every rank
  // computes the same figure, so every rank refuses together).
  const RunBytes need = run_bytes(req, model, p, opt, par, ck ? static_cast<std::int64_t>(wanted.size()) : 1,
                                  comm.name() == "in-process" ? comm.size() : 1, threads_per_rank);
  require_run_memory(need, p, opt.device);
  cpu::ThreadPool pool(threads_per_rank);
  // This rank's layers: seeded synthetic weights (global expert indices, so any layout draws the same
  // values), or the checkpoint's (only this rank's experts read).
  std::vector<CheckpointLayer> layers;
  if (!ck) {
    if (root) std::cerr << "moekit run: building " << req.dp << " rank(s) of seeded synthetic experts...\n";
    layers.push_back(synthetic_layer(req, model, p, first, pool, placement ? &*placement : nullptr));
  } else {
    if (root)
      std::cerr << fmt::format("moekit run: loading {} MoE layer(s) from {}...\n", wanted.size(), req.checkpoint);
    const auto t0 = std::chrono::steady_clock::now();
    std::int64_t loaded = 0;  // the weights' bytes a load produced (codes, scales, biases)
    for (const std::int64_t L : wanted) {
      layers.push_back(
          placement ? ck->load_layer(L, p,
                                     std::span(placement->physical_to_logical)
                                         .subspan(static_cast<std::size_t>(first), static_cast<std::size_t>(p.E_local)),
                                     req.shared_experts)
                    : ck->load_layer(L, p, first, req.shared_experts));
      loaded += expert_weight_bytes(p) +
                (layers.back().shared_experts ? expert_weight_bytes(layers.back().shared_experts->problem) : 0);
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (root)
      std::cerr << fmt::format(
          "moekit run: loaded {:.2f} GiB of expert weights in {:.2f} s ({:.2f} GiB/s, {} threads; "
          "{})\n",
          static_cast<double>(loaded) / (1 << 30), s, static_cast<double>(loaded) / (1 << 30) / std::max(s, 1e-9),
          threads_per_rank, layers.front().note);
  }
  // This rank's tokens are global tokens [rank * T, (rank + 1) * T); a checkpoint's layers route them
  // with their own router weights.
  const std::int64_t T = req.tokens_per_rank, K = p.K, E = p.E;
  const synthetic::Tokens tokens = synthetic::make_tokens(K, E, comm.rank() * T, T, req.seed);
  std::vector<std::vector<float>> host_logits;
  for (const CheckpointLayer& l : layers)
    host_logits.push_back(ck ? l.router_logits(tokens.hidden.data(), T) : tokens.logits);

  const std::unique_ptr<Memory> memory = make_memory(opt.device);
  DeviceCopies dev(*memory);
  const std::uint16_t* hidden = dev.put(tokens.hidden, "hidden");
  std::vector<const float*> logits;
  for (const auto& l : host_logits) logits.push_back(dev.put(l, "logits"));
  const std::size_t nl = layers.size();
  std::vector<std::vector<std::uint16_t>> out(nl, std::vector<std::uint16_t>(static_cast<std::size_t>(T * K)));
  std::vector<DeviceBuffer> out_dev;
  std::vector<std::uint16_t*> output;
  for (std::size_t l = 0; l < nl; ++l) {
    if (opt.device != Device::kCpu && T > 0) {
      out_dev.emplace_back(*memory, 2 * T * K, "output");
      output.push_back(out_dev.back().as<std::uint16_t>());
    } else {
      output.push_back(out[l].data());
    }
  }

  MoeRuntime runtime(model, par, opt, comm);
  for (const CheckpointLayer& l : layers) runtime.add_layer(l.view(dev));
  const MoeProblem& lp = runtime.problem();
  if (root) {
    std::cout << fmt::format(
        "moekit run: {} device={}{} experts={} dispatch={} comm={} ranks={} dp={} ep={} E={} E_local={} K={} I={} "
        "topk={} act={} quant={}{} format={}\n",
        model.name, device_name(opt.device), req.device == "auto" ? " (auto)" : "", req.experts,
        runtime.plan().section("prepare-finalize").owner, comm.name(), comm.size(), par.dp, par.ep, lp.E, lp.E_local,
        lp.K, lp.I(), lp.topk, activation_name(lp.activation), quant_name(lp.quant), lp.fuse_w1 ? " (fused W1)" : "",
        format_name(lp.format));
    std::cout << fmt::format("quantization: {}\n", quant.note);
    if (ck) {
      std::vector<std::int64_t> numbers;
      for (const auto& l : layers) numbers.push_back(l.layer);
      std::cout << fmt::format("checkpoint: {}: MoE layers {} on one runtime; rank 0 {}\n", req.checkpoint,
                               fmt::join(numbers, ", "), layers.front().note);
    }
    if (const auto& sp = runtime.shared_problem())
      std::cout << fmt::format("shared experts: one MLP of I = {}{}, on every rank beside the routed experts\n",
                               sp->I(),
                               model.shared_expert_gate ? ", gated by sigmoid(hidden . shared_expert_gate)" : "");
    else if (model.shared_intermediate_size > 0)
      std::cout << fmt::format("shared experts: not in the step (--no-shared-experts)\n");
    std::cout << fmt::format("tokens per rank {} (max_tokens_per_rank {}, M = {}), threads per rank {}\n", T,
                             par.max_tokens_per_rank, lp.M, threads_per_rank);
    if (placement)
      std::cout << fmt::format(
          "redundant experts: {} slots for {} experts ({} per rank), slot p holding expert p mod {} (round robin); "
          "a pair takes replica (token + rank) mod replicas\n",
          slots, p.E, p.E_local, p.E);
    std::cout << fmt::format(
        "workspace per rank: experts {} bytes ({}), layer {} bytes ({}) = moekit plan --device {} --experts {} for "
        "this layout; one for all {} layer(s){}\n",
        runtime.plan().section_bytes("experts"), human_bytes(runtime.plan().section_bytes("experts")),
        runtime.plan().total_bytes, human_bytes(runtime.plan().total_bytes), device_name(opt.device), req.experts, nl,
        req.check ? fmt::format("; allocated {} bytes with guard bands", runtime.allocated_workspace_bytes()) : "");
    std::cout << fmt::format(
        "memory: {} on the host for {} rank(s) of this process (of {}){}\n", human_bytes(need.host),
        comm.name() == "in-process" ? comm.size() : 1, human_bytes(limits::host_memory_bytes()),
        opt.device == Device::kCuda ? fmt::format(", {} on each GPU", human_bytes(need.device)) : "");
  }
  for (std::int64_t step = 0; step < req.steps; ++step) {
    comm.barrier();
    StepStats s;
    for (std::size_t l = 0; l < nl; ++l) {
      runtime.forward(static_cast<int>(l), hidden, logits[l], T, output[l]);
      const StepStats& one = runtime.last_step();
      s.route_ms += one.route_ms;
      s.prepare_ms += one.prepare_ms;
      s.experts_ms += one.experts_ms;
      s.finalize_ms += one.finalize_ms;
      s.total_ms += one.total_ms;
    }
    const double step_ms = comm.all_reduce_max(s.total_ms);
    if (root)
      std::cout << fmt::format(
                       "step {:>3}: {:9.2f} ms  {:10.1f} tokens/s  (rank 0: route {:.2f}, prepare {:.2f}, experts "
                       "{:.2f}, finalize {:.2f} ms{})\n",
                       step, step_ms, static_cast<double>(T * comm.size()) / (step_ms / 1e3), s.route_ms, s.prepare_ms,
                       s.experts_ms, s.finalize_ms, nl > 1 ? fmt::format("; {} layers", nl) : "")
                << std::flush;
  }
  // No NaN or Inf reaches a result silently, --check or not: the last step's outputs checked, a bad
  // one named by its layer (the checkpoint's number) and the seam it entered at.
  for (std::size_t l = 0; l < nl; ++l) {
    try {
      runtime.check_output(static_cast<int>(l), hidden, T, output[l]);
    } catch (const Error& e) {
      if (!ck) throw;
      const std::string m = e.what();  // "moekit: layer <l>: <what>"
      MOEKIT_FAIL("checkpoint layer {} (runtime layer {}): {}", layers[l].layer, l, m.substr(m.find(": ", 8) + 2));
    }
  }
  if (placement) report_load(runtime, comm, *placement, static_cast<int>(nl), par.ep);
  for (std::size_t l = 0; l < nl; ++l)
    if (output[l] != out[l].data() && T > 0) memory->to_host(out[l].data(), output[l], 2 * T * K, nullptr);
  if (!req.output.empty()) {
    const std::string path = comm.size() > 1 ? fmt::format("{}.rank{}", req.output, comm.rank()) : req.output;
    std::ofstream file(path, std::ios::binary);
    for (const auto& o : out)
      file.write(reinterpret_cast<const char*>(o.data()), static_cast<std::streamsize>(2 * o.size()));
    MOEKIT_CHECK(file.good(), "--output: cannot write {} bytes to '{}'", 2 * nl * T * K, path);
  }
  if (!req.check) return 0;
  if (opt.device != Device::kCpu) {
    // The same steps on the CPU backend with the same inputs and weights.
    LayerOptions cpu_opt = opt;
    cpu_opt.device = Device::kCpu;
    cpu_opt.prepare_finalize.clear();
    const auto host_memory = make_memory(Device::kCpu);
    DeviceCopies host(*host_memory);
    MoeRuntime cpu_runtime(model, par, cpu_opt, comm);
    for (const CheckpointLayer& l : layers) cpu_runtime.add_layer(l.view(host));
    double worst = 0;
    for (std::size_t l = 0; l < nl; ++l) {
      std::vector<std::uint16_t> cpu_out(out[l].size());
      cpu_runtime.forward(static_cast<int>(l), tokens.hidden.data(), host_logits[l].data(), T, cpu_out.data());
      double err = 0, norm = 0;
      for (std::size_t i = 0; i < cpu_out.size(); ++i) {
        const double x = numerics::bf16_decode(out[l][i]), y = numerics::bf16_decode(cpu_out[i]);
        err += (x - y) * (x - y);
        norm += y * y;
      }
      worst = std::max(worst, norm > 0 ? std::sqrt(err / norm) : 0.0);
    }
    std::lock_guard<std::mutex> lock(results.mutex);
    results.device_vs_cpu = std::max(results.device_vs_cpu, worst);
  }
  // Every rank's outputs to the check: in-process ranks share memory; MPI ranks send their outputs to
  // rank 0, whose bank builds the other ranks' synthetic experts again (a checkpoint's it loads).
  const auto P = static_cast<std::size_t>(comm.size());
  std::vector<std::vector<std::uint16_t>> all(nl);
  for (std::size_t l = 0; l < nl; ++l) {
    all[l].resize(root ? P * out[l].size() : 0);
    gather_to_root(comm, out[l].data(), 2 * T * K, all[l].data());
  }
  std::lock_guard<std::mutex> lock(results.mutex);
  if (root) results.output = std::move(all);
  if (!ck) results.weights.push_back(std::move(layers.front().experts));
  return 0;
}

int check_run(const RunRequest& req, const ModelConfig& model, RunResults& results, int threads) {
  const ParallelConfig par{
      req.dp, req.ep == 0 ? req.dp : req.ep,
      req.max_tokens_per_rank == 0 ? std::max<std::int64_t>(req.tokens_per_rank, 1) : req.max_tokens_per_rank,
      req.local_experts};
  const ExpertsEntry& entry = find_experts(req.experts, Device::kCpu);
  // The float64 reference follows the recipe (no bf16 W1 output where W1 is fused).
  const QuantScheme quant = choose_quant(model, req.quant).quant;
  const Activation act = req.activation.empty() ? model.activation : parse_activation(req.activation);
  const MoeProblem p =
      make_problem(model, par, entry.format, quant, act, req.fuse_w1, parse_accumulation(req.accumulation));
  cpu::ThreadPool pool(threads);
  // Every expert of each layer: the synthetic bank (regenerating the logical experts of slot
  // weights), or the checkpoint's layer loaded whole.
  std::unique_ptr<Checkpoint> ck;
  std::vector<std::int64_t> numbers{-1};
  if (!req.checkpoint.empty()) {
    ck = std::make_unique<Checkpoint>(req.checkpoint);
    numbers = selected_layers(req, *ck);
  }
  const MoeProblem whole = make_problem(model, ParallelConfig{1, 1, par.max_tokens_per_rank, 0}, entry.format, quant,
                                        act, req.fuse_w1, parse_accumulation(req.accumulation));
  const bool gpu = results.device_vs_cpu >= 0;
  const double cpu_tolerance = req.cpu_tolerance.value_or(check::device_vs_cpu_tolerance(p.quant));
  const double tolerance = gpu ? std::max(req.tolerance, cpu_tolerance) : req.tolerance;
  bool ok = true;
  const std::int64_t T = req.tokens_per_rank;
  for (std::size_t l = 0; l < numbers.size(); ++l) {
    synthetic::ExpertBank bank(p, req.seed, pool);
    for (const auto& w : results.weights)
      if (w.first_expert >= 0) bank.adopt(w);
    const CheckpointLayer layer =
        ck ? ck->load_layer(numbers[l], whole, 0, req.shared_experts) : synthetic_layer(req, model, whole, 0, pool);
    const ExpertWeightsView all = layer.experts.view();
    check::LayerReference reference(
        model, p, layer.e_score_correction_bias.empty() ? nullptr : layer.e_score_correction_bias.data(),
        [&](std::int64_t e) { return ck ? all.expert(e) : bank.expert(e); }, pool);
    if (layer.shared_experts)
      reference.set_shared(*shared_experts_problem(model, p), layer.shared_experts->view(),
                           layer.shared_expert_gate.empty() ? nullptr : layer.shared_expert_gate.data());
    for (std::int64_t r = 0; r < req.dp; ++r) {
      const synthetic::Tokens t = synthetic::make_tokens(p.K, p.E, r * T, T, req.seed);
      const std::vector<float> logits = ck ? layer.router_logits(t.hidden.data(), T) : t.logits;
      reference.add(t.hidden.data(), logits.data(), T, par.max_tokens_per_rank, results.output[l].data() + r * T * p.K);
    }
    // The float64 reference runs on the CPU's quantized operands; a GPU's FP8 codes flip where its
    // bf16 W1 outputs differ by an ulp, so a GPU run is held to the device-vs-CPU bound there.
    const check::LayerError& err = reference.error();
    ok = ok && err.relative() <= tolerance && err.nan_outputs == 0;
    std::cout << fmt::format(
        "check{}: relative error vs float64 {:.3e} {} tolerance {:.1e}{}; {} NaN outputs; guard bands intact\n",
        ck ? fmt::format(" layer {}", numbers[l]) : "", err.relative(), err.relative() <= tolerance ? "<=" : ">",
        tolerance, gpu ? " (GPU: FP8 code flips against the CPU's operands)" : "", err.nan_outputs);
  }
  if (gpu) {
    ok = ok && results.device_vs_cpu <= cpu_tolerance;
    std::cout << fmt::format(
        "check: relative difference to the cpu backend on the same inputs and weights {:.3e} {} "
        "tolerance {:.1e}\n",
        results.device_vs_cpu, results.device_vs_cpu <= cpu_tolerance ? "<=" : ">", cpu_tolerance);
  }
  return ok ? 0 : 3;
}

int run_command(const RunRequest& req) {
  MOEKIT_CHECK(req.tokens_per_rank >= 0, "--tokens-per-rank = {} must be >= 0", req.tokens_per_rank);
  MOEKIT_CHECK(req.steps >= 1, "--steps = {} must be >= 1", req.steps);
  if (req.device != "auto") parse_device(req.device);  // a bad name fails before any work
  ModelConfig model = req.checkpoint.empty() ? load_model(req.model) : Checkpoint(req.checkpoint).model();
  MOEKIT_CHECK(req.checkpoint.empty() || req.num_experts == 0,
               "--num-experts with --checkpoint: the checkpoint holds its model's {} experts", model.num_experts);
  MOEKIT_CHECK(!req.checkpoint.empty() || req.layers.empty(),
               "--layers selects a checkpoint's layers: pass --checkpoint");
  if (req.num_experts > 0) model.num_experts = req.num_experts;
  std::string comm_kind = req.comm;
  if (comm_kind == "auto") comm_kind = std::getenv("OMPI_COMM_WORLD_SIZE") ? "mpi" : "in-process";
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = req.threads > 0 ? req.threads : hw;
  RunResults results;
  int rc = 0;
  bool root = true;
  if (comm_kind == "mpi") {
    auto comm = make_mpi_communicator();
    MOEKIT_CHECK(comm->size() == req.dp, "mpirun started {} processes but --dp = {}: pass --dp {}", comm->size(),
                 req.dp, comm->size());
    rc = run_rank(req, model, *comm, std::max(1, threads / comm->size()), results);
    root = comm->rank() == 0;
  } else {
    MOEKIT_CHECK(comm_kind == "in-process", "--comm = '{}' must be auto, in-process or mpi", comm_kind);
    MOEKIT_CHECK(req.dp >= 1 && req.dp <= limits::kMaxInProcessRanks,
                 "--dp = {} must be in [1, {}] for in-process ranks (moekit/limits.h): run more as MPI processes",
                 req.dp, limits::kMaxInProcessRanks);
    run_in_process(static_cast<int>(req.dp), [&](Communicator& comm) {
      const int r = run_rank(req, model, comm, std::max(1, threads / static_cast<int>(req.dp)), results);
      if (comm.rank() == 0) rc = r;
    });
  }
  if (rc != 0 || !req.check || !root) return rc;
  return check_run(req, model, results, threads);
}

}  // namespace

std::function<int()> add_run_command(CLI::App& app) {
  auto req = std::make_shared<RunRequest>();
  CLI::App* cmd = app.add_subcommand(
      "run", "Run MoE layers over N ranks: seeded synthetic weights or a checkpoint's, seeded tokens");
  auto* model_opt = cmd->add_option("--model", req->model, "Preset name or path to a Hugging Face config.json")
                        ->capture_default_str();
  cmd->add_option("--checkpoint", req->checkpoint,
                  "Run a Hugging Face checkpoint directory's MoE layers (its weights and config) on one runtime per "
                  "rank")
      ->excludes(model_opt);
  cmd->add_option("--layers", req->layers,
                  "With --checkpoint: the MoE layers A-B or A (model layer numbers; default all)");
  cmd->add_option("--device", req->device, "auto (cuda when the layer runs on a present GPU), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--experts", req->experts, "Experts implementation: batched-fp8 or standard-fp8")
      ->capture_default_str();
  cmd->add_option("--dispatch", req->dispatch,
                  "Prepare/finalize (dispatch and combine) by registry name, e.g. nccl or nccl-reference on GPUs "
                  "(default: the first that runs the layout; moekit plan prints it)");
  cmd->add_option("--dp", req->dp, "Data-parallel ranks (in-process threads, or the mpirun size)")
      ->check(int_range(1, limits::kMaxRanks))
      ->capture_default_str();
  cmd->add_option("--ep", req->ep, "Expert-parallel ranks: dp (default, 0) or 1")
      ->check(int_range(0, limits::kMaxRanks))
      ->capture_default_str();
  cmd->add_option("--tokens-per-rank", req->tokens_per_rank, "Tokens each rank feeds the layer per step")
      ->check(int_range(0, limits::kMaxTokensPerRank))
      ->capture_default_str();
  cmd->add_option("--max-tokens-per-rank", req->max_tokens_per_rank,
                  "Chunk capacity (0: tokens-per-rank); larger steps are chunked")
      ->check(int_range(0, limits::kMaxTokensPerRank))
      ->capture_default_str();
  cmd->add_option("--num-experts", req->num_experts, "Override the model's routed experts (0: keep) to keep runs short")
      ->check(int_range(0, limits::kMaxExperts))
      ->capture_default_str();
  cmd->add_option("--local-experts", req->local_experts,
                  "Expert slots per rank (0: experts / ep; more: redundant experts, slot p holding expert p mod E; "
                  "prints the measured load and EPLB's rebalanced figure)")
      ->check(int_range(0, limits::kMaxSlotsPerExpert * limits::kMaxExperts))
      ->capture_default_str();
  add_quant_option(*cmd, req->quant);
  cmd->add_option("--activation", req->activation, "Override the model's activation");
  add_fuse_w1_flags(*cmd, req->fuse_w1);
  add_accumulation_option(*cmd, req->accumulation);
  add_shared_experts_flag(*cmd, req->shared_experts);
  cmd->add_option("--steps", req->steps, "Steps to run")->check(int_range(1, limits::kMaxSteps))->capture_default_str();
  cmd->add_flag("--check", req->check,
                "Checked mode (guard bands, NaN poisoning) and the float64 reference of the outputs");
  cmd->add_option("--tolerance", req->tolerance, "Relative error vs float64 allowed by --check")
      ->check(real_range(0, 1))
      ->capture_default_str();
  cmd->add_option("--cpu-tolerance", req->cpu_tolerance,
                  "Relative difference to the CPU backend allowed by --check on a GPU (default 3e-2: FP8 code flips, "
                  "~1.5e-2; per-tensor 5e-2: its one scale over a slab may move too)")
      ->check(real_range(0, 1));
  cmd->add_option("--seed", req->seed, "Seed of weights, tokens and logits")
      ->check(uint_range(0, UINT64_MAX))
      ->capture_default_str();
  cmd->add_option("--threads", req->threads, "CPU threads in all (0: hardware threads, at most 1024)")
      ->check(int_range(0, limits::kMaxThreads))
      ->capture_default_str();
  cmd->add_option("--comm", req->comm, "auto (mpi under mpirun), in-process or mpi")->capture_default_str();
  cmd->add_option("--output", req->output,
                  "Write each rank's outputs of the last step (tokens-per-rank x K bf16 bits) to this file "
                  "(.rank<r> appended when dp > 1)");
  return [cmd, req]() -> int {
    if (!cmd->parsed()) return -1;
    return run_command(*req);
  };
}

}  // namespace moekit::cli
