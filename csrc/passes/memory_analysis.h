// Analyses of a memory plan for the memory report (torch_ext.memory_report formats and plots
// them; it computes nothing itself).
//
// Both read only the plan value: its order, phases, buffers (arena and kernel-allocated) and the
// persistent and escaping bytes.
#pragma once

#include "ir/memory_plan.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace torch_ext::passes {

// The step planned as three separate programs, forward, backward and update (the plan's phases),
// run one after another: each is planned on its own (plan_best over the buffers its nodes produce,
// their lifetimes cut at its last node) and holds the persistent bytes plus every earlier buffer it
// still reads (its inputs). The peaks add up, since nothing is shared between programs.
struct SeparatePlanning {
  std::vector<std::pair<ir::StepPhase, int64_t>> parts;  // forward, backward, update; 0 for an empty one
  int64_t total = 0;
};
SeparatePlanning plan_phases_separately(const ir::MemoryPlan& plan);

// Bytes live at each position of the plan's order: persistent + escaping + the (unaligned) sizes of
// the buffers live there.
std::vector<int64_t> live_timeline(const ir::MemoryPlan& plan);

}  // namespace torch_ext::passes
