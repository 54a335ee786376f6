// recompose_silu_backward: the composite SiLU backward of a traced joint graph becomes the fused
// aten::silu_backward that eager autograd runs (golden text), and only when the forward is a SiLU.
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/eliminate_dead_code.h"
#include "passes/recompose_silu_backward.h"
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

}  // namespace

TEST(RecomposeSiluBackward, TheCompositeBecomesEagersFusedKernel) {
  auto g = ir::parse(joint("aten::silu.default(%x)"));
  EXPECT_EQ(passes::recompose_silu_backward(*g), 1);
  passes::eliminate_dead_code(*g);
  ir::verify(*g);
  EXPECT_EQ(ir::print(*g), R"(graph:
  %x : f32[3,4] = input()
  %g : f32[3,4] = input()
  %y : f32[3,4] = aten::silu.default(%x)
  %out : f32[3,4] = aten::silu_backward.default(%g, %x)
  return (%y, %out)
)");
  // Eager's backward, bit for bit (the composite rounds otherwise).
  const at::Tensor x = at::randn({3, 4}) * 3;
  const at::Tensor grad = at::randn({3, 4});
  runtime::Executor ex(*g);
  EXPECT_TRUE(at::equal(ex.run({x, grad})[1].toTensor(), at::silu_backward(grad, x)));
}

TEST(RecomposeSiluBackward, AHandWrittenProductIsLeftAlone) {
  const std::string text = joint("aten::mul.Tensor(%x, %x)");
  auto g = ir::parse(text);
  EXPECT_EQ(passes::recompose_silu_backward(*g), 0);
  EXPECT_EQ(ir::print(*g), text);
}
