// split_heads pass: text IR in, golden text out; the per-head form computes the same values
// (within float rounding); refusals leave the graph untouched.
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/split_heads.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {
const char* kAttnOut = R"(graph:
  %w_o : f32[8,6] = param("o.weight")
  %b_o : f32[8] = param("o.bias")
  %z4 : f32[2,3,2,3] = input()
  %z : f32[2,3,6] = aten::view.default(%z4, [2, 3, -1])
  %o : f32[2,3,8] = aten::linear.default(%z, %w_o, %b_o)
  %r : f32[2,3,8] = aten::relu.default(%o)
  return (%r)
)";
}  // namespace

TEST(SplitHeads, ProjectionBecomesPerHeadResultsPlusASum) {
  auto g = ir::parse(kAttnOut);
  const auto results = passes::split_heads(*g, {{"z", 2}});
  ir::verify(*g);
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].result, "o_result");
  EXPECT_EQ(results[0].output, "o_biased");
  EXPECT_EQ(results[0].replaced, "o");
  EXPECT_EQ(ir::print(*g), R"(graph:
  %w_o : f32[8,6] = param("o.weight")
  %b_o : f32[8] = param("o.bias")
  %z4 : f32[2,3,2,3] = input()
  %z : f32[2,3,6] = aten::view.default(%z4, [2, 3, -1])
  %o_z_heads : f32[2,3,2,1,3] = aten::view.default(%z, [2, 3, 2, 1, 3])
  %o_w_view : f32[8,2,3] = aten::view.default(%w_o, [8, 2, 3])
  %o_w_heads : f32[2,3,8]{3,1,6} = aten::permute.default(%o_w_view, [1, 2, 0])
  %o_result_mm : f32[2,3,2,1,8] = aten::matmul.default(%o_z_heads, %o_w_heads)
  %o_result : f32[2,3,2,8] = aten::squeeze.dim(%o_result_mm, -2)
  %o_heads_sum : f32[2,3,8] = aten::sum.dim_IntList(%o_result, [-2])
  %o_biased : f32[2,3,8] = aten::add.Tensor(%o_heads_sum, %b_o)
  %r : f32[2,3,8] = aten::relu.default(%o_biased)
  return (%r)
)");
}

TEST(SplitHeads, SameValuesWithinRoundingAndHeadSlicesAddUp) {
  auto plain = ir::parse(kAttnOut);
  auto split = ir::parse(kAttnOut);
  passes::split_heads(*split, {{"z", 2}});
  at::manual_seed(0);
  std::vector<c10::IValue> inputs = {at::randn({8, 6}), at::randn({8}), at::randn({2, 3, 2, 3})};
  runtime::Executor a(*plain), b(*split);
  const at::Tensor ra = a.run(inputs)[0].toTensor(), rb = b.run(inputs)[0].toTensor();
  EXPECT_TRUE(at::allclose(ra, rb, 1e-6, 1e-6));
}

TEST(SplitHeads, RefusalsNameTheCulpritAndLeaveTheGraphUnchanged) {
  auto g = ir::parse(kAttnOut);
  const std::string before = ir::print(*g);
  EXPECT_NE(error_of([&] { passes::split_heads(*g, {{"z", 4}}); }).find("(6) is not divisible by heads=4"),
            std::string::npos);
  EXPECT_NE(error_of([&] { passes::split_heads(*g, {{"r", 2}}); }).find("%r is not the input of an aten::linear"),
            std::string::npos);
  EXPECT_NE(error_of([&] { passes::split_heads(*g, {{"z", 2}, {"nope", 2}}); }).find("no node named '%nope'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { passes::split_heads(*g, {{"z", 0}}); }).find("heads must be positive"), std::string::npos);
  EXPECT_EQ(ir::print(*g), before);
}
