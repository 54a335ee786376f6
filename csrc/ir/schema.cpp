#include "ir/schema.h"

namespace torch_ext::ir {

std::optional<c10::OperatorHandle> find_op(const Target& target) {
  if (target.is_builtin()) return std::nullopt;
  c10::OperatorName name(target.ns + "::" + target.name, target.overload == "default" ? "" : target.overload);
  auto op = c10::Dispatcher::singleton().findOp(name);
  if (!op.has_value() || !op->hasSchema()) return std::nullopt;
  return op;
}

const c10::FunctionSchema* find_schema(const Target& target) {
  auto op = find_op(target);
  return op ? &op->schema() : nullptr;
}

bool is_view_op(const Node& node) {
  if (node.kind() != NodeKind::Call || node.target().is_builtin()) return false;
  const c10::FunctionSchema* s = find_schema(node.target());
  if (s == nullptr || s->returns().size() != 1) return false;
  const c10::AliasInfo* a = s->returns()[0].alias_info();
  return a != nullptr && !a->isWrite();
}

bool returns_input_storage(const Node& node) {
  if (node.kind() != NodeKind::Call) return false;
  const Target& t = node.target();
  return (t.ns == "aten" && t.name == "_unsafe_view") || (t.ns == "_c10d_functional" && t.name == "wait_tensor");
}

bool is_update_op(const Node& node) {
  const Target& t = node.target();
  return node.kind() == NodeKind::Call && t.ns == "torch_ext" && t.name.size() > 7 &&
         t.name.compare(t.name.size() - 7, 7, "_update") == 0;
}

std::vector<size_t> update_replaced_args(const Node& update) {
  const size_t n_out = update.type().kind == Type::Kind::Tuple ? update.type().elems.size() : 1;
  std::vector<size_t> out;
  for (size_t i = 0; i < n_out; ++i) out.push_back(i == 0 ? 0 : i + 1);
  return out;
}

}  // namespace torch_ext::ir
