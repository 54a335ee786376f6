// The bookkeeping of a list schedule that re-orders a topological order of call nodes: each
// node's position in the given order (its priority), and the nodes whose inputs among the order
// have all run. Used where an order is re-scheduled under a rule (schedule.cpp's hold_waits,
// serialize_collectives).
#pragma once

#include "ir/graph.h"

#include <unordered_map>
#include <vector>

namespace torch_ext::passes {

class ReadySet {
 public:
  explicit ReadySet(const std::vector<const ir::Node*>& order) {
    for (size_t i = 0; i < order.size(); ++i) rank_[order[i]] = i;
    for (const ir::Node* n : order) {
      size_t m = 0;
      for (const ir::Node* in : n->inputs())
        if (rank_.count(in)) {
          ++m;
          readers_[in].push_back(n);
        }
      missing_[n] = m;
      if (m == 0) ready_.push_back(n);
    }
  }

  // The nodes ready to run, in no particular order.
  const std::vector<const ir::Node*>& ready() const { return ready_; }
  // Position in the given order: lower runs first when the rule allows.
  size_t rank(const ir::Node* n) const { return rank_.at(n); }
  // Runs ready()[i]: removes it, and makes ready the readers whose inputs have now all run.
  const ir::Node* take(size_t i) {
    const ir::Node* n = ready_[i];
    ready_.erase(ready_.begin() + static_cast<std::ptrdiff_t>(i));
    for (const ir::Node* r : readers_[n])
      if (--missing_[r] == 0) ready_.push_back(r);
    return n;
  }

 private:
  std::unordered_map<const ir::Node*, size_t> rank_, missing_;
  std::unordered_map<const ir::Node*, std::vector<const ir::Node*>> readers_;
  std::vector<const ir::Node*> ready_;
};

}  // namespace torch_ext::passes
