// Pass: make one rank's step compute what DistributedDataParallel computes, with functional
// collectives inside the graph.
//
// Requires: gradient and mutated-buffer nodes of this graph (tensors), and a DataParallel spec
//           with a non-empty group name, world_size >= 1 and 0 <= rank < world_size.
// Guarantees: each gradient g becomes wait_tensor(all_reduce(g * (1/world_size), "sum", group)),
//             DDP's average (its reducer scales each gradient by 1/world_size before summing).
//             The scale and the all_reduce sit right after g's producer, so the collective is
//             issued while the rest of the backward runs; the wait sits before the output node,
//             where the first reader (clipping, the update) follows. Each mutated buffer b becomes
//             wait_tensor(broadcast(b, 0, group)): every rank keeps rank 0's buffers, which is what
//             DDP's default broadcast_buffers=True feeds the next forward on every rank. Returns the
//             new gradient and buffer values in the order given. Nothing changes on a refused spec.
//             The graph verifies.
#pragma once

#include "ir/graph.h"
#include "passes/train_step_spec.h"

#include <vector>

namespace torch_ext::passes {

struct DataParallelValues {
  std::vector<ir::Node*> grads;
  std::vector<ir::Node*> buffers;
};

DataParallelValues all_reduce_grads(ir::Graph& graph, const DataParallel& dp, const std::vector<ir::Node*>& grads,
                                    const std::vector<ir::Node*>& buffers);

}  // namespace torch_ext::passes
