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

}  // namespace torch_ext::ir
