#include "ir/schema.h"

#include "optim/descriptor.h"

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
  return (t.ns == "aten" && t.name == "_unsafe_view") || is_collective_wait(node);
}

bool is_collective(const Node& node) {
  return node.kind() == NodeKind::Call && node.target().ns == "_c10d_functional" && node.target().name != "wait_tensor";
}

bool is_collective_wait(const Node& node) {
  return node.kind() == NodeKind::Call && node.target().ns == "_c10d_functional" && node.target().name == "wait_tensor";
}

bool is_update_op(const Node& node) {
  if (node.kind() != NodeKind::Call) return false;
  const Target& t = node.target();
  return t.ns == "torch_ext" && optim::find_by_op(t.name) != nullptr;
}

std::vector<size_t> update_replaced_args(const Node& update) {
  TORCH_INTERNAL_ASSERT(is_update_op(update), "update_replaced_args: %", update.name(), " is not an optimizer update");
  const optim::Descriptor& d = *optim::find_by_op(update.target().name);
  std::vector<size_t> out{0};  // the parameter; the slots follow the gradient (argument 1)
  for (size_t k = 0; k < d.slots.size(); ++k) out.push_back(2 + k);
  return out;
}

}  // namespace torch_ext::ir
