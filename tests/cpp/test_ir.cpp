// IR building, printer/parser round trip, verifier negative cases.
#include "ir/graph.h"
#include "ir/parser.h"
#include "ir/printer.h"
#include "ir/verifier.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "test_util.h"

using namespace torch_ext::ir;
using torch_ext::testing::error_of;

namespace {

Type f32(std::vector<int64_t> sizes) {
  TensorMeta m;
  m.sizes = std::move(sizes);
  return Type::make_tensor(m);
}

const char* kMlp = R"(graph:
  %x : f32[8,16] = input()
  %w : f32[4,16] = param("fc.weight")
  %b : f32[4] = param("fc.bias")
  %linear : f32[8,4] = aten::linear.default(%x, %w, %b)  # fc
  %relu : f32[8,4] = aten::relu.default(%linear)
  %topk : (f32[8,2], i64[8,2]) = aten::topk.default(%relu, 2, dim=-1, largest=True)
  %getitem : f32[8,2] = getitem(%topk, 0)
  %sum : f32[8] = aten::sum.dim_IntList(%getitem, [1], False, dtype=torch.float32)
  %t : f32[4,8]{1,4} = aten::t.default(%relu)
  return (%sum, %t, None)
)";


}  // namespace

TEST(IrBuild, UseListsFollowEdits) {
  Graph g;
  Node* x = g.create_placeholder("x", InputRole::UserInput, f32({2}));
  Node* r = g.create_call("relu", Target::parse("aten::relu.default"), {Arg::of_node(x)}, {}, f32({2}));
  Node* s = g.create_call("sigmoid", Target::parse("aten::sigmoid.default"), {Arg::of_node(x)}, {}, f32({2}));
  Node* add = g.create_call("add", Target::parse("aten::add.Tensor"), {Arg::of_node(r), Arg::of_node(r)}, {},
                            f32({2}));
  g.create_output({Arg::of_node(add)});
  EXPECT_EQ(x->users(), (std::vector<Node*>{r, s}));
  EXPECT_EQ(r->users(), (std::vector<Node*>{add}));  // one entry even for two uses
  g.replace_input_of(add, r, s);
  EXPECT_TRUE(r->users().empty());
  EXPECT_EQ(s->users(), (std::vector<Node*>{add}));
  g.erase(r);
  EXPECT_EQ(g.find("relu"), nullptr);
  EXPECT_EQ(x->users(), (std::vector<Node*>{s}));
  verify(g);
  // A node with users cannot be erased.
  EXPECT_NE(error_of([&] { g.erase(s); }).find("still has 1 user"), std::string::npos);
  // New calls land before the output node.
  Node* neg = g.create_call(g.unique_name("add"), Target::parse("aten::neg.default"), {Arg::of_node(add)}, {},
                            f32({2}));
  EXPECT_EQ(neg->name(), "add_1");
  EXPECT_EQ(g.nodes().back()->kind(), NodeKind::Output);
  g.replace_all_uses_with(add, neg, neg);
  EXPECT_EQ(g.output()->inputs(), (std::vector<Node*>{neg}));
  verify(g);
}

TEST(IrBuild, EraseAllIsAtomicAndMoveBeforeKeepsIndices) {
  auto g = parse(kMlp);
  Node* relu = g->find("relu");
  Node* t = g->find("t");
  Node* topk = g->find("topk");
  // Refused: topk's user getitem is not erased with it; nothing changes.
  const std::string before = print(*g);
  EXPECT_NE(error_of([&] { g->erase_all({topk}); }).find("its user '%getitem' is not erased with it"),
            std::string::npos);
  EXPECT_EQ(print(*g), before);
  // Moving t back (before topk) and forward again (before the output), which stays topological,
  // keeps every index equal to its position.
  g->move_before(t, topk);
  for (size_t i = 0; i < g->nodes().size(); ++i) EXPECT_EQ(g->nodes()[i]->index(), static_cast<int64_t>(i));
  EXPECT_EQ(g->nodes()[5]->name(), "t");
  EXPECT_EQ(g->nodes()[6]->name(), "topk");
  verify(*g);
  g->move_before(t, g->output());
  for (size_t i = 0; i < g->nodes().size(); ++i) EXPECT_EQ(g->nodes()[i]->index(), static_cast<int64_t>(i));
  EXPECT_EQ(print(*g), before);
  // A whole dead chain goes in one call; survivors lose exactly those users.
  g->set_output({Arg::of_node(t)});
  g->erase_all({g->find("sum"), g->find("getitem"), topk});
  EXPECT_EQ(relu->users(), (std::vector<Node*>{t}));
  EXPECT_EQ(g->find("topk"), nullptr);
  for (size_t i = 0; i < g->nodes().size(); ++i) EXPECT_EQ(g->nodes()[i]->index(), static_cast<int64_t>(i));
  verify(*g);
}

TEST(IrBuild, CloneIsDeepAndPrintsTheSame) {
  auto g = parse(kMlp);
  auto c = g->clone();
  EXPECT_EQ(print(*g), print(*c));
  EXPECT_NE(c->find("relu"), g->find("relu"));
  EXPECT_EQ(c->find("relu")->owner(), c.get());
  verify(*c);
}

TEST(IrText, RoundTripIsExact) {
  auto g = parse(kMlp);
  EXPECT_EQ(print(*g), kMlp);
  verify(*g);
  EXPECT_EQ(g->find("linear")->module_path(), "fc");
  EXPECT_EQ(g->find("w")->role(), InputRole::Parameter);
  EXPECT_EQ(g->find("w")->state_name(), "fc.weight");
  EXPECT_FALSE(g->find("t")->type().tensor.is_contiguous());
}

TEST(IrText, FloatsAndConstantsRoundTrip) {
  const char* text = R"(graph:
  %x : f32[3] = input()
  %a : f32[3] = aten::add.Scalar(%x, 0.1)
  %b : f32[3] = aten::mul.Scalar(%a, 1e-05)
  %c : f32[3] = aten::clamp.default(%b, -inf, inf)
  %d : f64[3] = aten::to.dtype(%c, torch.float64)
  %e : f32[3]@cuda:0 = aten::to.device(%c, device("cuda:0"), torch.float32)
  %s : f32[3] = aten::div.Tensor_mode(%c, %c, rounding_mode="floor")
  %m : f32[3] = aten::clone.default(%c, memory_format=torch.contiguous_format)
  %n : f32[3] = aten::mul.Scalar(%m, 3.0000000000000004)
  return (%d, %e, %s, %n)
)";
  auto g = parse(text);
  EXPECT_EQ(print(*g), text);
  EXPECT_EQ(format_double(0.1), "0.1");
  EXPECT_EQ(format_double(2.0), "2.0");
  EXPECT_EQ(format_double(1e300), "1e+300");
}

TEST(IrText, RegionsRoundTrip) {
  const char* text = R"(graph:
  %p : b8[] = input()
  %x : f32[2] = input()
  %c : (f32[2]) = higher_order::cond.default(%p, [%x]) {
    graph:
      %a : f32[2] = input()
      %r : f32[2] = aten::relu.default(%a)
      return (%r)
  } {
    graph:
      %a : f32[2] = input()
      %n : f32[2] = aten::neg.default(%a)
      return (%n)
  }
  %g : f32[2] = getitem(%c, 0)
  return (%g)
)";
  auto g = parse(text);
  EXPECT_EQ(print(*g), text);
  EXPECT_EQ(g->find("c")->regions().size(), 2u);
  EXPECT_EQ(print(*g->clone()), text);
}

TEST(IrText, ParseErrorsNameTheLine) {
  EXPECT_NE(error_of([] { parse("graph:\n  %y : f32[2] = aten::relu.default(%x)\n  return (%y)\n"); })
                .find("line 2, column"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse("graph:\n  %x : q32[2] = input()\n  return (%x)\n"); }).find("unknown type 'q32'"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse("graph:\n  %x : f32[2] = input()\n"); }).find("no return"), std::string::npos);
  EXPECT_NE(error_of([] { parse("graph:\n  %x : f32[2] = input()\n  %x : f32[2] = input()\n  return (%x)\n"); })
                .find("redefinition of %x"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse("graph:\n  %x : f32[2] = input(\"unterminated)\n  return (%x)\n"); })
                .find("unterminated string"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse("graph:\n  %x : f32[2] = aten_relu(%x)\n  return (%x)\n"); })
                .find("malformed op target"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse("nonsense"); }).find("expected 'graph:'"), std::string::npos);
  EXPECT_NE(error_of([] { parse(std::string(kMlp) + "trailing"); }).find("unexpected text"), std::string::npos);
}

TEST(IrVerify, RejectsCycle) {
  auto g = parse("graph:\n  %x : f32[2] = input()\n  %a : f32[2] = aten::relu.default(%x)\n"
                 "  %b : f32[2] = aten::neg.default(%a)\n  return (%b)\n");
  Node* a = g->find("a");
  Node* b = g->find("b");
  g->set_args(a, {Arg::of_node(b)}, {});
  auto msg = error_of([&] { verify(*g); });
  EXPECT_NE(msg.find("node %a: uses %b before it is defined"), std::string::npos) << msg;
}

TEST(IrVerify, RejectsWrongArity) {
  auto g = parse("graph:\n  %x : f32[2] = input()\n  %a : f32[2] = aten::relu.default(%x, %x)\n  return (%a)\n");
  auto msg = error_of([&] { verify(*g); });
  EXPECT_NE(msg.find("node %a (aten::relu.default): takes at most 1 positional args, got 2"), std::string::npos) << msg;

  auto missing = parse("graph:\n  %x : f32[2] = input()\n  %a : f32[2] = aten::add.Tensor(%x)\n  return (%a)\n");
  msg = error_of([&] { verify(*missing); });
  EXPECT_NE(msg.find("missing required argument 'other'"), std::string::npos) << msg;

  auto kw = parse("graph:\n  %x : f32[2] = input()\n  %a : f32[2] = aten::relu.default(%x, bogus=1)\n  return (%a)\n");
  msg = error_of([&] { verify(*kw); });
  EXPECT_NE(msg.find("unknown keyword argument 'bogus'"), std::string::npos) << msg;
}

TEST(IrVerify, RejectsUnknownOp) {
  auto g = parse("graph:\n  %x : f32[2] = input()\n  %a : f32[2] = aten::no_such_op.default(%x)\n  return (%a)\n");
  auto msg = error_of([&] { verify(*g); });
  EXPECT_NE(msg.find("node %a (aten::no_such_op.default): unknown operator"), std::string::npos) << msg;
}

namespace torch_ext::ir {
struct GraphTestPeer {
  static void add_bogus_user(Node* n, Node* user) { n->users_.push_back(user); }
  static void drop_users(Node* n) { n->users_.clear(); }
};
}  // namespace torch_ext::ir

TEST(IrVerify, RejectsDanglingUse) {
  auto g = parse("graph:\n  %x : f32[2] = input()\n  %a : f32[2] = aten::relu.default(%x)\n"
                 "  %b : f32[2] = aten::neg.default(%x)\n  return (%a, %b)\n");
  GraphTestPeer::add_bogus_user(g->find("a"), g->find("b"));
  auto msg = error_of([&] { verify(*g); });
  EXPECT_NE(msg.find("node %a: use list names %b, which does not use it (dangling use)"), std::string::npos) << msg;
  GraphTestPeer::drop_users(g->find("x"));
  msg = error_of([&] { verify(*g); });
  EXPECT_NE(msg.find("node %a: missing from the use list of %x"), std::string::npos) << msg;
}

TEST(IrVerify, RejectsBadGetitemAndCrossGraphEdges) {
  auto g = parse("graph:\n  %x : f32[2] = input()\n  %t : (f32[1], i64[1]) = aten::topk.default(%x, 1)\n"
                 "  %a : f32[1] = getitem(%t, 2)\n  %b : f32[2] = getitem(%x, 0)\n  return (%a, %b)\n");
  auto msg = error_of([&] { verify(*g); });
  EXPECT_NE(msg.find("index 2 out of range for a tuple of 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("getitem source %x is not a tuple"), std::string::npos) << msg;

  Graph other;
  Node* y = other.create_placeholder("y", InputRole::UserInput, f32({2}));
  Graph h;
  Node* x = h.create_placeholder("x", InputRole::UserInput, f32({2}));
  Node* r = h.create_call("r", Target::parse("aten::relu.default"), {Arg::of_node(x)}, {}, f32({2}));
  h.create_output({Arg::of_node(r)});
  // Cross-graph edges are refused at edit time, leaving the graph unchanged.
  const std::string before = print(h);
  auto cross = error_of([&] { h.set_args(r, {Arg::of_node(y)}, {}); });
  EXPECT_NE(cross.find("belongs to another graph"), std::string::npos) << cross;
  EXPECT_EQ(print(h), before);
  verify(h);
}

TEST(IrVerify, RejectsMissingOutputAndLatePlaceholder) {
  Graph g;
  g.create_placeholder("x", InputRole::UserInput, f32({2}));
  auto msg = error_of([&] { verify(g); });
  EXPECT_NE(msg.find("graph has 0 output nodes, expected 1"), std::string::npos) << msg;
  EXPECT_NE(error_of([] {
              parse("graph:\n  %x : f32[2] = input()\n  %a : f32[2] = aten::relu.default(%x)\n"
                    "  %y : f32[2] = input()\n  return (%a)\n");
            }).find("must come before every call"),
            std::string::npos);
}
