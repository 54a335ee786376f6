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

// Hugging Face's Conv1D (GPT-2's c_proj): view to 2-d, addmm with the weight laid out [in, out],
// view back.
const char* kConv1D = R"(graph:
  %w_o : f32[6,8] = param("o.weight")
  %b_o : f32[8] = param("o.bias")
  %z4 : f32[2,3,2,3] = input()
  %z : f32[2,3,6] = aten::view.default(%z4, [2, 3, -1])
  %flat : f32[6,6] = aten::view.default(%z, [-1, 6])
  %mm : f32[6,8] = aten::addmm.default(%b_o, %flat, %w_o)
  %o : f32[2,3,8] = aten::view.default(%mm, [2, 3, 8])
  %r : f32[2,3,8] = aten::relu.default(%o)
  return (%r)
)";

// kConv1D with `line` in place of the addmm and the view back.
std::string conv1d_with(const std::string& lines) {
  std::string text = kConv1D;
  const std::string from = "  %mm : f32[6,8] = aten::addmm.default(%b_o, %flat, %w_o)\n"
                           "  %o : f32[2,3,8] = aten::view.default(%mm, [2, 3, 8])\n";
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos);
  return text.replace(at, from.size(), lines);
}
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

TEST(SplitHeads, Conv1DProjectionBecomesPerHeadResultsPlusASum) {
  auto g = ir::parse(kConv1D);
  const auto results = passes::split_heads(*g, {{"z", 2}});
  ir::verify(*g);
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].result, "mm_result");
  EXPECT_EQ(results[0].output, "mm_biased");
  EXPECT_EQ(results[0].replaced, "o");
  EXPECT_EQ(ir::print(*g), R"(graph:
  %w_o : f32[6,8] = param("o.weight")
  %b_o : f32[8] = param("o.bias")
  %z4 : f32[2,3,2,3] = input()
  %z : f32[2,3,6] = aten::view.default(%z4, [2, 3, -1])
  %mm_z_heads : f32[2,3,2,1,3] = aten::view.default(%z, [2, 3, 2, 1, 3])
  %mm_w_view : f32[2,3,8] = aten::view.default(%w_o, [2, 3, 8])
  %mm_result_mm : f32[2,3,2,1,8] = aten::matmul.default(%mm_z_heads, %mm_w_view)
  %mm_result : f32[2,3,2,8] = aten::squeeze.dim(%mm_result_mm, -2)
  %mm_heads_sum : f32[2,3,8] = aten::sum.dim_IntList(%mm_result, [-2])
  %mm_biased : f32[2,3,8] = aten::add.Tensor(%mm_heads_sum, %b_o)
  %r : f32[2,3,8] = aten::relu.default(%mm_biased)
  return (%r)
)");
}

TEST(SplitHeads, Conv1DWithoutBiasKeepsAFlatViewSomethingElseReads) {
  // aten::mm (no bias); the flattening view is also returned, so it stays.
  auto g = ir::parse(R"(graph:
  %w_o : f32[6,8] = param("o.weight")
  %z : f32[2,3,6] = input()
  %flat : f32[6,6] = aten::reshape.default(%z, [6, 6])
  %mm : f32[6,8] = aten::mm.default(%flat, %w_o)
  %o : f32[2,3,8] = aten::view.default(%mm, [2, 3, -1])
  return (%o, %flat)
)");
  const auto results = passes::split_heads(*g, {{"z", 3}});
  ir::verify(*g);
  ASSERT_EQ(results.size(), 1u);
  EXPECT_EQ(results[0].output, "mm_heads_sum");
  EXPECT_EQ(ir::print(*g), R"(graph:
  %w_o : f32[6,8] = param("o.weight")
  %z : f32[2,3,6] = input()
  %flat : f32[6,6] = aten::reshape.default(%z, [6, 6])
  %mm_z_heads : f32[2,3,3,1,2] = aten::view.default(%z, [2, 3, 3, 1, 2])
  %mm_w_view : f32[3,2,8] = aten::view.default(%w_o, [3, 2, 8])
  %mm_result_mm : f32[2,3,3,1,8] = aten::matmul.default(%mm_z_heads, %mm_w_view)
  %mm_result : f32[2,3,3,8] = aten::squeeze.dim(%mm_result_mm, -2)
  %mm_heads_sum : f32[2,3,8] = aten::sum.dim_IntList(%mm_result, [-2])
  return (%mm_heads_sum, %flat)
)");
}

TEST(SplitHeads, Conv1DSameValuesWithinRoundingAndEachHeadIsItsSliceThroughW) {
  auto plain = ir::parse(kConv1D);
  auto split = ir::parse(kConv1D);
  const auto results = passes::split_heads(*split, {{"z", 2}});
  at::manual_seed(0);
  const at::Tensor w = at::randn({6, 8}), b = at::randn({8}), z4 = at::randn({2, 3, 2, 3});
  std::vector<c10::IValue> inputs = {w, b, z4};
  runtime::Executor a(*plain), c(*split);
  EXPECT_TRUE(at::allclose(a.run(inputs)[0].toTensor(), c.run(inputs)[0].toTensor(), 1e-6, 1e-6));
  // Head h's result is z's h-th slice of 3 features times W's rows h*3 .. h*3+2 ([in, out] layout).
  auto probe = ir::parse(kConv1D);
  passes::split_heads(*probe, {{"z", 2}});
  probe->set_output({ir::Arg::of_node(probe->find(results[0].result))});
  const at::Tensor result = runtime::Executor(*probe).run(inputs)[0].toTensor();
  const at::Tensor z = z4.reshape({2, 3, 6});
  for (int64_t h = 0; h < 2; ++h) {
    const at::Tensor expected = at::matmul(z.slice(-1, 3 * h, 3 * h + 3), w.slice(0, 3 * h, 3 * h + 3));
    EXPECT_TRUE(at::allclose(result.select(-2, h), expected, 1e-6, 1e-6)) << "head " << h;
  }
}

TEST(SplitHeads, Conv1DRefusalsNameTheNodeAndWhatWasExpected) {
  struct Case {
    std::string lines;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {"  %mm : f32[6,8] = aten::addmm.default(%b_o, %flat, %w_o, beta=2)\n"
       "  %o : f32[2,3,8] = aten::view.default(%mm, [2, 3, 8])\n",
       "%mm has beta other than 1"},
      {"  %mm : f32[6,8] = aten::addmm.default(%b_o, %flat, %w_o)\n"
       "  %o : f32[3,2,8] = aten::view.default(%mm, [3, 2, 8])\n",
       "%mm (the Conv1D projection of %z) must be read only by a view back to [2, 3, 8]; its users: %o "
       "(aten::view.default)"},
      {"  %mm : f32[6,8] = aten::addmm.default(%b_o, %flat, %w_o)\n"
       "  %o : f32[2,3,8] = aten::view.default(%mm, [2, 3, 8])\n"
       "  %side : f32[6,8] = aten::relu.default(%mm)\n",
       "its users: %o (aten::view.default), %side (aten::relu.default)"},
      {"  %b2 : f32[6,8] = aten::expand.default(%b_o, [6, 8])\n"
       "  %mm : f32[6,8] = aten::addmm.default(%b2, %flat, %w_o)\n"
       "  %o : f32[2,3,8] = aten::view.default(%mm, [2, 3, 8])\n",
       "%mm adds a bias that is not a 1-d [8] node (got [6, 8])"},
  };
  for (const Case& c : cases) {
    auto g = ir::parse(conv1d_with(c.lines));
    const std::string before = ir::print(*g);
    EXPECT_NE(error_of([&] { passes::split_heads(*g, {{"z", 2}}); }).find(c.expected), std::string::npos)
        << error_of([&] { passes::split_heads(*g, {{"z", 2}}); });
    EXPECT_EQ(ir::print(*g), before);
  }
  // A 2-d view that is not the flatten of %z ([3, 12]) is no Conv1D input: the refusal lists %z's users.
  auto g = ir::parse(R"(graph:
  %w_o : f32[12,8] = param("o.weight")
  %z : f32[2,3,6] = input()
  %flat : f32[3,12] = aten::view.default(%z, [3, 12])
  %mm : f32[3,8] = aten::mm.default(%flat, %w_o)
  return (%mm)
)");
  const std::string before = ir::print(*g);
  EXPECT_NE(error_of([&] { passes::split_heads(*g, {{"z", 2}}); })
                .find("%z is not the input of an aten::linear nor of a Conv1D projection (aten::view to [N, 6] -> "
                      "aten::addmm(bias, x2d, W [in, out]) -> aten::view back); its users: %flat (aten::view.default)"),
            std::string::npos);
  EXPECT_EQ(ir::print(*g), before);
}
