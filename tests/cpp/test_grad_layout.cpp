// grad_layout (passes/grad_layout.h): which gradients AccumulateGrad keeps as they are, and the copy that puts
// another one in the parameter's layout: golden text IR, the verifier, and the executor's values and strides
// against eager's clone_obey_contract (empty_strided in the parameter's layout, then copy_).
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/grad_layout.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {

ir::TensorMeta meta(std::vector<int64_t> sizes, std::vector<int64_t> strides) {
  ir::TensorMeta m;
  m.dtype = at::kFloat;
  m.sizes = std::move(sizes);
  m.strides = std::move(strides);
  return m;
}

// %g (the gradient, as the backward made it) returned; the pass's copy, if any, is made the output.
std::string grad_graph(const std::string& type) {
  return "graph:\n  %x : " + type + " = input()\n  %g : " + type + " = aten::mul.Scalar(%x, 2.0)\n  return (%g)\n";
}

// Runs the pass on %g for a parameter of layout `param`, routes the output through its result, and returns
// the graph's text.
std::string obey(ir::Graph& g, const ir::TensorMeta& param) {
  ir::Node* grad = g.find("g");
  ir::Node* out = passes::obey_grad_layout(g, grad, param);
  if (out != grad) g.replace_input_of(g.output(), grad, out);
  ir::verify(g);
  return ir::print(g);
}

// What eager's AccumulateGrad stores for gradient `grad` of a parameter laid out as `param`.
at::Tensor eager_grad(const at::Tensor& grad, const at::Tensor& param) {
  if (!param.is_non_overlapping_and_dense()) return grad.contiguous();
  return at::empty_strided(param.sizes(), param.strides(), grad.options()).copy_(grad);
}

}  // namespace

TEST(GradLayout, ObeysTheContractByStridesOfDimsLargerThanOne) {
  const auto transposed = meta({4, 3}, {1, 4});
  EXPECT_FALSE(passes::obeys_grad_layout(meta({4, 3}, {3, 1}), transposed));
  EXPECT_TRUE(passes::obeys_grad_layout(meta({4, 3}, {1, 4}), transposed));
  EXPECT_TRUE(passes::obeys_grad_layout(meta({4, 3}, {3, 1}), meta({4, 3}, {3, 1})));
  // A size-1 dim's stride is free (AccumulateGrad compares dims of size > 1 only).
  EXPECT_TRUE(passes::obeys_grad_layout(meta({1, 5}, {1, 1}), meta({1, 5}, {5, 1})));
  // A parameter that is not dense and non-overlapping (expanded): only a contiguous gradient is kept.
  const auto expanded = meta({4, 3}, {0, 1});
  EXPECT_TRUE(passes::obeys_grad_layout(meta({4, 3}, {3, 1}), expanded));
  EXPECT_FALSE(passes::obeys_grad_layout(meta({4, 3}, {1, 4}), expanded));
}

TEST(GradLayout, AGradientThatObeysIsReturnedAndTheGraphIsUnchanged) {
  auto g = ir::parse(grad_graph("f32[4,3]{1,4}"));
  const std::string before = ir::print(*g);
  EXPECT_EQ(passes::obey_grad_layout(*g, g->find("g"), meta({4, 3}, {1, 4})), g->find("g"));
  EXPECT_EQ(ir::print(*g), before);
}

TEST(GradLayout, AContiguousGradientOfATransposedWeightIsCopiedIntoItsLayout) {
  auto g = ir::parse(grad_graph("f32[4,3]"));
  const auto param = meta({4, 3}, {1, 4});
  EXPECT_EQ(obey(*g, param), R"(graph:
  %x : f32[4,3] = input()
  %g : f32[4,3] = aten::mul.Scalar(%x, 2.0)
  %g_moved : f32[3,4]{1,3} = aten::permute.default(%g, [1, 0])
  %g_laid_out : f32[3,4] = aten::clone.default(%g_moved, memory_format=torch.contiguous_format)
  %g_like_param : f32[4,3]{1,4} = aten::permute.default(%g_laid_out, [1, 0])
  return (%g_like_param)
)");
  const at::Tensor x = at::randn({4, 3});
  const at::Tensor got = runtime::Executor(*g).run({x})[0].toTensor();
  const at::Tensor want = eager_grad(x * 2.0, at::empty_strided({4, 3}, {1, 4}));
  EXPECT_EQ(got.strides(), want.strides());
  EXPECT_TRUE(at::equal(got, want));
}

TEST(GradLayout, APermutedThreeDimWeightGetsItsMemoryOrder) {
  // Memory order of the parameter: dim 0 outermost, then dim 2, then dim 1 (strides 12, 1, 3).
  auto g = ir::parse(grad_graph("f32[2,3,4]"));
  const auto param = meta({2, 3, 4}, {12, 1, 3});
  const std::string text = obey(*g, param);
  EXPECT_NE(text.find("aten::permute.default(%g, [0, 2, 1])"), std::string::npos) << text;
  EXPECT_NE(text.find("%g_like_param : f32[2,3,4]{12,1,3}"), std::string::npos) << text;
  const at::Tensor x = at::randn({2, 3, 4});
  const at::Tensor got = runtime::Executor(*g).run({x})[0].toTensor();
  const at::Tensor want = eager_grad(x * 2.0, at::empty_strided({2, 3, 4}, {12, 1, 3}));
  EXPECT_EQ(got.strides(), want.strides());
  EXPECT_TRUE(at::equal(got, want));
}

TEST(GradLayout, ANonDenseWeightGetsAContiguousGradient) {
  // The gradient transposed, the parameter expanded along dim 0: eager keeps only a contiguous gradient.
  auto g = ir::parse(grad_graph("f32[4,3]{1,4}"));
  EXPECT_EQ(obey(*g, meta({4, 3}, {0, 1})), R"(graph:
  %x : f32[4,3]{1,4} = input()
  %g : f32[4,3]{1,4} = aten::mul.Scalar(%x, 2.0)
  %g_contiguous : f32[4,3] = aten::clone.default(%g, memory_format=torch.contiguous_format)
  return (%g_contiguous)
)");
  const at::Tensor x = at::randn({3, 4}).t();
  const at::Tensor got = runtime::Executor(*g).run({x})[0].toTensor();
  EXPECT_TRUE(got.is_contiguous());
  EXPECT_TRUE(at::equal(got, x * 2.0));
}

TEST(GradLayout, ANonTensorGradientIsRefusedByName) {
  auto g = ir::parse(R"(graph:
  %x : f32[4] = input()
  %n : int = aten::sym_size.int(%x, 0)
  return (%n)
)");
  const std::string msg = error_of([&] { passes::obey_grad_layout(*g, g->find("n"), meta({4}, {1})); });
  EXPECT_NE(msg.find("gradient %n is not a tensor"), std::string::npos) << msg;
}
