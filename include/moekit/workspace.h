// The workspace contract as code. An experts implementation declares its workspace as named
// regions (name, dtype, shape, lifetime, alias group) through a WorkspaceBuilder. The same
// declaration serves the planner (count only: no base pointer) and the runtime (assigns pointers
// into one allocation made once, at maximum size); there is no second source of truth.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "moekit/problem.h"
#include "moekit/types.h"

namespace moekit {

// Pipeline stages of the experts; a region is live from the stage that first writes it to the
// last stage that reads it (inclusive). Regions whose lifetimes intersect never share bytes.
enum class Stage : std::uint8_t { kPrepare, kGemm1, kActivation, kGemm2, kFinalize };
std::string_view stage_name(Stage stage);

struct Region {
  std::string name;
  DType dtype = DType::kUint8;
  std::vector<std::int64_t> shape;
  std::int64_t bytes = 0;
  std::int64_t offset = 0;  // from the workspace base; -1 for buffers outside the workspace
  Stage live_from = Stage::kPrepare;
  Stage live_to = Stage::kFinalize;
  std::string alias_group;  // regions of one group share bytes; empty: none
  std::string what;         // one line: what it holds and why it has this shape
};

struct Guard {
  std::int64_t offset = 0;
  std::int64_t bytes = 0;
};

struct WorkspacePlan {
  std::string backend;
  ActivationFormat format = ActivationFormat::kBatchedExperts;
  bool reference = false;  // a formula quoted for comparison, not something moekit allocates
  std::string note;
  MoeProblem problem;
  std::vector<Region> regions;    // the workspace, in offset order
  std::vector<Region> buffers;    // input/output the layer holds outside the workspace (offset -1)
  std::vector<Guard> guards;      // checked mode only
  std::int64_t total_bytes = 0;   // the one allocation, guards included when present
  std::int64_t buffer_bytes = 0;  // sum of buffers

  const Region& region(std::string_view name) const;
};

struct RegionSpec {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  Stage live_from;
  Stage live_to;
  std::string what;
};

class WorkspaceBuilder {
 public:
  // Regions start on this boundary: cudaMalloc's, and enough for TMA and 16-byte vector access.
  static constexpr std::int64_t kAlignment = 256;
  static constexpr std::uint8_t kGuardByte = 0xA5;

  // base == nullptr: count only. Otherwise pointers are assigned into [base, base + capacity),
  // and a plan that does not fit raises moekit::Error. guard_bytes > 0 puts a guard band before
  // the first region and after every region (checked mode).
  WorkspaceBuilder(std::string backend, const MoeProblem& problem, void* base = nullptr, std::int64_t capacity = 0,
                   std::int64_t guard_bytes = 0);

  void* add(const RegionSpec& spec);
  template <class T>
  T* add_as(const RegionSpec& spec) {
    return static_cast<T*>(add(spec));
  }
  // A buffer the layer holds outside the workspace (experts' input and output): listed, not placed.
  void add_buffer(const RegionSpec& spec);

  // Aliasing is declared: regions added between begin_alias and end_alias start at the group's
  // base; next_alternative() starts another sequence at the same base. The group is as large as
  // its largest alternative. The contract test checks that live regions never overlap.
  void begin_alias(std::string group);
  void next_alternative();
  void end_alias();

  void set_reference(std::string note);
  WorkspacePlan finish();

 private:
  std::int64_t place(std::int64_t bytes);

  WorkspacePlan plan_;
  std::byte* base_ = nullptr;
  std::int64_t capacity_ = 0;
  std::int64_t guard_bytes_ = 0;
  std::int64_t cursor_ = 0;
  bool in_alias_ = false;
  std::string alias_group_;
  std::int64_t alias_base_ = 0;
  std::int64_t alias_end_ = 0;
  bool finished_ = false;
};

// Checked product of a shape and an element size: raises moekit::Error on 64-bit overflow.
std::int64_t shape_bytes(const std::vector<std::int64_t>& shape, DType dtype, std::string_view what);

// --- Backends ---------------------------------------------------------------------------------
// moekit's own: "batched-fp8", "standard-fp8". References quoted from the upstream report:
// "upstream-batched-cutlass-before-fix", "upstream-batched-cutlass-after-fix".
struct BackendInfo {
  std::string name;
  ActivationFormat format;
  bool reference;
  std::string summary;
};
const std::vector<BackendInfo>& backends();
const BackendInfo& backend_info(std::string_view name);
// The plan of `backend` for `problem` (whose format must be the backend's), count only.
WorkspacePlan plan_workspace(std::string_view backend, const MoeProblem& problem, std::int64_t guard_bytes = 0);

// The local experts' FP8 weights and their fp32 scales, in bytes (what sits beside the workspace).
std::int64_t expert_weight_bytes(const MoeProblem& problem);

}  // namespace moekit
