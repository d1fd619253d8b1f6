// MOEKIT_HD marks a function both the host compiler and nvcc compile for the device: the numerics
// in src/numerics/ are written once and read by the CPU backend, the CUDA kernels and the planner.
#pragma once

#if defined(__CUDACC__)
#define MOEKIT_HD __host__ __device__
#else
#define MOEKIT_HD
#endif
