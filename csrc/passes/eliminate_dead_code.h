// Pass: remove call nodes whose values nobody reads.
//
// Requires: a verified graph.
// Guarantees: every remaining call node reaches the output or mutates an input (mutating ops
//             are never removed); placeholders are kept. Returns the number of nodes erased.
#pragma once

#include "ir/graph.h"

#include <cstddef>

namespace torch_ext::passes {

size_t eliminate_dead_code(ir::Graph& graph);

}  // namespace torch_ext::passes
