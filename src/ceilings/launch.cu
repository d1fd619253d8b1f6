// The host's floor for a launch (ceilings/ceilings.h): an empty kernel enqueued as moekit enqueues
// its kernels (launch_pdl), its parameters of a given size.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "ceilings/ceilings.h"
#include "cuda/check.h"
#include "cuda/pdl.cuh"

namespace moekit::ceilings {
namespace {

template <int kBytes>
struct Blob {
  unsigned char bytes[kBytes];
};

template <int kBytes>
__global__ void empty_kernel(const __grid_constant__ Blob<kBytes> blob) {
  cuda::pdl_wait();
  if (blob.bytes[0] == 1 && threadIdx.x == 1024) __trap();  // never: keeps the parameters live
}

template <int kBytes>
double median_launch_us(cudaStream_t stream, int grid) {
  const Blob<kBytes> blob{};
  return host_us(
      [&] {
        cuda::launch_pdl(empty_kernel<kBytes>, grid, 128, 0, stream, blob);
        MOEKIT_CUDA_CHECK_LAUNCH();
      },
      stream);
}

}  // namespace

double host_us(const std::function<void()>& enqueue, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  std::vector<double> us;
  for (int i = 0; i < 3 + 31; ++i) {
    MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto t0 = std::chrono::steady_clock::now();
    enqueue();
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= 3) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  MOEKIT_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::sort(us.begin(), us.end());
  return us[us.size() / 2];
}

double launch_us(int param_bytes, int grid, void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  switch (param_bytes) {
    case 64: return median_launch_us<64>(stream, grid);
    case 512: return median_launch_us<512>(stream, grid);
    case 1024: return median_launch_us<1024>(stream, grid);
    case 2048: return median_launch_us<2048>(stream, grid);
    case 4096: return median_launch_us<4096>(stream, grid);
  }
  MOEKIT_CUDA_REQUIRE(false, "launch_us: param_bytes = " + std::to_string(param_bytes) +
                                 " is not measured; take 64, 512, 1024, 2048 or 4096");
  return 0;
}

}  // namespace moekit::ceilings
