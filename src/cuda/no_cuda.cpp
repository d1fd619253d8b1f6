// The CUDA backend's device entry points when moekit is built without CUDA (-DMOEKIT_CUDA=OFF, or
// no nvcc): the host classes and their declarations stay (so `moekit plan` shows them), and running
// anything on the GPU raises moekit::Error saying how to get it.
#include "cuda/backend.h"
#include "cuda/device_info.h"
#include "cuda/launch.h"
#include "moekit/check.h"

namespace moekit::cuda {
namespace {

[[noreturn]] void no_cuda(const char* what) {
  MOEKIT_FAIL("{}: moekit was built without CUDA; rebuild with nvcc on the PATH (or -DMOEKIT_CUDA=ON) to run on a GPU",
              what);
}

}  // namespace

std::unique_ptr<Memory> make_device_memory() {
  no_cuda("CUDA memory");
}
bool available() {
  return false;
}
int current_device_num_sms() {
  no_cuda("the CUDA device");
}
int device_count() {
  return 0;
}
DeviceInfo device_info(int) {
  no_cuda("device_info");
}
std::string cutlass_version() {
  return "none";
}
void launch_batched_experts(const BatchedExpertsLaunch&, void*) {
  no_cuda("the CUDA batched experts");
}
void launch_experts_prepare(const BatchedExpertsLaunch&, void*) {
  no_cuda("the CUDA batched experts");
}
void launch_experts_gemm(const BatchedExpertsLaunch&, int, void*) {
  no_cuda("the CUDA batched experts");
}
void launch_activation_quant(const BatchedExpertsLaunch&, ActivationKernel, void*) {
  no_cuda("the CUDA batched experts");
}
void check_experts_status(const std::int32_t*, std::int64_t, void*) {
  no_cuda("the CUDA batched experts");
}

}  // namespace moekit::cuda
