// moekit/limits.h: checked arithmetic and the host memory a process may allocate.
// NOTES: host_memory_bytes reads the machine (sysconf, rlimits, the cgroup), the one place under
// src/plan/ that does: the loader, the planner and the CLI check their byte counts against it.
#include "moekit/limits.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>

#include "moekit/check.h"

namespace moekit::limits {
namespace {

std::string gib(std::int64_t bytes) {
  return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1024.0 * 1024 * 1024));
}

// A cgroup's memory limit file: "max" (none) or a byte count; 0 when absent or unreadable.
std::int64_t cgroup_limit(const char* path) {
  std::ifstream f(path);
  std::string text;
  if (!(f >> text) || text == "max") return 0;
  try {
    return static_cast<std::int64_t>(std::min<unsigned long long>(std::stoull(text), INT64_MAX));
  } catch (const std::exception&) {
    return 0;
  }
}

}  // namespace

std::int64_t checked_mul(std::int64_t a, std::int64_t b, std::string_view what) {
  std::int64_t r = 0;
  MOEKIT_CHECK(!__builtin_mul_overflow(a, b, &r), "{} = {} * {} overflows 64 bits; use smaller values", what, a, b);
  return r;
}

std::int64_t checked_add(std::int64_t a, std::int64_t b, std::string_view what) {
  std::int64_t r = 0;
  MOEKIT_CHECK(!__builtin_add_overflow(a, b, &r), "{} = {} + {} overflows 64 bits; use smaller values", what, a, b);
  return r;
}

std::int64_t host_memory_bytes() {
  const long pages = ::sysconf(_SC_PHYS_PAGES), page = ::sysconf(_SC_PAGE_SIZE);
  std::int64_t have = pages > 0 && page > 0 ? static_cast<std::int64_t>(pages) * page : INT64_MAX;
  for (const int resource : {RLIMIT_AS, RLIMIT_DATA}) {
    struct rlimit r {};
    if (::getrlimit(resource, &r) == 0 && r.rlim_cur != RLIM_INFINITY)
      have = std::min<std::int64_t>(have, static_cast<std::int64_t>(std::min<rlim_t>(r.rlim_cur, INT64_MAX)));
  }
  for (const char* path : {"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"})
    if (const std::int64_t limit = cgroup_limit(path); limit > 0) have = std::min(have, limit);
  return have;
}

void require_memory(std::int64_t need, std::int64_t have, std::string_view what, std::string_view where,
                    std::string_view fix) {
  MOEKIT_CHECK(need <= have, "{} needs {} bytes ({}), more than the {} bytes ({}) of {}: {}", what, need, gib(need),
               have, gib(have), where, fix);
}

}  // namespace moekit::limits
