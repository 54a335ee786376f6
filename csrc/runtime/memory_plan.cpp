#include "runtime/memory_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <numeric>

namespace torch_ext::runtime {
namespace {

bool overlaps(const BufferLife& a, const BufferLife& b) { return a.first <= b.last && b.first <= a.last; }

void check_buffers(const std::vector<BufferLife>& buffers) {
  for (size_t i = 0; i < buffers.size(); ++i)
    TORCH_CHECK(buffers[i].size > 0 && buffers[i].first <= buffers[i].last, "buffer ", i,
                ": needs size > 0 and first <= last, got size ", buffers[i].size, " [", buffers[i].first, ", ",
                buffers[i].last, "]");
}

// Best-fit offset for buffer `b` given the already placed ones.
int64_t best_fit(const std::vector<BufferLife>& buffers, const std::vector<int64_t>& offsets,
                 const std::vector<bool>& placed, size_t b) {
  std::vector<std::pair<int64_t, int64_t>> taken;  // [begin, end) of overlapping placed buffers
  for (size_t j = 0; j < buffers.size(); ++j)
    if (placed[j] && overlaps(buffers[j], buffers[b]))
      taken.emplace_back(offsets[j], offsets[j] + align_up(buffers[j].size));
  std::sort(taken.begin(), taken.end());
  const int64_t need = align_up(buffers[b].size);
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

ArenaPlan finish(std::string name, const std::vector<BufferLife>& buffers, std::vector<int64_t> offsets) {
  ArenaPlan plan;
  plan.algorithm = std::move(name);
  for (size_t i = 0; i < buffers.size(); ++i)
    plan.arena_bytes = std::max(plan.arena_bytes, offsets[i] + align_up(buffers[i].size));
  plan.offsets = std::move(offsets);
  return plan;
}

}  // namespace

int64_t align_up(int64_t bytes, int64_t alignment) { return (bytes + alignment - 1) / alignment * alignment; }

ArenaPlan plan_greedy_by_size(const std::vector<BufferLife>& buffers) {
  check_buffers(buffers);
  std::vector<size_t> order(buffers.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    if (buffers[a].size != buffers[b].size) return buffers[a].size > buffers[b].size;
    return buffers[a].first < buffers[b].first;
  });
  std::vector<int64_t> offsets(buffers.size(), 0);
  std::vector<bool> placed(buffers.size(), false);
  for (size_t b : order) {
    offsets[b] = best_fit(buffers, offsets, placed, b);
    placed[b] = true;
  }
  return finish("greedy_by_size", buffers, std::move(offsets));
}

ArenaPlan plan_greedy_by_breadth(const std::vector<BufferLife>& buffers) {
  check_buffers(buffers);
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
      offsets[b] = best_fit(buffers, offsets, placed, b);
      placed[b] = true;
    }
  }
  return finish("greedy_by_breadth", buffers, std::move(offsets));
}

ArenaPlan plan_naive(const std::vector<BufferLife>& buffers) {
  check_buffers(buffers);
  std::vector<int64_t> offsets(buffers.size());
  int64_t cursor = 0;
  for (size_t i = 0; i < buffers.size(); ++i) {
    offsets[i] = cursor;
    cursor += align_up(buffers[i].size);
  }
  return finish("naive", buffers, std::move(offsets));
}

ArenaPlan plan_buffers(const std::string& algorithm, const std::vector<BufferLife>& buffers) {
  if (algorithm == "greedy_by_size") return plan_greedy_by_size(buffers);
  if (algorithm == "greedy_by_breadth") return plan_greedy_by_breadth(buffers);
  if (algorithm == "naive") return plan_naive(buffers);
  TORCH_CHECK(false, "unknown memory planning algorithm '", algorithm,
              "' (expected greedy_by_size, greedy_by_breadth or naive)");
}

ArenaPlan plan_best(const std::vector<BufferLife>& buffers) {
  ArenaPlan a = plan_greedy_by_size(buffers);
  ArenaPlan b = plan_greedy_by_breadth(buffers);
  return b.arena_bytes < a.arena_bytes ? b : a;
}

int64_t lower_bound_bytes(const std::vector<BufferLife>& buffers) {
  std::map<int64_t, int64_t> delta;
  for (const auto& b : buffers) {
    delta[b.first] += align_up(b.size);
    delta[b.last + 1] -= align_up(b.size);
  }
  int64_t live = 0, peak = 0;
  for (const auto& [t, d] : delta) {
    live += d;
    peak = std::max(peak, live);
  }
  return peak;
}

void verify_plan(const std::vector<BufferLife>& buffers, const ArenaPlan& plan) {
  TORCH_CHECK(plan.offsets.size() == buffers.size(), "plan has ", plan.offsets.size(), " offsets for ", buffers.size(),
              " buffers");
  std::vector<size_t> order(buffers.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return plan.offsets[a] < plan.offsets[b]; });
  for (size_t i = 0; i < buffers.size(); ++i) {
    const int64_t off = plan.offsets[i];
    TORCH_CHECK(off >= 0 && off % kArenaAlignment == 0, "plan verifier: buffer ", i, " has offset ", off,
                " (must be non-negative and ", kArenaAlignment, "-byte aligned)");
    TORCH_CHECK(off + buffers[i].size <= plan.arena_bytes, "plan verifier: buffer ", i, " [", off, ", ",
                off + buffers[i].size, ") leaves the arena of ", plan.arena_bytes, " bytes");
  }
  // Pairwise on address-sorted buffers: stop scanning once addresses no longer overlap.
  for (size_t x = 0; x < order.size(); ++x) {
    const size_t i = order[x];
    for (size_t y = x + 1; y < order.size(); ++y) {
      const size_t j = order[y];
      if (plan.offsets[j] >= plan.offsets[i] + buffers[i].size) break;
      TORCH_CHECK(!overlaps(buffers[i], buffers[j]), "plan verifier: buffers ", i, " [", plan.offsets[i], ", ",
                  plan.offsets[i] + buffers[i].size, ") live [", buffers[i].first, ", ", buffers[i].last, "] and ", j,
                  " [", plan.offsets[j], ", ", plan.offsets[j] + buffers[j].size, ") live [", buffers[j].first, ", ",
                  buffers[j].last, "] overlap in both lifetime and storage");
    }
  }
}

}  // namespace torch_ext::runtime
