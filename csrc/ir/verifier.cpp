#include "ir/verifier.h"

#include "ir/higher_order.h"
#include "ir/printer.h"
#include "ir/schema.h"
#include "ir/type_check.h"

#include <ATen/core/function_schema.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

namespace torch_ext::ir {
namespace {

void check_call(const Node& n, const std::string& prefix, std::vector<std::string>& errors, bool infer_results) {
  const std::string where = prefix + "node %" + n.name() + " (" + n.target().str() + "): ";
  if (n.target().is_getitem()) {
    if (n.args().size() != 2 || !n.kwargs().empty() || n.args()[0].kind != Arg::Kind::Node ||
        n.args()[1].kind != Arg::Kind::Int) {
      errors.push_back(where + "getitem takes exactly (%value, index)");
      return;
    }
    const Type& src = n.args()[0].node->type();
    if (src.kind != Type::Kind::Tuple) {
      errors.push_back(where + "getitem source %" + n.args()[0].node->name() + " is not a tuple");
      return;
    }
    int64_t idx = n.args()[1].i;
    if (idx < 0 || idx >= static_cast<int64_t>(src.elems.size())) {
      errors.push_back(where + "index " + std::to_string(idx) + " out of range for a tuple of " +
                       std::to_string(src.elems.size()));
      return;
    }
    if (src.elems[idx] != n.type())
      errors.push_back(where + "declared type " + print_type(n.type()) + " differs from element " +
                       std::to_string(idx) + " of %" + n.args()[0].node->name() + ", " +
                       print_type(src.elems[idx]));
    return;
  }
  if (is_higher_order(n.target())) {
    // Ops with regions verify their own (MLIR's verifyRegions), from the table.
    const HigherOrderOp* hop = find_higher_order(n.target());
    if (hop == nullptr) {
      errors.push_back(where + "unknown higher-order operator");
      return;
    }
    if (std::string bad = check_layout(*hop, n); !bad.empty()) {
      errors.push_back(where + bad);
      return;
    }
    hop->verify(n, where, errors);
    return;
  }
  const auto op = find_op(n.target());
  if (!op) {
    errors.push_back(where + "unknown operator (not registered with the dispatcher)");
    return;
  }
  const c10::FunctionSchema* schema = &op->schema();
  const size_t errors_before = errors.size();
  const auto& formals = schema->arguments();
  size_t num_positional = 0;
  for (const auto& f : formals)
    if (!f.kwarg_only()) ++num_positional;
  if (n.args().size() > num_positional) {
    errors.push_back(where + "takes at most " + std::to_string(num_positional) + " positional args, got " +
                     std::to_string(n.args().size()));
    return;
  }
  std::vector<bool> filled(formals.size(), false);
  for (size_t i = 0; i < n.args().size(); ++i) filled[i] = true;
  for (const auto& kv : n.kwargs()) {
    auto it = std::find_if(formals.begin(), formals.end(), [&](const c10::Argument& a) { return a.name() == kv.first; });
    if (it == formals.end()) {
      errors.push_back(where + "unknown keyword argument '" + kv.first + "'");
      continue;
    }
    size_t k = static_cast<size_t>(it - formals.begin());
    if (filled[k]) errors.push_back(where + "argument '" + kv.first + "' given twice");
    filled[k] = true;
  }
  for (size_t k = 0; k < formals.size(); ++k)
    if (!filled[k] && !formals[k].default_value().has_value())
      errors.push_back(where + "missing required argument '" + formals[k].name() + "'");
  if (errors.size() != errors_before) return;
  try {
    check_call_types(n, *op, where, errors, infer_results);
  } catch (const c10::Error& e) {
    errors.push_back(where + "type check failed: " + e.msg());
  }
}

bool is_lifted_state(InputRole role) {
  return role == InputRole::Parameter || role == InputRole::Buffer || role == InputRole::OptimizerState;
}

void check_state_placeholder(const Node& n, const std::string& where,
                             std::unordered_map<std::string, const Node*>& holder, std::vector<std::string>& errors) {
  if (!is_lifted_state(n.role())) return;
  const std::string role = to_string(n.role());
  if (n.state_name().empty()) {
    errors.push_back(where + role + " placeholder has an empty state name (give it one: " + role + "(\"name\"))");
    return;
  }
  auto [it, fresh] = holder.emplace(n.state_name(), &n);
  if (!fresh)
    errors.push_back(where + role + " state name '" + n.state_name() + "' is already held by %" + it->second->name() +
                     " (" + to_string(it->second->role()) + "): one placeholder per state entry");
  if (n.role() == InputRole::Parameter && n.type().is_tensor()) {
    const c10::ScalarType dt = n.type().tensor.dtype;
    if (!c10::isFloatingType(dt) && !c10::isComplexType(dt))
      errors.push_back(where + "param '" + n.state_name() + "' has dtype " + c10::toString(dt) +
                       ": a parameter must be floating point or complex (an integer tensor is a buffer)");
  }
}

void verify_into(const Graph& g, const std::string& prefix, std::vector<std::string>& errors, bool infer_results) {
  std::unordered_set<const Node*> seen;
  // Use lists are checked against the inputs through one map of (user, input) pairs, so a
  // value with many users costs linear time, not quadratic.
  std::unordered_map<const Node*, std::unordered_set<const Node*>> inputs_of;
  // Nodes whose declared type is invalid or wrong. Their users are not type-checked: the first
  // error says what is wrong, and inference on a wrong type can be arbitrarily expensive
  // (split of a dim declared 2^31 long).
  std::unordered_set<const Node*> invalid;
  bool calls_started = false;
  size_t outputs = 0;
  // Lifted state (parameters, buffers, optimizer state): a state name names one entry of the step's
  // state, so it must be given and held by one placeholder. Constants may repeat a name (a graft
  // copies its block's parameter names as constants, once per graft) and inputs need none.
  std::unordered_map<std::string, const Node*> state_holder;
  const auto& nodes = g.nodes();
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = *nodes[i];
    const std::string where = prefix + "node %" + n.name() + ": ";
    if (n.owner() != &g) errors.push_back(where + "owned by another graph");
    if (g.find(n.name()) != &n) errors.push_back(where + "name does not resolve to this node");
    if (n.index() != static_cast<int64_t>(i)) errors.push_back(where + "stale index");
    if (n.kind() == NodeKind::Placeholder && calls_started)
      errors.push_back(where + "placeholder after a call node");
    if (n.kind() != NodeKind::Placeholder) calls_started = true;
    if (n.kind() == NodeKind::Placeholder) check_state_placeholder(n, where, state_holder, errors);
    if (n.kind() == NodeKind::Output) {
      ++outputs;
      if (i + 1 != nodes.size()) errors.push_back(where + "output node is not last");
      if (n.args().size() != 1 || n.args()[0].kind != Arg::Kind::List)
        errors.push_back(where + "output takes one list of values");
    }
    if (std::string bad = invalid_type_reason(n.type()); !bad.empty()) {
      errors.push_back(where + "invalid type " + print_type_safe(n.type()) + ": " + bad);
      invalid.insert(&n);
    }
    std::vector<Node*> ins = n.inputs();
    auto& my_inputs = inputs_of[&n];
    my_inputs.insert(ins.begin(), ins.end());
    for (Node* in : ins) {
      if (in->owner() != &g) {
        errors.push_back(where + "uses %" + in->name() + " from another graph");
        continue;
      }
      if (!seen.count(in))
        errors.push_back(where + "uses %" + in->name() + " before it is defined (cycle or bad order)");
      if (in->kind() == NodeKind::Output) errors.push_back(where + "uses the output node");
    }
    seen.insert(&n);
  }
  // Every (user, input) pair is in the input's use list and vice versa.
  std::unordered_map<const Node*, std::unordered_set<const Node*>> users_of;
  for (const auto& up : nodes) users_of[up.get()].insert(up->users().begin(), up->users().end());
  for (const auto& up : nodes) {
    const Node& n = *up;
    const std::string where = prefix + "node %" + n.name() + ": ";
    for (const Node* in : n.inputs()) {
      auto it = users_of.find(in);
      if (in->owner() == &g && (it == users_of.end() || !it->second.count(&n)))
        errors.push_back(where + "missing from the use list of %" + in->name());
    }
    for (const Node* u : n.users()) {
      auto it = inputs_of.find(u);
      if (it == inputs_of.end() || !it->second.count(&n))
        errors.push_back(where + "use list names %" + u->name() + ", which does not use it (dangling use)");
    }
  }
  for (size_t i = 0; i < nodes.size(); ++i) {
    const Node& n = *nodes[i];
    const std::string where = prefix + "node %" + n.name() + ": ";
    if (n.kind() == NodeKind::Call) {
      if (!n.regions().empty() && !is_higher_order(n.target()))
        errors.push_back(where + "only higher_order::" + higher_order_names() + " own regions, not " +
                         n.target().str());
      const auto ins = n.inputs();
      const bool inputs_valid = std::none_of(ins.begin(), ins.end(), [&](const Node* in) {
        return invalid.count(in) || in->owner() != &g;
      });
      if (inputs_valid && !invalid.count(&n)) {
        const size_t before = errors.size();
        check_call(n, prefix, errors, infer_results);
        if (errors.size() != before) invalid.insert(&n);
      } else {
        invalid.insert(&n);
      }
      for (size_t r = 0; r < n.regions().size(); ++r)
        verify_into(*n.regions()[r], prefix + "%" + n.name() + ".region" + std::to_string(r) + ": ", errors,
                    infer_results);
    }
  }
  if (outputs != 1) errors.push_back(prefix + "graph has " + std::to_string(outputs) + " output nodes, expected 1");
}

}  // namespace

std::vector<std::string> verify_errors(const Graph& graph, bool infer_results) {
  std::vector<std::string> errors;
  verify_into(graph, "", errors, infer_results);
  return errors;
}

void verify(const Graph& graph, bool infer_results) {
  auto errors = verify_errors(graph, infer_results);
  if (errors.empty()) return;
  std::string msg = "IR verification failed with " + std::to_string(errors.size()) + " error(s):";
  for (const auto& e : errors) msg += "\n  " + e;
  TORCH_CHECK(false, msg);
}

}  // namespace torch_ext::ir
