// The one place moekit::Error messages are assembled.
#include <fmt/format.h>

#include "moekit/error.h"

namespace moekit::detail {

void throw_error(const char* file, int line, const char* cond, const std::string& msg) {
  throw Error("moekit: " + msg, fmt::format("{}:{}, check `{}`", file, line, cond));
}

}  // namespace moekit::detail
