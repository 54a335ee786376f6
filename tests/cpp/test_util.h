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

// `text` (a graph's text IR) with node %name's definition made an input(), in its place: the same graph
// reading %name from the caller, for a full run to compare a patched evaluation of %name with.
inline std::string with_input(const std::string& text, const std::string& name) {
  const std::string head = "\n  %" + name + " : ";
  const size_t at = text.find(head);
  TORCH_CHECK(at != std::string::npos, "with_input: no node %", name, " in the graph text");
  const size_t eq = text.find(" = ", at + head.size());
  const size_t eol = text.find('\n', eq);
  TORCH_CHECK(eq != std::string::npos && eol != std::string::npos, "with_input: %", name, " has no definition");
  return text.substr(0, eq) + " = input()" + text.substr(eol);
}

// %x -> sin -> %l = torch_ext_test::<op>(%a) -> mul by %l -> cos: a chain around one out= kernel of
// tests/cpp/test_out_kernel_ops.cpp.
inline std::string out_kernel_chain(const std::string& op) {
  return R"(graph:
  %x : f32[16] = input()
  %a : f32[16] = aten::sin.default(%x)
  %l : f32[] = torch_ext_test::)" + op + R"(.default(%a)
  %b : f32[16] = aten::mul.Tensor(%a, %l)
  %s : f32[16] = aten::cos.default(%b)
  return (%s)
)";
}

}  // namespace torch_ext::testing
