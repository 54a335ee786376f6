// The out= overload a call node can write its result into, found by schema.
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

}  // namespace torch_ext::ir
