// The pass manager: declared lists, enablement predicates, verify-after-each-pass naming the
// pass, print-after-all; and the train-step pipeline as that list.
#include "ir/parser.h"
#include "ir/printer.h"
#include "passes/build_train_step.h"
#include "passes/pass_manager.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {

const char* kGraph = R"(graph:
  %x : f32[2] = input()
  %y : f32[2] = aten::relu.default(%x)
  return (%y)
)";

ir::Type f32(std::vector<int64_t> sizes) {
  ir::TensorMeta m;
  m.sizes = sizes;
  m.strides = ir::TensorMeta::contiguous_strides(sizes);
  return ir::Type::make_tensor(m);
}

// Appends neg(output) and returns it.
passes::PassResult append_neg(ir::Graph& g, passes::PassContext&) {
  ir::Node* out = g.output()->args()[0].list[0].node;
  ir::Node* n = g.create_call(g.unique_name("neg"), {"aten", "neg", "default"}, {ir::Arg::of_node(out)}, {}, out->type());
  g.set_output({ir::Arg::of_node(n)});
  return passes::PassResult::changed();
}

// Declares a wrong type for the node it adds: the verifier must catch it.
passes::PassResult append_mistyped(ir::Graph& g, passes::PassContext&) {
  ir::Node* out = g.output()->args()[0].list[0].node;
  g.create_call("bad", {"aten", "neg", "default"}, {ir::Arg::of_node(out)}, {}, f32({3}));
  return passes::PassResult::changed();
}

passes::PassResult replace_with_parsed(ir::Graph&, passes::PassContext&) {
  return passes::PassResult::replaced(ir::parse(kGraph));
}

passes::PassResult analysis(ir::Graph&, passes::PassContext& ctx) {
  ctx.num_user_inputs = 42;
  return passes::PassResult::unchanged();
}

bool never(const passes::PassContext&) { return false; }

passes::PassManagerOptions quiet() {
  passes::PassManagerOptions o;
  o.print_after_all = false;
  return o;
}

}  // namespace

TEST(PassManager, RunsEnabledPassesInListOrder) {
  passes::TrainStepSpec spec;
  passes::PassContext ctx(spec, 1);
  passes::PassManager pm({{"neg1", nullptr, append_neg}, {"skipped", never, append_mistyped}, {"neg2", nullptr, append_neg},
                          {"analysis", nullptr, analysis}},
                         quiet());
  auto g = pm.run(ir::parse(kGraph), ctx);
  EXPECT_EQ(ir::print(*g), R"(graph:
  %x : f32[2] = input()
  %y : f32[2] = aten::relu.default(%x)
  %neg : f32[2] = aten::neg.default(%y)
  %neg_1 : f32[2] = aten::neg.default(%neg)
  return (%neg_1)
)");
  EXPECT_EQ(ctx.num_user_inputs, 42u);
}

TEST(PassManager, LaterPassesRunOnAReplacementGraph) {
  passes::TrainStepSpec spec;
  passes::PassContext ctx(spec, 1);
  passes::PassManager pm({{"replace", nullptr, replace_with_parsed}, {"neg", nullptr, append_neg}}, quiet());
  auto g = pm.run(ir::parse(R"(graph:
  %x : f32[2] = input()
  return (%x)
)"), ctx);
  EXPECT_EQ(ir::print(*g), R"(graph:
  %x : f32[2] = input()
  %y : f32[2] = aten::relu.default(%x)
  %neg : f32[2] = aten::neg.default(%y)
  return (%neg)
)");
}

TEST(PassManager, VerifiesAfterEachPassAndNamesThePass) {
  passes::TrainStepSpec spec;
  passes::PassContext ctx(spec, 1);
  passes::PassManager pm({{"neg", nullptr, append_neg}, {"mistype", nullptr, append_mistyped}}, quiet());
  const std::string msg = error_of([&] { pm.run(ir::parse(kGraph), ctx); });
  EXPECT_NE(msg.find("graph invalid after pass mistype: IR verification failed"), std::string::npos) << msg;
  EXPECT_NE(msg.find("node %bad"), std::string::npos) << msg;
  // With verification off, the same list runs through.
  passes::PassManagerOptions off = quiet();
  off.verify_each = false;
  EXPECT_NE(passes::PassManager({{"mistype", nullptr, append_mistyped}}, off).run(ir::parse(kGraph), ctx)->find("bad"),
            nullptr);
}

TEST(PassManager, PrintsTheIrAfterEachPassThatRan) {
  passes::TrainStepSpec spec;
  passes::PassContext ctx(spec, 1);
  std::ostringstream os;
  passes::PassManagerOptions o;
  o.print_after_all = true;
  o.print_to = &os;
  auto g = passes::PassManager({{"skipped", never, append_neg}, {"neg", nullptr, append_neg}}, o).run(ir::parse(kGraph), ctx);
  EXPECT_EQ(os.str(), "// ----- IR after neg ----- //\n" + ir::print(*g));
  std::ostringstream silent;
  o.print_after_all = false;
  o.print_to = &silent;
  passes::PassManager({{"neg", nullptr, append_neg}}, o).run(ir::parse(kGraph), ctx);
  EXPECT_EQ(silent.str(), "");
}

TEST(PassManager, PrintAfterAllFollowsTheEnvironment) {
  ASSERT_EQ(setenv("TORCH_EXT_PRINT_AFTER_ALL", "1", 1), 0);
  EXPECT_TRUE(passes::PassManagerOptions::from_env().print_after_all);
  ASSERT_EQ(setenv("TORCH_EXT_PRINT_AFTER_ALL", "0", 1), 0);
  EXPECT_FALSE(passes::PassManagerOptions::from_env().print_after_all);
  ASSERT_EQ(unsetenv("TORCH_EXT_PRINT_AFTER_ALL"), 0);
  EXPECT_FALSE(passes::PassManagerOptions::from_env().print_after_all);
  EXPECT_TRUE(passes::PassManagerOptions::from_env().verify_each);
}

TEST(TrainStepPipeline, IsTheDeclaredListAndEachSpecEnablesItsEntries) {
  std::vector<std::string> names;
  for (const passes::Pass& p : passes::train_step_passes()) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"recompose_activation_backward", "accumulate", "read_outputs", "lift_optimizer_state", "all_reduce_grads",
                                             "clip_grad_norm", "shard_optimizer_state", "append_update", "thread_rng",
                                             "rewire_outputs", "eliminate_dead_code", "check_pure", "unroll",
                                             "check_pure", "serialize_collectives"}));
  auto enabled = [](const passes::TrainStepSpec& spec, int64_t unroll) {
    passes::PassContext ctx(spec, unroll);
    std::vector<std::string> out;
    for (const passes::Pass& p : passes::train_step_passes())
      if (p.enabled == nullptr || p.enabled(ctx)) out.push_back(p.name);
    return out;
  };
  passes::TrainStepSpec plain;
  EXPECT_EQ(enabled(plain, 1), (std::vector<std::string>{"recompose_activation_backward", "read_outputs", "lift_optimizer_state", "append_update",
                                                         "thread_rng", "rewire_outputs", "eliminate_dead_code",
                                                         "check_pure"}));
  passes::TrainStepSpec all = plain;
  all.accumulate = 2;
  all.clip_max_norm = 1.0;
  all.data_parallel = passes::DataParallel{"g", 2, 0, true};
  EXPECT_EQ(enabled(all, 3), (std::vector<std::string>{"recompose_activation_backward", "accumulate", "read_outputs", "lift_optimizer_state",
                                                       "all_reduce_grads", "clip_grad_norm", "shard_optimizer_state",
                                                       "thread_rng", "rewire_outputs", "eliminate_dead_code",
                                                       "check_pure", "unroll", "check_pure", "serialize_collectives"}));
  all.data_parallel->shard_optimizer_state = false;
  const auto unsharded = enabled(all, 1);
  EXPECT_NE(std::find(unsharded.begin(), unsharded.end(), "append_update"), unsharded.end());
  EXPECT_EQ(std::find(unsharded.begin(), unsharded.end(), "shard_optimizer_state"), unsharded.end());
  EXPECT_EQ(std::find(unsharded.begin(), unsharded.end(), "unroll"), unsharded.end());
}
