// Pass: ZeRO-1, the optimizer update of one rank's shard, then an all-gather of the parameters,
// inside the pure step. Used in place of append_update when DataParallel::shard_optimizer_state.
//
// Layout (flatten-and-slice per parameter): a parameter of N elements is flattened and padded
// with zeros to S * world_size elements, S = ceil(N / world_size); rank r owns the flat elements
// [r*S, (r+1)*S). Each of its optimizer-state slots that has the parameter's shape is a 1-D tensor
// of S elements on every rank (the padding lanes hold zeros and stay zero: every supported update
// maps param 0 and grad 0 to 0); scalar slots (step) are kept whole on every rank.
//
// Requires: the placeholders made by lift_optimizer_state, the (already averaged) gradients
//           keyed by parameter state name, contiguous parameters, element-wise update kinds
//           (a descriptor with `elementwise`; not Muon, whose Newton-Schulz step needs the whole matrix), and a valid
//           DataParallel spec.
// Guarantees: the state slots above are retyped to their shard; per parameter:
//             shard = clone(slice(pad(view(p, [-1])))), the same slice of the gradient,
//             append_update's update on the shard, then
//             view(slice(wait_tensor(all_gather_into_tensor(new_shard, world_size, group)), 0, N), p.shape)
//             is the new parameter, equal on every rank. Returns the new state values keyed as
//             append_update's. Nothing changes on a refused spec; the graph verifies.
#pragma once

#include "ir/graph.h"
#include "passes/train_step_spec.h"

#include <map>
#include <string>
#include <vector>

namespace torch_ext::passes {

std::vector<std::pair<std::string, ir::Node*>> shard_optimizer_state(ir::Graph& graph, const TrainStepSpec& spec,
                                                                     const DataParallel& dp,
                                                                     const std::map<std::string, ir::Node*>& grads,
                                                                     const std::map<std::string, ir::Node*>& lifted);

}  // namespace torch_ext::passes
