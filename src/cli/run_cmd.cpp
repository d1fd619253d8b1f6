// `moekit run`: one MoE layer over N ranks with seeded synthetic weights and tokens, on the CPU or
// a GPU (--device); prints per-step time and its stages, tokens/s, the workspace (equal to `moekit
// plan`) and, with --check, the relative error against the float64 reference (src/check/). Ranks
// are threads of this process (--comm in-process) or MPI processes (mpirun -np N moekit run ...).
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "check/reference.h"
#include "cli/commands.h"
#include "cuda/backend.h"
#include "cuda/device_info.h"
#include "cuda/ep_launch.h"
#include "moekit/check.h"
#include "moekit/layer.h"
#include "moekit/registry.h"
#include "numerics/fp8.h"
#include "synthetic/synthetic.h"

namespace moekit::cli {
namespace {

struct RunRequest {
  std::string model = "deepseek-v3";
  std::int64_t dp = 4;
  std::int64_t ep = 0;  // 0: dp
  std::int64_t tokens_per_rank = 16;
  std::int64_t max_tokens_per_rank = 0;  // 0: tokens_per_rank
  std::int64_t num_experts = 0;          // 0: the model's
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

// What the ranks of one run leave for the check: every rank's outputs in global token order, and
// the weights it built (the reference reads them instead of building them again).
struct RunResults {
  std::mutex mutex;
  std::vector<std::uint16_t> output;
  std::vector<synthetic::HostExpertWeights> weights;
  double device_vs_cpu = -1;  // a GPU run's relative difference to the CPU layer (-1: not run)
};

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
      req.max_tokens_per_rank == 0 ? std::max<std::int64_t>(req.tokens_per_rank, 1) : req.max_tokens_per_rank, 0};
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
  if (root) std::cerr << "moekit run: building " << req.dp << " rank(s) of seeded synthetic experts...\n";

  // Seeded synthetic weights and tokens: global expert and token indices, so any layout draws the
  // same values. This rank's tokens are global tokens [rank * T, (rank + 1) * T).
  cpu::ThreadPool pool(threads_per_rank);
  synthetic::HostExpertWeights host_weights =
      synthetic::make_expert_weights(p, first_local_expert(par, p, comm.rank()), req.seed, pool);
  const std::vector<float> bias =
      model.has_score_correction_bias ? synthetic::make_routing_bias(p.E, req.seed) : std::vector<float>{};
  const synthetic::HostSharedExperts shared =
      req.shared_experts ? synthetic::make_shared_experts(model, p, req.seed, pool) : synthetic::HostSharedExperts{};
  const std::int64_t T = req.tokens_per_rank, K = p.K, E = p.E;
  const synthetic::Tokens tokens = synthetic::make_tokens(K, E, comm.rank() * T, T, req.seed);

  const std::unique_ptr<Memory> memory = make_memory(opt.device);
  DeviceCopies dev(*memory);
  const ExpertWeightsView view = host_weights.view(dev);
  const float* bias_ptr = bias.empty() ? nullptr : dev.put(bias, "bias");
  const std::uint16_t* hidden = dev.put(tokens.hidden, "hidden");
  const float* logits = dev.put(tokens.logits, "logits");
  std::vector<std::uint16_t> out(static_cast<std::size_t>(T * K));
  DeviceBuffer out_dev;
  std::uint16_t* output = out.data();
  if (opt.device != Device::kCpu && T > 0) {
    out_dev = DeviceBuffer(*memory, 2 * T * K, "output");
    output = out_dev.as<std::uint16_t>();
  }

  LayerWeights layer_weights{view, bias_ptr};
  shared.set(layer_weights, dev);
  MoeLayer layer(model, par, opt, layer_weights, comm);
  const MoeProblem& lp = layer.problem();
  if (root) {
    std::cout << fmt::format(
        "moekit run: {} device={}{} experts={} dispatch={} comm={} ranks={} dp={} ep={} E={} E_local={} K={} I={} "
        "topk={} act={} quant={}{} format={}\n",
        model.name, device_name(opt.device), req.device == "auto" ? " (auto)" : "", req.experts,
        layer.plan().section("prepare-finalize").owner, comm.name(), comm.size(), par.dp, par.ep, lp.E, lp.E_local,
        lp.K, lp.I(), lp.topk, activation_name(lp.activation), quant_name(lp.quant), lp.fuse_w1 ? " (fused W1)" : "",
        format_name(lp.format));
    std::cout << fmt::format("quantization: {}\n", quant.note);
    if (const auto& sp = layer.shared_problem())
      std::cout << fmt::format("shared experts: one MLP of I = {}{}, on every rank beside the routed experts\n",
                               sp->I(),
                               model.shared_expert_gate ? ", gated by sigmoid(hidden . shared_expert_gate)" : "");
    else if (model.shared_intermediate_size > 0)
      std::cout << fmt::format("shared experts: not in the step (--no-shared-experts)\n");
    std::cout << fmt::format("tokens per rank {} (max_tokens_per_rank {}, M = {}), threads per rank {}\n", T,
                             par.max_tokens_per_rank, lp.M, threads_per_rank);
    std::cout << fmt::format(
        "workspace per rank: experts {} bytes ({}), layer {} bytes ({}) = moekit plan --device {} --experts {} for "
        "this layout{}\n",
        layer.plan().section_bytes("experts"), human_bytes(layer.plan().section_bytes("experts")),
        layer.plan().total_bytes, human_bytes(layer.plan().total_bytes), device_name(opt.device), req.experts,
        req.check ? fmt::format("; allocated {} bytes with guard bands", layer.allocated_workspace_bytes()) : "");
  }
  for (std::int64_t step = 0; step < req.steps; ++step) {
    comm.barrier();
    layer.forward(hidden, logits, T, output);
    const StepStats& s = layer.last_step();
    const double step_ms = comm.all_reduce_max(s.total_ms);
    if (root)
      std::cout << fmt::format(
                       "step {:>3}: {:9.2f} ms  {:10.1f} tokens/s  (rank 0: route {:.2f}, prepare {:.2f}, experts "
                       "{:.2f}, finalize {:.2f} ms)\n",
                       step, step_ms, static_cast<double>(T * comm.size()) / (step_ms / 1e3), s.route_ms, s.prepare_ms,
                       s.experts_ms, s.finalize_ms)
                << std::flush;
  }
  if (output != out.data() && T > 0) memory->to_host(out.data(), output, 2 * T * K, nullptr);
  if (!req.output.empty()) {
    const std::string path = comm.size() > 1 ? fmt::format("{}.rank{}", req.output, comm.rank()) : req.output;
    std::ofstream file(path, std::ios::binary);
    file.write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(2 * out.size()));
    MOEKIT_CHECK(file.good(), "--output: cannot write {} bytes to '{}'", 2 * out.size(), path);
  }
  if (!req.check) return 0;
  if (opt.device != Device::kCpu) {
    // The same step on the CPU backend with the same inputs and weights.
    LayerOptions cpu_opt = opt;
    cpu_opt.device = Device::kCpu;
    cpu_opt.prepare_finalize.clear();
    LayerWeights cpu_weights{host_weights.view(), bias.empty() ? nullptr : bias.data()};
    shared.set(cpu_weights);
    MoeLayer cpu_layer(model, par, cpu_opt, cpu_weights, comm);
    std::vector<std::uint16_t> cpu_out(out.size());
    cpu_layer.forward(tokens.hidden.data(), tokens.logits.data(), T, cpu_out.data());
    double err = 0, norm = 0;
    for (std::size_t i = 0; i < out.size(); ++i) {
      const double x = numerics::bf16_decode(out[i]), y = numerics::bf16_decode(cpu_out[i]);
      err += (x - y) * (x - y);
      norm += y * y;
    }
    std::lock_guard<std::mutex> lock(results.mutex);
    results.device_vs_cpu = norm > 0 ? std::sqrt(err / norm) : 0.0;
  }
  // Every rank's outputs and weights to the check: in-process ranks share memory; MPI ranks send
  // their outputs to rank 0, whose bank builds the other ranks' experts again.
  const auto P = static_cast<std::size_t>(comm.size());
  const std::int64_t bytes = 2 * T * K;
  std::vector<std::int64_t> send_bytes(P, 0), send_off(P, 0), recv_bytes(P, 0), recv_off(P, 0);
  send_bytes[0] = bytes;
  if (root)
    for (std::size_t r = 0; r < P; ++r) {
      recv_bytes[r] = bytes;
      recv_off[r] = static_cast<std::int64_t>(r) * bytes;
    }
  std::vector<std::uint16_t> all(root ? P * out.size() : 0);
  comm.all_to_all_v(out.data(), send_bytes, send_off, all.data(), recv_bytes, recv_off);
  std::lock_guard<std::mutex> lock(results.mutex);
  if (root) results.output = std::move(all);
  results.weights.push_back(std::move(host_weights));
  return 0;
}

int check_run(const RunRequest& req, const ModelConfig& model, RunResults& results, int threads) {
  const ParallelConfig par{
      req.dp, req.ep == 0 ? req.dp : req.ep,
      req.max_tokens_per_rank == 0 ? std::max<std::int64_t>(req.tokens_per_rank, 1) : req.max_tokens_per_rank, 0};
  const ExpertsEntry& entry = find_experts(req.experts, Device::kCpu);
  // The float64 reference follows the recipe (no bf16 W1 output where W1 is fused).
  const MoeProblem p = make_problem(model, par, entry.format, choose_quant(model, req.quant).quant,
                                    req.activation.empty() ? model.activation : parse_activation(req.activation),
                                    req.fuse_w1, parse_accumulation(req.accumulation));
  cpu::ThreadPool pool(threads);
  synthetic::ExpertBank bank(p, req.seed, pool);
  for (const auto& w : results.weights) bank.adopt(w);
  const std::vector<float> bias =
      model.has_score_correction_bias ? synthetic::make_routing_bias(p.E, req.seed) : std::vector<float>{};
  check::LayerReference reference(
      model, p, bias.empty() ? nullptr : bias.data(), [&](std::int64_t e) { return bank.expert(e); }, pool);
  const synthetic::HostSharedExperts shared =
      req.shared_experts ? synthetic::make_shared_experts(model, p, req.seed, pool) : synthetic::HostSharedExperts{};
  if (shared.problem)
    reference.set_shared(*shared.problem, shared.experts.view(), shared.gate.empty() ? nullptr : shared.gate.data());
  const std::int64_t T = req.tokens_per_rank;
  for (std::int64_t r = 0; r < req.dp; ++r) {
    const synthetic::Tokens t = synthetic::make_tokens(p.K, p.E, r * T, T, req.seed);
    reference.add(t.hidden.data(), t.logits.data(), T, par.max_tokens_per_rank, results.output.data() + r * T * p.K);
  }
  const check::LayerError& err = reference.error();
  // The float64 reference runs on the CPU's quantized operands; a GPU's FP8 codes flip where its bf16
  // W1 outputs differ by an ulp, so a GPU run is held to the device-vs-CPU bound there.
  const bool gpu = results.device_vs_cpu >= 0;
  const double cpu_tolerance = req.cpu_tolerance.value_or(check::device_vs_cpu_tolerance(p.quant));
  const double tolerance = gpu ? std::max(req.tolerance, cpu_tolerance) : req.tolerance;
  bool ok = err.relative() <= tolerance && err.nan_outputs == 0;
  std::cout << fmt::format(
      "check: relative error vs float64 {:.3e} {} tolerance {:.1e}{}; {} NaN outputs; guard bands intact\n",
      err.relative(), err.relative() <= tolerance ? "<=" : ">", tolerance,
      gpu ? " (GPU: FP8 code flips against the CPU's operands)" : "", err.nan_outputs);
  if (results.device_vs_cpu >= 0) {
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
  ModelConfig model = load_model(req.model);
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
    MOEKIT_CHECK(req.dp >= 1 && req.dp <= 256, "--dp = {} must be in [1, 256] for in-process ranks", req.dp);
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
  CLI::App* cmd = app.add_subcommand("run", "Run the MoE layer over N ranks with seeded synthetic weights and tokens");
  cmd->add_option("--model", req->model, "Preset name or path to a Hugging Face config.json")->capture_default_str();
  cmd->add_option("--device", req->device, "auto (cuda when the layer runs on a present GPU), cpu or cuda")
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--experts", req->experts, "Experts implementation: batched-fp8 or standard-fp8")
      ->capture_default_str();
  cmd->add_option("--dispatch", req->dispatch,
                  "Prepare/finalize (dispatch and combine) by registry name, e.g. nccl or nccl-reference on GPUs "
                  "(default: the first that runs the layout; moekit plan prints it)");
  cmd->add_option("--dp", req->dp, "Data-parallel ranks (in-process threads, or the mpirun size)")
      ->capture_default_str();
  cmd->add_option("--ep", req->ep, "Expert-parallel ranks: dp (default, 0) or 1")->capture_default_str();
  cmd->add_option("--tokens-per-rank", req->tokens_per_rank, "Tokens each rank feeds the layer per step")
      ->capture_default_str();
  cmd->add_option("--max-tokens-per-rank", req->max_tokens_per_rank,
                  "Chunk capacity (0: tokens-per-rank); larger steps are chunked")
      ->capture_default_str();
  cmd->add_option("--num-experts", req->num_experts, "Override the model's routed experts (0: keep) to keep runs short")
      ->capture_default_str();
  cmd->add_option("--quant", req->quant,
                  "auto (the model's quantization_config: block128 for fp8 with weight_block_size [128, 128]), "
                  "per-tensor, per-token or block128")
      ->capture_default_str();
  cmd->add_option("--activation", req->activation, "Override the model's activation");
  add_fuse_w1_flags(*cmd, req->fuse_w1);
  add_accumulation_option(*cmd, req->accumulation);
  add_shared_experts_flag(*cmd, req->shared_experts);
  cmd->add_option("--steps", req->steps, "Steps to run")->capture_default_str();
  cmd->add_flag("--check", req->check,
                "Checked mode (guard bands, NaN poisoning) and the float64 reference of the outputs");
  cmd->add_option("--tolerance", req->tolerance, "Relative error vs float64 allowed by --check")->capture_default_str();
  cmd->add_option("--cpu-tolerance", req->cpu_tolerance,
                  "Relative difference to the CPU backend allowed by --check on a GPU (default 3e-2: FP8 code flips, "
                  "~1.5e-2; per-tensor 5e-2: its one scale over a slab may move too)");
  cmd->add_option("--seed", req->seed, "Seed of weights, tokens and logits")->capture_default_str();
  cmd->add_option("--threads", req->threads, "CPU threads in all (0: hardware threads)")->capture_default_str();
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
