// Device properties read from the device, and the CUTLASS version this backend compiles against.
#include <cuda_runtime.h>
#include <cutlass/version.h>

#include <cstdlib>

#include "cuda/check.h"
#include "cuda/device_info.h"

namespace moekit::cuda {

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // no driver / no device: report zero, clear the sticky error
    return 0;
  }
  return count;
}

DeviceInfo device_info(int device) {
  cudaDeviceProp prop{};
  MOEKIT_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  DeviceInfo info;
  info.device = device;
  info.name = prop.name;
  info.sm_major = prop.major;
  info.sm_minor = prop.minor;
  info.num_sms = prop.multiProcessorCount;
  info.l2_bytes = prop.l2CacheSize;
  info.global_memory_bytes = static_cast<long long>(prop.totalGlobalMem);
  info.max_smem_per_block_optin = static_cast<long long>(prop.sharedMemPerBlockOptin);
  return info;
}

int use_device_of_rank(int rank) {
  const int count = device_count();
  MOEKIT_CUDA_REQUIRE(count > 0, "no CUDA device is present: use --device cpu");
  int local = rank;
  for (const char* name : {"OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK"})
    if (const char* v = std::getenv(name)) {
      local = std::atoi(v);
      break;
    }
  const int device = local % count;
  MOEKIT_CUDA_CHECK(cudaSetDevice(device));
  return device;
}

int current_device() {
  int device = -1;
  MOEKIT_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

void set_device(int device) {
  MOEKIT_CUDA_CHECK(cudaSetDevice(device));
}

bool stream_capturing(void* stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MOEKIT_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status));
  return status != cudaStreamCaptureStatusNone;
}

void* create_event() {
  cudaEvent_t e = nullptr;
  MOEKIT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

void record_event(void* event, void* stream) {
  MOEKIT_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}

void stream_wait_event(void* stream, void* event) {
  MOEKIT_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

void synchronize_event(void* event) {
  MOEKIT_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(event)));
}

void destroy_event(void* event) {
  MOEKIT_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
}

std::string cutlass_version() {
  return std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." + std::to_string(CUTLASS_PATCH);
}

}  // namespace moekit::cuda
