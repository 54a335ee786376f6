// greedy_by_size: Pisarchyk & Lee 2020 (TFLite's planner). Buffers by decreasing size (earlier
// first on a tie), each placed at the best-fitting gap among the already placed buffers whose
// lifetimes overlap it (smallest gap that fits, else the lowest offset past them).
#include "passes/memory_algorithms.h"

#include <algorithm>
#include <numeric>

namespace torch_ext::passes {

ir::ArenaPlan plan_greedy_by_size(const std::vector<ir::BufferLife>& buffers) {
  std::vector<size_t> order(buffers.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (buffers[a].size != buffers[b].size) return buffers[a].size > buffers[b].size;
    return buffers[a].first < buffers[b].first;
  });
  std::vector<int64_t> offsets(buffers.size(), 0);
  std::vector<bool> placed(buffers.size(), false);
  for (size_t b : order) {
    offsets[b] = best_fit_offset(buffers, offsets, placed, b);
    placed[b] = true;
  }
  return arena_plan_of("greedy_by_size", buffers, std::move(offsets));
}

}  // namespace torch_ext::passes
