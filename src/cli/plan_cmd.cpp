// `moekit plan`: what one GPU (or CPU rank) allocates for a model and a parallel layout with each
// experts implementation of the registry, section by section and region by region, from the same
// declarations the layer allocates with, beside the upstream reference formulas before and after
// their fix.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>
#include <cmath>
#include <iostream>
#include <memory>

#include "cli/commands.h"
#include "moekit/check.h"
#include "moekit/checkpoint.h"
#include "moekit/limits.h"
#include "moekit/recipe.h"
#include "moekit/registry.h"
#include "moekit/weights.h"
#include "plan/gemm_config.h"
#include "plan/upstream.h"

namespace moekit::cli {

std::int64_t parse_bytes(const std::string& text) {
  std::size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception&) {
    MOEKIT_FAIL("cannot read a byte count from '{}': write e.g. 141GiB, 80GB, 512MiB or 1e9", text);
  }
  const std::string unit = text.substr(used);
  double mult = 0;
  if (unit.empty() || unit == "B")
    mult = 1;
  else if (unit == "KiB" || unit == "K")
    mult = 1024.0;
  else if (unit == "MiB" || unit == "M")
    mult = 1024.0 * 1024;
  else if (unit == "GiB" || unit == "G")
    mult = 1024.0 * 1024 * 1024;
  else if (unit == "TiB" || unit == "T")
    mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "KB")
    mult = 1e3;
  else if (unit == "MB")
    mult = 1e6;
  else if (unit == "GB")
    mult = 1e9;
  else if (unit == "TB")
    mult = 1e12;
  MOEKIT_CHECK(mult > 0, "unknown unit '{}' in '{}': use B, KiB, MiB, GiB, TiB, KB, MB, GB or TB", unit, text);
  const double bytes = value * mult;
  MOEKIT_CHECK(bytes >= 0 && bytes < 9.2e18, "byte count '{}' must be in [0, 2^63)", text);
  return static_cast<std::int64_t>(std::llround(bytes));
}

namespace {

template <class T>
CLI::Validator range_of(T lo, T hi, const char* kind) {
  const std::string range = fmt::format("[{}, {}]", lo, hi);
  return CLI::Validator(
      [lo, hi, kind, range](std::string& text) -> std::string {
        // The whole text as a T (std::from_chars: decimal, no sign for unsigned, no whitespace).
        T v{};
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, v);
        if (ec == std::errc::result_out_of_range) return fmt::format("{} is outside {}", text, range);
        if (ec != std::errc() || ptr != end || text.empty())
          return fmt::format("'{}' is not {} (expected {} in {})", text, kind, kind, range);
        if constexpr (std::is_floating_point_v<T>) {
          if (!std::isfinite(v)) return fmt::format("{} is not a finite number (expected one in {})", text, range);
        }
        if (v < lo || v > hi) return fmt::format("{} is outside {} (moekit/limits.h)", text, range);
        return {};
      },
      fmt::format("in {}", range));
}

}  // namespace

CLI::Validator int_range(std::int64_t lo, std::int64_t hi) {
  return range_of<std::int64_t>(lo, hi, "an integer");
}
CLI::Validator uint_range(std::uint64_t lo, std::uint64_t hi) {
  return range_of<std::uint64_t>(lo, hi, "a non-negative integer");
}
CLI::Validator real_range(double lo, double hi) {
  return range_of<double>(lo, hi, "a number");
}

void add_fuse_w1_flags(CLI::App& cmd, std::optional<bool>& fuse_w1) {
  auto* on = cmd.add_flag_callback(
      "--fuse-w1", [&fuse_w1] { fuse_w1 = true; },
      "The fused W1: the activation and its 1x128 quantization in the W1 GEMM, no w1_out (the default where it runs: "
      "block128 with any activation but swigluoai; asked for elsewhere, an error)");
  auto* off = cmd.add_flag_callback(
      "--no-fuse-w1", [&fuse_w1] { fuse_w1 = false; },
      "The unfused recipe: W1 into bf16 w1_out, then the activation kernel");
  on->excludes(off);
}

void add_quant_option(CLI::App& cmd, std::string& quant) {
  std::string names;
  for (int i = 0; i < kNumRecipes; ++i)
    names += fmt::format("{}{}", i == 0 ? "" : i + 1 == kNumRecipes ? " or " : ", ", kRecipes[i].name);
  cmd.add_option("--quant", quant,
                 "auto (the model's quantization_config: block128 for fp8 with weight_block_size [128, 128]; "
                 "without one, its torch_dtype: fp16 for float16, else bf16), " +
                     names)
      ->capture_default_str();
}

void add_accumulation_option(CLI::App& cmd, std::string& accumulation) {
  cmd.add_option("--accumulation", accumulation,
                 "The GPU GEMMs' sum over K: precise (fp32 every 128 elements of K) or fast (per-token and per-tensor: "
                 "the whole K loop in the tensor cores' FP8 accumulation, 12-21% low at K = 7168)")
      ->check(CLI::IsMember({"precise", "fast"}))
      ->capture_default_str();
}

void add_shared_experts_flag(CLI::App& cmd, bool& shared_experts) {
  cmd.add_flag_callback(
      "--no-shared-experts", [&shared_experts] { shared_experts = false; },
      "The routed experts only: leave the model's shared experts (DeepSeek, GLM, Qwen2-MoE) to the caller (by "
      "default the step computes them beside the routed experts)");
}

std::string human_bytes(std::int64_t bytes) {
  const double b = static_cast<double>(bytes);
  const bool neg = b < 0;
  const double a = std::fabs(b);
  std::string s;
  if (a >= 1024.0 * 1024 * 1024)
    s = fmt::format("{:.2f} GiB", a / (1024.0 * 1024 * 1024));
  else if (a >= 1024.0 * 1024)
    s = fmt::format("{:.2f} MiB", a / (1024.0 * 1024));
  else if (a >= 1024.0)
    s = fmt::format("{:.2f} KiB", a / 1024.0);
  else
    s = fmt::format("{} B", bytes < 0 ? -bytes : bytes);
  return neg ? "-" + s : s;
}

PlanReport make_plan_report(const PlanRequest& req) {
  PlanReport report;
  if (!req.checkpoint.empty()) {
    // The checkpoint's headers, every MoE layer's tensors for every expert, checked as `run` checks
    // them before it loads (no tensor data read): a plan of a checkpoint run would refuse is refused.
    Checkpoint ck(req.checkpoint);
    MOEKIT_CHECK(!ck.moe_layers().empty(),
                 "--checkpoint {}: no MoE layer found (no tensor names a router of model_type '{}')", req.checkpoint,
                 ck.model().model_type);
    ck.check_headers(req.shared_experts);
    report.model = ck.model();
    report.moe_layers = static_cast<std::int64_t>(ck.moe_layers().size());
  } else {
    report.model = load_model(req.model);
    report.moe_layers = report.model.num_moe_layers;
  }
  const Device device = parse_device(req.device);
  const Activation act = req.activation.empty() ? report.model.activation : parse_activation(req.activation);
  const QuantChoice choice = choose_quant(report.model, req.quant);
  const QuantScheme quant = choice.quant;
  report.quant = choice.quant;
  report.quant_note = choice.note;
  if (!req.gpu_memory.empty()) report.gpu_memory = parse_bytes(req.gpu_memory);
  MOEKIT_CHECK(req.step_tokens >= 0 && req.step_tokens <= req.parallel.max_tokens_per_rank,
               "--step-tokens {}: a step holds 0 to --max-tokens-per-rank = {} tokens a rank (0: show the undeclared "
               "step)",
               req.step_tokens, req.parallel.max_tokens_per_rank);
  std::vector<std::string> known;
  bool used_dispatch = false;
  auto wanted = [&](std::string_view name) {
    known.emplace_back(name);
    return req.experts.empty() || std::find(req.experts.begin(), req.experts.end(), name) != req.experts.end();
  };
  // The local experts' weights, and every rank's copy of the shared experts (with the step's).
  auto weight_bytes = [&](const MoeProblem& p) {
    const auto shared = req.shared_experts ? shared_experts_problem(report.model, p) : std::nullopt;
    return expert_weight_bytes(p) + (shared ? expert_weight_bytes(*shared) : 0);
  };
  auto add = [&](WorkspacePlan plan, std::string config) {
    const std::int64_t weights = plan.reference ? expert_weight_bytes(plan.problem) : weight_bytes(plan.problem);
    const std::int64_t experts = plan.section_bytes("experts");
    const std::int64_t total = plan.total_bytes;
    const std::int64_t model =
        plan.reference
            ? -1
            : limits::checked_add(limits::checked_mul(report.moe_layers, weights, "every MoE layer's weights"), total,
                                  "the whole model's bytes per GPU");
    report.entries.push_back({std::move(plan), std::move(config), experts, total - experts, weights, model});
  };
  for (const auto& entry : experts_registry()) {
    if (entry.device != device || !wanted(entry.name)) continue;
    const MoeProblem problem = make_problem(report.model, req.parallel, entry.format, quant, act, req.fuse_w1,
                                            parse_accumulation(req.accumulation));
    const auto experts = entry.make({});
    const std::string why = experts->unsupported(problem);
    if (!why.empty()) {
      WorkspacePlan skipped;
      skipped.name = fmt::format("{} ({})", entry.name, device_name(entry.device));
      skipped.problem = problem;
      skipped.note = "does not run this problem: " + why;
      report.entries.push_back({std::move(skipped), "", -1, -1, weight_bytes(problem), -1});
      continue;
    }
    const bool has_dispatch =
        !req.dispatch.empty() && find_prepare_finalize(device, entry.format, req.parallel.ep, req.dispatch) != nullptr;
    used_dispatch = used_dispatch || has_dispatch;
    add(plan_layer(problem, entry, req.parallel.ep, 0, has_dispatch ? std::string_view(req.dispatch) : "",
                   req.shared_experts ? shared_experts_problem(report.model, problem) : std::nullopt),
        experts->describe_config(problem, plan::step_tokens_per_rank(problem, 0, req.step_tokens)));
  }
  for (const auto& ref : plan::upstream_references()) {
    if (!wanted(ref.name)) continue;
    const MoeProblem problem = make_problem(report.model, req.parallel, ActivationFormat::kBatchedExperts, quant, act);
    add(plan::plan_upstream_reference(ref, problem), "");
  }
  MOEKIT_CHECK(
      req.dispatch.empty() || used_dispatch,
      "--dispatch {}: no prepare/finalize of that name runs on {} with ep = {}: moekit has {} (batched format)",
      req.dispatch, req.device, req.parallel.ep,
      prepare_finalize_names(device, ActivationFormat::kBatchedExperts, req.parallel.ep));
  for (const auto& name : req.experts)
    MOEKIT_CHECK(std::find(known.begin(), known.end(), name) != known.end(),
                 "--experts {}: not an experts implementation on {} nor a reference; valid names are {}", name,
                 req.device, fmt::join(known, ", "));
  return report;
}

namespace {

nlohmann::json region_json(const Region& r) {
  return {{"name", r.name},
          {"section", r.section},
          {"dtype", std::string(dtype_name(r.dtype))},
          {"shape", r.shape},
          {"bytes", r.bytes},
          {"offset", r.offset},
          {"live", {std::string(stage_name(r.live_from)), std::string(stage_name(r.live_to))}},
          {"alias_group", r.alias_group},
          {"persistent", r.persistent},
          {"what", r.what}};
}

bool runs(const PlanEntry& e) {
  return e.workspace_bytes >= 0;
}

}  // namespace

nlohmann::json plan_json(const PlanRequest& req, const PlanReport& report) {
  nlohmann::json out;
  out["model"] = report.model.name;
  out["device"] = req.device;
  out["quant_note"] = report.quant_note;
  out["parallel"] = {{"dp", req.parallel.dp},
                     {"ep", req.parallel.ep},
                     {"max_tokens_per_rank", req.parallel.max_tokens_per_rank},
                     {"num_dispatchers", req.parallel.dp},
                     {"step_tokens", req.step_tokens}};
  out["plans"] = nlohmann::json::array();
  for (const PlanEntry& e : report.entries) {
    const WorkspacePlan& plan = e.plan;
    const MoeProblem& p = plan.problem;
    nlohmann::json b = {{"name", plan.name},
                        {"format", std::string(format_name(p.format))},
                        {"reference", plan.reference},
                        {"runs", runs(e)},
                        {"note", plan.note},
                        {"config", e.config},
                        {"M", p.M},
                        {"N", p.N},
                        {"K", p.K},
                        {"I", p.I()},
                        {"topk", p.topk},
                        {"E", p.E},
                        {"E_local", p.E_local},
                        {"num_dispatchers", p.num_dispatchers},
                        {"activation", std::string(activation_name(p.activation))},
                        {"quant", std::string(quant_name(p.quant))},
                        {"fuse_w1", p.fuse_w1},
                        {"accumulation", std::string(accumulation_name(p.accumulation))},
                        {"sections", nlohmann::json::array()},
                        {"regions", nlohmann::json::array()},
                        {"total_bytes", plan.total_bytes},
                        {"workspace_bytes", e.workspace_bytes},
                        {"buffer_bytes", e.buffer_bytes},
                        {"expert_weight_bytes", e.weight_bytes},
                        {"moe_layers", report.moe_layers},
                        {"model_bytes", e.model_bytes}};
    for (const auto& s : plan.sections)
      b["sections"].push_back({{"name", s.name}, {"owner", s.owner}, {"offset", s.offset}, {"bytes", s.bytes}});
    for (const auto& r : plan.regions) b["regions"].push_back(region_json(r));
    if (report.gpu_memory >= 0 && runs(e)) {
      b["gpu_memory_bytes"] = report.gpu_memory;
      b["gpu_memory_left_bytes"] = report.gpu_memory - e.weight_bytes - plan.total_bytes;
      b["model_fits_gpu_memory"] = e.model_bytes <= report.gpu_memory;
    }
    out["plans"].push_back(b);
  }
  return out;
}

std::string plan_table(const PlanRequest& req, const PlanReport& report) {
  std::string s;
  const ModelConfig& m = report.model;
  const std::string act =
      report.entries.empty() ? "-" : std::string(activation_name(report.entries[0].plan.problem.activation));
  s += fmt::format(
      "moekit plan: {} (K={} I={} E={} topk={} act={}), dp={} ep={} max_tokens_per_rank={} quant={}, per {}\n", m.name,
      m.hidden_size, m.moe_intermediate_size, m.num_experts, m.topk, act, req.parallel.dp, req.parallel.ep,
      req.parallel.max_tokens_per_rank, quant_name(report.quant), req.device == "cuda" ? "GPU" : "CPU rank");
  s += fmt::format("quantization: {}\n", report.quant_note);
  for (const PlanEntry& e : report.entries) {
    const WorkspacePlan& plan = e.plan;
    const MoeProblem& p = plan.problem;
    const std::string m_text = p.format == ActivationFormat::kBatchedExperts
                                   ? fmt::format("M = {} = max_tokens_per_rank {} x num_dispatchers {}", p.M,
                                                 p.max_tokens_per_rank, p.num_dispatchers)
                                   : fmt::format("M = max_tokens_per_rank = {}", p.M);
    s += fmt::format("\n== {}{} [{} format, E_local = {}, {}]\n   {}\n", plan.name,
                     plan.reference ? " (REFERENCE, not allocated by moekit)" : "", format_name(p.format), p.E_local,
                     m_text, plan.note);
    if (!runs(e)) continue;
    if (!e.config.empty()) s += fmt::format("   config: {}\n", e.config);
    for (const auto& sec : plan.sections) {
      s += fmt::format("   -- {} ({}): {}\n", sec.name, sec.owner, human_bytes(sec.bytes));
      s +=
          fmt::format("   {:<20} {:<9} {:<22} {:>12}  {:<22} {}\n", "region", "dtype", "shape", "size", "live", "what");
      for (const auto& r : plan.regions) {
        if (r.section != sec.name) continue;
        const std::string live = r.persistent ? std::string("persistent")
                                              : fmt::format("{}..{}{}", stage_name(r.live_from), stage_name(r.live_to),
                                                            r.alias_group.empty() ? "" : " @" + r.alias_group);
        s += fmt::format("   {:<20} {:<9} {:<22} {:>12}  {:<22} {}\n", r.name, dtype_name(r.dtype),
                         fmt::format("[{}]", fmt::join(r.shape, ", ")), human_bytes(r.bytes), live, r.what);
      }
    }
    s += fmt::format("   {:<20} {:<9} {:<22} {:>12}  ({} bytes, the experts' workspace)\n", "WORKSPACE TOTAL", "", "",
                     human_bytes(e.workspace_bytes), e.workspace_bytes);
    s += fmt::format("   {:<20} {:<9} {:<22} {:>12}  ({} bytes in one allocation with the buffers)\n", "LAYER TOTAL",
                     "", "", human_bytes(plan.total_bytes), plan.total_bytes);
  }
  s += fmt::format("\n{:<42} {:<9} {:>8} {:>12} {:>12} {:>14}{}\n", "summary (per GPU)", "format", "M", "workspace",
                   "buffers", "local weights", report.gpu_memory >= 0 ? "      GPU left" : "");
  for (const PlanEntry& e : report.entries) {
    const WorkspacePlan& plan = e.plan;
    if (!runs(e)) {
      s += fmt::format("{:<42} {:<9} {:>8} {:>12}\n", plan.name, format_name(plan.problem.format), plan.problem.M,
                       "does not run");
      continue;
    }
    std::string left;
    if (report.gpu_memory >= 0)
      left = fmt::format(" {:>13}", human_bytes(report.gpu_memory - e.weight_bytes - plan.total_bytes));
    s += fmt::format("{:<42} {:<9} {:>8} {:>12} {:>12} {:>14}{}\n", plan.name + (plan.reference ? " (ref)" : ""),
                     format_name(plan.problem.format), plan.problem.M, human_bytes(e.workspace_bytes),
                     human_bytes(e.buffer_bytes), human_bytes(e.weight_bytes), left);
  }
  if (report.gpu_memory >= 0)
    s += fmt::format("GPU left = {} - local experts' FP8 weights - workspace - buffers\n",
                     human_bytes(report.gpu_memory));
  s += fmt::format(
      "\nwhole model per GPU: {} MoE layers on one runtime = every layer's local weights + one workspace "
      "with its buffers\n",
      report.moe_layers);
  for (const PlanEntry& e : report.entries) {
    if (e.model_bytes < 0) continue;
    s += fmt::format(
        "{:<42} {} x {} + {} = {}{}\n", e.plan.name, report.moe_layers, human_bytes(e.weight_bytes),
        human_bytes(e.plan.total_bytes), human_bytes(e.model_bytes),
        report.gpu_memory < 0 ? std::string()
        : e.model_bytes <= report.gpu_memory
            ? fmt::format(", GPU left {}", human_bytes(report.gpu_memory - e.model_bytes))
            : fmt::format(": DOES NOT FIT in --gpu-memory {} ({} over; more ep ranks hold fewer experts each)",
                          human_bytes(report.gpu_memory), human_bytes(e.model_bytes - report.gpu_memory)));
  }
  return s;
}

std::function<int()> add_plan_command(CLI::App& app) {
  auto req = std::make_shared<PlanRequest>();
  CLI::App* cmd = app.add_subcommand(
      "plan", "Print what one GPU (or CPU rank) allocates with each experts implementation, region by region");
  auto* model_opt = cmd->add_option("--model", req->model, "Preset name or path to a Hugging Face config.json")
                        ->capture_default_str();
  cmd->add_option("--checkpoint", req->checkpoint,
                  "A Hugging Face checkpoint directory: its config.json, and its MoE layers counted from its tensors")
      ->excludes(model_opt);
  cmd->add_option("--dp", req->parallel.dp, "Data-parallel ranks (= num_dispatchers)")
      ->check(int_range(1, limits::kMaxRanks))
      ->capture_default_str();
  cmd->add_option("--ep", req->parallel.ep, "Expert-parallel ranks")
      ->check(int_range(1, limits::kMaxRanks))
      ->capture_default_str();
  cmd->add_option("--max-tokens-per-rank", req->parallel.max_tokens_per_rank, "Tokens one rank sends per chunk")
      ->check(int_range(1, limits::kMaxTokensPerRank))
      ->capture_default_str();
  cmd->add_option("--local-experts", req->parallel.local_experts,
                  "Experts held per rank (0: experts / ep; more with EPLB redundant experts)")
      ->check(int_range(0, limits::kMaxSlotsPerExpert * limits::kMaxExperts))
      ->capture_default_str();
  cmd->add_option("--device", req->device, "cuda (what one GPU allocates) or cpu")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  cmd->add_option("--activation", req->activation,
                  "silu, gelu, gelu_tanh, swigluoai, relu2, silu_no_mul (default: the model's)");
  add_quant_option(*cmd, req->quant);
  add_fuse_w1_flags(*cmd, req->fuse_w1);
  add_accumulation_option(*cmd, req->accumulation);
  add_shared_experts_flag(*cmd, req->shared_experts);
  cmd->add_option("--experts", req->experts,
                  "Only these experts implementations or references (repeatable; default: all)");
  cmd->add_option("--dispatch", req->dispatch,
                  "Plan this prepare/finalize where it runs the format (e.g. nccl, nccl-reference; default: the "
                  "first that runs the layout)");
  cmd->add_option("--gpu-memory", req->gpu_memory, "GPU memory, e.g. 141GiB: adds what is left per plan");
  cmd->add_option("--step-tokens", req->step_tokens,
                  "Show the GEMM configs of a step declared at this many tokens per rank (enqueue's "
                  "max_tokens_any_rank: a decode step launches only what its experts can reach; 0: "
                  "max_tokens_per_rank)")
      ->check(int_range(0, limits::kMaxTokensPerRank))
      ->capture_default_str();
  cmd->add_option("--format", req->format, "table or json")
      ->check(CLI::IsMember({"table", "json"}))
      ->capture_default_str();
  return [cmd, req]() -> int {
    if (!cmd->parsed()) return -1;
    const PlanReport report = make_plan_report(*req);
    if (req->format == "json")
      std::cout << plan_json(*req, report).dump(2) << "\n";
    else
      std::cout << plan_table(*req, report);
    return 0;
  };
}

}  // namespace moekit::cli
