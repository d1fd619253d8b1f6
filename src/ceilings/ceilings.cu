// The ceilings every benchmark reports against (ceilings/ceilings.h): device-to-device copy
// bandwidth and cuBLASLt's FP8, bf16 and fp16 GEMM rates.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "ceilings/ceilings.h"
#include "cuda/check.h"
#include "cuda/launch.h"

#define MOEKIT_CUBLAS_CHECK(expr)                                                                       \
  do {                                                                                                  \
    const cublasStatus_t moekit_s_ = (expr);                                                            \
    MOEKIT_CUDA_REQUIRE(                                                                                \
        moekit_s_ == CUBLAS_STATUS_SUCCESS,                                                             \
        std::string("cuBLASLt error ") + std::to_string(static_cast<int>(moekit_s_)) + " in " + #expr); \
  } while (0)

namespace moekit::ceilings {
namespace {

// What fill_random_kernel writes: any bytes, FP8 codes without NaN, or 16-bit values of magnitude
// [0.5, 1) (random sign and mantissa: no overflow in a GEMM's sums).
enum class Fill : int { kBytes, kFp8, kBf16, kFp16 };

// splitmix64 of (seed, word index): one 8-byte word per thread, FP8 NaN codes (0x7F, 0xFF) replaced.
__global__ void fill_random_kernel(std::uint64_t* words, std::size_t n, std::uint64_t seed, Fill fill) {
  for (std::size_t i = blockIdx.x * static_cast<std::size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    std::uint64_t z = seed + (i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    if (fill == Fill::kFp8) {
      for (int b = 0; b < 8; ++b) {
        const std::uint64_t byte = (z >> (8 * b)) & 0xFF;
        if ((byte & 0x7F) == 0x7F) z = (z & ~(0xFFull << (8 * b))) | (0x3Cull << (8 * b));
      }
    } else if (fill == Fill::kBf16) {
      z = (z & 0x807F807F807F807Full) | 0x3F003F003F003F00ull;  // sign, 7 mantissa bits, exponent of 0.5
    } else if (fill == Fill::kFp16) {
      z = (z & 0x83FF83FF83FF83FFull) | 0x3800380038003800ull;  // sign, 10 mantissa bits, exponent of 0.5
    }
    words[i] = z;
  }
}

}  // namespace

void fill_random_bytes(void* device, std::size_t bytes, std::uint64_t seed, bool fp8) {
  MOEKIT_CUDA_REQUIRE(reinterpret_cast<std::uintptr_t>(device) % 8 == 0 && bytes % 8 == 0,
                      "fill_random_bytes: 8-byte aligned whole words");
  fill_random_kernel<<<1024, 256>>>(static_cast<std::uint64_t*>(device), bytes / 8, seed,
                                    fp8 ? Fill::kFp8 : Fill::kBytes);
  MOEKIT_CUDA_CHECK_LAUNCH();
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
}

void fill_random_sixteen_bit(void* device, std::size_t count, std::uint64_t seed, DType dtype) {
  MOEKIT_CUDA_REQUIRE(is_sixteen_bit(dtype), "fill_random_sixteen_bit: bf16 or fp16");
  MOEKIT_CUDA_REQUIRE(reinterpret_cast<std::uintptr_t>(device) % 8 == 0 && count % 4 == 0,
                      "fill_random_sixteen_bit: 8-byte aligned whole words (a multiple of 4 values)");
  fill_random_kernel<<<1024, 256>>>(static_cast<std::uint64_t*>(device), count / 4, seed,
                                    dtype == DType::kBf16 ? Fill::kBf16 : Fill::kFp16);
  MOEKIT_CUDA_CHECK_LAUNCH();
  MOEKIT_CUDA_CHECK(cudaDeviceSynchronize());
}

double copy_gbs(void* stream_ptr) {
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const std::size_t bytes = std::size_t{2} << 30;
  void *a = nullptr, *b = nullptr;
  MOEKIT_CUDA_CHECK(cudaMalloc(&a, bytes));
  MOEKIT_CUDA_CHECK(cudaMalloc(&b, bytes));
  MOEKIT_CUDA_CHECK(cudaMemset(a, 1, bytes));
  const double ms = cuda::median_ms(
      10, [&] { MOEKIT_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream)); }, stream);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * static_cast<double>(bytes) / (ms * 1e-3) / 1e9;
}

namespace {
// cuBLASLt's dense GEMM rate at 8192^3 for `operand` (FP8 e4m3 -> bf16 D, bf16 -> bf16, fp16 -> fp16),
// fp32 accumulation, TFLOP/s: the median of 20.
double dense_gemm_tflops(DType operand, cudaStream_t stream) {
  const int n = 8192;
  const bool fp8 = operand == DType::kFp8E4m3;
  const std::size_t in_bytes = fp8 ? 1 : 2;
  const cudaDataType in_type = fp8 ? CUDA_R_8F_E4M3 : operand == DType::kBf16 ? CUDA_R_16BF : CUDA_R_16F;
  const cudaDataType out_type = operand == DType::kFp16 ? CUDA_R_16F : CUDA_R_16BF;
  void *A = nullptr, *B = nullptr, *D = nullptr, *work = nullptr;
  const std::size_t work_bytes = 64u << 20;
  MOEKIT_CUDA_CHECK(cudaMalloc(&A, std::size_t(n) * n * in_bytes));
  MOEKIT_CUDA_CHECK(cudaMalloc(&B, std::size_t(n) * n * in_bytes));
  MOEKIT_CUDA_CHECK(cudaMalloc(&D, std::size_t(n) * n * 2));
  MOEKIT_CUDA_CHECK(cudaMalloc(&work, work_bytes));
  if (fp8) {
    fill_random_bytes(A, std::size_t(n) * n, 1, true);
    fill_random_bytes(B, std::size_t(n) * n, 2, true);
  } else {
    fill_random_sixteen_bit(A, std::size_t(n) * n, 1, operand);
    fill_random_sixteen_bit(B, std::size_t(n) * n, 2, operand);
  }
  cublasLtHandle_t lt;
  MOEKIT_CUBLAS_CHECK(cublasLtCreate(&lt));
  cublasLtMatmulDesc_t op;
  MOEKIT_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t t = CUBLAS_OP_T, nn = CUBLAS_OP_N;
  MOEKIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
  MOEKIT_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &nn, sizeof(nn)));
  cublasLtMatrixLayout_t la, lb, ld;
  MOEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, in_type, n, n, n));
  MOEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, in_type, n, n, n));
  MOEKIT_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, out_type, n, n, n));
  cublasLtMatmulPreference_t pref;
  MOEKIT_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  MOEKIT_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &work_bytes,
                                                           sizeof(work_bytes)));
  cublasLtMatmulHeuristicResult_t heur{};
  int found = 0;
  MOEKIT_CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 1, &heur, &found));
  MOEKIT_CUDA_REQUIRE(found > 0,
                      "cuBLASLt found no " + std::string(dtype_name(operand)) + " GEMM algorithm for the ceiling");
  const float alpha = 1.0f, beta = 0.0f;
  const double ms = cuda::median_ms(
      20,
      [&] {
        MOEKIT_CUBLAS_CHECK(
            cublasLtMatmul(lt, op, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &heur.algo, work, work_bytes, stream));
      },
      stream);
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(la);
  cublasLtMatrixLayoutDestroy(lb);
  cublasLtMatrixLayoutDestroy(ld);
  cublasLtMatmulDescDestroy(op);
  cublasLtDestroy(lt);
  cudaFree(A);
  cudaFree(B);
  cudaFree(D);
  cudaFree(work);
  return 2.0 * n * double(n) * n / (ms * 1e-3) / 1e12;
}
}  // namespace

double fp8_gemm_tflops(void* stream) {
  return dense_gemm_tflops(DType::kFp8E4m3, static_cast<cudaStream_t>(stream));
}

double sixteen_bit_gemm_tflops(DType operand, void* stream) {
  MOEKIT_CUDA_REQUIRE(is_sixteen_bit(operand), "sixteen_bit_gemm_tflops: bf16 or fp16");
  return dense_gemm_tflops(operand, static_cast<cudaStream_t>(stream));
}

}  // namespace moekit::ceilings
