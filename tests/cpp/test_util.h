// Shared helpers for the GoogleTest suites.
#pragma once

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

namespace torch_ext::testing {

// The message of the c10::Error that `fn` throws; records a failure when it does not throw.
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  ADD_FAILURE() << "expected an error";
  return "";
}

}  // namespace torch_ext::testing
