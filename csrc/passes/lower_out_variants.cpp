#include "passes/lower_out_variants.h"

#include "ir/out_variant.h"
#include "ir/schema.h"

#include <c10/util/Exception.h>

#include <unordered_set>
#include <utility>
#include <vector>

namespace torch_ext::passes {
namespace {

// The target of `op` (an overload of some operator) as a graph target.
ir::Target target_of(const c10::OperatorHandle& op) {
  const c10::OperatorName& name = op.operator_name();
  return ir::Target::parse(name.name + "." + (name.overload_name.empty() ? "default" : name.overload_name));
}

}  // namespace

LoweringResult lower_out_variants(ir::Graph& graph, const ir::MemoryPlan& plan) {
  std::unordered_set<const ir::Node*> aliased;
  for (const auto& d : plan.aliases)
    if (d.applied) aliased.insert(d.update);
  std::vector<const ir::Node*> in_arena;  // producers of arena buffers, each once, in plan order
  std::unordered_set<const ir::Node*> seen;
  for (const auto& b : plan.buffers)
    if (seen.insert(b.node).second) in_arena.push_back(b.node);
  // Decide every rewrite before touching the graph, so a refusal leaves it unchanged.
  std::vector<std::pair<ir::Node*, ir::Target>> rewrites;
  auto owned = [&](const ir::Node* n) {
    ir::Node* m = graph.find(n->name());
    TORCH_CHECK(m == n, "lower_out_variants: the plan's node %", n->name(), " is not in this graph");
    return m;
  };
  for (const ir::Node* n : in_arena) {
    if (aliased.count(n)) continue;  // runs in place; its other results are allocated
    const auto out = ir::find_out_variant(*n);
    TORCH_CHECK(out.has_value(), "lower_out_variants: node %", n->name(), " (", n->target().str(),
                ") has arena buffers but no out= overload with a kernel of its own");
    rewrites.emplace_back(owned(n), target_of(out->op));
  }
  for (const ir::Node* n : plan.order) {
    if (!aliased.count(n)) continue;
    const auto inplace = ir::find_inplace_variant(*n);
    TORCH_CHECK(inplace.has_value(), "lower_out_variants: node %", n->name(), " (", n->target().str(),
                ") overwrites its state in place but has no in-place variant (an operator with its arguments that "
                "writes one per result)");
    TORCH_INTERNAL_ASSERT(inplace->written_args == ir::update_replaced_args(*n), "lower_out_variants: node %",
                          n->name(), ": the in-place variant writes other arguments than the plan aliased");
    rewrites.emplace_back(owned(n), target_of(inplace->op));
  }
  LoweringResult r;
  for (auto& [n, t] : rewrites) {
    (aliased.count(n) ? r.inplace : r.out_variants) += 1;
    graph.set_target(n, std::move(t));
  }
  return r;
}

}  // namespace torch_ext::passes
