// Pass: lift optimizer state into explicit graph inputs.
//
// Requires: a verified joint graph whose placeholders include every parameter named in
//           `spec.updates` (role param), with tensor types.
// Guarantees: one OptimizerState placeholder per (parameter, slot) of its update kind's
//             descriptor, typed like the parameter in torch.zeros_like(param)'s strides (a transposed weight's slots
//             transposed, as eager's; a step counter: f32[]; a factored slot contiguous), named from the parameter, with state name
//             "opt:<param>:<slot>"; one f64[] placeholder per param group for the learning
//             rate, state name "opt:lr:group<g>". Nothing else changes. The graph verifies.
#pragma once

#include "ir/graph.h"
#include "passes/train_step_spec.h"

#include <map>
#include <string>

namespace torch_ext::passes {

// The new placeholders by state name.
std::map<std::string, ir::Node*> lift_optimizer_state(ir::Graph& graph, const TrainStepSpec& spec);

}  // namespace torch_ext::passes
