// Pass: rematerialization. Forward activations are dropped after the forward and recomputed in
// the backward, as ordinary call nodes of the pure step (so every runtime, .pt2 and AOTInductor
// carry the recomputation).
//
// Terms. The forward is the call nodes the loss (output 0) depends on; the backward, every other
// call node. A candidate is a forward call that owns its storage (not a view or getitem), is
// recomputable (a functional aten/prims op, not tagged nondeterministic_seeded, or dropout reading
// its generator state as an argument, torch_ext::native_dropout_rng) and whose storage
// a backward node reads (a saved activation).
//
// rematerialize(graph, names):
//   Requires: a verified, side-effect-free graph; `names` are candidates (refused by name
//             otherwise, the graph untouched).
//   Guarantees: every backward read of a value owned by a node in `names` (directly or through
//             views and getitems) reads a clone instead: the same target on the same arguments,
//             where an argument owned by a node in `names` is itself cloned. Each value is cloned
//             once, named <name>_recomp, just before the first backward node that needs it (a
//             backward view of it, such as a detach, is cloned along and the original erased), so
//             the original dies with its last forward reader. The clones run the same kernels on
//             the same inputs: results are bit-exact. The verifier passes afterwards.
//
// rematerialize_for_budget(graph, budget, donate):
//   Chooses the set greedily and applies it. Each candidate comes as a group: itself and the
//   forward producers it would otherwise keep alive for its clone alone (relu with the
//   convolution it reads), and itself alone. Groups are tried by bytes saved per estimated FLOP of recomputation,
//   cheapest first (pointwise ops before matmuls, AOTAutograd's min-cut rule of thumb). Each round
//   evaluates the planner's exact peak (plan_memory's peak_bytes in the current order) for the
//   next few groups that lower it and keeps the one with the most bytes saved per added FLOP (or
//   the first that fits), until the peak fits or nothing lowers it. If that stalls above the budget,
//   checkpoint-style sets are tried: keep every k-th cut of the forward (a value that is the only large
//   one crossing its position, such as the residual stream between blocks) and recompute every other
//   large forward value, k = 1..4. The result says whether it fit, and the smallest peak found.
#pragma once

#include "ir/graph.h"

#include <cstdint>
#include <string>
#include <vector>

namespace torch_ext::passes {

struct RematResult {
  std::vector<std::string> recomputed;  // nodes whose backward reads now read clones
  int64_t clones = 0;                   // call nodes added
};

RematResult rematerialize(ir::Graph& graph, const std::vector<std::string>& names);

struct BudgetResult {
  bool feasible = false;
  int64_t budget = 0;
  int64_t peak_before = 0;    // planned peak with no recomputation
  int64_t peak = 0;           // planned peak of the graph as left
  int64_t min_peak = 0;       // smallest planned peak found (the smallest feasible budget found)
  int64_t forward_flops = 0;  // estimated FLOPs of the whole step before (estimated_flops)
  int64_t added_flops = 0;    // estimated FLOPs of the recomputation
  std::vector<std::string> recomputed;
  int64_t evaluations = 0;
  int64_t pruned = 0;  // evaluations settled by the liveness bound, without planning the arena
};

// Leaves `graph` with the chosen recomputation when feasible; when not, with the set that gave
// min_peak (the caller reports it). A trial whose liveness bound (lb_sched, which no arena placement
// beats) already reaches the peak to beat is settled by that bound, without planning the arena: the
// same answers, hence the same search and the same result. `prune_by_bound=false` plans every trial
// in full (the reference the tests compare against).
BudgetResult rematerialize_for_budget(ir::Graph& graph, int64_t budget, bool donate, bool prune_by_bound = true);

// Estimated FLOPs of one call node (the cost model the budget search ranks by).
int64_t estimated_flops(const ir::Node& node);

}  // namespace torch_ext::passes
