// The ceilings without CUDA (-DMOEKIT_CUDA=OFF, or no nvcc): each raises moekit::Error saying how to
// get them.
#include "ceilings/ceilings.h"
#include "moekit/check.h"

namespace moekit::ceilings {
namespace {

[[noreturn]] void no_cuda(const char* what) {
  MOEKIT_FAIL("{}: moekit was built without CUDA; rebuild with nvcc on the PATH (or -DMOEKIT_CUDA=ON) to measure it",
              what);
}

}  // namespace

double copy_gbs(void*) {
  no_cuda("the GPU's copy bandwidth");
}
double fp8_gemm_tflops(void*) {
  no_cuda("the GPU's FP8 rate");
}
double sixteen_bit_gemm_tflops(DType, void*) {
  no_cuda("the GPU's 16-bit GEMM rate");
}
double host_us(const std::function<void()>&, void*) {
  no_cuda("the host time of a launcher");
}
double launch_us(int, int, void*) {
  no_cuda("the host's launch floor");
}
double weight_stream_ms(const WeightStream&, void*) {
  no_cuda("the GPU's weight stream");
}
void fill_random_bytes(void*, std::size_t, std::uint64_t, bool) {
  no_cuda("fill_random_bytes");
}
void fill_random_sixteen_bit(void*, std::size_t, std::uint64_t, DType) {
  no_cuda("fill_random_sixteen_bit");
}

}  // namespace moekit::ceilings
