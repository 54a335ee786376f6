// Pass (analysis): liveness-based global memory plan for a pure step, in the graph's current order.
//
// Requires: a verified, side-effect-free graph (no Tensor(a!) schema); refuses one that still
//           mutates an input, naming the node.
// Guarantees: changes nothing in the graph. Returns
//   * one Buffer per storage-owning intermediate value (tuple elements separately; views and
//     getitems share their source's storage and extend its lifetime), with an inclusive
//     lifetime [first, last] over call positions;
//   * in-place aliases W_t -> W_{t+1} (and every optimizer-state slot) for each
//     torch_ext::*_update node whose state inputs are read by nothing scheduled after it; an
//     alias that would be unsafe is refused with the reason, and the output then needs its own
//     storage;
//   * the buffers a node writes through its out= overload (ir::find_out_variant) placed in an
//     arena; the others, which their kernels allocate, counted at their largest live sum;
//   * an arena plan (the smaller of greedy-by-size and greedy-by-breadth) checked by
//     runtime::verify_plan, the lower bound of the order (LB_sched) and the lower bound over every
//     order (LB_graph).
// Values that reach the graph output (directly or through views) escape: they are allocated
// outside the arena and counted in `escaping_bytes`.
#pragma once

#include "ir/graph.h"
#include "runtime/memory_plan.h"

#include <string>
#include <vector>

namespace torch_ext::passes {

struct PlannedBuffer {
  const ir::Node* node = nullptr;  // producer
  int64_t elem = -1;               // tuple element, -1 for a single tensor
  runtime::BufferLife life;
};

struct AliasDecision {
  const ir::Node* update = nullptr;  // the torch_ext::*_update node
  bool applied = false;
  std::string reason;  // why it was refused
};

struct MemoryPlan {
  std::vector<const ir::Node*> order;  // call nodes in schedule order
  std::vector<PlannedBuffer> buffers;  // in the arena (arena.offsets[i] is buffers[i]'s)
  // Buffers their kernels allocate (no out= overload with a kernel of its own, or a tuple result
  // with an element outside the arena, or moved out of the arena because they fit under the peak
  // of those), and the largest sum of them live at one position.
  std::vector<PlannedBuffer> dynamic;
  int64_t dynamic_bytes = 0;
  runtime::ArenaPlan arena;
  std::vector<AliasDecision> aliases;
  int64_t persistent_bytes = 0;  // placeholders: state and batch
  int64_t escaping_bytes = 0;    // outputs not written in place into donated state
  int64_t lower_bound = 0;       // largest live arena bytes at any position (LB_sched minus persistent)
  int64_t lb_graph = 0;          // graph_lower_bound(): no order or placement has a smaller peak_bytes()

  int64_t aliases_applied() const;
  int64_t aliases_refused() const;
  int64_t peak_bytes() const { return persistent_bytes + escaping_bytes + arena.arena_bytes + dynamic_bytes; }
  int64_t lb_sched() const { return persistent_bytes + escaping_bytes + lower_bound; }
};

// Without `with_lb_graph`, lb_graph is left 0 (it costs n^2/4 bytes; searches that only compare
// peaks skip it).
MemoryPlan plan_memory(const ir::Graph& graph, bool donate, bool with_lb_graph = true);

// LB_graph: a lower bound on peak_bytes() over every topological order of the call nodes and every
// arena placement (definition and proof in plan_memory.cpp). LB_graph <= lb_sched() of any order.
// Up to `max_exact_nodes` call nodes it is exact to its definition; beyond, a weaker bound that
// needs no n^2 bitsets.
int64_t graph_lower_bound(const ir::Graph& graph, bool donate, size_t max_exact_nodes = 8192);

// The simulated peak (persistent + escaping + largest live bytes) of running `order`.
int64_t simulate_peak(const ir::Graph& graph, const std::vector<const ir::Node*>& order, bool donate);

}  // namespace torch_ext::passes
