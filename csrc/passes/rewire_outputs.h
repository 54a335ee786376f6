// Pass: make the graph's signature that of a pure step, (loss, S') = F(S, R, batch).
//
// Requires: `loss` and every node in `new_state` belong to `graph`; each state name in
//           `new_state` names a placeholder of the graph (parameter, buffer or optimizer state).
// Guarantees: the output list is [loss, new_state...] (gradients and every other former output
//             are dropped); placeholders are reordered so that the k-th one is the state entry
//             whose new value is output k+1, followed by the other non-batch placeholders in their
//             former order, then the user inputs. Returns the number of state entries. Verifies.
#pragma once

#include "ir/graph.h"

#include <string>
#include <utility>
#include <vector>

namespace torch_ext::passes {

size_t rewire_outputs(ir::Graph& graph, ir::Node* loss, const std::vector<std::pair<std::string, ir::Node*>>& new_state);

}  // namespace torch_ext::passes
