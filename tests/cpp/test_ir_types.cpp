// Reliability of the IR front end: the type-checking verifier, parser limits, overflow-checked
// sizes, and errors from Executor::run that name the node. (Ops whose meta kernels are Python
// registrations, such as relu, are skipped by inference in this C++-only process; the cases
// here use ops with C++ meta kernels. tests/python/test_bad_input_ir.py covers the rest.)
#include "ir/graph.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <chrono>

#include "test_util.h"

using namespace torch_ext::ir;
using torch_ext::testing::error_of;

namespace {

std::string verify_message(const std::string& text) {
  auto g = parse(text);
  return error_of([&] { verify(*g); });
}

// True when `s` is well-formed UTF-8.
bool valid_utf8(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += len;
  }
  return true;
}

}  // namespace

TEST(IrTypes, GraphValueForScalarArgumentIsRefused) {
  auto msg = verify_message(
      "graph:\n  %a : f32[2,3] = input()\n  %b : f32[3,2] = aten::transpose.int(%a, %a, 1)\n  return (%b)\n");
  EXPECT_NE(msg.find("node %b (aten::transpose.int): argument 'dim0' expects int, got %a of type f32[2,3]"),
            std::string::npos)
      << msg;
  msg = verify_message(
      "graph:\n  %a : f32[2,3] = input()\n  %b : f32[3,2] = aten::permute.default(%a, %a)\n  return (%b)\n");
  EXPECT_NE(msg.find("argument 'dims' expects int[], got %a of type f32[2,3]"), std::string::npos) << msg;
  msg = verify_message(
      "graph:\n  %a : f32[2,3] = input()\n  %b : f32[3] = aten::sum.dim_IntList(%a, [0], %a)\n  return (%b)\n");
  EXPECT_NE(msg.find("argument 'keepdim' expects bool, got %a of type f32[2,3]"), std::string::npos) << msg;
  msg = verify_message(
      "graph:\n  %a : f32[2,3] = input()\n  %b : f32[3,2] = aten::permute.default(%a, [1, %a])\n  return (%b)\n");
  EXPECT_NE(msg.find("argument 'dims': element 1 expects int, got %a of type f32[2,3]"), std::string::npos) << msg;
  msg = verify_message("graph:\n  %a : f32[2] = input()\n  %b : f32[2] = aten::add.Tensor(%a, \"x\")\n  return (%b)\n");
  EXPECT_NE(msg.find("argument 'other': expected a tensor, got \"x\""), std::string::npos) << msg;
}

TEST(IrTypes, DeclaredResultMustMatchTheOperator) {
  auto msg = verify_message("graph:\n  %a : f32[2] = input()\n  %b : i64[7] = aten::add.Tensor(%a, %a)\n  return (%b)\n");
  EXPECT_NE(msg.find("node %b (aten::add.Tensor): declared type i64[7] differs from f32[2]"), std::string::npos)
      << msg;
  // A scalar constant for a Tensor argument is a 0-d wrapped number: the result stays f32[2].
  msg = verify_message("graph:\n  %a : f32[2] = input()\n  %b : f64[2] = aten::mul.Tensor(%a, 2.5)\n  return (%b)\n");
  EXPECT_NE(msg.find("declared type f64[2] differs from f32[2]"), std::string::npos) << msg;
  msg = verify_message(
      "graph:\n  %a : f32[4,3] = input()\n  %t : (f32[4,2], i64[4,2]) = aten::topk.default(%a, 2)\n"
      "  %v : f32[4,3] = getitem(%t, 0)\n  return (%v)\n");
  EXPECT_NE(msg.find("node %v (getitem): declared type f32[4,3] differs from element 0 of %t, f32[4,2]"),
            std::string::npos)
      << msg;
  // Multi-result types are compared element by element.
  msg = verify_message(
      "graph:\n  %a : f32[4,3] = input()\n  %t : (f32[4,2], f32[4,2]) = aten::topk.default(%a, 2)\n"
      "  return (%t)\n");
  EXPECT_NE(msg.find("declared type (f32[4,2], f32[4,2]) differs from (f32[4,2], i64[4,2])"), std::string::npos)
      << msg;
}

TEST(IrTypes, InferenceCanBeSkippedForGraphsCheckedBefore) {
  // verify(g, /*infer_results=*/false) (the build caches' graphs, checked in full when built) skips only
  // level 2: a wrong declared result passes, a structural or argument error is still refused.
  auto wrong_result = parse("graph:\n  %a : f32[2] = input()\n  %b : i64[7] = aten::add.Tensor(%a, %a)\n  return (%b)\n");
  EXPECT_TRUE(verify_errors(*wrong_result, /*infer_results=*/false).empty());
  EXPECT_FALSE(verify_errors(*wrong_result).empty());
  auto wrong_arg = parse("graph:\n  %a : f32[2] = input()\n  %b : f32[2] = aten::add.Tensor(%a, \"x\")\n  return (%b)\n");
  const auto errors = verify_errors(*wrong_arg, /*infer_results=*/false);
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("argument 'other'"), std::string::npos) << errors[0];
}

TEST(IrTypes, InconsistentShapesNeverReachAKernel) {
  auto msg = verify_message(
      "graph:\n  %a : f32[2,3] = input()\n  %b : f32[4,5] = input()\n  %c : f32[2,5] = aten::mm.default(%a, %b)\n"
      "  return (%c)\n");
  EXPECT_NE(msg.find("node %c (aten::mm.default): the operator refuses the declared argument types"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("cannot be multiplied"), std::string::npos) << msg;
}

TEST(IrTypes, DeclaredStridesMustBeTheOperatorsWhereTheyAddressMemory) {
  // The arena executor and the reactive engine's scratch path give out= kernels buffers laid out by
  // the declared strides: a sin declared transposed was stored transposed there, and as_strided read
  // other elements than the executor's (a silent disagreement between runtimes). Refused now.
  const std::string msg = verify_message(
      "graph:\n  %x : f32[8,4] = input()\n  %y : f32[8,4] = aten::mul.Tensor(%x, %x)\n"
      "  %r : f32[8,4]{1,8} = aten::sin.default(%y)\n"
      "  %a : f32[4,4] = aten::as_strided.default(%r, [4, 4], [4, 1])\n  return (%a)\n");
  EXPECT_NE(msg.find("node %r (aten::sin.default): declared type f32[8,4]{1,8} differs from f32[8,4]"),
            std::string::npos)
      << msg;
  // A view declared contiguous when the operator returns it transposed, likewise.
  const std::string view_msg = verify_message(
      "graph:\n  %a : f32[2,3] = input()\n  %t : f32[3,2] = aten::t.default(%a)\n  return (%t)\n");
  EXPECT_NE(view_msg.find("node %t (aten::t.default): declared type f32[3,2] differs from f32[3,2]{1,3}"),
            std::string::npos)
      << view_msg;
  // The stride of a size-1 dim addresses nothing, so any value is accepted there; so are the strides of
  // an empty tensor.
  verify(*parse("graph:\n  %x : f32[1,4] = input()\n  %e : f32[0,4] = input()\n"
                "  %s : f32[1,4]{1,1} = aten::sin.default(%x)\n  %c : f32[0,4]{1,0} = aten::cos.default(%e)\n  return (%s, %c)\n"));
}

TEST(IrTypes, DeclaredDeviceMustBeWhereTheOperatorPutsTheResult) {
  // Before: any declared device verified (devices were not inferred), so a graph could claim a result
  // on cuda:0 that its kernel computes on the CPU, and the runtimes would lay out buffers by the claim.
  auto msg = verify_message(
      "graph:\n  %a : f32[2] = input()\n  %b : f32[2]@cuda:0 = aten::add.Tensor(%a, %a)\n  return (%b)\n");
  EXPECT_NE(msg.find("node %b (aten::add.Tensor): declared device cuda:0 differs from cpu, where the operator puts "
                     "its result (the device of its input %a)"),
            std::string::npos)
      << msg;
  msg = verify_message(
      "graph:\n  %a : f32[2]@cuda:0 = input()\n  %b : f32[2] = aten::mul.Tensor(%a, %a)\n  return (%b)\n");
  EXPECT_NE(msg.find("node %b (aten::mul.Tensor): declared device cpu differs from cuda:0, where the operator puts "
                     "its result (the device of its input %a)"),
            std::string::npos)
      << msg;
  // A device argument decides: a conversion to cuda:1 declared on cuda:0, a factory given none (CPU).
  msg = verify_message(
      "graph:\n  %a : f32[3] = input()\n  %e : f32[3]@cuda:0 = aten::to.device(%a, device(\"cuda:1\"), "
      "torch.float32)\n  return (%e)\n");
  EXPECT_NE(msg.find("node %e (aten::to.device): declared device cuda:0 differs from cuda:1, where the operator "
                     "puts its result (its argument 'device')"),
            std::string::npos)
      << msg;
  msg = verify_message("graph:\n  %z : f32[4]@cuda:0 = aten::zeros.default([4])\n  return (%z)\n");
  EXPECT_NE(msg.find("node %z (aten::zeros.default): declared device cuda:0 differs from cpu, where the operator "
                     "puts its result (its argument 'device' (None: the default, cpu))"),
            std::string::npos)
      << msg;
  // A multi-result op: its first result.
  msg = verify_message(
      "graph:\n  %a : f32[4,3]@cuda:0 = input()\n  %t : (f32[4,2], i64[4,2]) = aten::topk.default(%a, 2)\n"
      "  return (%t)\n");
  EXPECT_NE(msg.find("node %t (aten::topk.default): declared device cpu (of result 0) differs from cuda:0"),
            std::string::npos)
      << msg;
  // Refused also when inference is skipped (a graph from the build caches).
  auto wrong = parse("graph:\n  %a : f32[2] = input()\n  %b : f32[2]@cuda:0 = aten::add.Tensor(%a, %a)\n  return (%b)\n");
  EXPECT_FALSE(verify_errors(*wrong, /*infer_results=*/false).empty());
  // Valid: a 0-d CPU tensor mixes with a cuda one (either order); a conversion keeps its input's device
  // when none is given; to.device moves it.
  verify(*parse("graph:\n  %s : f32[] = input()\n  %a : f32[2]@cuda:0 = input()\n"
                "  %b : f32[2]@cuda:0 = aten::mul.Tensor(%s, %a)\n  %c : f32[2]@cuda:0 = aten::add.Tensor(%a, %s)\n"
                "  %d : f64[2]@cuda:0 = aten::_to_copy.default(%c, dtype=torch.float64)\n"
                "  %e : f64[2] = aten::to.device(%d, device(\"cpu\"), torch.float64)\n  return (%b, %e)\n"));
}

TEST(IrTypes, ValidGraphsStillVerify) {
  // t() of a contiguous matrix is declared with its transposed strides, and verifies.
  auto g = parse(
      "graph:\n  %a : f32[2,3] = input()\n  %t : f32[3,2]{1,3} = aten::t.default(%a)\n"
      "  %s : f32[2] = aten::sum.dim_IntList(%a, [1])\n  %z : f32[4]@cuda:0 = aten::zeros.default([4], "
      "device=device(\"cuda:0\"))\n  return (%t, %s, %z)\n");
  verify(*g);
}

TEST(IrTypes, IntsForEnumArgumentsMustNameAnEnumValue) {
  // Schemas type ScalarType, Layout and MemoryFormat as int. ATen turns an out-of-range value into
  // an out-of-bounds read (a nondeterministic segfault found by the fuzzer), so the verifier
  // refuses it, naming the argument.
  const auto to_dtype = [](const std::string& dtype) {
    return "graph:\n  %a : f32[2] = input()\n  %b : f32[2] = aten::to.dtype(%a, " + dtype + ")\n  return (%b)\n";
  };
  const std::vector<std::string> bad_dtypes{"-2", "-1", std::to_string(static_cast<int>(c10::ScalarType::Undefined)),
                                            std::to_string(static_cast<int>(c10::ScalarType::NumOptions)), "1000"};
  for (const std::string& bad : bad_dtypes) {
    const auto msg = verify_message(to_dtype(bad));
    EXPECT_NE(msg.find("node %b (aten::to.dtype): argument 'dtype': expected a dtype, got " + bad +
                       ", which names no dtype"),
              std::string::npos)
        << msg;
  }
  // The int of a real dtype is what export writes for some calls; it still verifies.
  EXPECT_NO_THROW(verify(*parse(to_dtype(std::to_string(static_cast<int>(c10::ScalarType::Float))))));
  auto msg = verify_message(
      "graph:\n  %a : f32[2] = input()\n  %b : f32[2] = aten::clone.default(%a, memory_format=-1)\n  return (%b)\n");
  EXPECT_NE(msg.find("argument 'memory_format': expected a memory format, got -1, which names no memory format"),
            std::string::npos)
      << msg;
  msg = verify_message(
      "graph:\n  %a : f32[2] = aten::empty.memory_format([2], layout=57)\n  return (%a)\n");
  EXPECT_NE(msg.find("argument 'layout': expected a layout, got 57, which names no layout"), std::string::npos)
      << msg;
}

TEST(IrTypes, InvalidDeclaredTypesAreRefused) {
  // The parser refuses them in text ...
  auto msg = error_of([] { parse("graph:\n  %a : f32[-3] = input()\n  return (%a)\n"); });
  EXPECT_NE(msg.find("negative size -3 at dim 0"), std::string::npos) << msg;
  msg = error_of([] { parse("graph:\n  %a : f32[9223372036854775807,4] = input()\n  return (%a)\n"); });
  EXPECT_NE(msg.find("line 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("overflows int64"), std::string::npos) << msg;
  // ... and the verifier in graphs built through the API.
  Graph g;
  TensorMeta m;
  m.sizes = {3, -1};
  m.strides = {1, 1};
  Type t;
  t.kind = Type::Kind::Tensor;
  t.tensor = m;
  g.create_placeholder("x", InputRole::UserInput, t);
  g.create_output({});
  msg = error_of([&] { verify(g); });
  EXPECT_NE(msg.find("node %x: invalid type"), std::string::npos) << msg;
  EXPECT_NE(msg.find("negative size -1 at dim 1"), std::string::npos) << msg;
}

TEST(IrTypes, SizeArithmeticIsOverflowChecked) {
  const int64_t big = std::numeric_limits<int64_t>::max();
  auto msg = error_of([&] { TensorMeta::contiguous_strides({2, big, 2}); });
  EXPECT_NE(msg.find("the contiguous strides overflows int64"), std::string::npos) << msg;
  TensorMeta m;
  m.sizes = {big, 2};
  m.strides = {2, 1};
  msg = error_of([&] { m.numel(); });
  EXPECT_NE(msg.find("the element count overflows int64"), std::string::npos) << msg;
  m.sizes = {big / 2};
  m.strides = {1};
  msg = error_of([&] { m.nbytes(); });
  EXPECT_NE(msg.find("the byte size overflows int64"), std::string::npos) << msg;
  // The largest representable values still work.
  EXPECT_EQ(TensorMeta::contiguous_strides({big, 1}), (std::vector<int64_t>{1, 1}));
}

TEST(IrParse, NestingLimitsAreNamed) {
  auto msg = error_of([] { parse("graph:\n  %a : " + std::string(25000, '(')); });
  EXPECT_NE(msg.find("tuple types nested deeper than the limit of 64"), std::string::npos) << msg;
  msg = error_of([] {
    parse("graph:\n  %a : f32[2] = input()\n  %b : f32[2] = aten::cat.default(" + std::string(30000, '['));
  });
  EXPECT_NE(msg.find("argument lists nested deeper than the limit of 64"), std::string::npos) << msg;
  std::string nested = "graph:\n";
  for (int d = 0; d < 10000; ++d) nested += "  %p : b8[] = input()\n  %c : () = higher_order::cond.default(%p, []) {\n graph:\n";
  msg = error_of([&] { parse(nested); });
  EXPECT_NE(msg.find("regions nested deeper than the limit of 32"), std::string::npos) << msg;
  // Within the limits, nesting parses.
  std::string ok = "graph:\n  %a : " + std::string(60, '(') + "f32[1]" + std::string(60, ')') + " = input()\n  return (%a)\n";
  EXPECT_EQ(print(*parse(ok)), ok);
}

TEST(IrParse, NearExcerptNeverSplitsUtf8) {
  // 39 ASCII bytes then a 3-byte character: a 40-byte cut would split it.
  std::string text = "graph:\n  %a : f32[2] = input()\n  ?" + std::string(38, 'x') + "\xE2\x82\xAC\xE2\x82\xAC\n";
  auto msg = error_of([&] { parse(text); });
  EXPECT_NE(msg.find("IR parse error at line 3"), std::string::npos) << msg;
  EXPECT_TRUE(valid_utf8(msg)) << msg;
  // Invalid bytes are replaced, so the message is always valid UTF-8.
  msg = error_of([] { parse("graph:\n  \xff\xfe\x80 oops\n"); });
  EXPECT_TRUE(valid_utf8(msg)) << msg;
  EXPECT_NE(msg.find("near '??? oops'"), std::string::npos) << msg;
}

TEST(IrParse, ParseIsLinear) {
  // 100k-node chain; the quadratic version took ~13 s here, the linear one ~0.3 s.
  std::string text = "graph:\n  %x : f32[4] = input()\n";
  const int n = 100000;
  for (int i = 0; i < n; ++i)
    text += "  %n" + std::to_string(i) + " : f32[4] = aten::neg.default(%" + (i ? "n" + std::to_string(i - 1) : "x") + ")\n";
  text += "  return (%n" + std::to_string(n - 1) + ")\n";
  const auto start = std::chrono::steady_clock::now();
  auto g = parse(text);
  const double parse_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(g->size(), static_cast<size_t>(n + 2));
  EXPECT_LT(parse_s, 4.0);  // generous for a loaded 2-core machine
  EXPECT_EQ(print(*g).size(), text.size());
  verify(*g);
}

TEST(ExecutorErrors, StdExceptionsNameTheNode) {
  // The section count is a graph value, so only run time sees it; the kernel then throws
  // std::length_error, which must come back as a c10::Error naming the node.
  auto g = parse("graph:\n  %x : f32[4] = input()\n  %n : int = input()\n"
                 "  %s : (f32[2], f32[2]) = aten::tensor_split.sections(%x, %n)\n  return (%s)\n");
  torch_ext::runtime::Executor ex(*g);
  auto msg = error_of([&] { ex.run({at::ones({4}), c10::IValue(int64_t{1} << 62)}); });
  EXPECT_NE(msg.find("while executing node %s"), std::string::npos) << msg;
  // The executor stays usable.
  auto out = ex.run({at::ones({4}), c10::IValue(int64_t{2})});
  EXPECT_EQ(out.size(), 1u);
}
