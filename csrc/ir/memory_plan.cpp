#include "ir/memory_plan.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <optional>
#include <unordered_map>
#include <utility>

namespace torch_ext::ir {
namespace {

bool overlaps(const BufferLife& a, const BufferLife& b) { return a.first <= b.last && b.first <= a.last; }

// Offset and bounds checks, then the first pair (i, j) that overlaps in both lifetime and bytes.
std::optional<std::pair<size_t, size_t>> first_overlap(const std::vector<BufferLife>& buffers, const ArenaPlan& plan,
                                                       const std::function<std::string(size_t)>& name) {
  TORCH_CHECK(plan.offsets.size() == buffers.size(), "plan has ", plan.offsets.size(), " offsets for ", buffers.size(),
              " buffers");
  for (size_t i = 0; i < buffers.size(); ++i) {
    const int64_t off = plan.offsets[i];
    TORCH_CHECK(off >= 0 && off % kArenaAlignment == 0, "plan verifier: buffer ", name(i), " has offset ", off,
                " (must be non-negative and ", kArenaAlignment, "-byte aligned)");
    TORCH_CHECK(off + buffers[i].size <= plan.arena_bytes, "plan verifier: buffer ", name(i), " [", off, ", ",
                off + buffers[i].size, ") leaves the arena of ", plan.arena_bytes, " bytes");
  }
  std::vector<size_t> order(buffers.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return plan.offsets[a] < plan.offsets[b]; });
  // Pairwise on address-sorted buffers: stop scanning once addresses no longer overlap.
  for (size_t x = 0; x < order.size(); ++x) {
    const size_t i = order[x];
    for (size_t y = x + 1; y < order.size(); ++y) {
      const size_t j = order[y];
      if (plan.offsets[j] >= plan.offsets[i] + buffers[i].size) break;
      if (overlaps(buffers[i], buffers[j])) return std::make_pair(i, j);
    }
  }
  return std::nullopt;
}

std::string describe(const std::string& name, const BufferLife& b, int64_t offset) {
  return name + " [" + std::to_string(offset) + ", " + std::to_string(offset + b.size) + ") live [" +
         std::to_string(b.first) + ", " + std::to_string(b.last) + "]";
}

std::string value_name(const Node* node, int64_t elem) {
  return "%" + node->name() + (elem >= 0 ? "[" + std::to_string(elem) + "]" : "");
}

}  // namespace

int64_t align_up(int64_t bytes, int64_t alignment) { return (bytes + alignment - 1) / alignment * alignment; }

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
  const auto bad = first_overlap(buffers, plan, [](size_t i) { return std::to_string(i); });
  if (!bad) return;
  const auto [i, j] = *bad;
  TORCH_CHECK(false, "plan verifier: buffers ", describe(std::to_string(i), buffers[i], plan.offsets[i]), " and ",
              describe(std::to_string(j), buffers[j], plan.offsets[j]), " overlap in both lifetime and storage");
}

const char* to_string(StepPhase phase) {
  constexpr const char* kNames[] = {"forward", "backward", "update"};  // in enum order
  return kNames[static_cast<int>(phase)];
}

int64_t MemoryPlan::aliases_applied() const {
  return std::count_if(aliases.begin(), aliases.end(), [](const AliasDecision& d) { return d.applied; });
}

int64_t MemoryPlan::aliases_refused() const { return static_cast<int64_t>(aliases.size()) - aliases_applied(); }

void verify_memory_plan(const MemoryPlan& plan) {
  TORCH_CHECK(plan.phases.size() == plan.order.size(), "plan verifier: ", plan.phases.size(), " phases for ",
              plan.order.size(), " scheduled nodes");
  std::unordered_map<const Node*, int64_t> pos;
  for (size_t i = 0; i < plan.order.size(); ++i) pos[plan.order[i]] = static_cast<int64_t>(i);
  const int64_t end = static_cast<int64_t>(plan.order.size());
  auto check_life = [&](const PlannedBuffer& b) {
    auto it = pos.find(b.node);
    TORCH_CHECK(it != pos.end(), "plan verifier: buffer ", value_name(b.node, b.elem), " is not produced by a scheduled node");
    TORCH_CHECK(b.life.size > 0 && b.life.first == it->second && b.life.first <= b.life.last && b.life.last < end,
                "plan verifier: buffer ", value_name(b.node, b.elem), " of ", b.life.size, " bytes live [", b.life.first,
                ", ", b.life.last, "] must start at its producer's position ", it->second, " and end before ", end);
  };
  std::vector<BufferLife> lives;
  for (const PlannedBuffer& b : plan.buffers) {
    check_life(b);
    lives.push_back(b.life);
  }
  for (const PlannedBuffer& b : plan.dynamic) check_life(b);
  auto name = [&](size_t i) { return value_name(plan.buffers[i].node, plan.buffers[i].elem); };
  if (const auto bad = first_overlap(lives, plan.arena, name)) {
    const auto [i, j] = *bad;
    TORCH_CHECK(false, "plan verifier: buffers ", describe(name(i), lives[i], plan.arena.offsets[i]), " and ",
                describe(name(j), lives[j], plan.arena.offsets[j]),
                " overlap in both lifetime and storage, and neither is an alias of the other");
  }
  for (const PlannedView& v : plan.views) {
    TORCH_CHECK(v.buffer < plan.buffers.size(), "plan verifier: view ", value_name(v.node, v.elem), " aliases buffer #",
                v.buffer, " of ", plan.buffers.size());
    const BufferLife& base = lives[v.buffer];
    if (v.first >= base.first && v.last <= base.last) continue;
    // The view outlives its storage: name a buffer that reuses those bytes meanwhile, if any.
    const BufferLife view{base.size, v.first, v.last};
    const int64_t off = plan.arena.offsets[v.buffer];
    std::string reused;
    for (size_t j = 0; j < lives.size() && reused.empty(); ++j)
      if (j != v.buffer && overlaps(lives[j], view) && plan.arena.offsets[j] < off + base.size &&
          off < plan.arena.offsets[j] + lives[j].size)
        reused = "; " + describe(name(j), lives[j], plan.arena.offsets[j]) + " reuses its bytes meanwhile";
    TORCH_CHECK(false, "plan verifier: view ", value_name(v.node, v.elem), " live [", v.first, ", ", v.last,
                "] aliases buffer ", describe(name(v.buffer), base, off), " and outlives it", reused);
  }
}

}  // namespace torch_ext::ir
