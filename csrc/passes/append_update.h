// Pass: append the optimizer's update subgraph.
//
// Requires: the placeholders made by lift_optimizer_state (looked up by state name), one
//           gradient node per updated parameter (`grads`, keyed by parameter state name), and
//           parameter placeholders for every update in the spec.
// Guarantees: one call of the kind's functional op (optim/descriptor.h) per parameter, with its
//             state slots and scalars in the descriptor's order (plus getitems), in
//             spec order, after every existing call; returns the new value of every updated
//             state entry keyed by state name (the parameter's own name for the new parameter,
//             "opt:<param>:<slot>" for its optimizer state). Parameters without a gradient are
//             skipped, as torch.optim skips params whose .grad is None. The graph verifies.
//             `values`, when it names a parameter, is the tensor updated in place of the
//             parameter's placeholder (a shard, see shard_optimizer_state.h); the new value then
//             has that tensor's type.
#pragma once

#include "ir/graph.h"
#include "passes/train_step_spec.h"

#include <map>
#include <string>
#include <vector>

namespace torch_ext::passes {

std::vector<std::pair<std::string, ir::Node*>> append_update(ir::Graph& graph, const TrainStepSpec& spec,
                                                             const std::map<std::string, ir::Node*>& grads,
                                                             const std::map<std::string, ir::Node*>& lifted,
                                                             const std::map<std::string, ir::Node*>& values = {});

}  // namespace torch_ext::passes
