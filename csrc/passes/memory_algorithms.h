// Memory planning algorithms: a registry keyed by name, apart from the pass that feeds them
// (passes/plan_memory.h). An algorithm places a list of buffers (size and inclusive lifetime)
// in one arena; ir::verify_plan checks every result.
//
// Built-in algorithms are listed in memory_algorithms.def, one line each, and each lives in its own
// file memory_algorithm_<name>.cpp. Adding one is that file and that line. Others can be added at
// run time with register_memory_algorithm.
#pragma once

#include "ir/memory_plan.h"

#include <string>
#include <vector>

namespace torch_ext::passes {

using MemoryAlgorithmFn = ir::ArenaPlan (*)(const std::vector<ir::BufferLife>& buffers);

struct MemoryAlgorithm {
  std::string name;
  MemoryAlgorithmFn plan = nullptr;
  // Tried by plan_best (the planner's default); naive, the no-reuse upper bound, is not.
  bool tried_by_best = false;
};

// Every registered algorithm, built-ins first, in registration order: a snapshot, taken under the
// registry's lock, so a registration on another thread never moves the vector a planner walks.
std::vector<MemoryAlgorithm> memory_algorithms();
// Adds an algorithm; refuses a name already taken.
void register_memory_algorithm(MemoryAlgorithm algorithm);

// Runs the algorithm registered as `name` (checked: a sized first <= last for every buffer); throws
// naming the registered ones on an unknown name. The result's `algorithm` is `name`.
ir::ArenaPlan plan_buffers(const std::string& name, const std::vector<ir::BufferLife>& buffers);
// The smallest arena among the algorithms tried_by_best (the earliest registered wins a tie).
ir::ArenaPlan plan_best(const std::vector<ir::BufferLife>& buffers);

// Helpers for algorithms: the best-fit offset of buffer `b` among the `placed` ones that overlap it
// in lifetime (smallest gap that fits, else the lowest offset past them), and a plan from offsets.
int64_t best_fit_offset(const std::vector<ir::BufferLife>& buffers, const std::vector<int64_t>& offsets,
                        const std::vector<bool>& placed, size_t b);
ir::ArenaPlan arena_plan_of(std::string algorithm, const std::vector<ir::BufferLife>& buffers,
                            std::vector<int64_t> offsets);

}  // namespace torch_ext::passes
