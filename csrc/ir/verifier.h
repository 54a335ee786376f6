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

// All problems found, each naming its node; empty when the graph is valid.
std::vector<std::string> verify_errors(const Graph& graph);
// Throws c10::Error listing every problem.
void verify(const Graph& graph);

}  // namespace torch_ext::ir
