// CUDA device memory behind the Memory interface: cudaMalloc'd allocations (256-byte aligned, the
// workspace's region alignment), byte operations on the caller's stream.
#include <cuda_runtime.h>

#include <string>

#include "cuda/backend.h"
#include "cuda/check.h"
#include "cuda/device_info.h"
#include "cuda/launch.h"

namespace moekit::cuda {
namespace {

std::string gib(std::int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024 * 1024));
  return buf;
}

class CudaMemory final : public Memory {
 public:
  Device device() const override { return Device::kCuda; }
  void* allocate(std::int64_t bytes, std::string_view what) override {
    void* p = nullptr;
    const cudaError_t err = cudaMalloc(&p, static_cast<std::size_t>(bytes > 0 ? bytes : 256));
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      std::size_t free_bytes = 0, total_bytes = 0;
      (void)cudaMemGetInfo(&free_bytes, &total_bytes);
      MOEKIT_CUDA_REQUIRE(false, std::string("the GPU cannot allocate ") + std::to_string(bytes) + " bytes (" +
                                     gib(bytes) + ") for " + std::string(what) + ": " +
                                     gib(static_cast<std::int64_t>(free_bytes)) + " of " +
                                     gib(static_cast<std::int64_t>(total_bytes)) +
                                     " are free. `moekit plan` shows where the bytes go; lower "
                                     "--max-tokens-per-rank or the local experts");
    }
    return p;
  }
  void deallocate(void* p) noexcept override { cudaFree(p); }
  void fill(void* dst, std::uint8_t byte, std::int64_t bytes, Stream stream) override {
    MOEKIT_CUDA_CHECK(cudaMemsetAsync(dst, byte, static_cast<std::size_t>(bytes), static_cast<cudaStream_t>(stream)));
  }
  void to_host(void* dst, const void* src, std::int64_t bytes, Stream stream) override {
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(bytes), cudaMemcpyDefault,
                                      static_cast<cudaStream_t>(stream)));
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  }
  void from_host(void* dst, const void* src, std::int64_t bytes, Stream stream) override {
    MOEKIT_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(bytes), cudaMemcpyDefault,
                                      static_cast<cudaStream_t>(stream)));
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  }
  void synchronize(Stream stream) override {
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
  }
};

class CudaStreamFork final : public StreamFork {
 public:
  CudaStreamFork() {
    MOEKIT_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
    MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&forked_, cudaEventDisableTiming));
    MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&joined_, cudaEventDisableTiming));
  }
  ~CudaStreamFork() override {
    cudaEventDestroy(joined_);
    cudaEventDestroy(forked_);
    cudaStreamDestroy(side_);
  }
  CudaStreamFork(const CudaStreamFork&) = delete;
  CudaStreamFork& operator=(const CudaStreamFork&) = delete;
  Stream fork(Stream stream) override {
    MOEKIT_CUDA_CHECK(cudaEventRecord(forked_, static_cast<cudaStream_t>(stream)));
    MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(side_, forked_, 0));
    return side_;
  }
  void join(Stream stream) override {
    MOEKIT_CUDA_CHECK(cudaEventRecord(joined_, side_));
    MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), joined_, 0));
  }

 private:
  cudaStream_t side_ = nullptr;
  cudaEvent_t forked_ = nullptr, joined_ = nullptr;
};

}  // namespace

std::unique_ptr<StreamFork> make_stream_fork() {
  return std::make_unique<CudaStreamFork>();
}

std::unique_ptr<Memory> make_device_memory() {
  MOEKIT_CUDA_REQUIRE(device_count() > 0, "no CUDA device is present: use --device cpu");
  return std::make_unique<CudaMemory>();
}

bool available() {
  return device_count() > 0;
}

int current_device_num_sms() {
  int device = 0;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  return device_info(device).num_sms;
}

}  // namespace moekit::cuda
