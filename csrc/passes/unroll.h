// Pass: N consecutive pure steps as one graph.
//
// Requires: a pure step graph from rewire_outputs: placeholders [state (num_state)...,
//           other inputs..., user inputs...], outputs [loss, new state (num_state)...].
// Guarantees: a new graph with placeholders [state..., other inputs..., user inputs of step 0...,
//             ..., user inputs of step n-1...] and outputs [losses (f32[n], stacked), state after
//             n steps...]. Step i reads the state step i-1 produced. Node names get a "_s<i>"
//             suffix. The graph verifies.
#pragma once

#include "ir/graph.h"

#include <memory>

namespace torch_ext::passes {

std::unique_ptr<ir::Graph> unroll(const ir::Graph& step, size_t num_state, int64_t steps);

}  // namespace torch_ext::passes
