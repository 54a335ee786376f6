#include "passes/schedule.h"

#include "ir/higher_order.h"
#include "ir/schema.h"
#include "ir/users.h"
#include "passes/plan_memory.h"
#include "passes/ready_set.h"
#include "passes/serialize_collectives.h"

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

// aten::_unsafe_view and wait_tensor alias their input although their schemas say otherwise.
bool is_alias(const ir::Node& n) {
  return n.target().is_getitem() || ir::is_view_op(n) || ir::returns_input_storage(n);
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

// Kahn's algorithm's starting state, shared by every topological scheduler here: each call's
// count of unscheduled predecessors, its successors, and the calls ready at once (in graph order).
struct Kahn {
  std::unordered_map<const ir::Node*, size_t> missing;
  std::unordered_map<const ir::Node*, std::vector<const ir::Node*>> succ;
  std::vector<const ir::Node*> ready;
};

Kahn kahn_start(const Dag& d) {
  Kahn k;
  for (const ir::Node* n : d.calls) {
    auto it = d.preds.find(n);
    k.missing[n] = it != d.preds.end() ? it->second.size() : 0;
    if (it != d.preds.end())
      for (const ir::Node* p : it->second) k.succ[p].push_back(n);
    if (k.missing[n] == 0) k.ready.push_back(n);
  }
  return k;
}

// Generic list scheduler: repeatedly picks the ready node with the smallest key.
Order list_schedule(const Dag& d, const std::function<double(const ir::Node*, const std::unordered_set<const ir::Node*>&)>& key) {
  Kahn k = kahn_start(d);
  auto& [missing, succ, ready] = k;
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
    for (const ir::Node* u : ir::transitive_users(a.node, is_alias))
      if (u != upd && !done.count(u)) return false;
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

// Beam search over the ready set, on a storage-level model of live bytes: each non-alias call
// node owns one storage (its outputs together); views and getitems share their base's; a storage
// dies after its last reader unless it reaches the graph output. An update whose overwritten
// state nobody else still reads writes in place (allocates nothing). Alias nodes and such updates
// never raise live bytes, so they run as soon as they are ready; otherwise each of the
// kBeamWidth partial orders (ranked by their outlook, see below, then peak so far, live bytes and
// closeness to the export order) tries its kBeamBranch best ready nodes and its earliest one in
// the export order.
// Exact peaks come from simulate_peak().
constexpr size_t kBeamWidth = 16;
constexpr size_t kBeamMaxNodes = 4000;  // beyond this the search costs more than it tends to gain
constexpr size_t kBeamBranch = 4;

std::vector<Order> beam_schedule(const ir::Graph& g, const Dag& d) {
  const size_t n = d.calls.size();
  std::unordered_map<const ir::Node*, size_t> idx;
  for (size_t i = 0; i < n; ++i) idx[d.calls[i]] = i;
  std::vector<int64_t> root(n), bytes(n, 0);
  for (size_t i = 0; i < n; ++i) {
    const ir::Node* c = d.calls[i];
    root[i] = static_cast<int64_t>(i);
    if (is_alias(*c)) {
      const ir::Arg& base = c->args().at(0);
      root[i] = base.kind == ir::Arg::Kind::Node && base.node->kind() == ir::NodeKind::Call ? root[idx.at(base.node)] : -1;
    } else {
      bytes[i] = out_bytes(c);
    }
  }
  // Distinct storages each node reads, and how many nodes read each storage.
  std::vector<std::vector<size_t>> reads(n);
  std::vector<int32_t> readers(n, 0);
  for (size_t i = 0; i < n; ++i) {
    for (const ir::Node* in : d.calls[i]->inputs()) {
      if (in->kind() != ir::NodeKind::Call || root[idx.at(in)] < 0) continue;
      const size_t r = static_cast<size_t>(root[idx.at(in)]);
      if (std::find(reads[i].begin(), reads[i].end(), r) == reads[i].end()) reads[i].push_back(r);
    }
    for (size_t r : reads[i]) ++readers[r];
  }
  std::vector<bool> keep(n, false);  // reaches the output or a control-flow node: never freed here
  auto mark = [&](const ir::Node* v) {
    if (v->kind() == ir::NodeKind::Call && root[idx.at(v)] >= 0) keep[root[idx.at(v)]] = true;
  };
  g.output()->args()[0].for_each_node([&](ir::Node* v) { mark(v); });
  for (const ir::Node* c : d.calls)
    if (const ir::HigherOrderOp* hop = ir::find_higher_order(c->target()); hop && hop->outputs_may_alias_operands)
      for (const ir::Node* in : c->inputs()) mark(in);
  // For each update: the other nodes that read the state it overwrites (through aliases).
  std::vector<std::vector<size_t>> blockers(n);
  std::vector<bool> is_update(n, false);
  for (size_t i = 0; i < n; ++i) {
    const ir::Node* u = d.calls[i];
    if (!ir::is_update_op(*u)) continue;
    is_update[i] = true;
    for (size_t a : ir::update_replaced_args(*u)) {
      if (a >= u->args().size()) break;
      const ir::Arg& arg = u->args()[a];
      if (arg.kind != ir::Arg::Kind::Node || arg.node->kind() != ir::NodeKind::Placeholder) continue;
      for (const ir::Node* r : ir::transitive_users(arg.node, is_alias))
        if (r != u) blockers[i].push_back(idx.at(r));
    }
  }
  std::vector<std::vector<size_t>> succ(n);
  std::vector<int32_t> npred(n, 0);
  for (size_t i = 0; i < n; ++i)
    if (d.preds.count(d.calls[i]))
      for (const ir::Node* p : d.preds.at(d.calls[i])) {
        succ[idx.at(p)].push_back(i);
        ++npred[i];
      }

  struct State {
    std::vector<bool> done;
    std::vector<int32_t> missing, left;  // unscheduled preds per node; unscheduled readers per storage
    std::vector<size_t> ready;
    Order order;
    int64_t live = 0, peak = 0, rank_sum = 0;
    size_t big = 0;  // first unscheduled node in by_size
  };
  // Nodes that allocate, largest first (updates excluded: they mostly write in place).
  std::vector<size_t> by_size;
  for (size_t i = 0; i < n; ++i)
    if (bytes[i] > 0 && root[i] == static_cast<int64_t>(i) && !is_update[i]) by_size.push_back(i);
  std::stable_sort(by_size.begin(), by_size.end(), [&](size_t a, size_t b) { return bytes[a] > bytes[b]; });
  // The largest allocation still to come, `skip` counted as done.
  auto next_big = [&](const State& s, size_t skip) -> int64_t {
    for (size_t k = s.big; k < by_size.size(); ++k)
      if (!s.done[by_size[k]] && by_size[k] != skip) return bytes[by_size[k]];
    return 0;
  };
  // What a partial order is headed for: a greedy order that defers a big allocation looks cheap
  // until it must make it on top of everything it kept alive meanwhile, so rank by the peak so
  // far and by the live bytes plus the largest allocation still to come.
  auto outlook = [&](const State& s) { return std::max(s.peak, s.live + next_big(s, n)); };
  auto alloc_of = [&](const State& s, size_t i) -> int64_t {
    if (is_update[i] && std::all_of(blockers[i].begin(), blockers[i].end(), [&](size_t b) { return s.done[b]; }))
      return 0;
    return bytes[i];
  };
  // Live bytes after running i, and the high-water mark while it runs.
  auto effect = [&](const State& s, size_t i, int64_t& during, int64_t& after) {
    const int64_t a = alloc_of(s, i);
    during = s.live + a;
    after = during;
    if (a > 0 && readers[i] == 0 && !keep[i]) after -= a;
    for (size_t r : reads[i])
      if (s.left[r] == 1 && !keep[r]) after -= bytes[r];
  };
  auto run = [&](State& s, size_t i) {
    int64_t during = 0, after = 0;
    effect(s, i, during, after);
    s.peak = std::max(s.peak, during);
    s.live = after;
    for (size_t r : reads[i]) --s.left[r];
    s.done[i] = true;
    while (s.big < by_size.size() && s.done[by_size[s.big]]) ++s.big;
    s.order.push_back(d.calls[i]);
    s.rank_sum += static_cast<int64_t>(i) * static_cast<int64_t>(s.order.size());
    s.ready.erase(std::find(s.ready.begin(), s.ready.end(), i));
    for (size_t v : succ[i])
      if (--s.missing[v] == 0) s.ready.push_back(v);
  };
  auto run_free = [&](State& s) {  // alias nodes and in-place updates first
    for (bool again = true; again;) {
      again = false;
      for (size_t i : s.ready)
        if (root[i] != static_cast<int64_t>(i) || (is_update[i] && alloc_of(s, i) == 0)) {
          run(s, i);
          again = true;
          break;
        }
    }
  };
  auto better = [&](const State& a, const State& b) {
    const int64_t oa = outlook(a), ob = outlook(b);
    if (oa != ob) return oa < ob;
    if (a.peak != b.peak) return a.peak < b.peak;
    if (a.live != b.live) return a.live < b.live;
    return a.rank_sum < b.rank_sum;
  };

  State start;
  start.done.assign(n, false);
  start.missing = npred;
  start.left = readers;
  for (size_t i = 0; i < n; ++i)
    if (npred[i] == 0) start.ready.push_back(i);
  run_free(start);
  std::vector<State> beam{std::move(start)};
  auto unfinished = [](const State& s) { return !s.ready.empty(); };
  while (std::any_of(beam.begin(), beam.end(), unfinished)) {
    std::vector<State> next;
    for (State& s : beam) {
      if (!unfinished(s)) {
        next.push_back(std::move(s));
        continue;
      }
      std::vector<std::tuple<int64_t, int64_t, size_t>> options;  // (child's outlook, after, node)
      for (size_t i : s.ready) {
        int64_t during = 0, after = 0;
        effect(s, i, during, after);
        options.emplace_back(std::max({s.peak, during, after + next_big(s, i)}), after, i);
      }
      std::sort(options.begin(), options.end());
      // The kBeamBranch cheapest nodes, and the earliest in the export order (which keeps the
      // export and update-asap orders reachable).
      std::vector<size_t> picks;
      for (size_t k = 0; k < options.size() && k < kBeamBranch; ++k) picks.push_back(std::get<2>(options[k]));
      const size_t first = *std::min_element(s.ready.begin(), s.ready.end());
      if (std::find(picks.begin(), picks.end(), first) == picks.end()) picks.push_back(first);
      for (size_t i : picks) {
        State c = s;
        run(c, i);
        run_free(c);
        next.push_back(std::move(c));
      }
    }
    std::sort(next.begin(), next.end(), better);
    beam.clear();
    for (State& s : next) {
      if (beam.size() == kBeamWidth) break;
      // Two partial orders of the same node set differ only in their peak so far: keep the better.
      if (std::any_of(beam.begin(), beam.end(), [&](const State& b) { return b.done == s.done; })) continue;
      beam.push_back(std::move(s));
    }
  }
  std::vector<Order> out;
  for (State& s : beam) {
    TORCH_INTERNAL_ASSERT(s.order.size() == n, "schedule: the graph has a cycle");
    out.push_back(std::move(s.order));
  }
  return out;
}

// Collectives (_c10d_functional ops other than wait_tensor) are asynchronous: issued, they run
// while the order goes on, until their wait_tensor. In `order`:
//   1. each collective moves to right after its latest input (its producers that feed nothing
//      else move up first, e.g. the 1/world scale before an all_reduce);
//   2. a wait is held back until the next collective has been issued (a list schedule in `order`'s
//      priority where a wait whose collective is the latest issued yields to any other ready
//      node), so each all-reduce runs under the backward that makes the next gradient, and what
//      reads the wait (the update) follows it; a memory-minded order that updates right after each
//      gradient would otherwise wait on every all-reduce at once;
//   3. each wait moves to right before its first reader.
// Returns `order` unchanged without collectives.
using ir::is_collective;

// Step 2 of overlap_collectives: `order` rescheduled in its own priority, a wait yielding to every
// other ready node until a collective issued after its own one has run.
Order hold_waits(const Order& order) {
  ReadySet rs(order);
  std::unordered_map<const ir::Node*, size_t> issued_at;
  size_t issued = 0;  // collectives issued so far
  Order out;
  while (!rs.ready().empty()) {
    const auto& ready = rs.ready();
    auto held = [&](const ir::Node* n) {
      if (!ir::is_collective_wait(*n)) return false;
      const ir::Node* c = n->args().at(0).node;
      return issued_at.count(c) && issued_at.at(c) == issued;  // its collective is the latest issued
    };
    size_t best = ready.size();
    for (size_t pass = 0; pass < 2 && best == ready.size(); ++pass)
      for (size_t i = 0; i < ready.size(); ++i)
        if ((pass == 1 || !held(ready[i])) && (best == ready.size() || rs.rank(ready[i]) < rs.rank(ready[best])))
          best = i;
    const ir::Node* n = rs.take(best);
    out.push_back(n);
    if (is_collective(*n)) issued_at[n] = ++issued;
  }
  TORCH_INTERNAL_ASSERT(out.size() == order.size(), "hold_waits: the order is not a DAG");
  return out;
}

Order overlap_collectives(const Order& order) {
  if (std::none_of(order.begin(), order.end(), [](const ir::Node* n) { return is_collective(*n); })) return order;
  std::vector<const ir::Node*> seq(order.begin(), order.end());
  auto position = [&](const ir::Node* n) { return std::find(seq.begin(), seq.end(), n) - seq.begin(); };
  std::function<void(const ir::Node*)> hoist = [&](const ir::Node* n) {
    for (const ir::Node* in : n->inputs())
      if (in->kind() == ir::NodeKind::Call && in->users().size() == 1 && !is_collective(*in)) hoist(in);
    std::ptrdiff_t at = 0;  // first position after every input
    for (const ir::Node* in : n->inputs())
      if (in->kind() == ir::NodeKind::Call) at = std::max(at, position(in) + 1);
    const std::ptrdiff_t from = position(n);
    if (at >= from) return;
    seq.erase(seq.begin() + from);
    seq.insert(seq.begin() + at, n);
  };
  for (const ir::Node* n : order)
    if (is_collective(*n)) hoist(n);
  seq = hold_waits(seq);
  for (const ir::Node* n : order)  // the rescheduling may have put ready nodes of lower priority in between
    if (is_collective(*n)) hoist(n);
  for (const ir::Node* n : order) {
    if (!ir::is_collective_wait(*n)) continue;
    const std::ptrdiff_t from = position(n);
    std::ptrdiff_t to = static_cast<std::ptrdiff_t>(seq.size());  // before the first reader
    for (const ir::Node* u : n->users())
      if (u->kind() == ir::NodeKind::Call) to = std::min(to, position(u));
    if (to <= from + 1) continue;
    seq.erase(seq.begin() + from);
    seq.insert(seq.begin() + (to - 1), n);
  }
  return serialize_collectives(seq);  // all-gathers run alone (serialize_collectives.h)
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

  // frees-most: the ready node whose run changes live bytes the least (frees the most). A greedy
  // rule; it can lose to update-asap (issue 17), hence the beam search and the minimum below.
  candidates.emplace_back("frees-most", list_schedule(d, [&](const ir::Node* n, const auto& done) {
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

  if (d.calls.size() <= kBeamMaxNodes) {
    std::vector<Order> finals = beam_schedule(g, d);
    const Order* best = nullptr;
    int64_t best_peak = std::numeric_limits<int64_t>::max();
    for (const Order& o : finals) {
      const int64_t p = simulate_peak(g, o, donate);
      if (p < best_peak) {
        best_peak = p;
        best = &o;
      }
    }
    if (best) candidates.emplace_back("beam", *best);
  }

  // BFS and DFS topological orders (Kahn with a queue, with a stack).
  for (const bool depth_first : {false, true}) {
    Kahn k = kahn_start(d);
    auto& [missing, succ, ready] = k;
    std::deque<const ir::Node*> work(ready.begin(), ready.end());
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

  // least-peak: the smallest simulated peak of all candidates (the first on ties), so it is never
  // worse than any of them.
  ScheduleResult result;
  int64_t best_peak = std::numeric_limits<int64_t>::max();
  const Order* best = nullptr;
  for (auto& [name, order] : candidates) {
    order = overlap_collectives(order);
    const int64_t peak = simulate_peak(g, order, donate);
    result.candidates.emplace_back(name, peak);
    if (peak < best_peak) {
      best_peak = peak;
      best = &order;
      result.chosen = name;
    }
  }
  result.candidates.emplace_back("least-peak", best_peak);
  std::vector<ir::Node*> chosen;
  for (const ir::Node* n : *best) chosen.push_back(g.find(n->name()));
  g.reorder_calls(chosen);
  return result;
}

}  // namespace torch_ext::passes
