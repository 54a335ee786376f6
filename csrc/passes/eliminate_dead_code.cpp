#include "passes/eliminate_dead_code.h"

#include "ir/schema.h"

#include <vector>

namespace torch_ext::passes {

size_t eliminate_dead_code(ir::Graph& g) {
  // Collect first, erase after the walk; reverse order frees chains in one sweep.
  std::vector<ir::Node*> calls;
  for (const auto& n : g.nodes())
    if (n->kind() == ir::NodeKind::Call) calls.push_back(n.get());
  size_t erased = 0;
  for (auto it = calls.rbegin(); it != calls.rend(); ++it) {
    ir::Node* n = *it;
    if (!n->users().empty()) continue;
    const c10::FunctionSchema* schema = ir::find_schema(n->target());
    if (schema != nullptr && schema->is_mutable()) continue;
    g.erase(n);
    ++erased;
  }
  return erased;
}

}  // namespace torch_ext::passes
