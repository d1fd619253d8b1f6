// FP8 GEMM on the CPU (and its 16-bit twin below): D[m, n] = the scaled sum over k of A[m, k] * B[n, k], A (M, K) FP8
// row-major (activations), B (N, K) FP8 row-major (weights, K contiguous), fp32 accumulation, output fp32 or bf16.
// Scales as in cpu/quant.h. Per element, the result is
//   kPerTensor / kPerTokenPerChannel:  (acc * sa) * sb,  acc = sum over k in increasing order
//   kBlock128:  sum over k-blocks kb in increasing order of (acc_kb * sa[m, kb]) * sb[n/128, kb]
// then + bias[n] when a bias is given (expert biases: gpt-oss),
// and does not depend on M, on the other rows, on the blocking or on the thread count: the layer's
// results are bit-identical however tokens are spread over ranks.
#pragma once

#include <cstdint>

#include "cpu/thread_pool.h"
#include "moekit/types.h"
#include "numerics/fp8.h"

namespace moekit::cpu {

using namespace numerics;

struct Fp8GemmArgs {
  std::int64_t M = 0, N = 0, K = 0;
  QuantScheme quant = QuantScheme::kPerTokenPerChannel;
  const fp8_t* A = nullptr;
  std::int64_t lda = 0;
  const float* a_scales = nullptr;
  const fp8_t* B = nullptr;
  std::int64_t ldb = 0;
  const float* b_scales = nullptr;
  const float* bias = nullptr;  // (N) fp32 added to every row after the scales, before the store; or none
  float* D_f32 = nullptr;       // exactly one of D_f32 / D_bf16
  bf16_t* D_bf16 = nullptr;
  std::int64_t ldd = 0;
};

void fp8_gemm(const Fp8GemmArgs& args, ThreadPool& pool);
// float64 reference on the same quantized operands (dequantized exactly), output double (M, N).
void fp8_gemm_ref(const Fp8GemmArgs& args, double* D, std::int64_t ldd);

// The unquantized recipes' GEMM (bf16, fp16): A (M, K) and B (N, K) 16-bit values of `dtype`, no
// scales, the same fp32 chain per output element in increasing k, then + bias[n], then the store (fp32,
// or rounded once to `dtype`): bit-identical however M, the blocking or the threads split the work,
// like fp8_gemm.
struct SixteenBitGemmArgs {
  DType dtype = DType::kBf16;  // kBf16 or kFp16: A, B and D_16
  std::int64_t M = 0, N = 0, K = 0;
  const std::uint16_t* A = nullptr;
  std::int64_t lda = 0;
  const std::uint16_t* B = nullptr;
  std::int64_t ldb = 0;
  const float* bias = nullptr;  // (N) fp32 added to every row before the store; or none
  float* D_f32 = nullptr;       // exactly one of D_f32 / D_16
  std::uint16_t* D_16 = nullptr;
  std::int64_t ldd = 0;
};

void sixteen_bit_gemm(const SixteenBitGemmArgs& args, ThreadPool& pool);
// float64 reference on the same 16-bit operands, output double (M, N).
void sixteen_bit_gemm_ref(const SixteenBitGemmArgs& args, double* D, std::int64_t ldd);

}  // namespace moekit::cpu
