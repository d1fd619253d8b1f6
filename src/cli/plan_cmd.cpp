// `moekit plan`: what each experts backend allocates per GPU for a model and a parallel layout,
// region by region, beside the upstream reference formulas before and after their fix.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>
#include <iostream>
#include <memory>

#include "cli/commands.h"
#include "moekit/check.h"

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
  report.model = load_model(req.model);
  const Activation act = req.activation.empty() ? report.model.activation : parse_activation(req.activation);
  const QuantScheme quant = parse_quant(req.quant);
  if (!req.gpu_memory.empty()) report.gpu_memory = parse_bytes(req.gpu_memory);
  for (const auto& info : backends()) {
    if (!req.backends.empty() && std::find(req.backends.begin(), req.backends.end(), info.name) == req.backends.end())
      continue;
    const MoeProblem problem = make_problem(report.model, req.parallel, info.format, quant, act);
    report.plans.push_back(plan_workspace(info.name, problem));
    report.weight_bytes.push_back(expert_weight_bytes(problem));
  }
  for (const auto& name : req.backends) backend_info(name);  // unknown names are an error
  return report;
}

namespace {

nlohmann::json region_json(const Region& r) {
  return {{"name", r.name},
          {"dtype", std::string(dtype_name(r.dtype))},
          {"shape", r.shape},
          {"bytes", r.bytes},
          {"offset", r.offset},
          {"live", {std::string(stage_name(r.live_from)), std::string(stage_name(r.live_to))}},
          {"alias_group", r.alias_group},
          {"what", r.what}};
}

}  // namespace

nlohmann::json plan_json(const PlanRequest& req, const PlanReport& report) {
  nlohmann::json out;
  out["model"] = report.model.name;
  out["parallel"] = {{"dp", req.parallel.dp},
                     {"ep", req.parallel.ep},
                     {"max_tokens_per_rank", req.parallel.max_tokens_per_rank},
                     {"num_dispatchers", req.parallel.dp}};
  out["backends"] = nlohmann::json::array();
  for (std::size_t i = 0; i < report.plans.size(); ++i) {
    const WorkspacePlan& plan = report.plans[i];
    const MoeProblem& p = plan.problem;
    nlohmann::json b = {{"name", plan.backend},
                        {"format", std::string(format_name(plan.format))},
                        {"reference", plan.reference},
                        {"note", plan.note},
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
                        {"regions", nlohmann::json::array()},
                        {"buffers", nlohmann::json::array()},
                        {"total_bytes", plan.total_bytes},
                        {"buffer_bytes", plan.buffer_bytes},
                        {"expert_weight_bytes", report.weight_bytes[i]}};
    for (const auto& r : plan.regions) b["regions"].push_back(region_json(r));
    for (const auto& r : plan.buffers) b["buffers"].push_back(region_json(r));
    if (report.gpu_memory >= 0) {
      b["gpu_memory_bytes"] = report.gpu_memory;
      b["gpu_memory_left_bytes"] = report.gpu_memory - report.weight_bytes[i] - plan.total_bytes - plan.buffer_bytes;
    }
    out["backends"].push_back(b);
  }
  return out;
}

std::string plan_table(const PlanRequest& req, const PlanReport& report) {
  std::string s;
  const ModelConfig& m = report.model;
  s += fmt::format("moekit plan: {} (K={} I={} E={} topk={} act={}), dp={} ep={} max_tokens_per_rank={} quant={}\n",
                   m.name, m.hidden_size, m.moe_intermediate_size, m.num_experts, m.topk,
                   report.plans.empty() ? "-" : std::string(activation_name(report.plans[0].problem.activation)),
                   req.parallel.dp, req.parallel.ep, req.parallel.max_tokens_per_rank, req.quant);
  for (std::size_t i = 0; i < report.plans.size(); ++i) {
    const WorkspacePlan& plan = report.plans[i];
    const MoeProblem& p = plan.problem;
    const std::string m_text = p.format == ActivationFormat::kBatchedExperts
                                   ? fmt::format("M = {} = max_tokens_per_rank {} x num_dispatchers {}", p.M,
                                                 p.max_tokens_per_rank, p.num_dispatchers)
                                   : fmt::format("M = max_tokens_per_rank = {}", p.M);
    s += fmt::format("\n== {}{} [{} format, E_local = {}, {}]\n   {}\n", plan.backend,
                     plan.reference ? " (REFERENCE, not allocated by moekit)" : "", format_name(plan.format), p.E_local,
                     m_text, plan.note);
    s += fmt::format("   {:<20} {:<9} {:<22} {:>12}  {:<22} {}\n", "region", "dtype", "shape", "size", "live", "what");
    for (const auto& r : plan.regions) {
      const std::string live = fmt::format("{}..{}{}", stage_name(r.live_from), stage_name(r.live_to),
                                           r.alias_group.empty() ? "" : " @" + r.alias_group);
      s += fmt::format("   {:<20} {:<9} {:<22} {:>12}  {:<22} {}\n", r.name, dtype_name(r.dtype),
                       fmt::format("[{}]", fmt::join(r.shape, ", ")), human_bytes(r.bytes), live, r.what);
    }
    s += fmt::format("   {:<20} {:<9} {:<22} {:>12}  ({} bytes, one allocation)\n", "WORKSPACE TOTAL", "", "",
                     human_bytes(plan.total_bytes), plan.total_bytes);
    for (const auto& r : plan.buffers)
      s += fmt::format("   {:<20} {:<9} {:<22} {:>12}  outside the workspace: {}\n", r.name, dtype_name(r.dtype),
                       fmt::format("[{}]", fmt::join(r.shape, ", ")), human_bytes(r.bytes), r.what);
  }
  s += fmt::format("\n{:<42} {:<9} {:>8} {:>12} {:>12} {:>14}{}\n", "summary (per GPU)", "format", "M", "workspace",
                   "buffers", "local weights", report.gpu_memory >= 0 ? "      GPU left" : "");
  for (std::size_t i = 0; i < report.plans.size(); ++i) {
    const WorkspacePlan& plan = report.plans[i];
    std::string left;
    if (report.gpu_memory >= 0)
      left = fmt::format(
          " {:>13}", human_bytes(report.gpu_memory - report.weight_bytes[i] - plan.total_bytes - plan.buffer_bytes));
    s += fmt::format("{:<42} {:<9} {:>8} {:>12} {:>12} {:>14}{}\n", plan.backend + (plan.reference ? " (ref)" : ""),
                     format_name(plan.format), plan.problem.M, human_bytes(plan.total_bytes),
                     human_bytes(plan.buffer_bytes), human_bytes(report.weight_bytes[i]), left);
  }
  if (report.gpu_memory >= 0)
    s += fmt::format("GPU left = {} - local experts' FP8 weights - workspace - buffers\n",
                     human_bytes(report.gpu_memory));
  return s;
}

std::function<int()> add_plan_command(CLI::App& app) {
  auto req = std::make_shared<PlanRequest>();
  CLI::App* cmd = app.add_subcommand("plan", "Print the per-GPU workspace of each experts backend, region by region");
  cmd->add_option("--model", req->model, "Preset name or path to a Hugging Face config.json")->capture_default_str();
  cmd->add_option("--dp", req->parallel.dp, "Data-parallel ranks (= num_dispatchers)")->capture_default_str();
  cmd->add_option("--ep", req->parallel.ep, "Expert-parallel ranks")->capture_default_str();
  cmd->add_option("--max-tokens-per-rank", req->parallel.max_tokens_per_rank, "Tokens one rank sends per chunk")
      ->capture_default_str();
  cmd->add_option("--local-experts", req->parallel.local_experts,
                  "Experts held per rank (0: experts / ep; more with EPLB redundant experts)")
      ->capture_default_str();
  cmd->add_option("--activation", req->activation,
                  "silu, gelu, gelu_tanh, swigluoai, relu2, silu_no_mul (default: the model's)");
  cmd->add_option("--quant", req->quant, "per-tensor, per-token or block128")->capture_default_str();
  cmd->add_option("--backend", req->backends, "Only these backends (repeatable; default: all)");
  cmd->add_option("--gpu-memory", req->gpu_memory, "GPU memory, e.g. 141GiB: adds what is left per backend");
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
