// The check macros. MOEKIT_CHECK(cond, "fmt {}", args...) throws moekit::Error naming the values
// when cond is false; MOEKIT_FAIL(...) throws unconditionally. (CUDA files use src/cuda/check.h:
// nvcc's front end cannot compile fmt's compile-time format checks.)
#pragma once

#include <fmt/format.h>

#include "moekit/error.h"

#define MOEKIT_CHECK(cond, ...)                                                             \
  do {                                                                                      \
    if (!(cond)) [[unlikely]]                                                               \
      ::moekit::detail::throw_error(__FILE__, __LINE__, #cond, ::fmt::format(__VA_ARGS__)); \
  } while (0)

#define MOEKIT_FAIL(...) ::moekit::detail::throw_error(__FILE__, __LINE__, "unreachable", ::fmt::format(__VA_ARGS__))
