// Analysis: is the graph side-effect free?
//
// Requires: a verified graph.
// Guarantees: throws c10::Error naming the node when a call's schema mutates an argument
//             (Tensor(a!)), or when an output is an input or a view of one (so that no output
//             aliases an input); returns normally otherwise. Changes nothing.
#pragma once

#include "ir/graph.h"

namespace torch_ext::passes {

void check_pure(const ir::Graph& graph);

// The placeholder `n` is, or is a view of through schema-declared aliasing returns; null otherwise.
// An output for which this is non-null would alias an input.
const ir::Node* aliased_input(const ir::Node* n);

}  // namespace torch_ext::passes
