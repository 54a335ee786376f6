// Pass: no collective overlaps an all-gather (or any collective but all_reduce and broadcast).
//
// Why: on gloo (torch 2.9), an all_gather_into_tensor that runs while another collective is in
// flight corrupts the heap: a pure-torch loop of _c10d_functional all-gathers, issued together or
// next to in-flight all-reduces and waited later, aborts with "malloc(): unaligned tcache chunk"
// or SIGSEGV in 1 to 4 of 8 two-rank runs; waited one at a time, 0 of 8. All-reduces and
// broadcasts in flight together showed no fault (0 of 12 runs with 24 in flight). This was the
// intermittent crash of the ZeRO-1 data-parallel step (tests/python/test_distributed.py).
// Reproduction without torch_ext: scripts/repro_gloo_all_gather.py.
//
// Requires: a verified graph; every collective's result is read by exactly one wait_tensor.
// Guarantees: the call nodes are reordered into a topological order in which every collective
//             that runs_alone() is issued with no other collective in flight, and its wait comes
//             right after it. Other collectives keep their overlap. Otherwise the order stays the
//             given one as far as possible (a list schedule in its priority). Results cannot
//             change: every op is functional.
#pragma once

#include "ir/graph.h"

#include <vector>

namespace torch_ext::passes {

// A collective that must not overlap another one: every _c10d_functional op but wait_tensor,
// all_reduce and broadcast.
bool runs_alone(const ir::Node& n);

// `order` (call nodes, topological) reordered as the pass guarantees; unchanged without such
// collectives.
std::vector<const ir::Node*> serialize_collectives(const std::vector<const ir::Node*>& order);

// The pass: reorders `g`'s call nodes. Returns whether it moved any.
bool serialize_collectives(ir::Graph& g);

// The first violation of the guarantee in `order`, as a sentence naming the nodes; empty if none.
std::string collective_overlap(const std::vector<const ir::Node*>& order);

}  // namespace torch_ext::passes
