// The CUDA backend's device entry points when moekit is built without CUDA (-DMOEKIT_CUDA=OFF, or
// no nvcc): the host classes and their declarations stay (so `moekit plan` shows them), and running
// anything on the GPU raises moekit::Error saying how to get it.
#include "cuda/backend.h"
#include "cuda/device_info.h"
#include "cuda/launch.h"
#include "cuda/placement.h"
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
std::unique_ptr<StreamFork> make_stream_fork() {
  no_cuda("a CUDA stream");
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
int use_device_of_rank(int) {
  no_cuda("the CUDA device of a rank");
}
int current_device() {
  no_cuda("the CUDA device");
}
void set_device(int) {
  no_cuda("the CUDA device");
}
bool stream_capturing(void*) {
  return false;
}
void* create_event() {
  no_cuda("a CUDA event");
}
void record_event(void*, void*) {
  no_cuda("a CUDA event");
}
void stream_wait_event(void*, void*) {
  no_cuda("a CUDA event");
}
void synchronize_event(void*) {
  no_cuda("a CUDA event");
}
void destroy_event(void*) {
  no_cuda("a CUDA event");
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
void* create_stream() {
  no_cuda("a CUDA stream");
}
void destroy_stream(void*) {}
Graph::Graph(const std::function<void(void*)>&, void*) {
  no_cuda("a CUDA graph");
}
Graph::~Graph() = default;
void Graph::replay(void*) {
  no_cuda("a CUDA graph");
}
Event::Event() {
  no_cuda("a CUDA event");
}
Event::~Event() = default;
void Event::record(void*) {
  no_cuda("a CUDA event");
}
float Event::ms_since(const Event&) const {
  no_cuda("a CUDA event");
}
double median_ms(int, const std::function<void()>&, void*) {
  no_cuda("a CUDA timer");
}
void read_status_words(const std::int32_t*, std::int32_t*, void*) {
  no_cuda("the CUDA status words");
}
void clear_status_words(std::int32_t*, void*) {
  no_cuda("the CUDA status words");
}
void launch_route(const RoutingConfig&, const float*, std::int64_t, const float*, std::int32_t*, float*, std::int32_t*,
                  void*) {
  no_cuda("the CUDA router");
}
void launch_route_shared(const std::uint16_t*, std::int64_t, std::int64_t, const std::uint16_t*, std::int32_t*, float*,
                         void*) {
  no_cuda("the CUDA router");
}
void launch_place_experts(std::int32_t*, std::int64_t, std::int64_t, std::int64_t, const plan::PlacementTables&,
                          void*) {
  no_cuda("the CUDA expert placement");
}
void launch_row_map(const std::int32_t*, std::int64_t, int, int, bool, std::int64_t, std::int32_t*, std::int32_t*,
                    std::int32_t*, std::int32_t*, std::int32_t*, void*) {
  no_cuda("the CUDA dispatch");
}
void launch_quantize_tokens(const QuantizeLaunch&, void*) {
  no_cuda("the CUDA dispatch");
}
void launch_combine(const std::int32_t*, const float*, std::int64_t, int, std::int64_t, const std::uint16_t*,
                    std::uint16_t*, void*, bool, DType, DType) {
  no_cuda("the CUDA combine");
}
void launch_permute_rows(const std::int32_t*, std::int64_t, int, std::int64_t, QuantScheme, const std::uint8_t*,
                         const float*, std::uint8_t*, float*, void*) {
  no_cuda("the CUDA standard experts");
}

}  // namespace moekit::cuda
