#include "passes/check_pure.h"

#include "ir/higher_order.h"
#include "ir/schema.h"

#include <c10/util/Exception.h>

#include <string>

namespace torch_ext::passes {
namespace {

// Every call of `g`, and of every region at any depth, must be functional. `owner` names the
// outermost higher-order node a region belongs to, for the message.
void check_calls(const ir::Graph& g, const ir::Node* owner) {
  for (const auto& n : g.nodes()) {
    if (n->kind() != ir::NodeKind::Call || n->target().is_builtin()) continue;
    const std::string where = owner ? " inside %" + owner->name() : std::string();
    if (ir::is_higher_order(n->target())) {
      const ir::HigherOrderOp* hop = ir::find_higher_order(n->target());
      TORCH_CHECK(hop != nullptr && hop->pure_if_regions_are, "check_pure: node %", n->name(), " (",
                  n->target().str(), ")", where, " is a higher-order op with effects of its own");
      for (const auto& r : n->regions()) check_calls(*r, owner ? owner : n.get());
      continue;
    }
    const c10::FunctionSchema* schema = ir::find_schema(n->target());
    TORCH_CHECK(schema != nullptr, "check_pure: node %", n->name(), " (", n->target().str(), ")", where,
                " has no schema");
    TORCH_CHECK(!schema->is_mutable(), "check_pure: node %", n->name(), " (", n->target().str(), ")", where,
                " mutates an argument; the step must be side-effect free");
  }
}

}  // namespace

const ir::Node* aliased_input(const ir::Node* n) {
  // Follow view ops (returns with a non-writing alias set) back to their first argument.
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

void check_pure(const ir::Graph& g) {
  check_calls(g, nullptr);
  const auto& outs = g.output()->args()[0].list;
  for (size_t i = 0; i < outs.size(); ++i) {
    if (outs[i].kind != ir::Arg::Kind::Node) continue;
    const ir::Node* in = aliased_input(outs[i].node);
    TORCH_CHECK(in == nullptr, "check_pure: output #", i, " (%", outs[i].node->name(), ") aliases input %",
                in ? in->name() : "");
  }
}

}  // namespace torch_ext::passes
