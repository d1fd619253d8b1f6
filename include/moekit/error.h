// moekit::Error: what every violated contract throws. what() says what is wrong, the limit and the
// fix, for the user; where() says the source file, line and check expression, for `--verbose` and
// bug reports. Nothing asserts or aborts. The check macros are in moekit/check.h.
#pragma once

#include <stdexcept>
#include <string>

namespace moekit {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, std::string where = {})
      : std::runtime_error(message), where_(std::move(where)) {}
  const std::string& where() const noexcept { return where_; }

 private:
  std::string where_;
};

namespace detail {
// Throws moekit::Error("moekit: <msg>") with where() = "<file>:<line>, check `<cond>`".
[[noreturn]] void throw_error(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

}  // namespace moekit
