// The one helper of the tests of refusals: the message of the moekit::Error that `f` raises ("" when
// it raises none), for checks that the message names what it must.
#pragma once

#include <functional>
#include <string>

#include "moekit/error.h"

namespace moekit::testing {

inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace moekit::testing
