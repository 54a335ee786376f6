// Pass: operator-level scheduling for the lowest simulated peak memory.
//
// Requires: a verified, side-effect-free graph.
// Guarantees: the call nodes are reordered into a valid topological order (results cannot change:
//             every op is functional); the order chosen has the lowest simulate_peak() among the
//             candidates: the current order, update-asap (each optimizer update right after its
//             gradient and the last reader of its state, so the gradient dies there and the update
//             can write in place), frees-most (a greedy list schedule), BFS, DFS and, up to
//             4000 call nodes, a beam search over the ready set. In every candidate, collectives
//             (_c10d_functional) are issued as soon as their inputs exist and each wait_tensor
//             sits right before its first reader, so communication overlaps the compute between
//             (each update can run as soon as its wait is done). The verifier passes afterwards.
//             Returns the candidates' names and simulated peaks, the last one "least-peak": the
//             minimum of all of them, which is the chosen order's peak.
#pragma once

#include "ir/graph.h"

#include <string>
#include <utility>
#include <vector>

namespace torch_ext::passes {

struct ScheduleResult {
  std::string chosen;
  std::vector<std::pair<std::string, int64_t>> candidates;  // name, simulated peak bytes
};

ScheduleResult schedule(ir::Graph& graph, bool donate);

}  // namespace torch_ext::passes
