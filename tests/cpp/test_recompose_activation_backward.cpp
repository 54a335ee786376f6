// recompose_activation_backward: the composite SiLU and Mish backwards of a traced joint graph become the
// fused aten::silu_backward / mish_backward that eager autograd runs (golden text), and only when the
// forward is that activation.
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/eliminate_dead_code.h"
#include "passes/recompose_activation_backward.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

using namespace torch_ext;

namespace {

// `forward` is the op producing %y from %x: aten::silu.default (SiLU's joint graph) or a hand-written
// sigmoid product, whose backward composite is the same text.
std::string joint(const std::string& forward) {
  return R"(graph:
  %x : f32[3,4] = input()
  %g : f32[3,4] = input()
  %y : f32[3,4] = )" + forward + R"(
  %sig : f32[3,4] = aten::sigmoid.default(%x)
  %e : f32[3,4] = aten::empty_like.default(%sig, memory_format=torch.preserve_format)
  %f : f32[3,4] = aten::fill.Scalar(%e, 1)
  %s : f32[3,4] = aten::sub.Tensor(%f, %sig)
  %m : f32[3,4] = aten::mul.Tensor(%x, %s)
  %a : f32[3,4] = aten::add.Scalar(%m, 1)
  %m1 : f32[3,4] = aten::mul.Tensor(%sig, %a)
  %out : f32[3,4] = aten::mul.Tensor(%g, %m1)
  return (%y, %out)
)";
}

// The pass rewrites one composite: after dead-code elimination the graph is the forward `act` and its
// fused backward, which the executor runs bit for bit as eager's kernel `eager` (the composite rounds
// otherwise).
void expect_fused(ir::Graph& g, const std::string& act, at::Tensor (*eager)(const at::Tensor&, const at::Tensor&)) {
  EXPECT_EQ(passes::recompose_activation_backward(g), 1);
  passes::eliminate_dead_code(g);
  ir::verify(g);
  EXPECT_EQ(ir::print(g), "graph:\n  %x : f32[3,4] = input()\n  %g : f32[3,4] = input()\n  %y : f32[3,4] = aten::" +
                              act + ".default(%x)\n  %out : f32[3,4] = aten::" + act +
                              "_backward.default(%g, %x)\n  return (%y, %out)\n");
  const at::Tensor x = at::randn({3, 4}) * 3;
  const at::Tensor grad = at::randn({3, 4});
  runtime::Executor ex(g);
  EXPECT_TRUE(at::equal(ex.run({x, grad})[1].toTensor(), eager(grad, x)));
}

}  // namespace

TEST(RecomposeActivationBackward, SilusCompositeBecomesEagersFusedKernel) {
  auto g = ir::parse(joint("aten::silu.default(%x)"));
  expect_fused(*g, "silu", at::silu_backward);
}

TEST(RecomposeActivationBackward, AHandWrittenProductIsLeftAlone) {
  const std::string text = joint("aten::mul.Tensor(%x, %x)");
  auto g = ir::parse(text);
  EXPECT_EQ(passes::recompose_activation_backward(*g), 0);
  EXPECT_EQ(ir::print(*g), text);
}

TEST(RecomposeActivationBackward, MishsCompositeBecomesEagersFusedKernel) {
  auto g = ir::parse(R"(graph:
  %x : f32[3,4] = input()
  %g : f32[3,4] = input()
  %y : f32[3,4] = aten::mish.default(%x)
  %sp : f32[3,4] = aten::softplus.default(%x)
  %tsp : f32[3,4] = aten::tanh.default(%sp)
  %sig : f32[3,4] = aten::sigmoid.default(%x)
  %sq : f32[3,4] = aten::mul.Tensor(%tsp, %tsp)
  %e : f32[3,4] = aten::empty_like.default(%sq, memory_format=torch.preserve_format)
  %f : f32[3,4] = aten::fill.Scalar(%e, 1)
  %s : f32[3,4] = aten::sub.Tensor(%f, %sq)
  %m1 : f32[3,4] = aten::mul.Tensor(%x, %sig)
  %m2 : f32[3,4] = aten::mul.Tensor(%m1, %s)
  %a : f32[3,4] = aten::add.Tensor(%tsp, %m2)
  %out : f32[3,4] = aten::mul.Tensor(%g, %a)
  return (%y, %out)
)");
  expect_fused(*g, "mish", at::mish_backward);
}

// nn.SiLU(inplace=True): functionalized to silu(%y), with autograd's saved input a clone of %y.
TEST(RecomposeActivationBackward, AnInPlaceActivationsSavedCloneIsItsInput) {
  const std::string text = joint("aten::silu.default(%y0)");
  std::string cloned = text;
  cloned.replace(cloned.find("  %g : f32[3,4] = input()\n"), std::string("  %g : f32[3,4] = input()\n").size(),
                 "  %g : f32[3,4] = input()\n  %y0 : f32[3,4] = aten::relu.default(%x)\n");
  // %x becomes the clone of %y0 that autograd saved: the composite reads the clone.
  cloned.replace(cloned.find("  %x : f32[3,4] = input()\n"), std::string("  %x : f32[3,4] = input()\n").size(),
                 "  %w : f32[3,4] = input()\n");
  cloned.replace(cloned.find("  %y0 : f32[3,4] = aten::relu.default(%x)\n"),
                 std::string("  %y0 : f32[3,4] = aten::relu.default(%x)\n").size(),
                 "  %y0 : f32[3,4] = aten::relu.default(%w)\n  %x : f32[3,4] = aten::clone.default(%y0)\n");
  auto g = ir::parse(cloned);
  EXPECT_EQ(passes::recompose_activation_backward(*g), 1);
  passes::eliminate_dead_code(*g);
  ir::verify(*g);
  EXPECT_NE(ir::print(*g).find("%out : f32[3,4] = aten::silu_backward.default(%g, %x)"), std::string::npos)
      << ir::print(*g);
}
