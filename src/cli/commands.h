// The moekit CLI's subcommands. Each registers its flags on a CLI11 app and returns an exit code;
// the rendering functions are separate so tests can call them without a process. One vocabulary:
// --device cpu|cuda is where a thing runs, --experts names an experts implementation of the
// registry (batched-fp8, standard-fp8), --quant and --activation the numerics.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "moekit/model.h"
#include "moekit/problem.h"
#include "moekit/workspace.h"

namespace moekit::cli {

// Parses "141GiB", "80GB", "512MiB", "1e9" (bytes); raises moekit::Error on anything else.
std::int64_t parse_bytes(const std::string& text);
std::string human_bytes(std::int64_t bytes);

struct PlanRequest {
  std::string model = "deepseek-v3";
  std::string checkpoint;  // a Hugging Face checkpoint directory: its config and MoE layers (instead of model)
  ParallelConfig parallel{32, 32, 256, 0};
  std::string device = "cuda";           // whose declarations: what one GPU (or one CPU rank) allocates
  std::string activation;                // empty: the model's
  std::string quant = "auto";            // auto: the checkpoint's scheme (choose_quant)
  std::optional<bool> fuse_w1;           // the fused W1 (no w1_out): nullopt where it runs (fuse_w1_runs)
  std::string accumulation = "precise";  // the GPU GEMMs' sum over K (moekit::Accumulation)
  bool shared_experts = true;            // the model's shared experts in the step (their section and weights)
  std::vector<std::string> experts;      // empty: every implementation on the device and the references
  std::string dispatch;                  // the prepare/finalize where it runs the format (empty: the default)
  std::string gpu_memory;                // empty: not shown
  std::string format = "table";
  // The GEMM configs shown for a step declared at this many tokens per rank (max_tokens_any_rank;
  // 0: max_tokens_per_rank, an undeclared step). The workspace is the same either way.
  std::int64_t step_tokens = 0;
};

struct PlanEntry {
  WorkspacePlan plan;
  std::string config;            // the implementation's choices at capacity (GEMM configs)
  std::int64_t workspace_bytes;  // the "experts" section: the figure the upstream report is about
  std::int64_t buffer_bytes;     // the other sections: the experts' input/output, routing, shared experts
  std::int64_t weight_bytes;     // the local experts' FP8 weights + scales, the shared experts' included
  // The whole model on one runtime: every MoE layer's weight_bytes + one plan total (-1: a reference
  // formula or a plan that does not run).
  std::int64_t model_bytes = -1;
};

struct PlanReport {
  ModelConfig model;
  std::vector<PlanEntry> entries;
  std::int64_t gpu_memory = -1;
  std::int64_t moe_layers = 0;  // the model's MoE layers (the config's count, or a checkpoint's tensors)
  QuantScheme quant = QuantScheme::kPerTokenPerChannel;  // the scheme planned (choose_quant)
  std::string quant_note;                                // where it came from
};

PlanReport make_plan_report(const PlanRequest& request);
nlohmann::json plan_json(const PlanRequest& request, const PlanReport& report);
std::string plan_table(const PlanRequest& request, const PlanReport& report);

// The q-quantile (0 < q <= 1) of a benchmark's samples, nearest rank (bench_cmd.cpp).
double percentile(std::vector<double> samples, double q);

// `moekit bench dispatch` (bench_dispatch_cmd.cpp): the NCCL transport alone, one rank per GPU.
struct DispatchBenchRequest {
  std::string model = "deepseek-v3";
  std::int64_t num_experts = 0;  // 0: the model's
  std::vector<std::int64_t> tokens{1, 8, 32, 128, 512, 4096};
  std::vector<std::string> routing{"uniform", "skewed"};
  std::string dispatch = "nccl";
  std::string quant = "auto";            // auto: the checkpoint's scheme (choose_quant)
  int ranks = 0;                         // 0: every GPU
  std::int64_t max_tokens_per_rank = 0;  // 0: each case's tokens
  int iters = 50;
  std::uint64_t seed = 1;
  std::string format = "table";
};
int bench_dispatch_command(const DispatchBenchRequest& request);

// A numeric flag's range [lo, hi] (the limits of moekit/limits.h): the text is parsed exactly as the
// flag's kind (decimal digits for integers: no -1 wrapped into an unsigned, no saturation, no 1e3;
// a finite number for reals: no nan, no inf) and refused outside the range. CLI11 reports a refusal
// as a usage error (exit code 2) naming the flag, the value and the range.
CLI::Validator int_range(std::int64_t lo, std::int64_t hi);
CLI::Validator uint_range(std::uint64_t lo, std::uint64_t hi);
CLI::Validator real_range(double lo, double hi);

// Registration: each returns a callback run when its subcommand was chosen.
// --fuse-w1 / --no-fuse-w1 of plan, run and bench: the fused W1 asked for (an Error where it
// cannot run) or refused; neither: fused wherever it runs (make_problem's default).
void add_fuse_w1_flags(CLI::App& cmd, std::optional<bool>& fuse_w1);
// --quant of plan, run and bench: auto or a recipe's name (moekit/recipe.h's rows).
void add_quant_option(CLI::App& cmd, std::string& quant);
// --accumulation precise|fast of plan, run and bench (moekit::Accumulation).
void add_accumulation_option(CLI::App& cmd, std::string& accumulation);
// --no-shared-experts (LayerOptions::shared_experts = false).
void add_shared_experts_flag(CLI::App& cmd, bool& shared_experts);

std::function<int()> add_plan_command(CLI::App& app);
std::function<int()> add_run_command(CLI::App& app);
std::function<int()> add_bench_command(CLI::App& app);

}  // namespace moekit::cli
