// accumulate: N micro-batches, one summed gradient, buffers chained, losses stacked.
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/accumulate.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {

const char* kJoint = R"(graph:
  %w : f32[3] = param("w")
  %rm : f32[3] = buffer("rm")
  %x : f32[3] = input()
  %y : f32[3] = aten::mul.Tensor(%x, %w)
  %loss : f32[] = aten::sum.default(%y)
  %seed : f32[] = aten::ones_like.default(%loss)
  %gw : f32[3] = aten::mul.Tensor(%seed, %x)
  %rm2 : f32[3] = aten::add.Tensor(%rm, %x)
  return (%loss, %gw, %rm2)
)";

passes::TrainStepSpec spec() {
  passes::TrainStepSpec s;
  s.loss_output = 0;
  s.grads = {{1, "w"}};
  s.buffer_mutations = {{2, "rm"}};
  return s;
}

}  // namespace

TEST(Accumulate, TwoMicroBatchesComputeTheEagerAccumulation) {
  auto joint = ir::parse(kJoint);
  auto g = passes::accumulate(*joint, spec(), 2);
  EXPECT_EQ(ir::print(*joint), kJoint) << "the input graph must not change";
  ir::verify(*g);
  const std::string text = ir::print(*g);
  EXPECT_NE(text.find("%seed_div_mb0 : f32[] = aten::div.Scalar(%seed_mb0, 2)"), std::string::npos) << text;
  EXPECT_NE(text.find("%rm2_mb1 : f32[3] = aten::add.Tensor(%rm2_mb0, %x_mb1)"), std::string::npos) << text;
  EXPECT_NE(text.find("%gw_acc1 : f32[3] = aten::add.Tensor(%gw_mb0, %gw_mb1)"), std::string::npos) << text;
  EXPECT_NE(text.find("%micro_losses : f32[2] = aten::stack.default([%loss_mb0, %loss_mb1])"), std::string::npos)
      << text;
  runtime::Executor ex(*g);
  const at::Tensor w = at::randn({3}), rm = at::randn({3}), x0 = at::randn({3}), x1 = at::randn({3});
  auto out = ex.run({w, rm, x0, x1});
  EXPECT_TRUE(at::equal(out[0].toTensor(), at::stack({(x0 * w).sum(), (x1 * w).sum()})));
  const at::Tensor half = at::ones({}) / 2;
  EXPECT_TRUE(at::equal(out[1].toTensor(), half * x0 + half * x1));
  EXPECT_TRUE(at::equal(out[2].toTensor(), rm + x0 + x1));
}

TEST(Accumulate, RefusesAGraphWithoutABackwardSeed) {
  auto joint = ir::parse(R"(graph:
  %w : f32[3] = param("w")
  %loss : f32[] = aten::sum.default(%w)
  %gw : f32[3] = aten::ones_like.default(%w)
  return (%loss, %gw)
)");
  passes::TrainStepSpec s;
  s.loss_output = 0;
  s.grads = {{1, "w"}};
  EXPECT_NE(error_of([&] { passes::accumulate(*joint, s, 2); }).find("no aten::ones_like(%loss) seeds the backward"),
            std::string::npos);
  s.aux_outputs = {0};
  EXPECT_NE(error_of([&] { passes::accumulate(*joint, s, 2); }).find("auxiliary outputs are not supported"),
            std::string::npos);
}
