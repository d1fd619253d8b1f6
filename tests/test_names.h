// The one rule for GoogleTest parameter names across moekit's tests: every character outside
// [A-Za-z0-9] becomes '_' (a model name's '-' and '.', a scheme's '-', a list's ','), so that a
// generated name is a valid test name and --gtest_filter patterns stay plain.
#pragma once

#include <cctype>
#include <string>

namespace moekit::testing {

inline std::string test_name(std::string n) {
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
}

}  // namespace moekit::testing
