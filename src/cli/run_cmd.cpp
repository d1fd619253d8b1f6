// `moekit run`: one MoE layer over N ranks on the CPU backend with seeded random weights and
// tokens; prints per-step time, tokens/s, the workspace bytes (equal to `moekit plan`) and, with
// --check, the relative error against the float64 reference. Ranks are threads of this process
// (--comm in-process) or MPI processes (mpirun -np N moekit run ...).
#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <iostream>
#include <memory>
#include <thread>

#include "cli/commands.h"
#include "cpu/numerics.h"
#include "cpu/random.h"
#include "moekit/check.h"
#include "moekit/layer.h"

namespace moekit::cli {
namespace {

struct RunRequest {
  std::string model = "deepseek-v3";
  std::int64_t dp = 4;
  std::int64_t ep = 0;  // 0: dp
  std::int64_t tokens_per_rank = 16;
  std::int64_t max_tokens_per_rank = 0;  // 0: tokens_per_rank
  std::int64_t experts = 0;              // 0: the model's
  std::string backend = "cpu";
  std::string format = "batched";
  std::string quant = "per-token";
  std::string activation;
  std::int64_t steps = 2;
  bool check = false;
  std::uint64_t seed = 1;
  int threads = 0;  // 0: hardware threads
  std::string comm = "auto";
  double tolerance = 1e-2;
};

// Sums each entry over all ranks (every rank gets the sums).
std::vector<double> all_sum(Communicator& comm, const std::vector<double>& local) {
  const auto P = static_cast<std::size_t>(comm.size());
  const auto n = static_cast<std::int64_t>(local.size() * sizeof(double));
  std::vector<double> send(local.size() * P), recv(local.size() * P);
  std::vector<std::int64_t> bytes(P, n), offs(P);
  for (std::size_t r = 0; r < P; ++r) {
    std::copy(local.begin(), local.end(), send.begin() + static_cast<std::ptrdiff_t>(r * local.size()));
    offs[r] = static_cast<std::int64_t>(r) * n;
  }
  comm.all_to_all_v(send.data(), bytes, offs, recv.data(), bytes, offs);
  std::vector<double> sum(local.size(), 0.0);
  for (std::size_t r = 0; r < P; ++r)
    for (std::size_t i = 0; i < local.size(); ++i) sum[i] += recv[r * local.size() + i];
  return sum;
}

int run_rank(const RunRequest& req, const ModelConfig& model, Communicator& comm, int threads_per_rank) {
  const bool root = comm.rank() == 0;
  ParallelConfig par{
      req.dp, req.ep == 0 ? req.dp : req.ep,
      req.max_tokens_per_rank == 0 ? std::max<std::int64_t>(req.tokens_per_rank, 1) : req.max_tokens_per_rank, 0};
  LayerOptions opt;
  opt.format = parse_format(req.format);
  opt.quant = parse_quant(req.quant);
  if (!req.activation.empty()) opt.activation = parse_activation(req.activation);
  opt.checked = req.check;
  opt.reference = req.check;
  opt.num_threads = threads_per_rank;
  opt.seed = req.seed;
  if (root) std::cerr << "moekit run: building " << req.dp << " rank(s) of seeded random experts...\n";
  MoeLayer layer(model, par, opt, comm);
  const MoeProblem& p = layer.problem();

  // This rank's tokens: global token g = rank * T + t, drawn from its own stream.
  const std::int64_t T = req.tokens_per_rank, K = p.K, E = p.E;
  std::vector<std::uint16_t> hidden(static_cast<std::size_t>(T * K)), out(static_cast<std::size_t>(T * K));
  std::vector<float> logits(static_cast<std::size_t>(T * E));
  for (std::int64_t t = 0; t < T; ++t) {
    const auto g = static_cast<std::uint64_t>(comm.rank() * T + t);
    cpu::SplitMix h = cpu::stream(req.seed, 4, g), l = cpu::stream(req.seed, 5, g);
    for (std::int64_t c = 0; c < K; ++c) hidden[static_cast<std::size_t>(t * K + c)] = cpu::bf16_encode(h.normal());
    for (std::int64_t e = 0; e < E; ++e) logits[static_cast<std::size_t>(t * E + e)] = 2.0f * l.normal();
  }

  if (root) {
    std::cout << fmt::format(
        "moekit run: {} backend=cpu comm={} ranks={} dp={} ep={} E={} E_local={} K={} I={} topk={} act={} quant={} "
        "format={}\n",
        model.name, comm.name(), comm.size(), par.dp, par.ep, p.E, p.E_local, p.K, p.I(), p.topk,
        activation_name(p.activation), quant_name(p.quant), format_name(p.format));
    std::cout << fmt::format("tokens per rank {} (max_tokens_per_rank {}, M = {}), threads per rank {}\n", T,
                             par.max_tokens_per_rank, p.M, threads_per_rank);
    std::cout << fmt::format(
        "workspace per rank: {} bytes ({}), = moekit plan {} for this layout{}\n", layer.plan().total_bytes,
        human_bytes(layer.plan().total_bytes), layer.plan().backend,
        req.check ? fmt::format("; allocated {} bytes with guard bands", layer.allocated_workspace_bytes()) : "");
  }
  double last_err = 0;
  for (std::int64_t step = 0; step < req.steps; ++step) {
    comm.barrier();
    layer.forward(hidden.data(), logits.data(), T, out.data());
    const StepStats& s = layer.last_step();
    const double step_ms = comm.all_reduce_max(s.total_ms);
    const auto sums = all_sum(comm, {s.ref_err_sq, s.ref_norm_sq, static_cast<double>(s.expert_rows)});
    if (root) {
      std::string line = fmt::format(
          "step {:>3}: {:9.2f} ms  {:10.1f} tokens/s  (rank 0: route+quant {:.2f}, dispatch {:.2f}, experts {:.2f}, "
          "combine {:.2f} ms; {} expert rows in all)",
          step, step_ms, static_cast<double>(T * comm.size()) / (step_ms / 1e3), s.route_quant_ms, s.dispatch_ms,
          s.experts_ms, s.combine_ms, static_cast<std::int64_t>(sums[2]));
      if (req.check) {
        last_err = sums[1] > 0 ? std::sqrt(sums[0] / sums[1]) : 0.0;
        line += fmt::format("  rel err vs float64 {:.3e}", last_err);
      }
      std::cout << line << "\n" << std::flush;
    }
  }
  if (req.check && root) {
    const bool ok = last_err <= req.tolerance;
    std::cout << fmt::format(
        "check: relative error {:.3e} {} tolerance {:.1e}; guard bands intact, no NaN in outputs\n", last_err,
        ok ? "<=" : ">", req.tolerance);
    return ok ? 0 : 3;
  }
  return 0;
}

int run_command(const RunRequest& req) {
  MOEKIT_CHECK(req.backend == "cpu", "backend '{}' is not available in `moekit run` yet: use --backend cpu",
               req.backend);
  MOEKIT_CHECK(req.tokens_per_rank >= 0, "--tokens-per-rank = {} must be >= 0", req.tokens_per_rank);
  MOEKIT_CHECK(req.steps >= 1, "--steps = {} must be >= 1", req.steps);
  ModelConfig model = load_model(req.model);
  if (req.experts > 0) model.num_experts = req.experts;
  std::string comm_kind = req.comm;
  if (comm_kind == "auto") comm_kind = std::getenv("OMPI_COMM_WORLD_SIZE") ? "mpi" : "in-process";
  const int hw = std::max(1u, std::thread::hardware_concurrency());
  const int threads = req.threads > 0 ? req.threads : hw;
  if (comm_kind == "mpi") {
    auto comm = make_mpi_communicator();
    return run_rank(req, model, *comm, std::max(1, threads / comm->size()));
  }
  MOEKIT_CHECK(comm_kind == "in-process", "--comm = '{}' must be auto, in-process or mpi", comm_kind);
  MOEKIT_CHECK(req.dp >= 1 && req.dp <= 256, "--dp = {} must be in [1, 256] for in-process ranks", req.dp);
  int rc = 0;
  run_in_process(static_cast<int>(req.dp), [&](Communicator& comm) {
    const int r = run_rank(req, model, comm, std::max(1, threads / static_cast<int>(req.dp)));
    if (comm.rank() == 0) rc = r;
  });
  return rc;
}

}  // namespace

std::function<int()> add_run_command(CLI::App& app) {
  auto req = std::make_shared<RunRequest>();
  CLI::App* cmd = app.add_subcommand("run", "Run the MoE layer over N ranks with seeded random weights and tokens");
  cmd->add_option("--model", req->model, "Preset name or path to a Hugging Face config.json")->capture_default_str();
  cmd->add_option("--dp", req->dp, "Data-parallel ranks (in-process threads, or the mpirun size)")
      ->capture_default_str();
  cmd->add_option("--ep", req->ep, "Expert-parallel ranks: dp (default, 0) or 1")->capture_default_str();
  cmd->add_option("--tokens-per-rank", req->tokens_per_rank, "Tokens each rank feeds the layer per step")
      ->capture_default_str();
  cmd->add_option("--max-tokens-per-rank", req->max_tokens_per_rank,
                  "Chunk capacity (0: tokens-per-rank); larger steps are chunked")
      ->capture_default_str();
  cmd->add_option("--experts", req->experts, "Override the model's routed experts (0: keep) to keep runs short")
      ->capture_default_str();
  cmd->add_option("--backend", req->backend, "cpu")->capture_default_str();
  cmd->add_option("--format", req->format, "batched or standard")->capture_default_str();
  cmd->add_option("--quant", req->quant, "per-tensor, per-token or block128")->capture_default_str();
  cmd->add_option("--activation", req->activation, "Override the model's activation");
  cmd->add_option("--steps", req->steps, "Steps to run")->capture_default_str();
  cmd->add_flag("--check", req->check, "Checked mode + float64 reference: guard bands, NaN poisoning, error");
  cmd->add_option("--tolerance", req->tolerance, "Relative error allowed by --check")->capture_default_str();
  cmd->add_option("--seed", req->seed, "Seed of weights, tokens and logits")->capture_default_str();
  cmd->add_option("--threads", req->threads, "CPU threads in all (0: hardware threads)")->capture_default_str();
  cmd->add_option("--comm", req->comm, "auto (mpi under mpirun), in-process or mpi")->capture_default_str();
  return [cmd, req]() -> int {
    if (!cmd->parsed()) return -1;
    return run_command(*req);
  };
}

}  // namespace moekit::cli
