#include "passes/memory_analysis.h"

#include "passes/memory_algorithms.h"

#include <algorithm>

namespace torch_ext::passes {
namespace {

// Arena buffers then kernel-allocated ones: the order the separate plans see their buffers in.
std::vector<const ir::PlannedBuffer*> all_buffers(const ir::MemoryPlan& plan) {
  std::vector<const ir::PlannedBuffer*> out;
  for (const auto& b : plan.buffers) out.push_back(&b);
  for (const auto& b : plan.dynamic) out.push_back(&b);
  return out;
}

}  // namespace

SeparatePlanning plan_phases_separately(const ir::MemoryPlan& plan) {
  SeparatePlanning r;
  const auto buffers = all_buffers(plan);
  for (const ir::StepPhase part : {ir::StepPhase::Forward, ir::StepPhase::Backward, ir::StepPhase::Update}) {
    int64_t start = -1, end = -1;
    for (size_t i = 0; i < plan.phases.size(); ++i) {
      if (plan.phases[i] != part) continue;
      if (start < 0) start = static_cast<int64_t>(i);
      end = static_cast<int64_t>(i);
    }
    if (start < 0) {
      r.parts.emplace_back(part, 0);
      continue;
    }
    std::vector<ir::BufferLife> lives;
    int64_t carried_in = 0;  // produced by an earlier program, read here: an input of this one
    for (const ir::PlannedBuffer* b : buffers) {
      const int64_t produced_at = b->life.first;
      if (plan.phases.at(produced_at) == part)
        lives.push_back({b->life.size, b->life.first, std::min(b->life.last, end)});
      else if (produced_at < start && b->life.last >= start)
        carried_in += b->life.size;
    }
    int64_t arena = 0;
    if (!lives.empty()) {
      const ir::ArenaPlan p = plan_best(lives);
      ir::verify_plan(lives, p);
      arena = p.arena_bytes;
    }
    r.parts.emplace_back(part, plan.persistent_bytes + carried_in + arena);
    r.total += r.parts.back().second;
  }
  return r;
}

std::vector<int64_t> live_timeline(const ir::MemoryPlan& plan) {
  std::vector<int64_t> live(plan.order.size(), plan.persistent_bytes + plan.escaping_bytes);
  for (const ir::PlannedBuffer* b : all_buffers(plan))
    for (int64_t t = b->life.first; t <= b->life.last; ++t) live.at(t) += b->life.size;
  return live;
}

}  // namespace torch_ext::passes
