// WorkspaceBuilder: places named regions at aligned offsets (count-only or into a real
// allocation), declared aliasing, and guard bands for checked mode.
#include "moekit/workspace.h"

#include <algorithm>
#include <cstring>

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

const Region& WorkspacePlan::region(std::string_view name) const {
  for (const auto& r : regions)
    if (r.name == name) return r;
  for (const auto& r : buffers)
    if (r.name == name) return r;
  MOEKIT_FAIL("workspace plan of {} has no region '{}'", backend, name);
}

WorkspaceBuilder::WorkspaceBuilder(std::string backend, const MoeProblem& problem, void* base, std::int64_t capacity,
                                   std::int64_t guard_bytes)
    : base_(static_cast<std::byte*>(base)), capacity_(capacity), guard_bytes_(guard_bytes) {
  MOEKIT_CHECK(guard_bytes >= 0 && guard_bytes % kAlignment == 0, "guard_bytes = {} must be a multiple of {}",
               guard_bytes, kAlignment);
  MOEKIT_CHECK(base == nullptr || reinterpret_cast<std::uintptr_t>(base) % kAlignment == 0,
               "workspace base {} must be {}-byte aligned", base, kAlignment);
  plan_.backend = std::move(backend);
  plan_.format = problem.format;
  plan_.problem = problem;
  if (guard_bytes_ > 0) {
    plan_.guards.push_back({0, guard_bytes_});
    cursor_ = guard_bytes_;
  }
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

void* WorkspaceBuilder::add(const RegionSpec& spec) {
  MOEKIT_CHECK(!finished_, "region '{}' added after finish()", spec.name);
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
  r.what = spec.what;
  plan_.regions.push_back(r);
  if (base_ == nullptr) return nullptr;
  MOEKIT_CHECK(r.offset + r.bytes <= capacity_,
               "workspace of {} bytes is too small for region '{}' at offset {} ({} bytes): allocate the plan's "
               "total_bytes",
               capacity_, r.name, r.offset, r.bytes);
  return base_ + r.offset;
}

void WorkspaceBuilder::add_buffer(const RegionSpec& spec) {
  Region r;
  r.name = spec.name;
  r.dtype = spec.dtype;
  r.shape = spec.shape;
  r.bytes = shape_bytes(spec.shape, spec.dtype, spec.name);
  r.offset = -1;
  r.live_from = spec.live_from;
  r.live_to = spec.live_to;
  r.what = spec.what;
  plan_.buffer_bytes += r.bytes;
  plan_.buffers.push_back(r);
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

void WorkspaceBuilder::set_reference(std::string note) {
  plan_.reference = true;
  plan_.note = std::move(note);
}

WorkspacePlan WorkspaceBuilder::finish() {
  MOEKIT_CHECK(!in_alias_, "alias group '{}' was not closed", alias_group_);
  finished_ = true;
  std::stable_sort(plan_.regions.begin(), plan_.regions.end(),
                   [](const Region& a, const Region& b) { return a.offset < b.offset; });
  plan_.total_bytes = align_up(cursor_, kAlignment);
  if (base_ != nullptr)
    MOEKIT_CHECK(plan_.total_bytes <= capacity_, "workspace of {} bytes is smaller than the plan's {} bytes", capacity_,
                 plan_.total_bytes);
  return plan_;
}

}  // namespace moekit
