#include "passes/check_pure.h"

#include "ir/higher_order.h"
#include "ir/schema.h"

#include <c10/util/Exception.h>

namespace torch_ext::passes {
namespace {

// The placeholder `n` is a view of, following view ops (returns with a non-writing alias set).
const ir::Node* viewed_input(const ir::Node* n) {
  while (n->kind() == ir::NodeKind::Call) {
    if (n->target().is_getitem()) return nullptr;
    const c10::FunctionSchema* schema = ir::find_schema(n->target());
    if (schema == nullptr || schema->returns().empty()) return nullptr;
    const c10::AliasInfo* alias = schema->returns()[0].alias_info();
    if (alias == nullptr || alias->isWrite() || n->args().empty() || n->args()[0].kind != ir::Arg::Kind::Node)
      return nullptr;
    n = n->args()[0].node;
  }
  return n->kind() == ir::NodeKind::Placeholder ? n : nullptr;
}

}  // namespace

void check_pure(const ir::Graph& g) {
  for (const auto& n : g.nodes()) {
    if (n->kind() != ir::NodeKind::Call || n->target().is_builtin()) continue;
    if (ir::is_higher_order(n->target())) {
      const ir::HigherOrderOp* hop = ir::find_higher_order(n->target());
      TORCH_CHECK(hop != nullptr && hop->pure_if_regions_are, "check_pure: node %", n->name(), " (",
                  n->target().str(), ") is a higher-order op with effects of its own");
      for (const auto& r : n->regions())
        for (const auto& inner : r->nodes()) {
          if (inner->kind() != ir::NodeKind::Call || inner->target().is_builtin()) continue;
          const c10::FunctionSchema* s = ir::find_schema(inner->target());
          TORCH_CHECK(ir::is_higher_order(inner->target()) || (s != nullptr && !s->is_mutable()), "check_pure: node %",
                      inner->name(), " (", inner->target().str(), ") inside %", n->name(), " mutates an argument");
        }
      continue;
    }
    const c10::FunctionSchema* schema = ir::find_schema(n->target());
    TORCH_CHECK(schema != nullptr, "check_pure: node %", n->name(), " (", n->target().str(), ") has no schema");
    TORCH_CHECK(!schema->is_mutable(), "check_pure: node %", n->name(), " (", n->target().str(),
                ") mutates an argument; the step must be side-effect free");
  }
  const auto& outs = g.output()->args()[0].list;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (outs[i].kind != ir::Arg::Kind::Node) continue;
    const ir::Node* in = viewed_input(outs[i].node);
    TORCH_CHECK(in == nullptr, "check_pure: output #", i, " (%", outs[i].node->name(), ") aliases input %",
                in ? in->name() : "");
  }
}

}  // namespace torch_ext::passes
