// cond / while_loop regions: verifier signatures, the executor and the reactive engine on text IR.
#include "ir/parser.h"
#include "ir/verifier.h"
#include "reactive/engine.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {
const char* kCond = R"(graph:
  %x : f32[3] = input()
  %s : f32[] = aten::sum.default(%x)
  %p : b8[] = aten::gt.Scalar(%s, 0)
  %c : (f32[3]) = higher_order::cond.default(%p, [%x]) {
    graph:
      %a : f32[3] = input()
      %r : f32[3] = aten::relu.default(%a)
      return (%r)
  } {
    graph:
      %a : f32[3] = input()
      %n : f32[3] = aten::neg.default(%a)
      return (%n)
  }
  %g : f32[3] = getitem(%c, 0)
  %o : f32[3] = aten::mul.Tensor(%g, 2)
  return (%o)
)";

const char* kLoop = R"(graph:
  %i : i64[] = input()
  %x : f32[2] = input()
  %w : (i64[], f32[2]) = higher_order::while_loop.default([%i, %x], []) {
    graph:
      %j : i64[] = input()
      %v : f32[2] = input()
      %c : b8[] = aten::lt.Scalar(%j, 5)
      return (%c)
  } {
    graph:
      %j : i64[] = input()
      %v : f32[2] = input()
      %j2 : i64[] = aten::add.Tensor(%j, 1)
      %v2 : f32[2] = aten::mul.Tensor(%v, 2)
      return (%j2, %v2)
  }
  %n : i64[] = getitem(%w, 0)
  %y : f32[2] = getitem(%w, 1)
  return (%n, %y)
)";
}  // namespace

TEST(ControlFlow, CondRunsOnlyTheChosenBranch) {
  auto g = ir::parse(kCond);
  ir::verify(*g);
  runtime::Executor ex(*g);
  at::Tensor pos = at::tensor({1.0f, -2.0f, 3.0f});
  EXPECT_TRUE(at::equal(ex.run({pos})[0].toTensor(), at::relu(pos) * 2));
  at::Tensor neg = at::tensor({-1.0f, -2.0f, 1.0f});
  EXPECT_TRUE(at::equal(ex.run({neg})[0].toTensor(), -neg * 2));
}

TEST(ControlFlow, WhileLoopIteratesUntilTheConditionFails) {
  auto g = ir::parse(kLoop);
  ir::verify(*g);
  runtime::Executor ex(*g);
  auto out = ex.run({at::scalar_tensor(2, at::kLong), at::ones({2})});
  EXPECT_EQ(out[0].toTensor().item<int64_t>(), 5);
  EXPECT_TRUE(at::equal(out[1].toTensor(), at::full({2}, 8.0f)));
}

TEST(ControlFlow, ReactiveCondIsOneUnitAndFlipsBranches) {
  auto g = ir::parse(kCond);
  reactive::Engine e(*g);
  at::Tensor x = at::tensor({1.0f, -2.0f, 3.0f});
  e.run({x});
  EXPECT_EQ(e.stats().evaluations, 5);  // s, p, c (once, whatever its region holds), g, o
  e.reset_stats();
  e.patch("p", at::scalar_tensor(false, at::kBool));
  auto out = e.demand();
  EXPECT_EQ(e.stats().evaluations, 3);  // c, g, o
  EXPECT_TRUE(at::equal(out[0].toTensor(), -x * 2));
  e.restore();
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), at::relu(x) * 2));
  e.check_invariants();
}

TEST(ControlFlow, VerifierChecksRegionSignatures) {
  auto swap = [](std::string text, const std::string& from, const std::string& to) {
    return text.replace(text.find(from), from.size(), to);
  };
  std::string bad = swap(kCond, "%n : f32[3] = aten::neg.default(%a)", "%n : f32[] = aten::sum.default(%a)");
  auto g = ir::parse(bad);
  auto msg = error_of([&] { ir::verify(*g); });
  EXPECT_NE(msg.find("branches return different types: true (f32[3]), false (f32[])"), std::string::npos) << msg;
  std::string loop = swap(kLoop, "%v2 : f32[2] = aten::mul.Tensor(%v, 2)", "%v2 : f32[4] = aten::cat.default([%v, %v])");
  auto l = ir::parse(loop);
  msg = error_of([&] { ir::verify(*l); });
  EXPECT_NE(msg.find("loop body changes the carried values from (i64[], f32[2]) to (i64[], f32[4])"), std::string::npos)
      << msg;
}
