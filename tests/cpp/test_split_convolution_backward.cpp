// split_convolution_backward: text IR in, checked text out.
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/split_convolution_backward.h"

#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {
// Two convolution_backward calls: %cb computes all three parts (split), %cb0 only the weight and
// bias gradients (the first conv: no input gradient; left alone).
const char* kStep = R"(graph:
  %w : f32[4,4,3,3] = param("w")
  %w0 : f32[4,2,3,3] = param("w0")
  %x : f32[2,2,8,8] = input()
  %a : f32[2,4,8,8] = input()
  %go : f32[2,4,8,8] = input()
  %cb : (f32[2,4,8,8], f32[4,4,3,3], f32[4]) = aten::convolution_backward.default(%go, %a, %w, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
  %gi : f32[2,4,8,8] = getitem(%cb, 0)
  %gw : f32[4,4,3,3] = getitem(%cb, 1)
  %gb : f32[4] = getitem(%cb, 2)
  %cb0 : (none, f32[4,2,3,3], f32[4]) = aten::convolution_backward.default(%gi, %x, %w0, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, True])
  %gw0 : f32[4,2,3,3] = getitem(%cb0, 1)
  return (%gw, %gb, %gw0)
)";
}  // namespace

TEST(SplitConvolutionBackward, InputAndWeightPartsBecomeTwoCallsOfTheSameOp) {
  auto g = ir::parse(kStep);
  EXPECT_EQ(passes::splittable_convolution_backwards(*g), std::vector<std::string>{"cb"});
  EXPECT_EQ(passes::split_convolution_backward(*g, {"cb"}), std::vector<std::string>{"cb"});
  ir::verify(*g);
  EXPECT_EQ(ir::print(*g), R"(graph:
  %w : f32[4,4,3,3] = param("w")
  %w0 : f32[4,2,3,3] = param("w0")
  %x : f32[2,2,8,8] = input()
  %a : f32[2,4,8,8] = input()
  %go : f32[2,4,8,8] = input()
  %cb_weight : (none, f32[4,4,3,3], f32[4]) = aten::convolution_backward.default(%go, %a, %w, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, True])
  %cb : (f32[2,4,8,8], none, none) = aten::convolution_backward.default(%go, %a, %w, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False])
  %gi : f32[2,4,8,8] = getitem(%cb, 0)
  %gw : f32[4,4,3,3] = getitem(%cb_weight, 1)
  %gb : f32[4] = getitem(%cb_weight, 2)
  %cb0 : (none, f32[4,2,3,3], f32[4]) = aten::convolution_backward.default(%gi, %x, %w0, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, True])
  %gw0 : f32[4,2,3,3] = getitem(%cb0, 1)
  return (%gw, %gb, %gw0)
)");
  // Nothing is left to split.
  EXPECT_TRUE(passes::splittable_convolution_backwards(*g).empty());
}

TEST(SplitConvolutionBackward, WithoutBiasTheWeightCallKeepsItsMask) {
  const std::string text = R"(graph:
  %w : f32[4,4,3,3] = param("w")
  %a : f32[2,4,8,8] = input()
  %go : f32[2,4,8,8] = input()
  %cb : (f32[2,4,8,8], f32[4,4,3,3], none) = aten::convolution_backward.default(%go, %a, %w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
  %gi : f32[2,4,8,8] = getitem(%cb, 0)
  %gw : f32[4,4,3,3] = getitem(%cb, 1)
  return (%gi, %gw)
)";
  auto g = ir::parse(text);
  passes::split_convolution_backward(*g, {"cb"});
  ir::verify(*g);
  const std::string out = ir::print(*g);
  EXPECT_NE(out.find("%cb_weight : (none, f32[4,4,3,3], none) = aten::convolution_backward.default(%go, %a, %w, None, "
                     "[1, 1], [1, 1], [1, 1], False, [0, 0], 1, [False, True, False])"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("%cb : (f32[2,4,8,8], none, none) = aten::convolution_backward.default(%go, %a, %w, None, [1, 1], "
                     "[1, 1], [1, 1], False, [0, 0], 1, [True, False, False])"),
            std::string::npos)
      << out;
}

TEST(SplitConvolutionBackward, RefusesCallsItCannotSplitByNameLeavingTheGraphUntouched) {
  const std::string text = R"(graph:
  %w : f32[4,4,3,3] = param("w")
  %a : f32[2,4,8,8] = input()
  %go : f32[2,4,8,8] = input()
  %cb : (f32[2,4,8,8], f32[4,4,3,3], f32[4]) = aten::convolution_backward.default(%go, %a, %w, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, True])
  return (%cb)
)";
  auto g = ir::parse(text);
  EXPECT_TRUE(passes::splittable_convolution_backwards(*g).empty());
  // Read by the output, not by getitems.
  EXPECT_NE(error_of([&] { passes::split_convolution_backward(*g, {"cb"}); }).find("%cb (aten::convolution_backward.default) is not a convolution_backward computing"), std::string::npos);
  EXPECT_NE(error_of([&] { passes::split_convolution_backward(*g, {"nope"}); }).find("no node %nope"), std::string::npos);
  EXPECT_EQ(ir::print(*g), text);
  // Only the weight part: nothing to split. A refusal after a valid name edits nothing either.
  auto g2 = ir::parse(kStep);
  const std::string before = ir::print(*g2);
  EXPECT_NE(error_of([&] { passes::split_convolution_backward(*g2, {"cb", "cb0"}); }).find("%cb0 ("), std::string::npos);
  EXPECT_NE(error_of([&] { passes::split_convolution_backward(*g2, {"cb", "cb"}); }).find("%cb is named twice"), std::string::npos);
  EXPECT_EQ(ir::print(*g2), before);
}
