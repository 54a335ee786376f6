// The higher-order operators: calls that own regions (nested graphs), one table entry each.
//
// The entry says everything the rest of the code needs to know about the op, so nothing else
// tests a HOP by name (MLIR: ops verify their own regions; torch's _higher_order_ops registry):
//   verify   the argument layout and the region signatures (the verifier calls it);
//   run      the semantics, given the argument values and a way to run a region (BoundKernel);
//   purity   whether the op is functional exactly when its regions are (check_pure);
//   aliasing whether an output may be an operand handed straight through a region, so the
//            operands outlive the call (plan_memory, schedule);
//   FX form  the argument order of torch.ops.higher_order.<name> and the regions whose FX graph
//            returns a bare value, for the Python importer and exporter (torch_ext/ir.py).
//
// Adding a HOP: one entry in higher_order.cpp (its verify and run functions beside it).
#pragma once

#include "ir/graph.h"

#include <ATen/core/ivalue.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace torch_ext::ir {

// The namespace of every HOP target: higher_order::<name>.default.
constexpr const char* kHigherOrderNamespace = "higher_order";

// One positional argument of a HOP: a graph value, or a list of graph values.
struct HopArg {
  enum class Kind { Value, List };
  const char* name;  // in errors: "predicate", "operands", "carried values"
  Kind kind;
};

// What a runtime hands a HOP's run function.
struct HopRunContext {
  // Runs region `region` of the node on `inputs` and returns its outputs.
  std::function<std::vector<c10::IValue>(size_t region, std::vector<c10::IValue> inputs)> run_region;
  int64_t max_loop_iterations;  // a loop running longer fails, naming the node
  std::string node_name;
};

// One argument of the FX call: IR argument `index`, or region `index` (a GraphModule attribute).
struct FxArg {
  enum class Kind { Arg, Region };
  Kind kind;
  size_t index;
};

struct HigherOrderOp {
  const char* name;       // the target's name: higher_order::<name>.default
  const char* signature;  // the usage, in errors: "cond takes (%pred, [operands]) and two regions"
  std::vector<HopArg> args;
  size_t num_regions;
  // Appends one message per problem in the node's region signatures and argument types; the
  // argument layout (check_layout) has already passed.
  void (*verify)(const Node& node, const std::string& where, std::vector<std::string>& errors);
  // The node's value (a tuple of the region outputs) from its argument values: args[i] holds the
  // value of argument i, one element for a Value argument.
  c10::IValue (*run)(const std::vector<std::vector<c10::IValue>>& args, const HopRunContext& ctx);
  bool pure_if_regions_are;       // the op itself has no effect beyond its regions'
  bool outputs_may_alias_operands;  // a region may return an operand unchanged
  // FX form: the arguments of the torch.ops.higher_order call, in order.
  std::vector<FxArg> fx_args;
  std::vector<size_t> bare_output_regions;  // regions whose FX graph returns one value, not a tuple
};

// Every HOP, in a fixed order.
const std::vector<HigherOrderOp>& higher_order_ops();
// True when the target is in the higher_order namespace (known to the table or not).
bool is_higher_order(const Target& target);
// The entry of a higher_order:: target, or nullptr when the table has none.
const HigherOrderOp* find_higher_order(const Target& target);
// "cond and while_loop": the table's names, for errors.
std::string higher_order_names();
// Empty when the node's region count and argument kinds fit the entry's layout; otherwise the
// problem, without a prefix. Shared by the verifier and the kernel binder.
std::string check_layout(const HigherOrderOp& op, const Node& node);

}  // namespace torch_ext::ir
