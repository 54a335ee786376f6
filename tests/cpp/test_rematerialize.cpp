// Rematerialization pass: text IR in, checked text out; refusals leave the graph untouched.
#include "ir/out_variant.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/plan_memory.h"
#include "passes/rematerialize.h"

#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {
// Forward: h = x @ w, r = relu(h), loss = sum(r). Backward (its seed go reads the loss): threshold_backward reads r (saved),
// the weight gradient reads x.
const char* kStep = R"(graph:
  %w : f32[64,64] = param("w")
  %lr : f64[] = optstate("opt:lr:group0")
  %x : f32[32,64] = input()
  %h : f32[32,64] = aten::mm.default(%x, %w)
  %r : f32[32,64] = aten::relu.default(%h)
  %loss : f32[] = aten::sum.default(%r)
  %go : f32[32,64] = aten::mul.Tensor(%x, %loss)
  %gr : f32[32,64] = aten::threshold_backward.default(%go, %r, 0)
  %xt : f32[64,32]{1,64} = aten::t.default(%x)
  %gw : f32[64,64] = aten::mm.default(%xt, %gr)
  %u : f32[64,64] = torch_ext::sgd_update.default(%w, %gw, %lr, 0.0, False)
  return (%loss, %u)
)";
}  // namespace

TEST(Rematerialize, CloneOfAChainGoesBeforeItsFirstBackwardReader) {
  auto g = ir::parse(kStep);
  auto r = passes::rematerialize(*g, {"r", "h"});
  ir::verify(*g);
  EXPECT_EQ(r.clones, 2);
  EXPECT_EQ(ir::print(*g), R"(graph:
  %w : f32[64,64] = param("w")
  %lr : f64[] = optstate("opt:lr:group0")
  %x : f32[32,64] = input()
  %h : f32[32,64] = aten::mm.default(%x, %w)
  %r : f32[32,64] = aten::relu.default(%h)
  %loss : f32[] = aten::sum.default(%r)
  %go : f32[32,64] = aten::mul.Tensor(%x, %loss)
  %h_recomp : f32[32,64] = aten::mm.default(%x, %w)
  %r_recomp : f32[32,64] = aten::relu.default(%h_recomp)
  %gr : f32[32,64] = aten::threshold_backward.default(%go, %r_recomp, 0)
  %xt : f32[64,32]{1,64} = aten::t.default(%x)
  %gw : f32[64,64] = aten::mm.default(%xt, %gr)
  %u : f32[64,64] = torch_ext::sgd_update.default(%w, %gw, %lr, 0.0, False)
  return (%loss, %u)
)");
  // %r now dies with %loss, not at %gr.
  const auto plan = passes::plan_memory(*g, true);
  for (const auto& b : plan.buffers) if (b.node->name() == "r") EXPECT_EQ(b.life.last, 2);
  for (const auto& b : plan.dynamic) if (b.node->name() == "r") EXPECT_EQ(b.life.last, 2);
}

TEST(Rematerialize, RecomputingOnlyTheSavedValueKeepsItsInputAlive) {
  auto g = ir::parse(kStep);
  passes::rematerialize(*g, {"r"});
  ir::verify(*g);
  const std::string text = ir::print(*g);
  EXPECT_NE(text.find("%r_recomp : f32[32,64] = aten::relu.default(%h)\n  %gr : f32[32,64] = "
                      "aten::threshold_backward.default(%go, %r_recomp, 0)"),
            std::string::npos)
      << text;
}

TEST(Rematerialize, RefusesNonCandidatesByNameLeavingTheGraphUntouched) {
  auto g = ir::parse(kStep);
  const std::string before = ir::print(*g);
  EXPECT_NE(error_of([&] { passes::rematerialize(*g, {"r", "gr"}); }).find("%gr is not in the forward"),
            std::string::npos);
  EXPECT_NE(error_of([&] { passes::rematerialize(*g, {"nope"}); }).find("no node %nope"), std::string::npos);
  EXPECT_NE(error_of([&] { passes::rematerialize(*g, {"loss"}); }).find("%loss is a graph output"), std::string::npos);
  EXPECT_EQ(ir::print(*g), before);
}

// kStep with a wide forward tail: at %e, the saved %r is live beside it unless recomputed.
const char* kWide = R"(graph:
  %w : f32[64,64] = param("w")
  %lr : f64[] = optstate("opt:lr:group0")
  %x : f32[32,64] = input()
  %h : f32[32,64] = aten::mm.default(%x, %w)
  %r : f32[32,64] = aten::relu.default(%h)
  %s : f32[32,64] = aten::mul.Tensor(%r, 3)
  %e : f32[32,1024] = aten::repeat.default(%s, [1, 16])
  %loss : f32[] = aten::sum.default(%e)
  %go : f32[32,64] = aten::mul.Tensor(%x, %loss)
  %gr : f32[32,64] = aten::threshold_backward.default(%go, %r, 0)
  %xt : f32[64,32]{1,64} = aten::t.default(%x)
  %gw : f32[64,64] = aten::mm.default(%xt, %gr)
  %u : f32[64,64] = torch_ext::sgd_update.default(%w, %gw, %lr, 0.0, False)
  return (%loss, %u)
)";

TEST(Rematerialize, BudgetSearchFitsOrReportsTheSmallestPeakFound) {
  auto g = ir::parse(kWide);
  const int64_t before = passes::plan_memory(*g, true).peak_bytes();
  // Unconstrained: nothing recomputed.
  auto easy = ir::parse(kWide);
  auto none = passes::rematerialize_for_budget(*easy, before, true);
  EXPECT_TRUE(none.feasible);
  EXPECT_TRUE(none.recomputed.empty());
  EXPECT_EQ(ir::print(*easy), ir::print(*g));
  // One byte less: the search recomputes and must land strictly lower, with the planner's peak.
  auto res = passes::rematerialize_for_budget(*g, before - 1, true);
  ir::verify(*g);
  EXPECT_EQ(res.peak_before, before);
  EXPECT_LT(res.min_peak, before);
  EXPECT_EQ(res.peak, passes::plan_memory(*g, true).peak_bytes());
  EXPECT_TRUE(res.feasible);
  EXPECT_GT(res.added_flops, 0);
  // Impossible: the state alone exceeds it; the graph keeps the best set found.
  auto h = ir::parse(kWide);
  auto no = passes::rematerialize_for_budget(*h, 64, true);
  EXPECT_FALSE(no.feasible);
  EXPECT_EQ(no.min_peak, passes::plan_memory(*h, true).peak_bytes());
  EXPECT_EQ(no.min_peak, res.min_peak);  // the same greedy path, run to its end
}

TEST(OutVariant, FoundBySchemaAndOnlyWithAKernelOfItsOwn) {
  auto g = ir::parse(R"(graph:
  %x : f32[4,8] = input()
  %t : i64[4] = input()
  %go : f32[4,8] = aten::mul.Tensor(%x, 2)
  %tb : f32[4,8] = aten::threshold_backward.default(%go, %x, 0)
  %r : f32[4,8] = aten::relu.default(%x)
  %s : f32[4] = aten::sum.dim_IntList(%x, [1])
  %nll : (f32[], f32[]) = aten::nll_loss_forward.default(%x, %t, None, 1, -100)
  return (%tb, %r, %s, %nll)
)");
  auto out_of = [&](const char* name) { return ir::find_out_variant(*g->find(name)); };
  ASSERT_TRUE(out_of("go").has_value());
  EXPECT_EQ(out_of("go")->out_args, std::vector<std::string>{"out"});
  ASSERT_TRUE(out_of("tb").has_value());  // named grad_input, not out
  EXPECT_EQ(out_of("tb")->out_args, std::vector<std::string>{"grad_input"});
  ASSERT_TRUE(out_of("s").has_value());  // the IntList_out overload
  ASSERT_TRUE(out_of("nll").has_value());  // two outs
  EXPECT_EQ(out_of("nll")->out_args, (std::vector<std::string>{"output", "total_weight"}));
  // relu.out on CPU is the generated functional-then-copy wrapper: refused.
  EXPECT_FALSE(out_of("r").has_value());
}

TEST(OutVariant, MatchesArgumentTypesNotOnlyNames) {
  // pow.Scalar_out(Scalar self, Tensor exponent) names its arguments as pow.Tensor_Scalar does.
  auto g = ir::parse(R"(graph:
  %x : f32[4] = input()
  %p : f32[4] = aten::pow.Tensor_Scalar(%x, 2)
  return (%p)
)");
  const auto out = ir::find_out_variant(*g->find("p"));
  ASSERT_TRUE(out.has_value());
  EXPECT_EQ(out->op.operator_name().overload_name, "Tensor_Scalar_out");
}
