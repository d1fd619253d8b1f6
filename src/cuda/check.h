// MOEKIT_CUDA_CHECK: every CUDA call and launch is checked; a failure raises moekit::Error naming
// the call, the CUDA error and where to look. No fmt here (nvcc cannot compile its checks).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "moekit/error.h"

#define MOEKIT_CUDA_CHECK(expr)                                                                         \
  do {                                                                                                  \
    const cudaError_t moekit_err_ = (expr);                                                             \
    if (moekit_err_ != cudaSuccess) [[unlikely]]                                                        \
      ::moekit::detail::throw_error(__FILE__, __LINE__, #expr,                                          \
                                    std::string("CUDA error ") + cudaGetErrorName(moekit_err_) + " (" + \
                                        cudaGetErrorString(moekit_err_) +                               \
                                        "); run under compute-sanitizer to locate it");                 \
  } while (0)

// After a kernel launch: its configuration error, if any.
#define MOEKIT_CUDA_CHECK_LAUNCH() MOEKIT_CUDA_CHECK(cudaGetLastError())

// Host-side checks in .cu files, message built from std::string pieces.
#define MOEKIT_CUDA_REQUIRE(cond, msg)                                            \
  do {                                                                            \
    if (!(cond)) [[unlikely]]                                                     \
      ::moekit::detail::throw_error(__FILE__, __LINE__, #cond, std::string(msg)); \
  } while (0)
