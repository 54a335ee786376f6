// Pass (analysis): liveness-based global memory plan for a pure step, in the graph's current order.
//
// Requires: a verified, side-effect-free graph (no Tensor(a!) schema); refuses one that still
//           mutates an input, naming the node.
// Guarantees: changes nothing in the graph. Returns an ir::MemoryPlan (ir/memory_plan.h) that
// passes ir::verify_memory_plan, holding
//   * one Buffer per storage-owning intermediate value (tuple elements separately; views and
//     getitems share their source's storage and extend its lifetime), with an inclusive
//     lifetime [first, last] over call positions;
//   * in-place aliases W_t -> W_{t+1} (and every optimizer-state slot) for each
//     torch_ext::*_update node whose state inputs are read by nothing scheduled after it; an
//     alias that would be unsafe is refused with the reason, and the output then needs its own
//     storage;
//   * the buffers a node writes through its out= overload (ir::find_out_variant) placed in an
//     arena; the others, which their kernels allocate, counted at their largest live sum;
//   * an arena plan (passes::plan_best over the registered algorithms, memory_algorithms.h)
//     checked by ir::verify_plan, the lower bound of the order (LB_sched) and the lower bound over
//     every order (LB_graph);
//   * the views of arena buffers (alias-of), and each scheduled node's phase (forward, backward,
//     update; step_phases below).
// Values that reach the graph output (directly or through views) escape: they are allocated
// outside the arena and counted in `escaping_bytes`.
#pragma once

#include "ir/graph.h"
#include "ir/memory_plan.h"

#include <vector>

namespace torch_ext::passes {

// Without `with_lb_graph`, lb_graph is left 0 (it costs n^2/4 bytes; searches that only compare
// peaks skip it).
ir::MemoryPlan plan_memory(const ir::Graph& graph, bool donate, bool with_lb_graph = true);

// LB_graph: a lower bound on peak_bytes() over every topological order of the call nodes and every
// arena placement (definition and proof in plan_memory.cpp). LB_graph <= lb_sched() of any order.
// Up to `max_exact_nodes` call nodes it is exact to its definition; beyond, a weaker bound that
// needs no n^2 bitsets.
int64_t graph_lower_bound(const ir::Graph& graph, bool donate, size_t max_exact_nodes = 8192);

// The simulated peak (persistent + escaping + largest live bytes) of running `order`.
int64_t simulate_peak(const ir::Graph& graph, const std::vector<const ir::Node*>& order, bool donate);

// The phase of each node of `order` (call nodes of `graph`), decided by structure: forward when
// output 0 (the loss) depends on it, update for an ir::is_update_op node and the getitems of its
// results, backward otherwise.
std::vector<ir::StepPhase> step_phases(const ir::Graph& graph, const std::vector<const ir::Node*>& order);

}  // namespace torch_ext::passes
