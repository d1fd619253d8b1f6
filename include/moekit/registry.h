// What exists: one table per seam (name -> factory), and the layer's workspace plan that `moekit
// plan` prints and the layer allocates. A new backend is a new implementation of one seam plus a
// row here (src/layer/registry.cpp). Factories never touch a device: the planner builds every row
// to ask for its declaration, on machines without a GPU too.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/communicator.h"
#include "moekit/experts.h"
#include "moekit/prepare_finalize.h"
#include "moekit/router.h"
#include "moekit/workspace.h"

namespace moekit {

namespace cpu {
class ThreadPool;
}

// What an implementation runs with: the CPU threads of this rank, the communicator of its ranks.
struct ExecContext {
  cpu::ThreadPool* pool = nullptr;  // CPU implementations (required to run, not to declare)
  Communicator* comm = nullptr;     // multi-rank prepare/finalize
};

struct ExpertsEntry {
  std::string_view name;  // e.g. "batched-fp8"
  Device device;
  ActivationFormat format;
  std::string_view summary;
  std::unique_ptr<Experts> (*make)(const ExecContext&);
};

struct PrepareFinalizeEntry {
  std::string_view name;
  Device device;
  ActivationFormat format;
  bool multi_rank;  // runs over a communicator of any size (otherwise one rank, or ep == 1)
  std::string_view summary;
  std::unique_ptr<PrepareFinalize> (*make)(const ExecContext&);
};

struct RouterEntry {
  std::string_view name;
  Device device;
  std::unique_ptr<Router> (*make)(const RoutingConfig&, const ExecContext&);
};

const std::vector<ExpertsEntry>& experts_registry();
const std::vector<PrepareFinalizeEntry>& prepare_finalize_registry();
const std::vector<RouterEntry>& router_registry();

// Lookups raise moekit::Error listing what exists.
const ExpertsEntry& find_experts(std::string_view name, Device device);
// The prepare/finalize a layer of this format uses on `device` with `ep` expert-parallel ranks: the
// one called `name`, or (empty name) the first row that runs it; nullptr when there is none.
const PrepareFinalizeEntry* find_prepare_finalize(Device device, ActivationFormat format, std::int64_t ep,
                                                  std::string_view name = {});
// The names of the prepare/finalize rows that run this format on `device` with `ep` ranks, for errors.
std::string prepare_finalize_names(Device device, ActivationFormat format, std::int64_t ep);
const RouterEntry* find_router(Device device);

// The layer's one workspace: the experts' section first (offset 0; its size is what `moekit plan`
// calls the workspace), then the prepare/finalize's buffers, then the routing output, then (with
// `shared`, shared_experts_problem's) the shared experts' own step as one section. Raises
// moekit::Error when the experts do not run `problem` (their unsupported() reason).
// `prepare_finalize` names the dispatch/combine (empty: find_prepare_finalize's default).
WorkspacePlan plan_layer(const MoeProblem& problem, const ExpertsEntry& experts, std::int64_t ep,
                         std::int64_t guard_bytes = 0, std::string_view prepare_finalize = {},
                         const std::optional<MoeProblem>& shared = std::nullopt);

// The shared experts' step on `device`: the standard experts, the local quantize/combine and the
// shared route (Router::route_shared), planned as a layer of its own; plan_layer places it as
// section kSharedExpertsSection, its regions prefixed kSharedExpertsPrefix, and the layer binds it
// with Workspace::part.
inline constexpr std::string_view kSharedExpertsSection = "shared-experts";
inline constexpr std::string_view kSharedExpertsPrefix = "shared/";
inline constexpr std::string_view kSharedExpertsImpl = "standard-fp8";
inline constexpr std::string_view kSharedPrepareFinalize = "local";
WorkspacePlan plan_shared_experts(const MoeProblem& shared, Device device, std::int64_t guard_bytes = 0);

}  // namespace moekit
