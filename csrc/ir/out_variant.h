// The out= overload a call node can write its result into, and the in-place variant that
// overwrites its inputs instead, both found by schema (alias annotations), never by name.
#pragma once

#include "ir/graph.h"

#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <vector>

namespace torch_ext::ir {

struct OutVariant {
  c10::OperatorHandle op;
  std::vector<std::string> out_args;  // one per result (tuple element), in result order
};

// The overload of `node`'s operator that takes the same arguments (same names, same order) plus
// one trailing keyword-only Tensor(a!) per result, and returns them: found among every overload
// by schema, never by overload name (aten::threshold_backward's is `grad_input`,
// aten::sum.dim_IntList's `IntList_out`, aten::nll_loss_forward's `output` with two outs).
// Nullopt when there is none, or when that overload has no kernel of its own for the node's
// backend (CPU, CUDA ...): such an out= is the generated CompositeExplicitAutograd wrapper that
// runs the functional kernel into a fresh tensor and copies it over (aten::convolution.out,
// aten::relu.out), a full extra pass over the result that the planned arena must not pay.
std::optional<OutVariant> find_out_variant(const Node& node);

// Marks the out= overload `out` as unusable, process-wide: its kernel, called on a planned buffer (an arena
// view, the reactive sweep's scratch), resized or re-pointed it, or failed trying (runtime/arena_executor.h).
// The runtime that saw it ran the functional kernel instead; from then on find_out_variant offers no node
// that overload, so later plans leave such nodes to their kernels (no planned buffer that would stay unused,
// no failed first call).
void mark_out_kernel_unusable(const c10::OperatorName& out);

// The overload names ("", "Tensor", "out" ...) of the operator `qualified_name` ("aten::add") registered now,
// sorted: from an index the dispatcher keeps current (a library loaded later included), without copying its
// whole name table as c10::Dispatcher::getAllOpNames does.
std::vector<std::string> overload_names(const std::string& qualified_name);

struct InplaceVariant {
  c10::OperatorHandle op;
  std::vector<size_t> written_args;  // one per result, in result order: the argument it overwrites
};

// The operator, in `node`'s namespace, that takes exactly `node`'s arguments (same names and types,
// same order), annotates as written (Tensor(a!)) one argument per result of `node`, and returns
// nothing or exactly those: `node` computed in place (torch_ext::sgd_update ->
// torch_ext::sgd_update_). Among several (aten::add -> aten::add_, but aten::sub_ has the same
// arguments), the shortest name that extends the node's is taken; nullopt when there is none or it
// stays ambiguous. Looked up once per target while no operator is defined or removed.
std::optional<InplaceVariant> find_inplace_variant(const Node& node);

// The input `node` would overwrite by running `variant` instead: the one argument the variant writes
// (it returns only that), given through no other argument or keyword (a variant reading what it
// already wrote gives other values, or refuses: index_put_(b, [b], b)), whose declared layout (sizes,
// strides, dtype, device) is the result's, so the bits and the layout are the functional kernel's;
// nullptr otherwise. Whether the input is dead there and unaliased is the runtime's to decide.
const Node* overwritten_input(const Node& node, const InplaceVariant& variant);

// A step that may run in place: `node` computed by its in-place variant `op`, which overwrites `input`.
struct Overwrite {
  const Node* input;
  c10::OperatorHandle op;
};

// The runtimes' one rule for which node may overwrite which input (runtime::Executor, and the reactive
// sweep's cone, reactive/scratch.cpp): a pointwise functional op (tagged pointwise, not mutable) with an
// in-place variant (find_inplace_variant, looked up once per target and process) and an overwritten_input
// computed by a call node (never a caller's tensor). A pointwise in-place variant runs the same elementwise
// kernel on the same operands, so the bits are the functional kernel's, except where torch's in-place
// variant rounds a Scalar argument to a half-precision tensor's dtype first (aten::mul.Scalar on float16 and
// bfloat16, out_variant.cpp lists what was checked): such a node is never overwritten. Whether the input dies at `node`,
// is no output and is referenced by nothing else is each runtime's to decide (the executor checks it at
// run time with runtime::sole_owner; the sweep's scratch by its planned lifetimes).
std::optional<Overwrite> find_overwrite(const Node& node);

}  // namespace torch_ext::ir
