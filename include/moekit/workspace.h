// The workspace contract as code. Each seam of a layer (experts, prepare/finalize, routing) declares
// the memory it needs as named regions (name, dtype, shape, lifetime, alias group) through a
// WorkspaceBuilder, in its own section. The same declaration serves the planner (count only: no
// base pointer) and the runtime: a Workspace makes the one allocation at the plan's size, once, and
// binds every region by name. There is no second source of truth.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "moekit/memory.h"
#include "moekit/problem.h"
#include "moekit/types.h"

namespace moekit {

// Pipeline stages of a step; a region is live from the stage that first writes it to the last stage
// that reads it (inclusive). Regions whose lifetimes intersect never share bytes.
enum class Stage : std::uint8_t { kPrepare, kGemm1, kActivation, kGemm2, kFinalize };
std::string_view stage_name(Stage stage);

struct Region {
  std::string name;  // unique in a plan
  DType dtype = DType::kUint8;
  std::vector<std::int64_t> shape;
  std::int64_t bytes = 0;
  std::int64_t offset = 0;  // from the workspace base
  Stage live_from = Stage::kPrepare;
  Stage live_to = Stage::kFinalize;
  std::string alias_group;  // regions of one group share bytes; empty: none
  std::string section;      // the seam that declared it
  std::string what;         // one line: what it holds and why it has this shape
  // Written by other ranks through a symmetric window, or state kept across steps (a seam's status
  // words, a transport's flags and epochs): never aliased, never poisoned per step (a peer may be
  // writing it); zero when the workspace is built, and its owner may set it up further once
  // (PrepareFinalize::attach).
  bool persistent = false;
};

// The regions one seam declared, contiguous: [offset, offset + bytes), guard bands included.
struct Section {
  std::string name;   // "experts", "prepare-finalize", "routing"
  std::string owner;  // the implementation, e.g. "batched-fp8 (cuda)"
  std::int64_t offset = 0;
  std::int64_t bytes = 0;
};

struct Guard {
  std::int64_t offset = 0;
  std::int64_t bytes = 0;
};

struct WorkspacePlan {
  std::string name;        // what it plans, e.g. "batched-fp8 (cuda)"
  bool reference = false;  // a formula quoted for comparison, not something moekit allocates
  std::string note;
  MoeProblem problem;
  std::vector<Region> regions;    // in offset order
  std::vector<Section> sections;  // in offset order
  std::vector<Guard> guards;      // checked mode only
  std::int64_t total_bytes = 0;   // the one allocation, guards included when present

  const Region& region(std::string_view name) const;
  const Region* find_region(std::string_view name) const;
  const Section& section(std::string_view name) const;
  std::int64_t section_bytes(std::string_view name) const;  // 0 when absent
};

struct RegionSpec {
  std::string name;
  DType dtype;
  std::vector<std::int64_t> shape;
  Stage live_from;
  Stage live_to;
  std::string what;
  bool persistent = false;  // see Region::persistent
};

class WorkspaceBuilder {
 public:
  // Regions start on this boundary: cudaMalloc's, and enough for TMA and 16-byte vector access.
  static constexpr std::int64_t kAlignment = 256;
  static constexpr std::uint8_t kGuardByte = 0xA5;

  // guard_bytes > 0 puts a guard band before the first region and after every region (checked mode).
  WorkspaceBuilder(std::string name, const MoeProblem& problem, std::int64_t guard_bytes = 0);

  // Regions added from here on belong to section `name` (declared by `owner`), until the next one.
  void begin_section(std::string name, std::string owner);
  void add(const RegionSpec& spec);

  // Aliasing is declared: regions added between begin_alias and end_alias start at the group's
  // base; next_alternative() starts another sequence at the same base. The group is as large as
  // its largest alternative. The contract test checks that live regions never overlap.
  void begin_alias(std::string group);
  void next_alternative();
  void end_alias();

  // Places a whole plan of its own as section `name` (the shared experts' step beside the routed
  // one): its regions renamed `prefix` + name, its alias groups prefixed alike, its guard bands kept.
  // The plan must have been built with this builder's guard_bytes. Workspace::part binds it.
  void add_plan(std::string name, const WorkspacePlan& plan, std::string_view prefix);

  void set_reference(std::string note);
  WorkspacePlan finish();

 private:
  std::int64_t place(std::int64_t bytes);
  void close_section();

  WorkspacePlan plan_;
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

// The one allocation of a plan on one device, its regions bound by name, and the problem it was
// declared for. Seams read their regions with get<T>(name) (the dtype is checked against T).
class Workspace {
 public:
  // Allocates plan.total_bytes once; a device that cannot satisfy it raises moekit::Error naming
  // the plan's figure and the free memory.
  Workspace(WorkspacePlan plan, Memory& memory);
  ~Workspace();
  // The plan that WorkspaceBuilder::add_plan placed as section `section` of this workspace, bound at
  // its offset (nothing allocated): its seams read their own region names. Raises moekit::Error when
  // `plan` is not the one placed there.
  std::unique_ptr<Workspace> part(WorkspacePlan plan, std::string_view section) const;
  // The plan bound over memory the caller owns (an engine's own workspace buffer): nothing allocated
  // or freed here. Raises moekit::Error when `bytes` is below the plan's total or `base` is not
  // aligned (kAlignment on a GPU, alignof(std::max_align_t) on the CPU). With `zero_persistent`, the persistent
  // regions (status words) start at zero on `stream`, as a new workspace's do.
  static std::unique_ptr<Workspace> over(WorkspacePlan plan, Memory& memory, std::byte* base, std::int64_t bytes,
                                         bool zero_persistent, Stream stream);
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // Workspaces that made their own allocation in this process so far (parts and over() make none):
  // the count the tests hold a runtime to (one per runtime, whatever its number of layers).
  static std::int64_t allocation_count();

  const WorkspacePlan& plan() const { return plan_; }
  const MoeProblem& problem() const { return plan_.problem; }
  Device device() const { return memory_.device(); }
  Memory& memory() const { return memory_; }
  std::int64_t bytes() const { return plan_.total_bytes; }
  std::byte* base() const { return base_; }

  // Raises moekit::Error when `problem` is not the one this workspace was declared for.
  void require(const MoeProblem& problem, std::string_view who) const;

  template <class T>
  T* get(std::string_view name) const {
    return static_cast<T*>(region_ptr(name, sizeof(T), accepts<T>));
  }

  // Checked mode: every region but the persistent ones 0xFF (NaN in fp8, bf16 and fp32), every guard
  // band its pattern.
  void poison(Stream stream);
  // Raises moekit::Error naming the region just before the first damaged guard band.
  void verify_guards(Stream stream) const;

 private:
  // The C++ types a region of each dtype may be read as (bf16 and fp8 travel as their bits).
  template <class T>
  static bool accepts(DType d) {
    if constexpr (std::is_same_v<T, std::byte>) return true;
    if constexpr (std::is_same_v<T, float>) return d == DType::kFp32;
    if constexpr (std::is_same_v<T, std::int32_t>) return d == DType::kInt32;
    if constexpr (std::is_same_v<T, std::int64_t>) return d == DType::kInt64;
    if constexpr (std::is_same_v<T, std::uint16_t>) return is_sixteen_bit(d);
    if constexpr (std::is_same_v<T, std::uint8_t>) return d == DType::kFp8E4m3 || d == DType::kUint8;
    return false;
  }
  void* region_ptr(std::string_view name, std::size_t elem_size, bool (*accepts_dtype)(DType)) const;

  Workspace(WorkspacePlan plan, Memory& memory, std::byte* base);  // a part: owns nothing

  WorkspacePlan plan_;
  Memory& memory_;
  std::byte* base_ = nullptr;
  bool owner_ = true;
};

}  // namespace moekit
