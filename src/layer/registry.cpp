// The registries of the seams and the layer's plan. To add a backend: implement one seam (see
// include/moekit/experts.h, prepare_finalize.h, router.h) and add its row below.
#include "moekit/registry.h"

#include <fmt/format.h>

#include "cpu/backend.h"
#include "cuda/backend.h"
#include "moekit/check.h"

namespace moekit {

const std::vector<ExpertsEntry>& experts_registry() {
  static const std::vector<ExpertsEntry> all = {
      {"batched-fp8", Device::kCpu, ActivationFormat::kBatchedExperts,
       "batched FP8 experts: valid rows only, W2 straight into the output", cpu::make_batched_experts},
      {"standard-fp8", Device::kCpu, ActivationFormat::kStandard,
       "standard FP8 experts: permute, per-expert GEMMs; GEMM buffers aliased by lifetime", cpu::make_standard_experts},
      {"batched-fp8", Device::kCuda, ActivationFormat::kBatchedExperts,
       "Hopper batched FP8 experts: CUTLASS grouped GEMMs sized on the device, valid rows only, W2 straight into "
       "the output",
       cuda::make_batched_experts},
      {"standard-fp8", Device::kCuda, ActivationFormat::kStandard,
       "Hopper standard FP8 experts: device permutation, CUTLASS grouped GEMMs over contiguous rows; GEMM buffers "
       "aliased by lifetime",
       cuda::make_standard_experts},
  };
  return all;
}

const std::vector<PrepareFinalizeEntry>& prepare_finalize_registry() {
  static const std::vector<PrepareFinalizeEntry> all = {
      {"all-to-all", Device::kCpu, ActivationFormat::kBatchedExperts, true,
       "(token, expert) records to the owning rank over the communicator, results back, combine at the source",
       cpu::make_all_to_all},
      {"local", Device::kCpu, ActivationFormat::kStandard, false,
       "every expert on every rank (ep == 1): quantize in place, combine the experts' rows", cpu::make_local},
      {"scatter", Device::kCuda, ActivationFormat::kBatchedExperts, false,
       "one GPU holding every expert: FP8 quantization fused with the scatter into (E_local, M, K), combine back",
       cuda::make_scatter},
      {"local", Device::kCuda, ActivationFormat::kStandard, false,
       "one GPU holding every expert: quantize in place, combine the experts' permuted rows", cuda::make_local},
      {"nccl", Device::kCuda, ActivationFormat::kBatchedExperts, true,
       "expert parallelism on NCCL's device API: each token once per destination GPU, stored by the kernels into "
       "the peer's symmetric window, fanned out there; the owner's partial sums come back the same way",
       cuda::make_nccl_device},
      {"nccl-reference", Device::kCuda, ActivationFormat::kBatchedExperts, true,
       "expert parallelism on grouped ncclSend/ncclRecv, counts exchanged first and read on the host: the oracle "
       "and fallback of the nccl transport",
       cuda::make_nccl_reference},
  };
  return all;
}

const std::vector<RouterEntry>& router_registry() {
  static const std::vector<RouterEntry> all = {
      {"topk", Device::kCpu, cpu::make_router},
      {"topk", Device::kCuda, cuda::make_router},
  };
  return all;
}

const ExpertsEntry& find_experts(std::string_view name, Device device) {
  std::string valid;
  for (const auto& e : experts_registry()) {
    if (e.name == name && e.device == device) return e;
    valid += fmt::format("{}{} ({})", valid.empty() ? "" : ", ", e.name, device_name(e.device));
  }
  MOEKIT_FAIL("no experts '{}' on {}: moekit has {}", name, device_name(device), valid);
}

const PrepareFinalizeEntry* find_prepare_finalize(Device device, ActivationFormat format, std::int64_t ep,
                                                  std::string_view name) {
  for (const auto& e : prepare_finalize_registry())
    if (e.device == device && e.format == format && (e.multi_rank || ep == 1) && (name.empty() || e.name == name))
      return &e;
  return nullptr;
}

std::string prepare_finalize_names(Device device, ActivationFormat format, std::int64_t ep) {
  std::string names;
  for (const auto& e : prepare_finalize_registry())
    if (e.device == device && e.format == format && (e.multi_rank || ep == 1))
      names += fmt::format("{}{}", names.empty() ? "" : ", ", e.name);
  return names.empty() ? "none" : names;
}

const RouterEntry* find_router(Device device) {
  for (const auto& e : router_registry())
    if (e.device == device) return &e;
  return nullptr;
}

std::unique_ptr<Memory> make_memory(Device device) {
  return device == Device::kCpu ? cpu::make_host_memory() : cuda::make_device_memory();
}

std::unique_ptr<StreamFork> make_stream_fork(Device device) {
  return device == Device::kCpu ? cpu::make_stream_fork() : cuda::make_stream_fork();
}

WorkspacePlan plan_shared_experts(const MoeProblem& shared, Device device, std::int64_t guard_bytes) {
  MOEKIT_CHECK(shared.format == ActivationFormat::kStandard && shared.E == 1 && shared.topk == 1,
               "the shared experts' step runs one standard-format expert, got {}", shared.describe());
  return plan_layer(shared, find_experts(kSharedExpertsImpl, device), 1, guard_bytes, kSharedPrepareFinalize);
}

WorkspacePlan plan_layer(const MoeProblem& problem, const ExpertsEntry& entry, std::int64_t ep,
                         std::int64_t guard_bytes, std::string_view prepare_finalize,
                         const std::optional<MoeProblem>& shared) {
  validate_problem(problem);
  const auto experts = entry.make({});
  const std::string why = experts->unsupported(problem);
  MOEKIT_CHECK(why.empty(), "{} ({}) cannot run this problem: {}", entry.name, device_name(entry.device), why);
  const std::string owner = fmt::format("{} ({})", entry.name, device_name(entry.device));
  WorkspaceBuilder b(owner, problem, guard_bytes);
  b.begin_section("experts", owner);
  experts->declare(problem, b);
  const PrepareFinalizeEntry* pf = find_prepare_finalize(entry.device, entry.format, ep, prepare_finalize);
  MOEKIT_CHECK(pf != nullptr || prepare_finalize.empty(),
               "no prepare/finalize '{}' runs the {} format on {} with ep = {}: moekit has {}", prepare_finalize,
               format_name(entry.format), device_name(entry.device), ep,
               prepare_finalize_names(entry.device, entry.format, ep));
  if (pf != nullptr) {
    b.begin_section("prepare-finalize", fmt::format("{} ({})", pf->name, device_name(pf->device)));
    pf->make({})->declare(problem, b);
  } else {
    b.begin_section("prepare-finalize",
                    fmt::format("the {} experts' input/output (no prepare/finalize on {} for ep = {} yet)",
                                format_name(entry.format), device_name(entry.device), ep));
    declare_experts_io(problem, b);
  }
  const RouterEntry* router = find_router(entry.device);
  b.begin_section("routing", router != nullptr
                                 ? fmt::format("router {} ({})", router->name, device_name(router->device))
                                 : "router output");
  if (router != nullptr)
    router->make(RoutingConfig{problem.E, problem.topk}, {})->declare(problem, b);
  else
    declare_router_output(problem, b);
  if (shared)
    b.add_plan(std::string(kSharedExpertsSection), plan_shared_experts(*shared, entry.device, guard_bytes),
               kSharedExpertsPrefix);
  WorkspacePlan plan = b.finish();
  plan.note = std::string(entry.summary);
  return plan;
}

}  // namespace moekit
