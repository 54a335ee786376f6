#include "passes/schedule.h"

#include "ir/schema.h"
#include "passes/plan_memory.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <deque>
#include <functional>
#include <limits>
#include <unordered_map>
#include <unordered_set>

namespace torch_ext::passes {
namespace {

using Order = std::vector<const ir::Node*>;

// aten::_unsafe_view aliases its input although its schema says otherwise (see plan_memory.cpp).
bool is_alias(const ir::Node& n) {
  return n.target().is_getitem() || ir::is_view_op(n) || (n.target().ns == "aten" && n.target().name == "_unsafe_view");
}

struct Dag {
  Order calls;
  std::unordered_map<const ir::Node*, size_t> rank;  // position in the current order
  std::unordered_map<const ir::Node*, std::vector<const ir::Node*>> preds;
};

Dag build(const ir::Graph& g) {
  Dag d;
  for (const auto& n : g.nodes())
    if (n->kind() == ir::NodeKind::Call) {
      d.rank[n.get()] = d.calls.size();
      d.calls.push_back(n.get());
    }
  for (const ir::Node* n : d.calls)
    for (const ir::Node* in : n->inputs())
      if (in->kind() == ir::NodeKind::Call) d.preds[n].push_back(in);
  return d;
}

// Generic list scheduler: repeatedly picks the ready node with the smallest key.
Order list_schedule(const Dag& d, const std::function<double(const ir::Node*, const std::unordered_set<const ir::Node*>&)>& key) {
  std::unordered_map<const ir::Node*, size_t> missing;
  std::unordered_map<const ir::Node*, std::vector<const ir::Node*>> succ;
  std::vector<const ir::Node*> ready;
  for (const ir::Node* n : d.calls) {
    missing[n] = d.preds.count(n) ? d.preds.at(n).size() : 0;
    if (d.preds.count(n))
      for (const ir::Node* p : d.preds.at(n)) succ[p].push_back(n);
    if (missing[n] == 0) ready.push_back(n);
  }
  Order order;
  std::unordered_set<const ir::Node*> done;
  while (!ready.empty()) {
    size_t best = 0;
    double best_key = std::numeric_limits<double>::infinity();
    for (size_t i = 0; i < ready.size(); ++i) {
      const double k = key(ready[i], done);
      if (k < best_key || (k == best_key && d.rank.at(ready[i]) < d.rank.at(ready[best]))) {
        best = i;
        best_key = k;
      }
    }
    const ir::Node* n = ready[best];
    ready.erase(ready.begin() + static_cast<std::ptrdiff_t>(best));
    order.push_back(n);
    done.insert(n);
    if (succ.count(n))
      for (const ir::Node* s : succ.at(n))
        if (--missing[s] == 0) ready.push_back(s);
  }
  TORCH_INTERNAL_ASSERT(order.size() == d.calls.size(), "schedule: the graph has a cycle");
  return order;
}

// Readers (through views/getitems) of each state input an update may overwrite.
bool update_is_safe(const ir::Node* upd, const std::unordered_set<const ir::Node*>& done) {
  // Only the inputs the update overwrites matter (param, then its state slots after the grad);
  // read-only inputs such as the group's lr are shared by every update.
  for (size_t idx : ir::update_replaced_args(*upd)) {
    if (idx >= upd->args().size()) break;
    const ir::Arg& a = upd->args()[idx];
    if (a.kind != ir::Arg::Kind::Node || a.node->kind() != ir::NodeKind::Placeholder) continue;
    std::vector<const ir::Node*> work{a.node};
    while (!work.empty()) {
      const ir::Node* v = work.back();
      work.pop_back();
      for (const ir::Node* u : v->users()) {
        if (u == upd || u->kind() != ir::NodeKind::Call) continue;
        if (!done.count(u)) return false;
        if (is_alias(*u)) work.push_back(u);
      }
    }
  }
  return true;
}

int64_t out_bytes(const ir::Node* n) {
  if (is_alias(*n)) return 0;
  const ir::Type& t = n->type();
  if (t.is_tensor()) return t.tensor.nbytes();
  int64_t b = 0;
  for (const auto& e : t.elems)
    if (e.is_tensor()) b += e.tensor.nbytes();
  return b;
}

}  // namespace

ScheduleResult schedule(ir::Graph& g, bool donate) {
  const Dag d = build(g);
  std::vector<std::pair<std::string, Order>> candidates;
  candidates.emplace_back("export", d.calls);

  // update-asap: original order, but an update (and its getitems) runs as soon as it is ready
  // and no unscheduled node still reads the state it overwrites.
  candidates.emplace_back("update-asap", list_schedule(d, [&](const ir::Node* n, const auto& done) {
                            if (ir::is_update_op(*n) && update_is_safe(n, done)) return -2.0;
                            // Views and getitems cost nothing and unblock the updates that read them.
                            if (is_alias(*n)) return -1.0;
                            return static_cast<double>(d.rank.at(n));
                          }));

  // least-peak-first: the ready node whose run changes live bytes the least (frees the most).
  candidates.emplace_back("least-peak", list_schedule(d, [&](const ir::Node* n, const auto& done) {
                            double delta = ir::is_update_op(*n) && update_is_safe(n, done) ? 0.0 : static_cast<double>(out_bytes(n));
                            for (const ir::Node* in : n->inputs()) {
                              if (in->kind() != ir::NodeKind::Call || is_alias(*in)) continue;
                              size_t left = 0;
                              for (const ir::Node* u : in->users())
                                if (u != n && !done.count(u)) ++left;
                              if (left == 0) delta -= static_cast<double>(out_bytes(in));
                            }
                            return delta + 1e-9 * static_cast<double>(d.rank.at(n));
                          }));

  // BFS and DFS topological orders (Kahn with a queue, with a stack).
  for (const bool depth_first : {false, true}) {
    std::unordered_map<const ir::Node*, size_t> missing;
    std::unordered_map<const ir::Node*, std::vector<const ir::Node*>> succ;
    std::deque<const ir::Node*> work;
    for (const ir::Node* n : d.calls) {
      missing[n] = d.preds.count(n) ? d.preds.at(n).size() : 0;
      if (d.preds.count(n))
        for (const ir::Node* p : d.preds.at(n)) succ[p].push_back(n);
      if (missing[n] == 0) work.push_back(n);
    }
    Order order;
    while (!work.empty()) {
      const ir::Node* n = depth_first ? work.back() : work.front();
      depth_first ? work.pop_back() : work.pop_front();
      order.push_back(n);
      if (succ.count(n))
        for (const ir::Node* s : succ.at(n))
          if (--missing[s] == 0) work.push_back(s);
    }
    candidates.emplace_back(depth_first ? "dfs" : "bfs", order);
  }

  ScheduleResult result;
  int64_t best_peak = std::numeric_limits<int64_t>::max();
  const Order* best = nullptr;
  for (const auto& [name, order] : candidates) {
    const int64_t peak = simulate_peak(g, order, donate);
    result.candidates.emplace_back(name, peak);
    if (peak < best_peak) {
      best_peak = peak;
      best = &order;
      result.chosen = name;
    }
  }
  std::vector<ir::Node*> chosen;
  for (const ir::Node* n : *best) chosen.push_back(g.find(n->name()));
  g.reorder_calls(chosen);
  return result;
}

}  // namespace torch_ext::passes
