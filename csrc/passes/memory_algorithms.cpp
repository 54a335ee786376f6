#include "passes/memory_algorithms.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <mutex>
#include <optional>

namespace torch_ext::passes {

#define TORCH_EXT_MEMORY_ALGORITHM(name, tried) ir::ArenaPlan plan_##name(const std::vector<ir::BufferLife>& buffers);
#include "passes/memory_algorithms.def"
#undef TORCH_EXT_MEMORY_ALGORITHM

namespace {

bool overlaps(const ir::BufferLife& a, const ir::BufferLife& b) { return a.first <= b.last && b.first <= a.last; }

void check_buffers(const std::vector<ir::BufferLife>& buffers) {
  for (size_t i = 0; i < buffers.size(); ++i)
    TORCH_CHECK(buffers[i].size > 0 && buffers[i].first <= buffers[i].last, "buffer ", i,
                ": needs size > 0 and first <= last, got size ", buffers[i].size, " [", buffers[i].first, ", ",
                buffers[i].last, "]");
}

// Built on first use (no static constructors); register_memory_algorithm appends under the mutex.
std::vector<MemoryAlgorithm>& registry() {
  static std::vector<MemoryAlgorithm> algorithms{
#define TORCH_EXT_MEMORY_ALGORITHM(name, tried) MemoryAlgorithm{#name, &plan_##name, tried},
#include "passes/memory_algorithms.def"
#undef TORCH_EXT_MEMORY_ALGORITHM
  };
  return algorithms;
}

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

std::vector<MemoryAlgorithm> memory_algorithms() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  return registry();
}

void register_memory_algorithm(MemoryAlgorithm algorithm) {
  TORCH_CHECK(algorithm.plan != nullptr, "register_memory_algorithm: '", algorithm.name, "' has no plan function");
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (const MemoryAlgorithm& a : registry())
    TORCH_CHECK(a.name != algorithm.name, "register_memory_algorithm: '", algorithm.name, "' is already registered");
  registry().push_back(std::move(algorithm));
}

ir::ArenaPlan plan_buffers(const std::string& name, const std::vector<ir::BufferLife>& buffers) {
  std::string known;
  for (const MemoryAlgorithm& a : memory_algorithms()) {
    if (a.name == name) {
      check_buffers(buffers);
      ir::ArenaPlan plan = a.plan(buffers);
      plan.algorithm = name;
      return plan;
    }
    known += (known.empty() ? "" : ", ") + a.name;
  }
  TORCH_CHECK(false, "unknown memory planning algorithm '", name, "' (expected one of: ", known, ")");
}

ir::ArenaPlan plan_best(const std::vector<ir::BufferLife>& buffers) {
  std::optional<ir::ArenaPlan> best;
  for (const MemoryAlgorithm& a : memory_algorithms()) {
    if (!a.tried_by_best) continue;
    ir::ArenaPlan p = plan_buffers(a.name, buffers);
    if (!best || p.arena_bytes < best->arena_bytes) best = std::move(p);
  }
  TORCH_INTERNAL_ASSERT(best.has_value(), "no memory planning algorithm is tried by plan_best");
  return *best;
}

int64_t best_fit_offset(const std::vector<ir::BufferLife>& buffers, const std::vector<int64_t>& offsets,
                        const std::vector<bool>& placed, size_t b) {
  std::vector<std::pair<int64_t, int64_t>> taken;  // [begin, end) of overlapping placed buffers
  for (size_t j = 0; j < buffers.size(); ++j)
    if (placed[j] && overlaps(buffers[j], buffers[b]))
      taken.emplace_back(offsets[j], offsets[j] + ir::align_up(buffers[j].size));
  std::sort(taken.begin(), taken.end());
  const int64_t need = ir::align_up(buffers[b].size);
  int64_t best = -1, best_gap = INT64_MAX, cursor = 0;
  for (const auto& [begin, end] : taken) {
    const int64_t gap = begin - cursor;
    if (gap >= need && gap < best_gap) {
      best = cursor;
      best_gap = gap;
    }
    cursor = std::max(cursor, end);
  }
  return best >= 0 ? best : cursor;
}

ir::ArenaPlan arena_plan_of(std::string algorithm, const std::vector<ir::BufferLife>& buffers,
                            std::vector<int64_t> offsets) {
  ir::ArenaPlan plan;
  plan.algorithm = std::move(algorithm);
  for (size_t i = 0; i < buffers.size(); ++i)
    plan.arena_bytes = std::max(plan.arena_bytes, offsets[i] + ir::align_up(buffers[i].size));
  plan.offsets = std::move(offsets);
  return plan;
}

}  // namespace torch_ext::passes
