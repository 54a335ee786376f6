// Out= and in-place lowering (passes/lower_out_variants.h): text IR in, the plan, checked text out;
// the arena executor consuming the plan and the lowered graph.
#include "ir/out_variant.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/lower_out_variants.h"
#include "passes/plan_memory.h"
#include "runtime/arena_executor.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;
using torch_ext::testing::out_kernel_chain;

namespace {

const char* kStep = R"(graph:
  %x : f32[256] = input()
  %w : f32[256] = param("w")
  %lr : f64[] = optstate("opt:lr:group0")
  %a : f32[256] = aten::mul.Tensor(%x, %w)
  %r : f32[256] = aten::relu.default(%a)
  %g : f32[256] = aten::mul.Tensor(%r, %a)
  %u : f32[256] = torch_ext::sgd_update.default(%w, %g, %lr, 0.0, False)
  %loss : f32[] = aten::sum.default(%r)
  return (%loss, %u)
)";

// `text` with each `from` replaced by its `to` (each must occur once): the expected output of a
// lowering that changes those targets and nothing else.
std::string with_targets(std::string text, const std::vector<std::pair<std::string, std::string>>& edits) {
  for (const auto& [from, to] : edits) {
    const size_t at = text.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    EXPECT_EQ(text.find(from, at + 1), std::string::npos) << from;
    if (at != std::string::npos) text.replace(at, from.size(), to);
  }
  return text;
}

std::string lowered_text(ir::Graph& g, const ir::MemoryPlan& plan) {
  passes::lower_out_variants(g, plan);
  return ir::print(g);
}

}  // namespace

TEST(LowerOutVariants, GoldenOutAndInPlace) {
  auto g = ir::parse(kStep);
  const ir::MemoryPlan plan = passes::plan_memory(*g, /*donate=*/true);
  const auto r = passes::lower_out_variants(*g, plan);
  EXPECT_EQ(r.inplace, 1);
  // %a and %g write into the arena through mul.out; relu.out on CPU is the generated
  // functional-then-copy wrapper (find_out_variant refuses it) and %loss escapes: unchanged.
  EXPECT_EQ(ir::print(*g), with_targets(kStep, {{"%a : f32[256] = aten::mul.Tensor", "%a : f32[256] = aten::mul.out"},
                                                {"%g : f32[256] = aten::mul.Tensor", "%g : f32[256] = aten::mul.out"},
                                                {"sgd_update.default", "sgd_update_.default"}}));
  EXPECT_EQ(r.out_variants, 2);
}

TEST(LowerOutVariants, WithoutDonationNothingRunsInPlace) {
  auto g = ir::parse(kStep);
  const ir::MemoryPlan plan = passes::plan_memory(*g, /*donate=*/false);
  const std::string text = lowered_text(*g, plan);
  EXPECT_NE(text.find("torch_ext::sgd_update.default(%w, %g, %lr, 0.0, False)"), std::string::npos) << text;
  EXPECT_EQ(text.find("sgd_update_"), std::string::npos) << text;
}

TEST(LowerOutVariants, RefusesAPlanOfAnotherGraphAndLeavesTheGraphUntouched) {
  auto g = ir::parse(kStep);
  auto other = ir::parse(kStep);
  const ir::MemoryPlan plan = passes::plan_memory(*other, true);
  const std::string before = ir::print(*g);
  EXPECT_NE(error_of([&] { passes::lower_out_variants(*g, plan); }).find("the plan's node %a is not in this graph"),
            std::string::npos);
  EXPECT_EQ(ir::print(*g), before);
}

TEST(LowerOutVariants, RefusesAnArenaNodeWithoutOutOverload) {
  auto g = ir::parse(kStep);
  ir::MemoryPlan plan = passes::plan_memory(*g, true);
  plan.buffers.push_back(ir::PlannedBuffer{g->find("r"), -1, {1024, 1, 3}});  // relu: no out= kernel of its own
  plan.arena.offsets.push_back(plan.arena.arena_bytes);
  const std::string before = ir::print(*g);
  EXPECT_NE(error_of([&] { passes::lower_out_variants(*g, plan); })
                .find("node %r (aten::relu.default) has arena buffers but no out= overload"),
            std::string::npos);
  EXPECT_EQ(ir::print(*g), before);
}

TEST(InplaceVariant, FoundBySchemaNotByName) {
  auto g = ir::parse(R"(graph:
  %w : f32[4] = param("w")
  %m : f32[4] = optstate("opt:w:momentum_buffer")
  %s : f32[] = optstate("opt:w:step")
  %lr : f64[] = optstate("opt:lr:group0")
  %x : f32[4] = input()
  %add : f32[4] = aten::add.Tensor(%x, %w)
  %neg : f32[4] = aten::neg.default(%x)
  %dot : f32[] = aten::dot.default(%x, %x)
  %u : (f32[4], f32[4], f32[]) = torch_ext::sgd_momentum_update.default(%w, %add, %m, %s, %lr, 0.9, 0.0, 0.0, False, False)
  return (%u)
)");
  auto of = [&](const char* n) { return ir::find_inplace_variant(*g->find(n)); };
  ASSERT_TRUE(of("u").has_value());
  EXPECT_EQ(of("u")->op.operator_name().name, "torch_ext::sgd_momentum_update_");
  EXPECT_EQ(of("u")->written_args, (std::vector<size_t>{0, 2, 3}));  // param, momentum_buffer, step
  ASSERT_TRUE(of("add").has_value());  // aten::sub_.Tensor has the same arguments: the name decides
  EXPECT_EQ(of("add")->op.operator_name().name, "aten::add_");
  ASSERT_TRUE(of("neg").has_value());  // over aten::negative_ and every other unary in-place op
  EXPECT_EQ(of("neg")->op.operator_name().name, "aten::neg_");
  EXPECT_FALSE(of("dot").has_value());  // dot has no in-place variant
  EXPECT_FALSE(of("w").has_value());   // not a call
}

TEST(ArenaExecutor, ConsumesThePlanAndTheLoweredGraphBitExact) {
  for (const bool donate : {true, false}) {
    auto g = ir::parse(kStep);
    runtime::Executor plain(*g);
    auto lowered = g->clone();
    ir::MemoryPlan plan = passes::plan_memory(*lowered, donate);
    passes::lower_out_variants(*lowered, plan);
    runtime::ArenaExecutor ex(std::move(lowered), std::move(plan), /*num_state=*/0, donate);
    EXPECT_EQ(ex.num_out_variant(), 2);
    EXPECT_EQ(ex.num_inplace_updates(), donate ? 1 : 0);
    at::manual_seed(0);
    at::Tensor w = at::randn({256}), x = at::randn({256});
    at::Tensor lr = at::scalar_tensor(0.1, at::kDouble);
    auto want = plain.run({x, w.clone(), lr});
    at::Tensor wd = w.clone();
    auto got = ex.run({x, wd, lr});
    EXPECT_TRUE(at::equal(got[0].toTensor(), want[0].toTensor()));
    EXPECT_TRUE(at::equal(got[1].toTensor(), want[1].toTensor()));
    // With donation the update overwrote the parameter it was given.
    EXPECT_EQ(got[1].toTensor().data_ptr() == wd.data_ptr(), donate);
  }
}

TEST(ArenaExecutor, RefusesAnUnloweredGraphOrAPlanOfAnotherGraph) {
  auto g = ir::parse(kStep);
  ir::MemoryPlan plan = passes::plan_memory(*g, true);
  EXPECT_NE(error_of([&] { runtime::ArenaExecutor ex(g->clone(), plan, 1, true); })
                .find("is not in the graph it was given"),
            std::string::npos);
  EXPECT_NE(error_of([&] { runtime::ArenaExecutor ex(std::move(g), plan, 1, true); })
                .find("the plan puts node %a (aten::mul.Tensor) in the arena or in place, but the graph is not lowered"),
            std::string::npos);
}

// An out= kernel that uses its result as scratch of another shape (torch 2.9's CPU mse_loss.out resizes `out` to the
// input's shape before reducing into it): given an arena view, which cannot grow, it threw "Trying to resize storage
// that is not resizable". The arena checks every out= call and runs the functional kernel instead, from then on.
TEST(ArenaExecutor, AnOutKernelThatResizesItsResultRunsTheFunctionalKernel) {
  const char* text = R"(graph:
  %x : f32[16] = input()
  %y : f32[16] = input()
  %l : f32[] = aten::mse_loss.default(%x, %y, 1)
  %s : f32[] = aten::mul.Tensor(%l, %l)
  return (%s)
)";
  auto g = ir::parse(text);
  runtime::Executor plain(*g);
  auto lowered = g->clone();
  ir::MemoryPlan plan = passes::plan_memory(*lowered, /*donate=*/false);
  passes::lower_out_variants(*lowered, plan);
  // find_out_variant leaves mse_loss out of the arena; put it there by hand, as a plan for any op might.
  ir::Node* l = lowered->find("l");
  ASSERT_TRUE(plan.buffers.empty());
  plan.buffers.push_back(ir::PlannedBuffer{l, -1, {64, 0, 1}});
  plan.arena.offsets.push_back(0);
  plan.arena.arena_bytes = 64;
  lowered->set_target(l, ir::Target::parse("aten::mse_loss.out"));
  runtime::ArenaExecutor ex(std::move(lowered), std::move(plan), /*num_state=*/0, /*donate=*/false);
  EXPECT_EQ(ex.num_out_variant(), 1);
  EXPECT_EQ(ex.fallbacks(), (std::vector<std::string>{"s"}));  // an output: allocated by its kernel
  at::manual_seed(0);
  for (int call = 0; call < 2; ++call) {
    at::Tensor x = at::randn({16}), y = at::randn({16});
    auto want = plain.run({x, y});
    auto got = ex.run({x, y});
    EXPECT_TRUE(at::equal(got[0].toTensor(), want[0].toTensor())) << call;
    EXPECT_EQ(ex.fallbacks(), (std::vector<std::string>{"s", "l"})) << call;  // once, from the first call on
  }
}

// A node whose out= kernel falls back at run time (see above) allocates its result from then on: the plan the
// executor reports counts that allocation in dynamic_bytes (it was left out: the peak understated what ran),
// and later plans leave the operator to its kernel (no arena buffer that would stay unused).
TEST(ArenaExecutor, AnOutKernelThatFallsBackIsCountedAndNotPlannedAgain) {
  for (const char* op : {"arena_sq_sum_resizing", "arena_sq_sum_repointing"}) {
    const std::string text = out_kernel_chain(op);
    auto g = ir::parse(text);
    runtime::Executor plain(*g);
    auto lowered = g->clone();
    ir::MemoryPlan plan = passes::plan_memory(*lowered, /*donate=*/false);
    ir::Node* l = lowered->find("l");
    const auto in_arena = [&](const ir::MemoryPlan& p, const ir::Node* n) {
      return std::any_of(p.buffers.begin(), p.buffers.end(), [&](const ir::PlannedBuffer& b) { return b.node == n; });
    };
    const auto dynamic_of = [](const ir::MemoryPlan& p, const ir::Node* n) {
      return std::count_if(p.dynamic.begin(), p.dynamic.end(), [&](const ir::PlannedBuffer& b) { return b.node == n; });
    };
    ASSERT_TRUE(in_arena(plan, l)) << op;  // its out= overload has a kernel of its own
    ASSERT_EQ(dynamic_of(plan, l), 0) << op;
    passes::lower_out_variants(*lowered, plan);
    runtime::ArenaExecutor ex(std::move(lowered), plan, /*num_state=*/0, /*donate=*/false);
    const int64_t dynamic_before = ex.plan().dynamic_bytes;
    at::manual_seed(0);
    for (int call = 0; call < 2; ++call) {
      const at::Tensor x = at::randn({16});
      EXPECT_TRUE(at::equal(ex.run({x})[0].toTensor(), plain.run({x})[0].toTensor())) << op << " " << call;
      EXPECT_EQ(ex.fallbacks().back(), "l") << op;
      // Counted once: l's result (4 bytes, aligned to 64) is live with a's... as the planner counts it.
      const ir::Node* pl = ex.graph().find("l");
      EXPECT_EQ(dynamic_of(ex.plan(), pl), 1) << op;
      std::vector<ir::BufferLife> lives;
      for (const auto& b : ex.plan().dynamic) lives.push_back(b.life);
      EXPECT_EQ(ex.plan().dynamic_bytes, ir::lower_bound_bytes(lives)) << op;
      EXPECT_GE(ex.plan().dynamic_bytes, dynamic_before + ir::align_up(4)) << op;
      EXPECT_EQ(ex.plan().peak_bytes(), plan.peak_bytes() + ex.plan().dynamic_bytes - dynamic_before) << op;
    }
    // A later plan of the same graph leaves it to its kernel.
    auto again = ir::parse(text);
    const ir::MemoryPlan later = passes::plan_memory(*again, /*donate=*/false);
    EXPECT_FALSE(in_arena(later, again->find("l"))) << op;
    EXPECT_EQ(dynamic_of(later, again->find("l")), 1) << op;
  }
}
