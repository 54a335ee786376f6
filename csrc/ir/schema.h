// Resolution of IR targets to c10 dispatcher operators.
#pragma once

#include "ir/graph.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <vector>

namespace torch_ext::ir {

// The registered operator for `target`, or nullopt (builtins, unknown ops).
// Overload "default" is the dispatcher's empty overload name.
std::optional<c10::OperatorHandle> find_op(const Target& target);
const c10::FunctionSchema* find_schema(const Target& target);

// A call whose single result aliases its first argument without writing it (t, view, permute,
// split's Tensor(a)[] ...).
bool is_view_op(const Node& node);
// A call whose result is its first argument's storage although its schema declares a fresh
// tensor: aten::_unsafe_view (a view autograd must not see), and _c10d_functional::wait_tensor,
// which hands back the collective's output once the collective is done (until then the
// collective still writes it, so its lifetime runs from the collective to the wait's last reader).
bool returns_input_storage(const Node& node);
// An asynchronous collective (a _c10d_functional call other than wait_tensor): issued, it runs
// until its wait_tensor.
bool is_collective(const Node& node);
// _c10d_functional::wait_tensor: the end of the collective that is its argument.
bool is_collective_wait(const Node& node);
// A registered optimizer's functional update op (optim/descriptor.h), found in the registry.
bool is_update_op(const Node& node);
// For each output of an update op, the argument it replaces: the parameter (arg 0), then the
// state slots, which follow the gradient (arg 1).
std::vector<size_t> update_replaced_args(const Node& update);

}  // namespace torch_ext::ir
