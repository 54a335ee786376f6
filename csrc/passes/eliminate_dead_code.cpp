#include "passes/eliminate_dead_code.h"

#include "ir/schema.h"

#include <unordered_set>
#include <vector>

namespace torch_ext::passes {

size_t eliminate_dead_code(ir::Graph& g) {
  // One reverse walk marks a node dead when every user is already dead (so chains die in one
  // sweep); one compaction then removes them all, linear in the graph.
  std::unordered_set<const ir::Node*> dead;
  std::vector<ir::Node*> order;
  const auto& nodes = g.nodes();
  for (auto it = nodes.rbegin(); it != nodes.rend(); ++it) {
    ir::Node* n = it->get();
    if (n->kind() != ir::NodeKind::Call) continue;
    bool unread = true;
    for (const ir::Node* u : n->users())
      if (dead.count(u) == 0) { unread = false; break; }
    if (!unread) continue;
    const c10::FunctionSchema* schema = ir::find_schema(n->target());
    if (schema != nullptr && schema->is_mutable()) continue;
    dead.insert(n);
    order.push_back(n);
  }
  if (!order.empty()) g.erase_all(order);
  return order.size();
}

}  // namespace torch_ext::passes
