// Walks over use lists shared by the passes.
#pragma once

#include "ir/graph.h"

#include <functional>
#include <vector>

namespace torch_ext::ir {

// Every call node that reads `root`, directly or through a chain of calls for which `follow`
// holds (with follow = "shares its input's storage": every reader of root's storage). Depth first
// from the last found, each use list in order; a node reached along two chains is listed twice.
std::vector<const Node*> transitive_users(const Node* root, const std::function<bool(const Node&)>& follow);

}  // namespace torch_ext::ir
