// WorkspaceBuilder: places named regions at aligned offsets, section by section, with declared
// aliasing and guard bands for checked mode. Workspace: the one allocation of a plan, bound by name.
#include "moekit/workspace.h"

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <vector>

#include "moekit/check.h"

namespace moekit {
namespace {

std::int64_t align_up(std::int64_t x, std::int64_t a) {
  std::int64_t r = 0;
  MOEKIT_CHECK(!__builtin_add_overflow(x, a - 1, &r), "workspace offset {} overflows 64 bits", x);
  return r / a * a;
}

}  // namespace

std::string_view stage_name(Stage stage) {
  switch (stage) {
    case Stage::kPrepare: return "prepare";
    case Stage::kGemm1: return "gemm1";
    case Stage::kActivation: return "activation";
    case Stage::kGemm2: return "gemm2";
    case Stage::kFinalize: return "finalize";
  }
  MOEKIT_FAIL("unknown stage {}", static_cast<int>(stage));
}

std::int64_t shape_bytes(const std::vector<std::int64_t>& shape, DType dtype, std::string_view what) {
  std::int64_t bytes = dtype_size(dtype);
  for (std::int64_t d : shape) {
    MOEKIT_CHECK(d >= 0, "region '{}' has a negative dimension {}", what, d);
    MOEKIT_CHECK(!__builtin_mul_overflow(bytes, d, &bytes),
                 "region '{}' of shape [{}] x {} overflows 64-bit bytes; reduce max_tokens_per_rank, dp or the "
                 "local experts",
                 what, fmt::join(shape, ", "), dtype_name(dtype));
  }
  return bytes;
}

// --- WorkspacePlan ------------------------------------------------------------------------------

const Region* WorkspacePlan::find_region(std::string_view region_name) const {
  for (const auto& r : regions)
    if (r.name == region_name) return &r;
  return nullptr;
}

const Region& WorkspacePlan::region(std::string_view region_name) const {
  const Region* r = find_region(region_name);
  MOEKIT_CHECK(r != nullptr, "workspace plan of {} has no region '{}'", name, region_name);
  return *r;
}

const Section& WorkspacePlan::section(std::string_view section_name) const {
  for (const auto& s : sections)
    if (s.name == section_name) return s;
  MOEKIT_FAIL("workspace plan of {} has no section '{}'", name, section_name);
}

std::int64_t WorkspacePlan::section_bytes(std::string_view section_name) const {
  for (const auto& s : sections)
    if (s.name == section_name) return s.bytes;
  return 0;
}

// --- WorkspaceBuilder ---------------------------------------------------------------------------

WorkspaceBuilder::WorkspaceBuilder(std::string name, const MoeProblem& problem, std::int64_t guard_bytes)
    : guard_bytes_(guard_bytes) {
  MOEKIT_CHECK(guard_bytes >= 0 && guard_bytes % kAlignment == 0, "guard_bytes = {} must be a multiple of {}",
               guard_bytes, kAlignment);
  plan_.name = std::move(name);
  plan_.problem = problem;
  if (guard_bytes_ > 0) {
    plan_.guards.push_back({0, guard_bytes_});
    cursor_ = guard_bytes_;
  }
}

void WorkspaceBuilder::close_section() {
  if (!plan_.sections.empty())
    plan_.sections.back().bytes = align_up(cursor_, kAlignment) - plan_.sections.back().offset;
}

void WorkspaceBuilder::begin_section(std::string name, std::string owner) {
  MOEKIT_CHECK(!in_alias_, "section '{}' opened inside alias group '{}'", name, alias_group_);
  for (const auto& s : plan_.sections) MOEKIT_CHECK(s.name != name, "section '{}' declared twice", name);
  close_section();
  cursor_ = align_up(cursor_, kAlignment);
  // The first section owns the leading guard band too: sections tile the whole allocation.
  plan_.sections.push_back({std::move(name), std::move(owner), plan_.sections.empty() ? 0 : cursor_, 0});
}

std::int64_t WorkspaceBuilder::place(std::int64_t bytes) {
  const std::int64_t offset = align_up(cursor_, kAlignment);
  std::int64_t end = 0;
  MOEKIT_CHECK(!__builtin_add_overflow(offset, bytes, &end), "workspace end {} + {} overflows 64 bits", offset, bytes);
  std::int64_t next = align_up(end, kAlignment);
  if (guard_bytes_ > 0) {
    plan_.guards.push_back({next, guard_bytes_});
    next += guard_bytes_;
  }
  cursor_ = next;
  if (in_alias_) alias_end_ = std::max(alias_end_, cursor_);
  return offset;
}

void WorkspaceBuilder::add(const RegionSpec& spec) {
  MOEKIT_CHECK(!finished_, "region '{}' added after finish()", spec.name);
  MOEKIT_CHECK(!plan_.sections.empty(), "region '{}' added before any section: call begin_section first", spec.name);
  MOEKIT_CHECK(plan_.find_region(spec.name) == nullptr, "region '{}' declared twice (sections '{}' and '{}')",
               spec.name, plan_.find_region(spec.name) ? plan_.find_region(spec.name)->section : "",
               plan_.sections.back().name);
  MOEKIT_CHECK(spec.live_from <= spec.live_to, "region '{}' is live from {} to {}: backwards", spec.name,
               stage_name(spec.live_from), stage_name(spec.live_to));
  Region r;
  r.name = spec.name;
  r.dtype = spec.dtype;
  r.shape = spec.shape;
  r.bytes = shape_bytes(spec.shape, spec.dtype, spec.name);
  r.offset = place(r.bytes);
  r.live_from = spec.live_from;
  r.live_to = spec.live_to;
  r.alias_group = in_alias_ ? alias_group_ : std::string();
  r.section = plan_.sections.back().name;
  r.what = spec.what;
  MOEKIT_CHECK(!(spec.persistent && in_alias_), "region '{}' is persistent and cannot share bytes (alias group '{}')",
               spec.name, alias_group_);
  r.persistent = spec.persistent;
  plan_.regions.push_back(std::move(r));
}

void WorkspaceBuilder::begin_alias(std::string group) {
  MOEKIT_CHECK(!in_alias_, "alias group '{}' opened inside '{}'", group, alias_group_);
  in_alias_ = true;
  alias_group_ = std::move(group);
  alias_base_ = align_up(cursor_, kAlignment);
  cursor_ = alias_base_;
  alias_end_ = alias_base_;
}

void WorkspaceBuilder::next_alternative() {
  MOEKIT_CHECK(in_alias_, "next_alternative() outside an alias group");
  // NOTES: checked mode lays alternatives out one after the other so that every region has its
  // own guard bands; a guard inside an aliased range would be overwritten legitimately.
  if (guard_bytes_ == 0) cursor_ = alias_base_;
}

void WorkspaceBuilder::end_alias() {
  MOEKIT_CHECK(in_alias_, "end_alias() without begin_alias()");
  in_alias_ = false;
  cursor_ = std::max(cursor_, alias_end_);
}

void WorkspaceBuilder::add_plan(std::string name, const WorkspacePlan& plan, std::string_view prefix) {
  MOEKIT_CHECK(!finished_, "plan '{}' added after finish()", plan.name);
  MOEKIT_CHECK(!plan.reference, "'{}' is a reference formula, not a plan to place", plan.name);
  MOEKIT_CHECK(plan.guards.empty() == (guard_bytes_ == 0),
               "plan '{}' was built {} guard bands, this workspace {}: build both with the same guard_bytes", plan.name,
               plan.guards.empty() ? "without" : "with", guard_bytes_ == 0 ? "without" : "with");
  MOEKIT_CHECK(!plan_.sections.empty(), "plan '{}' placed as the first section: it starts after another", plan.name);
  begin_section(name, plan.name);
  const std::int64_t base = plan_.sections.back().offset;  // begin_section aligned it
  for (const Region& r : plan.regions) {
    Region placed = r;
    placed.name = std::string(prefix) + r.name;
    MOEKIT_CHECK(plan_.find_region(placed.name) == nullptr, "region '{}' declared twice", placed.name);
    placed.offset = base + r.offset;
    if (!r.alias_group.empty()) placed.alias_group = std::string(prefix) + r.alias_group;
    placed.section = name;
    plan_.regions.push_back(std::move(placed));
  }
  for (const Guard& g : plan.guards) plan_.guards.push_back({base + g.offset, g.bytes});
  cursor_ = base + plan.total_bytes;
}

void WorkspaceBuilder::set_reference(std::string note) {
  plan_.reference = true;
  plan_.note = std::move(note);
}

WorkspacePlan WorkspaceBuilder::finish() {
  MOEKIT_CHECK(!in_alias_, "alias group '{}' was not closed", alias_group_);
  MOEKIT_CHECK(!finished_, "finish() called twice");
  finished_ = true;
  close_section();
  std::stable_sort(plan_.regions.begin(), plan_.regions.end(),
                   [](const Region& a, const Region& b) { return a.offset < b.offset; });
  plan_.total_bytes = align_up(cursor_, kAlignment);
  return std::move(plan_);
}

// --- Workspace ----------------------------------------------------------------------------------

namespace {
std::atomic<std::int64_t> g_allocations{0};  // Workspace::allocation_count
}  // namespace

std::int64_t Workspace::allocation_count() {
  return g_allocations.load(std::memory_order_relaxed);
}

Workspace::Workspace(WorkspacePlan plan, Memory& memory) : plan_(std::move(plan)), memory_(memory) {
  MOEKIT_CHECK(!plan_.reference, "'{}' is a reference formula, not a plan moekit allocates", plan_.name);
  if (plan_.total_bytes > 0) {
    base_ = static_cast<std::byte*>(memory_.allocate(plan_.total_bytes, "the workspace of " + plan_.name));
    g_allocations.fetch_add(1, std::memory_order_relaxed);
  }
  // Persistent regions (status words, transport state kept across steps) start at zero.
  bool zeroed = false;
  for (const auto& r : plan_.regions)
    if (r.persistent && r.bytes > 0) {
      memory_.fill(base_ + r.offset, 0, r.bytes, nullptr);
      zeroed = true;
    }
  if (zeroed) memory_.synchronize(nullptr);
}

Workspace::Workspace(WorkspacePlan plan, Memory& memory, std::byte* base)
    : plan_(std::move(plan)), memory_(memory), base_(base), owner_(false) {}

Workspace::~Workspace() {
  if (owner_ && base_ != nullptr) memory_.deallocate(base_);
}

std::unique_ptr<Workspace> Workspace::part(WorkspacePlan plan, std::string_view section) const {
  const Section& s = plan_.section(section);
  MOEKIT_CHECK(s.owner == plan.name && plan.total_bytes <= s.bytes,
               "section '{}' of the {} workspace holds '{}' ({} bytes), not '{}' ({} bytes)", section, plan_.name,
               s.owner, s.bytes, plan.name, plan.total_bytes);
  return std::unique_ptr<Workspace>(new Workspace(std::move(plan), memory_, base_ + s.offset));
}

std::unique_ptr<Workspace> Workspace::over(WorkspacePlan plan, Memory& memory, std::byte* base, std::int64_t bytes,
                                           bool zero_persistent, Stream stream) {
  MOEKIT_CHECK(!plan.reference, "'{}' is a reference formula, not a plan moekit allocates", plan.name);
  MOEKIT_CHECK(bytes >= plan.total_bytes,
               "a workspace of {} bytes for {}, which needs {} (its plan's total): pass a larger buffer", bytes,
               plan.name, plan.total_bytes);
  // A GPU's regions start on kAlignment (TMA, vector stores); the CPU reads any region unaligned but
  // its elements need their own alignment (NumPy's allocations give 16 bytes).
  const std::uintptr_t align = memory.device() == Device::kCuda
                                   ? static_cast<std::uintptr_t>(WorkspaceBuilder::kAlignment)
                                   : alignof(std::max_align_t);
  MOEKIT_CHECK(plan.total_bytes == 0 || (base != nullptr && reinterpret_cast<std::uintptr_t>(base) % align == 0),
               "a workspace buffer at {} for {}: it must start on a {}-byte boundary", static_cast<void*>(base),
               plan.name, align);
  auto w = std::unique_ptr<Workspace>(new Workspace(std::move(plan), memory, base));
  if (zero_persistent)
    for (const auto& r : w->plan_.regions)
      if (r.persistent && r.bytes > 0) memory.fill(base + r.offset, 0, r.bytes, stream);
  return w;
}

void Workspace::require(const MoeProblem& problem, std::string_view who) const {
  MOEKIT_CHECK(problem == plan_.problem,
               "{} was asked to run {} on a workspace planned for {}: build the workspace from this problem's plan",
               who, problem.describe(), plan_.problem.describe());
}

void* Workspace::region_ptr(std::string_view name, std::size_t elem_size, bool (*accepts_dtype)(DType)) const {
  const Region* r = plan_.find_region(name);
  MOEKIT_CHECK(r != nullptr, "the workspace of {} has no region '{}' (its declaration did not add it)", plan_.name,
               name);
  MOEKIT_CHECK(accepts_dtype(r->dtype), "region '{}' holds {}, read as a {}-byte type that is not one", name,
               dtype_name(r->dtype), elem_size);
  return base_ + r->offset;
}

void Workspace::poison(Stream stream) {
  for (const auto& r : plan_.regions)
    if (!r.persistent) memory_.fill(base_ + r.offset, 0xFF, r.bytes, stream);
  for (const auto& g : plan_.guards) memory_.fill(base_ + g.offset, WorkspaceBuilder::kGuardByte, g.bytes, stream);
}

void Workspace::verify_guards(Stream stream) const {
  if (plan_.guards.empty()) return;
  std::vector<std::uint8_t> host;
  for (const auto& g : plan_.guards) {
    host.resize(static_cast<std::size_t>(g.bytes));
    memory_.to_host(host.data(), base_ + g.offset, g.bytes, stream);
    for (std::int64_t i = 0; i < g.bytes; ++i) {
      if (host[static_cast<std::size_t>(i)] == WorkspaceBuilder::kGuardByte) continue;
      std::string near = "the start of the workspace";
      for (const auto& r : plan_.regions)
        if (r.offset + r.bytes <= g.offset) near = "region '" + r.name + "' (" + r.section + ")";
      MOEKIT_FAIL(
          "checked mode: the guard band at offset {} (+{}) of the {} workspace was overwritten, just after {}: a "
          "kernel wrote outside its region",
          g.offset, i, plan_.name, near);
    }
  }
}

}  // namespace moekit
