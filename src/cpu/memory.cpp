// Host memory behind the Memory interface: 256-byte aligned allocations (the workspace's region
// alignment), byte operations as memset / memcpy.
#include <cstdlib>
#include <cstring>

#include "cpu/backend.h"
#include "moekit/check.h"
#include "moekit/limits.h"
#include "moekit/workspace.h"

namespace moekit::cpu {
namespace {

class HostMemory final : public Memory {
 public:
  Device device() const override { return Device::kCpu; }
  void* allocate(std::int64_t bytes, std::string_view what) override {
    MOEKIT_CHECK(bytes >= 0, "allocation of {} bytes for {}", bytes, what);
    limits::require_memory(bytes, limits::host_memory_bytes(), fmt::format("the host allocation for {}", what),
                           "host memory", "lower max_tokens_per_rank or the experts per rank");
    const std::int64_t a = WorkspaceBuilder::kAlignment;
    const auto rounded = static_cast<std::size_t>((bytes + a - 1) / a * a);
    void* p = std::aligned_alloc(static_cast<std::size_t>(a), rounded == 0 ? static_cast<std::size_t>(a) : rounded);
    MOEKIT_CHECK(p != nullptr,
                 "host allocation of {} bytes for {} failed: the plan needs it; lower max_tokens_per_rank", bytes,
                 what);
    return p;
  }
  void deallocate(void* p) noexcept override { std::free(p); }
  void fill(void* dst, std::uint8_t byte, std::int64_t bytes, Stream) override {
    std::memset(dst, byte, static_cast<std::size_t>(bytes));
  }
  void to_host(void* dst, const void* src, std::int64_t bytes, Stream) override {
    std::memcpy(dst, src, static_cast<std::size_t>(bytes));
  }
  void from_host(void* dst, const void* src, std::int64_t bytes, Stream) override {
    std::memcpy(dst, src, static_cast<std::size_t>(bytes));
  }
  void synchronize(Stream) override {}
};

}  // namespace

std::unique_ptr<StreamFork> make_stream_fork() {
  struct InOrder final : StreamFork {
    Stream fork(Stream stream) override { return stream; }
    void join(Stream) override {}
  };
  return std::make_unique<InOrder>();
}

std::unique_ptr<Memory> make_host_memory() {
  return std::make_unique<HostMemory>();
}

}  // namespace moekit::cpu
