// Setting a seam's status words from a kernel (cuda/launch.h): the first error wins, later ones are
// dropped; the host reads them after the step.
#pragma once

#include <cstdint>

#include "cuda/launch.h"

namespace moekit::cuda {

__device__ __forceinline__ void flag_status(std::int32_t* status, StatusCode code, int a, int b = 0, int c = 0) {
  if (atomicCAS(status, kStatusOk, code) == kStatusOk) {
    status[1] = a;
    status[2] = b;
    status[3] = c;
  }
}

}  // namespace moekit::cuda
