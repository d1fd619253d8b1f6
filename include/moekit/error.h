// moekit::Error: what every violated contract throws, with the file, the line, the values involved
// and a hint on how to fix it; nothing asserts or aborts. The check macros are in moekit/check.h.
#pragma once

#include <stdexcept>
#include <string>

namespace moekit {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
// Formats "moekit: <msg> (<file>:<line>, check `<cond>`)" and throws moekit::Error.
[[noreturn]] void throw_error(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

}  // namespace moekit
