// Where bytes live and how to touch them: one small allocator per device. CUDA work is ordered on a
// Stream (a cudaStream_t passed as void*; nullptr is the default stream); the CPU ignores streams.
// Plain C++: no CUDA type appears here.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "moekit/types.h"

namespace moekit {

using Stream = void*;

class Memory {
 public:
  virtual ~Memory() = default;
  virtual Device device() const = 0;
  // Raises moekit::Error naming `what`, the bytes asked for and, on a GPU, the free memory.
  virtual void* allocate(std::int64_t bytes, std::string_view what) = 0;
  virtual void deallocate(void* ptr) noexcept = 0;
  virtual void fill(void* dst, std::uint8_t byte, std::int64_t bytes, Stream stream) = 0;
  // Between host memory and this device (or within it); complete when they return.
  virtual void to_host(void* host_dst, const void* src, std::int64_t bytes, Stream stream) = 0;
  virtual void from_host(void* dst, const void* host_src, std::int64_t bytes, Stream stream) = 0;
  virtual void synchronize(Stream stream) = 0;
};

// A second stream for work that overlaps a step (the shared experts beside the routed ones). fork()
// orders the side stream after everything enqueued on `stream` so far and returns it; join() orders
// `stream` after everything enqueued on the side stream since. Both are capturable in a CUDA graph
// (the side stream joins the capture through fork's event). The CPU runs everything in order: fork
// returns `stream`, join does nothing.
class StreamFork {
 public:
  virtual ~StreamFork() = default;
  virtual Stream fork(Stream stream) = 0;
  virtual void join(Stream stream) = 0;
};
std::unique_ptr<StreamFork> make_stream_fork(Device device);

// The allocator of `device`. kCuda raises moekit::Error when moekit was built without CUDA or no
// CUDA device is present.
std::unique_ptr<Memory> make_memory(Device device);

// An owning allocation on one device, freed on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(Memory& memory, std::int64_t bytes, std::string_view what)
      : memory_(&memory), ptr_(bytes > 0 ? memory.allocate(bytes, what) : nullptr), bytes_(bytes) {}
  ~DeviceBuffer() { reset(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : memory_(o.memory_), ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      memory_ = o.memory_;
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  void* get() const { return ptr_; }
  template <class T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  std::int64_t bytes() const { return bytes_; }
  void reset() noexcept {
    if (ptr_ != nullptr) memory_->deallocate(ptr_);
    ptr_ = nullptr;
  }

 private:
  Memory* memory_ = nullptr;
  void* ptr_ = nullptr;
  std::int64_t bytes_ = 0;
};

// Host data made readable on the device of `memory`: on the CPU the host memory itself (nothing is
// copied; it must outlive its use), on a GPU a copy this object owns (nullptr for zero bytes).
class DeviceCopies {
 public:
  explicit DeviceCopies(Memory& memory) : memory_(&memory) {}
  Device device() const { return memory_->device(); }
  const void* put(const void* host, std::int64_t bytes, std::string_view what) {
    if (memory_->device() == Device::kCpu) return host;
    if (bytes == 0) return nullptr;
    buffers_.emplace_back(*memory_, bytes, what);
    memory_->from_host(buffers_.back().get(), host, bytes, nullptr);
    return buffers_.back().get();
  }
  template <class T, class Alloc>
  const T* put(const std::vector<T, Alloc>& host, std::string_view what) {
    return static_cast<const T*>(put(host.data(), static_cast<std::int64_t>(host.size() * sizeof(T)), what));
  }

 private:
  Memory* memory_;
  std::vector<DeviceBuffer> buffers_;
};

}  // namespace moekit
