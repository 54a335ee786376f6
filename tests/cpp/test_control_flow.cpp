// cond / while_loop regions: verifier signatures, the executor and the reactive engine on text IR.
#include "ir/higher_order.h"
#include "ir/parser.h"
#include "ir/verifier.h"
#include "reactive/engine.h"
#include "runtime/executor.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "test_util.h"

using namespace torch_ext;
using torch_ext::testing::error_of;

namespace {
const char* kCond = R"(graph:
  %x : f32[3] = input()
  %s : f32[] = aten::sum.default(%x)
  %p : b8[] = aten::gt.Scalar(%s, 0)
  %c : (f32[3]) = higher_order::cond.default(%p, [%x]) {
    graph:
      %a : f32[3] = input()
      %r : f32[3] = aten::relu.default(%a)
      return (%r)
  } {
    graph:
      %a : f32[3] = input()
      %n : f32[3] = aten::neg.default(%a)
      return (%n)
  }
  %g : f32[3] = getitem(%c, 0)
  %o : f32[3] = aten::mul.Tensor(%g, 2)
  return (%o)
)";

const char* kLoop = R"(graph:
  %i : i64[] = input()
  %x : f32[2] = input()
  %w : (i64[], f32[2]) = higher_order::while_loop.default([%i, %x], []) {
    graph:
      %j : i64[] = input()
      %v : f32[2] = input()
      %c : b8[] = aten::lt.Scalar(%j, 5)
      return (%c)
  } {
    graph:
      %j : i64[] = input()
      %v : f32[2] = input()
      %j2 : i64[] = aten::add.Tensor(%j, 1)
      %v2 : f32[2] = aten::mul.Tensor(%v, 2)
      return (%j2, %v2)
  }
  %n : i64[] = getitem(%w, 0)
  %y : f32[2] = getitem(%w, 1)
  return (%n, %y)
)";

// `text` with its one occurrence of `from` replaced by `to`.
std::string swap(std::string text, const std::string& from, const std::string& to) {
  const size_t at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return at == std::string::npos ? text : text.replace(at, from.size(), to);
}
}  // namespace

TEST(ControlFlow, CondRunsOnlyTheChosenBranch) {
  auto g = ir::parse(kCond);
  ir::verify(*g);
  runtime::Executor ex(*g);
  at::Tensor pos = at::tensor({1.0f, -2.0f, 3.0f});
  EXPECT_TRUE(at::equal(ex.run({pos})[0].toTensor(), at::relu(pos) * 2));
  at::Tensor neg = at::tensor({-1.0f, -2.0f, 1.0f});
  EXPECT_TRUE(at::equal(ex.run({neg})[0].toTensor(), -neg * 2));
}

TEST(ControlFlow, WhileLoopIteratesUntilTheConditionFails) {
  auto g = ir::parse(kLoop);
  ir::verify(*g);
  runtime::Executor ex(*g);
  auto out = ex.run({at::scalar_tensor(2, at::kLong), at::ones({2})});
  EXPECT_EQ(out[0].toTensor().item<int64_t>(), 5);
  EXPECT_TRUE(at::equal(out[1].toTensor(), at::full({2}, 8.0f)));
}

TEST(ControlFlow, ReactiveCondIsOneUnitAndFlipsBranches) {
  auto g = ir::parse(kCond);
  reactive::Engine e(*g);
  at::Tensor x = at::tensor({1.0f, -2.0f, 3.0f});
  e.run({x});
  EXPECT_EQ(e.stats().evaluations, 5);  // s, p, c (once, whatever its region holds), g, o
  e.reset_stats();
  e.patch("p", at::scalar_tensor(false, at::kBool));
  auto out = e.demand();
  EXPECT_EQ(e.stats().evaluations, 3);  // c, g, o
  EXPECT_TRUE(at::equal(out[0].toTensor(), -x * 2));
  e.restore();
  EXPECT_TRUE(at::equal(e.demand()[0].toTensor(), at::relu(x) * 2));
  e.check_invariants();
}

TEST(ControlFlow, VerifierChecksRegionSignatures) {
  std::string bad = swap(kCond, "%n : f32[3] = aten::neg.default(%a)", "%n : f32[] = aten::sum.default(%a)");
  auto g = ir::parse(bad);
  auto msg = error_of([&] { ir::verify(*g); });
  EXPECT_NE(msg.find("branches return different types: true (f32[3]), false (f32[])"), std::string::npos) << msg;
  std::string loop = swap(kLoop, "%v2 : f32[2] = aten::mul.Tensor(%v, 2)", "%v2 : f32[4] = aten::cat.default([%v, %v])");
  auto l = ir::parse(loop);
  msg = error_of([&] { ir::verify(*l); });
  EXPECT_NE(msg.find("loop body changes the carried values from (i64[], f32[2]) to (i64[], f32[4])"), std::string::npos)
      << msg;
}

namespace {
struct HopCase {
  std::string text;
  std::string error;  // empty: the text verifies
};

// Per entry of the higher-order op table: a valid use, then malformed ones (argument layout,
// then each region signature).
std::map<std::string, std::vector<HopCase>> hop_cases() {
  return {
      {"cond",
       {{kCond, ""},
        {swap(kCond, "(%p, [%x])", "(%p, %x)"), "node %c (higher_order::cond.default): cond operands must be a list"},
        {swap(kCond, "%p : b8[] = aten::gt.Scalar(%s, 0)", "%p : f32[3] = aten::relu.default(%x)"),
         "predicate %p of type f32[3] must be a bool or a one-element tensor"},
        {swap(kCond, "%a : f32[3] = input()\n      %r", "%a : f32[2] = input()\n      %r"),
         "true branch takes (f32[2]) but the operands are (f32[3])"},
        {swap(kCond, "%n : f32[3] = aten::neg.default(%a)", "%n : f32[] = aten::sum.default(%a)"),
         "branches return different types: true (f32[3]), false (f32[])"},
        {swap(kCond, "%c : (f32[3]) = higher_order", "%c : (f32[1]) = higher_order"),
         "node type (f32[1]) differs from the branches' outputs (f32[3])"}}},
      {"while_loop",
       {{kLoop, ""},
        {swap(kLoop, "([%i, %x], [])", "([%i, %x])"),
         "node %w (higher_order::while_loop.default): while_loop takes ([carried], [additional]) and two regions"},
        {swap(kLoop, "([%i, %x], [])", "(%i, [])"), "while_loop carried values must be a list"},
        {swap(kLoop, "%j : i64[] = input()\n      %v : f32[2] = input()\n      %c",
              "%j : f32[] = input()\n      %v : f32[2] = input()\n      %c"),
         "loop regions must take the carried and additional values (i64[], f32[2])"},
        {swap(kLoop, "%c : b8[] = aten::lt.Scalar(%j, 5)\n      return (%c)",
              "%c : b8[] = aten::lt.Scalar(%j, 5)\n      return (%c, %c)"),
         "loop condition must return one b8[] scalar, got (b8[], b8[])"},
        {swap(kLoop, "%v2 : f32[2] = aten::mul.Tensor(%v, 2)", "%v2 : f32[4] = aten::cat.default([%v, %v])"),
         "loop body changes the carried values from (i64[], f32[2]) to (i64[], f32[4])"}}},
  };
}
}  // namespace

TEST(HigherOrderTable, EveryEntryVerifiesItsRegionsAndRejectsMalformedOnes) {
  const auto all = hop_cases();
  for (const ir::HigherOrderOp& op : ir::higher_order_ops()) {
    SCOPED_TRACE(op.name);
    auto it = all.find(op.name);
    ASSERT_NE(it, all.end()) << "table entry " << op.name << " has no verifier cases";
    ASSERT_GE(it->second.size(), 3u);
    for (const HopCase& c : it->second) {
      auto g = ir::parse(c.text);
      if (c.error.empty()) {
        EXPECT_TRUE(ir::verify_errors(*g).empty()) << c.text;
        continue;
      }
      const std::string msg = error_of([&] { ir::verify(*g); });
      EXPECT_NE(msg.find(c.error), std::string::npos) << msg;
    }
  }
  EXPECT_EQ(all.size(), ir::higher_order_ops().size());
}

TEST(HigherOrderTable, WrongRegionCountIsALayoutError) {
  // cond without its false branch.
  auto g = ir::parse(swap(kCond,
                          "} {\n    graph:\n      %a : f32[3] = input()\n"
                          "      %n : f32[3] = aten::neg.default(%a)\n      return (%n)\n  }",
                          "}"));
  EXPECT_EQ(g->find("c")->regions().size(), 1u);
  const std::string msg = error_of([&] { ir::verify(*g); });
  EXPECT_NE(msg.find("node %c (higher_order::cond.default): cond takes (%pred, [operands]) and two regions"),
            std::string::npos)
      << msg;
}

TEST(HigherOrderTable, LookupsAndNames) {
  EXPECT_EQ(ir::higher_order_names(), "cond and while_loop");
  const ir::HigherOrderOp* cond = ir::find_higher_order({"higher_order", "cond", "default"});
  ASSERT_NE(cond, nullptr);
  EXPECT_STREQ(cond->name, "cond");
  EXPECT_EQ(cond->num_regions, 2u);
  EXPECT_EQ(ir::find_higher_order({"higher_order", "scan", "default"}), nullptr);
  EXPECT_EQ(ir::find_higher_order({"aten", "cond", "default"}), nullptr);
  EXPECT_TRUE(ir::is_higher_order({"higher_order", "scan", "default"}));
  EXPECT_FALSE(ir::is_higher_order({"aten", "relu", "default"}));
  for (const ir::HigherOrderOp& op : ir::higher_order_ops()) {
    // The FX layout places every argument and region exactly once.
    std::vector<int> args(op.args.size()), regions(op.num_regions);
    for (const ir::FxArg& a : op.fx_args) ++(a.kind == ir::FxArg::Kind::Arg ? args : regions).at(a.index);
    EXPECT_EQ(args, std::vector<int>(op.args.size(), 1)) << op.name;
    EXPECT_EQ(regions, std::vector<int>(op.num_regions, 1)) << op.name;
  }
}

TEST(HigherOrderTable, UnknownOpsAndRegionsOnOrdinaryOpsAreRejected) {
  auto g = ir::parse(swap(kCond, "higher_order::cond.default", "higher_order::scan.default"));
  std::string msg = error_of([&] { ir::verify(*g); });
  EXPECT_NE(msg.find("node %c (higher_order::scan.default): unknown higher-order operator"), std::string::npos) << msg;
  g = ir::parse(swap(kCond, "higher_order::cond.default", "aten::relu.default"));
  msg = error_of([&] { ir::verify(*g); });
  EXPECT_NE(msg.find("node %c: only higher_order::cond and while_loop own regions, not aten::relu.default"),
            std::string::npos)
      << msg;
}

TEST(HigherOrderTable, TheBinderTakesArgumentKindsFromTheTable) {
  // A constant predicate passes the verifier (it has no type to check) but cannot be bound.
  auto g = ir::parse(swap(kCond, "(%p, [%x])", "(True, [%x])"));
  const std::string msg = error_of([&] { runtime::Executor ex(*g); });
  EXPECT_NE(msg.find("node %c (higher_order::cond.default): the predicate must be a graph value"), std::string::npos)
      << msg;
}
