// Golden text-IR tests for the pure-step passes, positive and negative, verifier after each pass.
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/append_update.h"
#include "passes/build_train_step.h"
#include "passes/check_pure.h"
#include "passes/clip_grad_norm.h"
#include "passes/eliminate_dead_code.h"
#include "passes/lift_optimizer_state.h"
#include "passes/rewire_outputs.h"
#include "passes/unroll.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {

// kJoint in parts, for the golden texts of passes that append to it or reorder its state: its state
// placeholders, and the rest but its return.
const std::string kJointState = R"(  %w : f32[2,3] = param("fc.weight")
  %b : f32[2] = param("fc.bias")
  %rm : f32[2] = buffer("bn.running_mean")
)";
const std::string kJointBody = R"(  %x : f32[4,3] = input()
  %y : f32[4,2] = aten::linear.default(%x, %w, %b)
  %loss : f32[] = aten::sum.default(%y)
  %gw : f32[2,3] = aten::ones_like.default(%w)
  %gb : f32[2] = aten::ones_like.default(%b)
  %rm2 : f32[2] = aten::mul.Tensor(%rm, 0.9)
)";
const std::string kJoint = "graph:\n" + kJointState + kJointBody + "  return (%rm2, %loss, %gw, %gb)\n";

passes::TrainStepSpec spec() {
  passes::TrainStepSpec s;
  s.loss_output = 1;
  s.buffer_mutations = {{0, "bn.running_mean"}};
  s.grads = {{2, "fc.weight"}, {3, "fc.bias"}};
  s.num_groups = 2;
  passes::ParamUpdate w{"fc.weight", "adam", 0, {{"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}, {"weight_decay", 0.0}},
                        {{"decoupled", true}, {"maximize", false}}};
  passes::ParamUpdate b{"fc.bias", "sgd", 1, {{"weight_decay", 0.0}}, {{"maximize", false}}};
  s.updates = {w, b};
  return s;
}


std::map<std::string, ir::Node*> grads_of(const ir::Graph& g) {
  return {{"fc.weight", g.find("gw")}, {"fc.bias", g.find("gb")}};
}

}  // namespace

TEST(LiftOptimizerState, AddsTypedStateAndLrInputs) {
  auto g = ir::parse(kJoint);
  auto lifted = passes::lift_optimizer_state(*g, spec());
  ir::verify(*g);
  EXPECT_EQ(lifted.size(), 5u);
  const std::string text = ir::print(*g);
  EXPECT_NE(text.find("  %x : f32[4,3] = input()\n"
                      "  %opt_fc_weight_exp_avg : f32[2,3] = optstate(\"opt:fc.weight:exp_avg\")\n"
                      "  %opt_fc_weight_exp_avg_sq : f32[2,3] = optstate(\"opt:fc.weight:exp_avg_sq\")\n"
                      "  %opt_fc_weight_step : f32[] = optstate(\"opt:fc.weight:step\")\n"
                      "  %lr_group0 : f64[] = optstate(\"opt:lr:group0\")\n"
                      "  %lr_group1 : f64[] = optstate(\"opt:lr:group1\")\n"
                      "  %y : f32[4,2]"),
            std::string::npos)
      << text;
}

TEST(LiftOptimizerState, RejectsUnknownParameterAndLeavesGraph) {
  auto g = ir::parse(kJoint);
  auto s = spec();
  s.updates[1].param = "fc.nope";
  EXPECT_NE(error_of([&] { passes::lift_optimizer_state(*g, s); }).find("no parameter placeholder for 'fc.nope'"),
            std::string::npos);
  s = spec();
  s.updates[0].kind = "lamb";
  EXPECT_NE(error_of([&] { passes::lift_optimizer_state(*g, s); }).find("unknown update kind 'lamb'"),
            std::string::npos);
  EXPECT_EQ(ir::print(*g), kJoint);
}

TEST(AppendUpdate, EmitsFunctionalUpdatesAndGetitems) {
  auto g = ir::parse(kJoint);
  auto lifted = passes::lift_optimizer_state(*g, spec());
  auto updated = passes::append_update(*g, spec(), grads_of(*g), lifted);
  ir::verify(*g);
  std::vector<std::string> keys;
  for (const auto& e : updated) keys.push_back(e.first + "=" + e.second->name());
  EXPECT_EQ(keys, (std::vector<std::string>{"fc.weight=w_adam_param", "opt:fc.weight:exp_avg=w_adam_exp_avg",
                                            "opt:fc.weight:exp_avg_sq=w_adam_exp_avg_sq",
                                            "opt:fc.weight:step=w_adam_step", "fc.bias=b_sgd"}));
  const std::string text = ir::print(*g);
  EXPECT_NE(text.find("  %w_adam : (f32[2,3], f32[2,3], f32[2,3], f32[]) = torch_ext::adam_update.default(%w, %gw, "
                      "%opt_fc_weight_exp_avg, %opt_fc_weight_exp_avg_sq, %opt_fc_weight_step, %lr_group0, 0.9, "
                      "0.999, 1e-08, 0.0, True, False)  # optimizer\n"
                      "  %w_adam_param : f32[2,3] = getitem(%w_adam, 0)  # optimizer\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("  %b_sgd : f32[2] = torch_ext::sgd_update.default(%b, %gb, %lr_group1, 0.0, False)  # optimizer\n"),
            std::string::npos)
      << text;
}

TEST(AppendUpdate, MissingHyperparameterIsNamedAndNothingChanges) {
  auto g = ir::parse(kJoint);
  auto lifted = passes::lift_optimizer_state(*g, spec());
  const std::string before = ir::print(*g);
  auto s = spec();
  s.updates[0].hyper.erase("eps");
  EXPECT_NE(error_of([&] { passes::append_update(*g, s, grads_of(*g), lifted); })
                .find("parameter 'fc.weight' (adam) is missing hyperparameter 'eps'"),
            std::string::npos);
  EXPECT_EQ(ir::print(*g), before);
}

TEST(ClipGradNorm, TorchOpSequence) {
  auto g = ir::parse(kJoint);
  auto clipped = passes::clip_grad_norm(*g, {g->find("gw"), g->find("gb")}, 1.0, 2.0);
  ir::verify(*g);
  ASSERT_EQ(clipped.size(), 2u);
  EXPECT_EQ(ir::print(*g), "graph:\n" + kJointState + kJointBody + R"(  %grad_norm : f32[] = aten::linalg_vector_norm.default(%gw, 2.0)
  %grad_norm_1 : f32[] = aten::linalg_vector_norm.default(%gb, 2.0)
  %grad_norms : f32[2] = aten::stack.default([%grad_norm, %grad_norm_1])
  %total_norm : f32[] = aten::linalg_vector_norm.default(%grad_norms, 2.0)
  %clip_denom : f32[] = aten::add.Tensor(%total_norm, 1e-06)
  %clip_recip : f32[] = aten::reciprocal.default(%clip_denom)
  %clip_coef : f32[] = aten::mul.Tensor(%clip_recip, 1.0)
  %clip_coef_clamped : f32[] = aten::clamp.default(%clip_coef, None, 1.0)
  %gw_clipped : f32[2,3] = aten::mul.Tensor(%gw, %clip_coef_clamped)
  %gb_clipped : f32[2] = aten::mul.Tensor(%gb, %clip_coef_clamped)
  return (%rm2, %loss, %gw, %gb)
)");
  // Numerical parity with torch.nn.utils.clip_grad_norm_ is checked bit-exact in test_train_step.py.
  EXPECT_NE(error_of([&] { passes::clip_grad_norm(*g, {g->find("gw")}, 0.0, 2.0); }).find("max_norm must be positive"),
            std::string::npos);
}

TEST(RewireOutputs, StateFirstThenOthersThenBatch) {
  auto g = ir::parse(kJoint);
  const size_t k = passes::rewire_outputs(*g, g->find("loss"), {{"fc.weight", g->find("gw")}, {"bn.running_mean", g->find("rm2")}});
  ir::verify(*g);
  EXPECT_EQ(k, 2u);
  EXPECT_EQ(ir::print(*g), R"(graph:
  %w : f32[2,3] = param("fc.weight")
  %rm : f32[2] = buffer("bn.running_mean")
  %b : f32[2] = param("fc.bias")
)" + kJointBody + "  return (%loss, %gw, %rm2)\n");
  EXPECT_NE(error_of([&] { passes::rewire_outputs(*g, g->find("loss"), {{"nope", g->find("gw")}}); })
                .find("no placeholder holds state 'nope'"),
            std::string::npos);
}

TEST(EliminateDeadCode, RemovesUnreadKeepsMutating) {
  auto g = ir::parse(R"(graph:
  %x : f32[2] = input()
  %c : i64[] = buffer("count")
  %a : f32[2] = aten::sin.default(%x)
  %dead1 : f32[2] = aten::cos.default(%a)
  %dead2 : f32[2] = aten::exp.default(%dead1)
  %inc : i64[] = aten::add_.Tensor(%c, 1)
  return (%a)
)");
  EXPECT_EQ(passes::eliminate_dead_code(*g), 2u);
  ir::verify(*g);
  EXPECT_EQ(ir::print(*g), std::string(R"(graph:
  %x : f32[2] = input()
  %c : i64[] = buffer("count")
  %a : f32[2] = aten::sin.default(%x)
  %inc : i64[] = aten::add_.Tensor(%c, 1)
  return (%a)
)"));
}

TEST(CheckPure, RejectsMutationAndAliasedOutputs) {
  auto mut = ir::parse("graph:\n  %c : i64[] = buffer(\"count\")\n  %inc : i64[] = aten::add_.Tensor(%c, 1)\n"
                       "  return (%inc)\n");
  EXPECT_NE(error_of([&] { passes::check_pure(*mut); }).find("node %inc (aten::add_.Tensor) mutates an argument"),
            std::string::npos);
  auto alias = ir::parse("graph:\n  %w : f32[2,3] = param(\"w\")\n  %t : f32[3,2]{1,3} = aten::t.default(%w)\n"
                         "  %v : f32[6] = aten::view.default(%t, [6])\n  return (%v)\n");
  EXPECT_NE(error_of([&] { passes::check_pure(*alias); }).find("output #0 (%v) aliases input %w"), std::string::npos);
  auto direct = ir::parse("graph:\n  %w : f32[2] = param(\"w\")\n  return (%w)\n");
  EXPECT_NE(error_of([&] { passes::check_pure(*direct); }).find("output #0 (%w) aliases input %w"), std::string::npos);
  auto ok = ir::parse("graph:\n  %w : f32[2] = param(\"w\")\n  %c : f32[2] = aten::clone.default(%w)\n  return (%c)\n");
  passes::check_pure(*ok);
}

// A mutation two regions deep (a cond inside a cond's branch) is found and named with the outer node.
TEST(CheckPure, LooksIntoNestedRegions) {
  auto nested = [&](const std::string& op) {
    return ir::parse(R"(graph:
  %x : f32[3] = input()
  %p : b8[] = input()
  %c : (f32[3]) = higher_order::cond.default(%p, [%x, %p]) {
    graph:
      %a : f32[3] = input()
      %q : b8[] = input()
      %d : (f32[3]) = higher_order::cond.default(%q, [%a]) {
        graph:
          %u : f32[3] = input()
          %m : f32[3] = aten::)" + op + R"((%u, 1)
          return (%m)
      } {
        graph:
          %u : f32[3] = input()
          %n : f32[3] = aten::neg.default(%u)
          return (%n)
      }
      %e : f32[3] = getitem(%d, 0)
      return (%e)
  } {
    graph:
      %a : f32[3] = input()
      %q : b8[] = input()
      %n : f32[3] = aten::neg.default(%a)
      return (%n)
  }
  %g : f32[3] = getitem(%c, 0)
  return (%g)
)");
  };
  EXPECT_NE(error_of([&] { passes::check_pure(*nested("add_.Tensor")); })
                .find("node %m (aten::add_.Tensor) inside %c mutates an argument"),
            std::string::npos);
  passes::check_pure(*nested("add.Tensor"));
}

TEST(Unroll, ChainsStateThroughSteps) {
  auto g = ir::parse(R"(graph:
  %w : f32[2] = param("w")
  %x : f32[2] = input()
  %d : f32[2] = aten::mul.Tensor(%w, %x)
  %loss : f32[] = aten::sum.default(%d)
  %w2 : f32[2] = aten::sub.Tensor(%w, %x)
  return (%loss, %w2)
)");
  auto u = passes::unroll(*g, 1, 2);
  ir::verify(*u);
  EXPECT_EQ(ir::print(*u), std::string(R"(graph:
  %w : f32[2] = param("w")
  %x_s0 : f32[2] = input()
  %x_s1 : f32[2] = input()
  %d_s0 : f32[2] = aten::mul.Tensor(%w, %x_s0)
  %loss_s0 : f32[] = aten::sum.default(%d_s0)
  %w2_s0 : f32[2] = aten::sub.Tensor(%w, %x_s0)
  %d_s1 : f32[2] = aten::mul.Tensor(%w2_s0, %x_s1)
  %loss_s1 : f32[] = aten::sum.default(%d_s1)
  %w2_s1 : f32[2] = aten::sub.Tensor(%w2_s0, %x_s1)
  %losses : f32[2] = aten::stack.default([%loss_s0, %loss_s1])
  return (%losses, %w2_s1)
)"));
  EXPECT_NE(error_of([&] { passes::unroll(*g, 3, 2); }).find("expected 4 outputs"), std::string::npos);
}

TEST(BuildTrainStep, EndToEndIsPureAndComputesTheUpdate) {
  auto joint = ir::parse(kJoint);
  auto out = passes::build_train_step(*joint, spec(), 1);
  EXPECT_EQ(ir::print(*joint), kJoint) << "the input graph must not change";
  ir::verify(*out.graph);
  passes::check_pure(*out.graph);
  EXPECT_EQ(out.state_names, (std::vector<std::string>{"fc.weight", "fc.bias", "bn.running_mean",
                                                        "opt:fc.weight:exp_avg", "opt:fc.weight:exp_avg_sq",
                                                        "opt:fc.weight:step"}));
  EXPECT_EQ(out.num_user_inputs, 1u);
  // Run it: SGD on the bias with all-ones gradient and lr 0.5 subtracts 0.5.
  runtime::Executor ex(*out.graph);
  std::vector<c10::IValue> in;
  for (const ir::Node* p : out.graph->placeholders()) {
    if (p->state_name() == "opt:lr:group0") in.emplace_back(at::scalar_tensor(1e-3, at::kDouble));
    else if (p->state_name() == "opt:lr:group1") in.emplace_back(at::scalar_tensor(0.5, at::kDouble));
    else in.emplace_back(at::zeros(p->type().tensor.sizes, p->type().tensor.dtype));
  }
  auto res = ex.run(in);
  ASSERT_EQ(res.size(), 7u);
  EXPECT_TRUE(at::equal(res[2].toTensor(), at::full({2}, -0.5)));
  EXPECT_EQ(res[6].toTensor().item<float>(), 1.0f);  // adam step count
}

TEST(BuildTrainStep, RejectsNonScalarLossAndBadIndices) {
  auto joint = ir::parse(kJoint);
  auto s = spec();
  s.loss_output = 2;
  EXPECT_NE(error_of([&] { passes::build_train_step(*joint, s, 1); }).find("the loss must be a scalar tensor"),
            std::string::npos);
  s = spec();
  s.grads.push_back({9, "fc.bias"});
  EXPECT_NE(error_of([&] { passes::build_train_step(*joint, s, 1); }).find("gradient output index 9 out of range"),
            std::string::npos);
  EXPECT_EQ(ir::print(*joint), kJoint);
}

TEST(BuildTrainStep, PrintAfterAllShowsEachPassThatRan) {
  auto joint = ir::parse(kJoint);
  ASSERT_EQ(setenv("TORCH_EXT_PRINT_AFTER_ALL", "1", 1), 0);
  ::testing::internal::CaptureStderr();
  auto out = passes::build_train_step(*joint, spec(), 1);
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(unsetenv("TORCH_EXT_PRINT_AFTER_ALL"), 0);
  std::vector<std::string> headers;
  for (size_t at = err.find("// ----- IR after "); at != std::string::npos; at = err.find("// ----- IR after ", at + 1))
    headers.push_back(err.substr(at + 18, err.find(' ', at + 18) - (at + 18)));
  EXPECT_EQ(headers, (std::vector<std::string>{"recompose_activation_backward", "read_outputs", "lift_optimizer_state", "append_update", "thread_rng",
                                               "rewire_outputs", "eliminate_dead_code", "check_pure"}));
  const std::string last = ir::print(*out.graph);
  ASSERT_GE(err.size(), last.size());
  EXPECT_EQ(err.substr(err.size() - last.size()), last);
}
