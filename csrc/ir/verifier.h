// Structural and schema checks for an ir::Graph.
//
// Checked: every node is owned by the graph and reachable by name; placeholders
// come first and exactly one output node comes last; every input is defined
// before its use (so the graph is acyclic and in topological order); use lists
// are exact in both directions; each call's target resolves in the c10
// dispatcher and its positional and keyword args fit the schema (no surplus, no
// unknown or duplicated keyword, every argument without a default supplied);
// getitem reads a tuple-typed node at an in-range index. Regions are verified
// recursively; a higher-order op's arguments and region signatures are checked by
// its entry in the table (ir/higher_order.h).
#pragma once

#include "ir/graph.h"

#include <string>
#include <vector>

namespace torch_ext::ir {

// All problems found, each naming its node; empty when the graph is valid. `infer_results`
// false skips level 2 of the call type checks (running each operator on meta tensors, see
// ir/type_check.h): only for a graph that passed the full check under the same torch and
// torch_ext (the on-disk build cache's entries), since Python meta kernels are costly to load.
std::vector<std::string> verify_errors(const Graph& graph, bool infer_results = true);
// Throws c10::Error listing every problem.
void verify(const Graph& graph, bool infer_results = true);

}  // namespace torch_ext::ir
