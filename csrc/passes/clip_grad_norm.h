// Pass: global-norm gradient clipping as pure ops, the same op sequence as
// torch.nn.utils.clip_grad_norm_ on CPU (torch 2.9: per-tensor vector norms via the foreach
// fallback, a norm of their stack, max_norm / (total + 1e-6) as reciprocal * max_norm, clamp to
// at most 1, then one multiply per gradient).
//
// Requires: `grads` are tensor-valued nodes of `graph`; max_norm > 0.
// Guarantees: returns the clipped gradient nodes, in the same order; the original gradient nodes
//             are untouched (their other users still see unclipped values). The graph verifies.
#pragma once

#include "ir/graph.h"

#include <vector>

namespace torch_ext::passes {

std::vector<ir::Node*> clip_grad_norm(ir::Graph& graph, const std::vector<ir::Node*>& grads, double max_norm,
                                      double norm_type);

}  // namespace torch_ext::passes
