// greedy_by_breadth: the breadth-first variant of Pisarchyk & Lee 2020. Positions by decreasing
// total live bytes; at each position its unplaced buffers by decreasing size, each at its best fit.
#include "passes/memory_algorithms.h"

#include <algorithm>
#include <map>

namespace torch_ext::passes {

ir::ArenaPlan plan_greedy_by_breadth(const std::vector<ir::BufferLife>& buffers) {
  std::map<int64_t, int64_t> live;  // position -> live bytes
  for (const auto& b : buffers)
    for (int64_t t = b.first; t <= b.last; ++t) live[t] += b.size;
  std::vector<std::pair<int64_t, int64_t>> positions(live.begin(), live.end());
  std::stable_sort(positions.begin(), positions.end(),
                   [](const auto& a, const auto& b) { return a.second > b.second; });
  std::vector<int64_t> offsets(buffers.size(), 0);
  std::vector<bool> placed(buffers.size(), false);
  for (const auto& [t, bytes] : positions) {
    std::vector<size_t> here;
    for (size_t i = 0; i < buffers.size(); ++i)
      if (!placed[i] && buffers[i].first <= t && t <= buffers[i].last) here.push_back(i);
    std::stable_sort(here.begin(), here.end(), [&](size_t a, size_t b) { return buffers[a].size > buffers[b].size; });
    for (size_t b : here) {
      offsets[b] = best_fit_offset(buffers, offsets, placed, b);
      placed[b] = true;
    }
  }
  return arena_plan_of("greedy_by_breadth", buffers, std::move(offsets));
}

}  // namespace torch_ext::passes
