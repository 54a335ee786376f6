// ir::transitive_users: the readers of a value, directly and through the nodes a walk follows.
#include "ir/parser.h"
#include "ir/users.h"

#include <gtest/gtest.h>

using namespace torch_ext;

namespace {

std::vector<std::string> names(const std::vector<const ir::Node*>& nodes) {
  std::vector<std::string> out;
  for (const ir::Node* n : nodes) out.push_back(n->name());
  return out;
}

}  // namespace

TEST(TransitiveUsers, FollowsOnlyTheNodesThePredicateAccepts) {
  auto g = ir::parse(R"(graph:
  %x : f32[4] = input()
  %v : f32[2,2] = aten::view.default(%x, [2, 2])
  %a : f32[4] = aten::neg.default(%x)
  %t : f32[2,2] = aten::t.default(%v)
  %b : f32[2,2] = aten::relu.default(%v)
  %c : f32[2,2] = aten::relu.default(%t)
  %d : f32[4] = aten::neg.default(%a)
  return (%b, %c, %d)
)");
  const auto is_view = [](const ir::Node& n) { return n.target().name == "view" || n.target().name == "t"; };
  // Depth first from the last found: x's users v, a; then v's users t, b; then t's user c.
  EXPECT_EQ(names(ir::transitive_users(g->find("x"), is_view)), (std::vector<std::string>{"v", "a", "t", "b", "c"}));
  EXPECT_EQ(names(ir::transitive_users(g->find("x"), [](const ir::Node&) { return false; })),
            (std::vector<std::string>{"v", "a"}));
  // The output node is not a reader.
  EXPECT_TRUE(ir::transitive_users(g->find("d"), is_view).empty());
}
