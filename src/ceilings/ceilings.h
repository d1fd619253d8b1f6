// The machine's measured ceilings and floors that benchmarks report their results against: not part
// of the layer (the library moekit_ceilings, linked by the CLI's `bench` commands and bench/, never
// by the layer). Each raises moekit::Error without CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "moekit/types.h"

namespace moekit::ceilings {

// Device-to-device copy bandwidth (bytes read + written per second, GB/s) and cuBLASLt's FP8 e4m3
// GEMM rate at 8192^3 (TFLOP/s).
double copy_gbs(void* stream);
double fp8_gemm_tflops(void* stream);
// cuBLASLt's bf16 or fp16 GEMM rate at 8192^3 (fp32 accumulation, D in the operands' dtype), TFLOP/s.
double sixteen_bit_gemm_tflops(DType operand, void* stream);

// Host time of `enqueue` (what it puts on `stream`) in us: the median of 31 after 3 warm-ups, each
// timed on a drained stream, so that no launch waits for room in the launch queue.
double host_us(const std::function<void()>& enqueue, void* stream);

// Host time to enqueue one empty kernel of `grid` blocks as moekit enqueues its kernels (with
// programmatic dependent launch), its parameters `param_bytes` (64, 512, 1024, 2048 or 4096) long,
// in us: the median of 31, each on a drained stream. A launcher's floor a launch.
double launch_us(int param_bytes, int grid, void* stream);

// One read of an FP8 weight tensor: the median time TMA alone takes to stream experts x
// rows_per_expert x k bytes (row-major, as the grouped GEMMs read them; tiled: the same bytes as
// contiguous 128x128 blocks) into a ring of `stages` 16 KB stages, one CTA per SM taking 128-row
// tiles in turn, no math; token_rows > 0 also loads that many rows of the expert's tokens (experts x
// token_rows x k) each k-block, as the swapped GEMMs do. The small-m_e floor of the experts
// benchmark. sm_90a only (TMA).
inline constexpr int kMaxWeightStreamStages = 6;
struct WeightStream {
  const void* weights = nullptr;
  std::int64_t experts = 0, rows_per_expert = 0, k = 0;  // rows_per_expert and k: multiples of 128
  int stages = kMaxWeightStreamStages;
  bool tiled = false;
  const void* tokens = nullptr;
  int token_rows = 0;
};
// The weight shapes the stream takes: whole 128-row, 128-byte TMA boxes.
inline constexpr std::int64_t kWeightStreamBox = 128;
constexpr bool weight_stream_takes(std::int64_t rows_per_expert, std::int64_t k) {
  return rows_per_expert > 0 && rows_per_expert % kWeightStreamBox == 0 && k > 0 && k % kWeightStreamBox == 0;
}
double weight_stream_ms(const WeightStream& w, void* stream);

// Random FP8 codes (no NaN) or bytes, for timing runs that need no particular values.
void fill_random_bytes(void* device, std::size_t bytes, std::uint64_t seed, bool fp8);
// `count` random bf16 or fp16 values of magnitude [0.5, 1) (count a multiple of 4).
void fill_random_sixteen_bit(void* device, std::size_t count, std::uint64_t seed, DType dtype);

}  // namespace moekit::ceilings
