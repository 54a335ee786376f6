// Golden text-IR tests for the data-parallel passes (all_reduce_grads, shard_optimizer_state) and
// for the scheduler's placement of collectives, positive and negative, verifier after each pass.
// Running the collectives needs a process group: that is tests/python/test_distributed.py.
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/all_reduce_grads.h"
#include "passes/build_train_step.h"
#include "passes/lift_optimizer_state.h"
#include "passes/plan_memory.h"
#include "passes/schedule.h"
#include "passes/serialize_collectives.h"
#include "passes/shard_optimizer_state.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/FakeProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <algorithm>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {

// gb is produced before the rest of the backward (gw, rm2): its all_reduce must be issued there.
const char* kJoint = R"(graph:
  %w : f32[2,3] = param("fc.weight")
  %b : f32[3] = param("fc.bias")
  %rm : f32[2] = buffer("bn.running_mean")
  %x : f32[4,3] = input()
  %loss : f32[] = aten::sum.default(%x)
  %gb : f32[3] = aten::ones_like.default(%b)
  %gw : f32[2,3] = aten::ones_like.default(%w)
  %rm2 : f32[2] = aten::mul.Tensor(%rm, 0.9)
  return (%rm2, %loss, %gw, %gb)
)";

// The verifier runs each op's kernel on meta tensors, and the collectives look their group up by
// name: register a fake 2-rank group (c10d's FakeProcessGroup, no communication) as "test_dp".
// The registry holds groups weakly: the static keeps this one alive for the whole test binary.
void register_fake_group() {
  static const c10::intrusive_ptr<c10d::ProcessGroup> group = [] {
    auto pg = c10::make_intrusive<c10d::ProcessGroup>(0, 2);
    auto backend = c10::make_intrusive<c10d::FakeProcessGroup>(0, 2);
    pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::CUSTOM, backend);
    pg->setBackend(c10::DeviceType::Meta, c10d::ProcessGroup::BackendType::CUSTOM, backend);
    pg->setDefaultBackend(c10d::ProcessGroup::BackendType::CUSTOM);
    c10d::register_process_group("test_dp", pg);
    return pg;
  }();
  (void)group;
}

passes::DataParallel dp(int64_t rank, bool shard = false) {
  register_fake_group();
  return {"test_dp", 2, rank, shard};
}

passes::TrainStepSpec spec(const std::string& bias_kind = "sgd") {
  passes::TrainStepSpec s;
  s.loss_output = 1;
  s.buffer_mutations = {{0, "bn.running_mean"}};
  s.grads = {{2, "fc.weight"}, {3, "fc.bias"}};
  s.num_groups = 1;
  passes::ParamUpdate w{"fc.weight", "adam", 0, {{"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}, {"weight_decay", 0.0}},
                        {{"decoupled", true}, {"maximize", false}}};
  passes::ParamUpdate b{"fc.bias", "sgd", 0, {{"weight_decay", 0.0}}, {{"maximize", false}}};
  if (bias_kind == "muon") b = {"fc.bias", "muon", 0, {{"weight_decay", 0.0}, {"momentum", 0.9}, {"a", 1}, {"b", 1},
                                {"c", 1}, {"ns_steps", 5}, {"eps", 1e-7}, {"lr_ratio", 1}}, {{"nesterov", true}}};
  s.updates = {w, b};
  return s;
}

}  // namespace

TEST(AllReduceGrads, AveragesGradientsWhereTheyAreMadeAndBroadcastsBuffers) {
  auto g = ir::parse(kJoint);
  auto out = passes::all_reduce_grads(*g, dp(1), {g->find("gw"), g->find("gb")}, {g->find("rm2")});
  ir::verify(*g);
  ASSERT_EQ(out.grads.size(), 2u);
  ASSERT_EQ(out.buffers.size(), 1u);
  EXPECT_EQ(out.grads[0]->name(), "gw_reduced");
  EXPECT_EQ(out.grads[1]->name(), "gb_reduced");
  EXPECT_EQ(out.buffers[0]->name(), "rm2_synced");
  EXPECT_EQ(ir::print(*g), std::string(R"(graph:
  %w : f32[2,3] = param("fc.weight")
  %b : f32[3] = param("fc.bias")
  %rm : f32[2] = buffer("bn.running_mean")
  %x : f32[4,3] = input()
  %loss : f32[] = aten::sum.default(%x)
  %gb : f32[3] = aten::ones_like.default(%b)
  %gb_scaled : f32[3] = aten::mul.Tensor(%gb, 0.5)  # data_parallel
  %gb_all_reduce : f32[3] = _c10d_functional::all_reduce.default(%gb_scaled, "sum", "test_dp")  # data_parallel
  %gw : f32[2,3] = aten::ones_like.default(%w)
  %gw_scaled : f32[2,3] = aten::mul.Tensor(%gw, 0.5)  # data_parallel
  %gw_all_reduce : f32[2,3] = _c10d_functional::all_reduce.default(%gw_scaled, "sum", "test_dp")  # data_parallel
  %rm2 : f32[2] = aten::mul.Tensor(%rm, 0.9)
  %rm2_broadcast : f32[2] = _c10d_functional::broadcast.default(%rm2, 0, "test_dp")  # data_parallel
  %gw_reduced : f32[2,3] = _c10d_functional::wait_tensor.default(%gw_all_reduce)  # data_parallel
  %gb_reduced : f32[3] = _c10d_functional::wait_tensor.default(%gb_all_reduce)  # data_parallel
  %rm2_synced : f32[2] = _c10d_functional::wait_tensor.default(%rm2_broadcast)  # data_parallel
  return (%rm2, %loss, %gw, %gb)
)"));
}

TEST(AllReduceGrads, RefusesABadSpecAndLeavesTheGraph) {
  auto g = ir::parse(kJoint);
  const std::string before = ir::print(*g);
  const std::vector<ir::Node*> grads{g->find("gw")};
  EXPECT_NE(error_of([&] { passes::all_reduce_grads(*g, {"test_dp", 2, 2, false}, grads, {}); }).find("rank 2 is outside [0, 2)"),
            std::string::npos);
  EXPECT_NE(error_of([&] { passes::all_reduce_grads(*g, {"", 2, 0, false}, grads, {}); }).find("no registered name"),
            std::string::npos);
  EXPECT_NE(error_of([&] { passes::all_reduce_grads(*g, {"test_dp", 0, 0, false}, grads, {}); }).find("world_size must be >= 1, got 0"),
            std::string::npos);
  auto other = ir::parse(kJoint);
  EXPECT_NE(error_of([&] { passes::all_reduce_grads(*g, dp(0), {other->find("gw")}, {}); }).find("gradient %gw is not a tensor of this graph"),
            std::string::npos);
  EXPECT_EQ(ir::print(*g), before);
}

TEST(ShardOptimizerState, UpdatesThisRanksShardThenAllGathers) {
  auto g = ir::parse(kJoint);
  const auto s = spec();
  auto lifted = passes::lift_optimizer_state(*g, s);
  auto updated = passes::shard_optimizer_state(*g, s, dp(1, true), {{"fc.weight", g->find("gw")}, {"fc.bias", g->find("gb")}},
                                               lifted);
  ir::verify(*g);
  std::map<std::string, std::string> names;
  for (const auto& [k, v] : updated) names[k] = v->name();
  EXPECT_EQ(names, (std::map<std::string, std::string>{{"fc.weight", "w_new"},
                                                       {"opt:fc.weight:exp_avg", "w_owned_adam_exp_avg"},
                                                       {"opt:fc.weight:exp_avg_sq", "w_owned_adam_exp_avg_sq"},
                                                       {"opt:fc.weight:step", "w_owned_adam_step"},
                                                       {"fc.bias", "b_new"}}));
  // fc.weight: 6 elements, shard 3, rank 1 owns [3, 6). fc.bias: 3 elements padded to 4, shard 2,
  // rank 1 owns [2, 4) (one real element, one zero lane).
  EXPECT_EQ(ir::print(*g), std::string(R"(graph:
  %w : f32[2,3] = param("fc.weight")
  %b : f32[3] = param("fc.bias")
  %rm : f32[2] = buffer("bn.running_mean")
  %x : f32[4,3] = input()
  %opt_fc_weight_exp_avg : f32[3] = optstate("opt:fc.weight:exp_avg")
  %opt_fc_weight_exp_avg_sq : f32[3] = optstate("opt:fc.weight:exp_avg_sq")
  %opt_fc_weight_step : f32[] = optstate("opt:fc.weight:step")
  %lr_group0 : f64[] = optstate("opt:lr:group0")
  %loss : f32[] = aten::sum.default(%x)
  %gb : f32[3] = aten::ones_like.default(%b)
  %gw : f32[2,3] = aten::ones_like.default(%w)
  %rm2 : f32[2] = aten::mul.Tensor(%rm, 0.9)
  %w_flat : f32[6] = aten::view.default(%w, [-1])  # zero
  %w_shard : f32[3] = aten::slice.Tensor(%w_flat, 0, 3, 6, 1)  # zero
  %w_owned : f32[3] = aten::clone.default(%w_shard)  # zero
  %gw_flat : f32[6] = aten::view.default(%gw, [-1])  # zero
  %gw_shard : f32[3] = aten::slice.Tensor(%gw_flat, 0, 3, 6, 1)  # zero
  %b_flat : f32[3] = aten::view.default(%b, [-1])  # zero
  %b_padded : f32[4] = aten::constant_pad_nd.default(%b_flat, [0, 1], 0.0)  # zero
  %b_shard : f32[2] = aten::slice.Tensor(%b_padded, 0, 2, 4, 1)  # zero
  %b_owned : f32[2] = aten::clone.default(%b_shard)  # zero
  %gb_flat : f32[3] = aten::view.default(%gb, [-1])  # zero
  %gb_padded : f32[4] = aten::constant_pad_nd.default(%gb_flat, [0, 1], 0.0)  # zero
  %gb_shard : f32[2] = aten::slice.Tensor(%gb_padded, 0, 2, 4, 1)  # zero
  %w_owned_adam : (f32[3], f32[3], f32[3], f32[]) = torch_ext::adam_update.default(%w_owned, %gw_shard, %opt_fc_weight_exp_avg, %opt_fc_weight_exp_avg_sq, %opt_fc_weight_step, %lr_group0, 0.9, 0.999, 1e-08, 0.0, True, False)  # optimizer
  %w_owned_adam_param : f32[3] = getitem(%w_owned_adam, 0)  # optimizer
  %w_owned_adam_exp_avg : f32[3] = getitem(%w_owned_adam, 1)  # optimizer
  %w_owned_adam_exp_avg_sq : f32[3] = getitem(%w_owned_adam, 2)  # optimizer
  %w_owned_adam_step : f32[] = getitem(%w_owned_adam, 3)  # optimizer
  %b_owned_sgd : f32[2] = torch_ext::sgd_update.default(%b_owned, %gb_shard, %lr_group0, 0.0, False)  # optimizer
  %w_all_gather : f32[6] = _c10d_functional::all_gather_into_tensor.default(%w_owned_adam_param, 2, "test_dp")  # zero
  %b_all_gather : f32[4] = _c10d_functional::all_gather_into_tensor.default(%b_owned_sgd, 2, "test_dp")  # zero
  %w_gathered : f32[6] = _c10d_functional::wait_tensor.default(%w_all_gather)  # zero
  %w_new : f32[2,3] = aten::view.default(%w_gathered, [2, 3])  # zero
  %b_gathered : f32[4] = _c10d_functional::wait_tensor.default(%b_all_gather)  # zero
  %b_unpadded : f32[3] = aten::slice.Tensor(%b_gathered, 0, 0, 3, 1)  # zero
  %b_new : f32[3] = aten::view.default(%b_unpadded, [3])  # zero
  return (%rm2, %loss, %gw, %gb)
)"));
}

// A 0-d parameter has the shape of Adam's step counter: its moments become 1-element shards, the
// step counter stays 0-d (it was reshaped with them).
TEST(ShardOptimizerState, KeepsTheStepCounterOfAScalarParameterWhole) {
  auto g = ir::parse(R"(graph:
  %s : f32[] = param("scale")
  %x : f32[4] = input()
  %loss : f32[] = aten::sum.default(%x)
  %gs : f32[] = aten::ones_like.default(%s)
  return (%loss, %gs)
)");
  passes::TrainStepSpec s;
  s.loss_output = 0;
  s.grads = {{1, "scale"}};
  s.num_groups = 1;
  s.updates = {{"scale", "adam", 0, {{"beta1", 0.9}, {"beta2", 0.999}, {"eps", 1e-8}, {"weight_decay", 0.0}},
                {{"decoupled", true}, {"maximize", false}}}};
  auto lifted = passes::lift_optimizer_state(*g, s);
  passes::shard_optimizer_state(*g, s, dp(0, true), {{"scale", g->find("gs")}}, lifted);
  ir::verify(*g);
  EXPECT_EQ(lifted.at("opt:scale:step")->type().tensor.sizes, std::vector<int64_t>{});
  EXPECT_EQ(lifted.at("opt:scale:exp_avg")->type().tensor.sizes, std::vector<int64_t>{1});
}

TEST(ShardOptimizerState, RefusesMuonAndLeavesTheGraph) {
  auto g = ir::parse(kJoint);
  const auto s = spec("muon");
  auto lifted = passes::lift_optimizer_state(*g, s);
  const std::string before = ir::print(*g);
  EXPECT_NE(error_of([&] {
              passes::shard_optimizer_state(*g, s, dp(0, true), {{"fc.weight", g->find("gw")}, {"fc.bias", g->find("gb")}},
                                            lifted);
            }).find("parameter 'fc.bias' uses Muon"),
            std::string::npos);
  EXPECT_EQ(ir::print(*g), before);
}

// The whole pipeline with data parallelism, then the scheduler: every all_reduce is issued right
// after its scaled gradient, and every wait sits right before the first reader of its result.
TEST(ScheduleCollectives, IssueEarlyWaitLate) {
  auto joint = ir::parse(kJoint);
  auto s = spec();
  s.data_parallel = dp(0);
  auto step = passes::build_train_step(*joint, s, 1);
  for (const bool donate : {false, true}) {
    auto g = step.graph->clone();
    passes::schedule(*g, donate);
    ir::verify(*g);
    g->index();
    int64_t collectives = 0;
    for (const auto& n : g->nodes()) {
      if (n->kind() != ir::NodeKind::Call || n->target().ns != "_c10d_functional") continue;
      ++collectives;
      if (n->target().name == "wait_tensor") {
        int64_t first_reader = static_cast<int64_t>(g->size());
        for (const ir::Node* u : n->users())
          if (u->kind() == ir::NodeKind::Call) first_reader = std::min(first_reader, u->index());
        // Right before its reader, or before the output when only the output reads it.
        const ir::Node* next = g->nodes()[n->index() + 1].get();
        EXPECT_TRUE(next->index() == first_reader || next->kind() == ir::NodeKind::Output ||
                    next->target().ns == "_c10d_functional")
            << n->name() << " is followed by %" << next->name() << "\n" << ir::print(*g);
        continue;
      }
      // Right after its input (the 1/world scale, itself right after the gradient, or the buffer).
      const ir::Node* prev = g->nodes()[n->index() - 1].get();
      EXPECT_EQ(prev, n->args()[0].node) << ir::print(*g);
      if (n->target().name == "all_reduce") {
        const ir::Node* grad = prev->args()[0].node;
        EXPECT_EQ(g->nodes()[prev->index() - 1].get(), grad) << ir::print(*g);
      }
    }
    EXPECT_EQ(collectives, 6);  // 2 all_reduce + 1 broadcast, 3 waits
    // gb's all-reduce stays in flight until gw's is issued (the wait is held for the next collective).
    EXPECT_GT(g->find("gb_reduced")->index(), g->find("gw_all_reduce")->index()) << ir::print(*g);
  }
}

// all_reduce's result is written by the collective until its wait, and wait_tensor returns that
// very storage: the planner must keep the buffer alive through the last reader of the wait.
TEST(PlanMemoryCollectives, AllReduceBufferLivesUntilTheWaitsLastReader) {
  auto joint = ir::parse(kJoint);
  auto s = spec();
  s.data_parallel = dp(0);
  auto step = passes::build_train_step(*joint, s, 1);
  passes::schedule(*step.graph, true);
  const ir::MemoryPlan plan = passes::plan_memory(*step.graph, true);
  std::map<const ir::Node*, int64_t> pos;
  for (size_t i = 0; i < plan.order.size(); ++i) pos[plan.order[i]] = static_cast<int64_t>(i);
  // all_reduce has no out= kernel: its buffer is a dynamic one (allocated by the op), planned all the same.
  std::vector<ir::PlannedBuffer> all = plan.buffers;
  all.insert(all.end(), plan.dynamic.begin(), plan.dynamic.end());
  int64_t checked = 0;
  for (const auto& b : all) {
    if (b.node->target().name != "all_reduce") continue;
    const ir::Node* wait = b.node->users().at(0);
    ASSERT_EQ(wait->target().name, "wait_tensor");
    for (const ir::Node* reader : wait->users())
      if (reader->kind() == ir::NodeKind::Call) EXPECT_GE(b.life.last, pos.at(reader)) << reader->name();
    EXPECT_LT(b.life.first, pos.at(wait));
    ++checked;
  }
  EXPECT_EQ(checked, 2);
  for (const auto& b : all) EXPECT_NE(b.node->target().name, "wait_tensor") << "a wait owns no storage";
}

// gloo corrupts the heap when an all-gather overlaps another collective (serialize_collectives.h):
// the all-reduce in flight is waited first, then each all-gather runs alone, its wait right after.
TEST(SerializeCollectives, AllGathersRunAloneAndTheirWaitsFollow) {
  register_fake_group();
  auto g = ir::parse(R"(graph:
  %a : f32[2] = input()
  %b : f32[2] = input()
  %ar : f32[2] = _c10d_functional::all_reduce.default(%a, "sum", "test_dp")
  %ag1 : f32[4] = _c10d_functional::all_gather_into_tensor.default(%a, 2, "test_dp")
  %ag2 : f32[4] = _c10d_functional::all_gather_into_tensor.default(%b, 2, "test_dp")
  %bc : f32[2] = _c10d_functional::broadcast.default(%b, 0, "test_dp")
  %w1 : f32[4] = _c10d_functional::wait_tensor.default(%ag1)
  %w2 : f32[4] = _c10d_functional::wait_tensor.default(%ag2)
  %war : f32[2] = _c10d_functional::wait_tensor.default(%ar)
  %wbc : f32[2] = _c10d_functional::wait_tensor.default(%bc)
  %s : f32[2] = aten::add.Tensor(%a, %b)
  return (%w1, %w2, %war, %wbc, %s)
)");
  ir::verify(*g);
  std::vector<const ir::Node*> before;
  for (const auto& n : g->nodes())
    if (n->kind() == ir::NodeKind::Call) before.push_back(n.get());
  EXPECT_EQ(passes::collective_overlap(before),
            "%ag1 (_c10d_functional::all_gather_into_tensor.default) is issued while %ar "
            "(_c10d_functional::all_reduce.default) is in flight");
  EXPECT_TRUE(passes::serialize_collectives(*g));
  ir::verify(*g);
  // The broadcast may overlap the all-reduce; it is issued after the gathers only because it
  // comes after them in the given order.
  EXPECT_EQ(ir::print(*g), std::string(R"(graph:
  %a : f32[2] = input()
  %b : f32[2] = input()
  %ar : f32[2] = _c10d_functional::all_reduce.default(%a, "sum", "test_dp")
  %war : f32[2] = _c10d_functional::wait_tensor.default(%ar)
  %ag1 : f32[4] = _c10d_functional::all_gather_into_tensor.default(%a, 2, "test_dp")
  %w1 : f32[4] = _c10d_functional::wait_tensor.default(%ag1)
  %ag2 : f32[4] = _c10d_functional::all_gather_into_tensor.default(%b, 2, "test_dp")
  %w2 : f32[4] = _c10d_functional::wait_tensor.default(%ag2)
  %bc : f32[2] = _c10d_functional::broadcast.default(%b, 0, "test_dp")
  %wbc : f32[2] = _c10d_functional::wait_tensor.default(%bc)
  %s : f32[2] = aten::add.Tensor(%a, %b)
  return (%w1, %w2, %war, %wbc, %s)
)"));
  EXPECT_FALSE(passes::serialize_collectives(*g));  // idempotent
}

// The whole ZeRO-1 pipeline: its graph order (what the executor runs) and every schedule of it
// (what the arena executor runs) keep all-gathers alone; all-reduces still overlap each other.
TEST(SerializeCollectives, TheZeroStepAndItsSchedulesNeverOverlapAnAllGather) {
  auto joint = ir::parse(kJoint);
  auto s = spec();
  s.data_parallel = dp(1, true);
  auto step = passes::build_train_step(*joint, s, 1);
  const auto calls = [](const ir::Graph& g) {
    std::vector<const ir::Node*> out;
    for (const auto& n : g.nodes())
      if (n->kind() == ir::NodeKind::Call) out.push_back(n.get());
    return out;
  };
  EXPECT_EQ(passes::collective_overlap(calls(*step.graph)), "") << ir::print(*step.graph);
  for (const bool donate : {false, true}) {
    auto g = step.graph->clone();
    passes::schedule(*g, donate);
    ir::verify(*g);
    EXPECT_EQ(passes::collective_overlap(calls(*g)), "") << ir::print(*g);
    const ir::MemoryPlan plan = passes::plan_memory(*g, donate);
    EXPECT_EQ(passes::collective_overlap(plan.order), "");
  }
}
