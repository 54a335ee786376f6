#include "passes/plan_memory.h"

#include "ir/higher_order.h"
#include "ir/out_variant.h"
#include "ir/schema.h"
#include "ir/users.h"
#include "passes/memory_algorithms.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>
#include <unordered_map>

namespace torch_ext::passes {
namespace {

using ValueKey = std::pair<const ir::Node*, int64_t>;  // (node, tuple element or -1)

std::vector<int64_t> elems_of(const ir::Type& t) {
  if (t.kind == ir::Type::Kind::Tuple) {
    std::vector<int64_t> out;
    for (size_t i = 0; i < t.elems.size(); ++i) out.push_back(static_cast<int64_t>(i));
    return out;
  }
  return {-1};
}

const ir::Type& elem_type(const ir::Type& t, int64_t elem) { return elem < 0 ? t : t.elems.at(elem); }

int64_t bytes_of(const ir::Type& t) { return t.is_tensor() ? t.tensor.nbytes() : 0; }

// A view in storage: schema views, and the calls ir::returns_input_storage names (aten::_unsafe_view,
// which returns a view of its input although its schema declares a fresh tensor; wait_tensor,
// which returns the collective's output). Planning one as fresh lets the arena reuse its base
// while the view is still read, or returned, or while a collective still writes it.
bool shares_input_storage(const ir::Node& n) { return ir::is_view_op(n) || ir::returns_input_storage(n); }

// Every node that reads `root`'s storage: readers of the node and, through views and getitems, of
// everything that shares it.
std::vector<const ir::Node*> storage_readers(const ir::Node* root) {
  return ir::transitive_users(root, [](const ir::Node& u) { return shares_input_storage(u) || u.target().is_getitem(); });
}

// State inputs an update op may overwrite, with the output element that replaces each.
std::vector<std::pair<const ir::Node*, int64_t>> aliasable_inputs(const ir::Node& upd) {
  std::vector<std::pair<const ir::Node*, int64_t>> out;
  const bool tuple = upd.type().kind == ir::Type::Kind::Tuple;
  const auto replaced = ir::update_replaced_args(upd);
  for (size_t i = 0; i < replaced.size(); ++i) {
    const size_t arg = replaced[i];
    if (arg >= upd.args().size() || upd.args()[arg].kind != ir::Arg::Kind::Node) continue;
    const ir::Node* in = upd.args()[arg].node;
    if (in->kind() != ir::NodeKind::Placeholder || in->role() == ir::InputRole::UserInput) continue;
    out.emplace_back(in, tuple ? static_cast<int64_t>(i) : -1);
  }
  return out;
}

struct Analysis {
  std::vector<ir::PlannedBuffer> buffers;  // arena buffers only
  std::vector<ir::PlannedView> views;      // with record_views: aliases of `buffers` (index into it)
  std::vector<std::vector<const ir::Node*>> readers;  // per arena buffer: every call node reading its storage
  std::vector<ir::AliasDecision> aliases;
  int64_t persistent = 0;
  int64_t escaping = 0;
  int64_t lower_bound = 0;
};

// With `assume_all_aliases`, every update with a state input to overwrite is taken as aliased,
// whatever the order: the fewest buffers any order can have (used by graph_lower_bound). With
// `record_views`, the values sharing an arena buffer's storage are listed too (plan_memory).
Analysis analyze(const ir::Graph& g, const std::vector<const ir::Node*>& order, bool donate,
                 bool assume_all_aliases = false, bool record_views = false) {
  Analysis a;
  std::unordered_map<const ir::Node*, int64_t> pos;
  for (size_t i = 0; i < order.size(); ++i) pos[order[i]] = static_cast<int64_t>(i);
  for (const ir::Node* p : g.placeholders()) a.persistent += bytes_of(p->type());

  // Alias decisions for update ops.
  std::map<ValueKey, const ir::Node*> aliased_to;  // update output -> placeholder whose storage it reuses
  for (const ir::Node* n : order) {
    if (!ir::is_update_op(*n)) continue;
    ir::AliasDecision d;
    d.update = n;
    if (!donate) {
      d.reason = "state is not donated";
      a.aliases.push_back(d);
      continue;
    }
    const auto inputs = aliasable_inputs(*n);
    for (const auto& [in, elem] : inputs) {
      if (assume_all_aliases) break;
      for (const ir::Node* r : storage_readers(in)) {
        if (r == n || pos.at(r) < pos.at(n)) continue;
        d.reason = "%" + in->name() + " is read by %" + r->name() + " after the update";
        break;
      }
      if (!d.reason.empty()) break;
    }
    d.applied = d.reason.empty() && !inputs.empty();
    if (inputs.empty()) d.reason = "no state input to overwrite";
    if (d.applied)
      for (const auto& [in, elem] : inputs) aliased_to[{n, elem}] = in;
    a.aliases.push_back(d);
  }

  // Storage roots: buffer index, or -1 for placeholder storage.
  std::map<ValueKey, int64_t> root;
  std::vector<ir::PlannedBuffer> all;
  std::map<ValueKey, ir::PlannedView> views;  // with record_views; `buffer` indexes `all` here
  auto add_view = [&](const ir::Node* n, int64_t e, int64_t r, int64_t at) {
    if (record_views && r >= 0) views[{n, e}] = ir::PlannedView{n, e, static_cast<size_t>(r), at, at};
  };
  for (const ir::Node* p : g.placeholders()) root[{p, -1}] = -1;
  for (const ir::Node* n : order) {
    const int64_t at = pos.at(n);
    if (n->target().is_getitem()) {
      const ir::Node* src = n->args()[0].node;
      root[{n, -1}] = root.at({src, n->args()[1].i});
      add_view(n, -1, root[{n, -1}], at);
      continue;
    }
    if (shares_input_storage(*n)) {
      // Views (split's Tensor(a)[] included) share their base's storage, element by element.
      const ir::Arg& base = n->args().at(0);
      const int64_t r = base.kind == ir::Arg::Kind::Node ? root.at({base.node, -1}) : -1;
      for (int64_t e : elems_of(n->type())) {
        root[{n, e}] = r;
        add_view(n, e, r, at);
      }
      continue;
    }
    for (int64_t e : elems_of(n->type())) {
      if (aliased_to.count({n, e}) || bytes_of(elem_type(n->type(), e)) == 0) {
        root[{n, e}] = -1;
        continue;
      }
      root[{n, e}] = static_cast<int64_t>(all.size());
      ir::PlannedBuffer b;
      b.node = n;
      b.elem = e;
      b.life = {bytes_of(elem_type(n->type(), e)), at, at};
      all.push_back(b);
    }
  }
  // Reads extend lifetimes.
  std::vector<std::vector<const ir::Node*>> readers(all.size());
  for (const ir::Node* n : order) {
    const int64_t at = pos.at(n);
    for (const ir::Node* in : n->inputs()) {
      for (int64_t e : elems_of(in->type())) {
        auto it = root.find({in, e});
        if (it == root.end() || it->second < 0) continue;
        all[it->second].life.last = std::max(all[it->second].life.last, at);
        auto& r = readers[it->second];
        if (r.empty() || r.back() != n) r.push_back(n);
        if (!views.empty())
          if (auto v = views.find({in, e}); v != views.end()) v->second.last = std::max(v->second.last, at);
      }
    }
  }
  // Escaping values live beyond the step: outside the arena. A control-flow node may hand an operand
  // straight through (an identity branch), so its operands escape too.
  std::vector<bool> escapes(all.size(), false);
  for (const ir::Node* n : order) {
    const ir::HigherOrderOp* hop = ir::find_higher_order(n->target());
    if (hop == nullptr || !hop->outputs_may_alias_operands) continue;
    for (const ir::Node* in : n->inputs())
      for (int64_t e : elems_of(in->type())) {
        auto it = root.find({in, e});
        if (it != root.end() && it->second >= 0) escapes[it->second] = true;
      }
  }
  g.output()->args()[0].for_each_node([&](ir::Node* n) {
    for (int64_t e : elems_of(n->type())) {
      auto it = root.find({n, e});
      if (it != root.end() && it->second >= 0) escapes[it->second] = true;
    }
  });
  std::vector<ir::BufferLife> lives;
  std::vector<int64_t> kept(all.size(), -1);  // index in a.buffers
  for (size_t i = 0; i < all.size(); ++i) {
    if (escapes[i]) {
      a.escaping += all[i].life.size;
      continue;
    }
    kept[i] = static_cast<int64_t>(a.buffers.size());
    a.buffers.push_back(all[i]);
    a.readers.push_back(std::move(readers[i]));
    lives.push_back(all[i].life);
  }
  a.lower_bound = ir::lower_bound_bytes(lives);
  for (auto& [key, v] : views) {
    if (kept[v.buffer] < 0) continue;
    v.buffer = static_cast<size_t>(kept[v.buffer]);
    a.views.push_back(v);
  }
  // Deterministic: by definition position, then element.
  std::stable_sort(a.views.begin(), a.views.end(), [](const ir::PlannedView& x, const ir::PlannedView& y) {
    return x.first != y.first ? x.first < y.first : x.elem < y.elem;
  });
  return a;
}

std::vector<const ir::Node*> call_order(const ir::Graph& g) {
  std::vector<const ir::Node*> order;
  for (const auto& n : g.nodes())
    if (n->kind() == ir::NodeKind::Call) order.push_back(n.get());
  return order;
}

}  // namespace

int64_t simulate_peak(const ir::Graph& g, const std::vector<const ir::Node*>& order, bool donate) {
  Analysis a = analyze(g, order, donate);
  return a.persistent + a.escaping + a.lower_bound;
}

// LB_graph: a lower bound on peak_bytes() over every topological order and every arena placement.
//
// Cost model (the one peak_bytes() uses): persistent + escaping + arena_bytes + dynamic_bytes,
// where every non-escaping buffer lives over its inclusive lifetime [producer, last storage
// reader], either in the arena (arena_bytes = max(offset + align_up(size)) with 64-aligned
// offsets) or, when its kernel allocates it (no out= kernel), among the dynamic buffers, whose
// dynamic_bytes is the largest sum of align_up(size) live at one position.
//
// Definition. Take every update with a state input as aliased (A*). For a call node n, let
// S(n) be the arena buffers b (under A*) whose producer p_b is n or an ancestor of n and which
// some reader r of b's storage is n or a descendant of (if b has no reader: n == p_b). Then
//   LB_graph = persistent + escaping(A*) + max_n sum_{b in S(n)} align_up(size_b).
//
// Proof that LB_graph <= peak_bytes() of any order O and any placement:
//  1. Buffers only grow when an alias is refused: a refused alias turns an update output into a
//     new buffer (arena or escaping) and changes no other buffer's lifetime. So buffers(O) is a
//     superset of buffers(A*) with the same lifetimes, and escaping(O) >= escaping(A*).
//  2. In O, p_b comes no later than n (ancestor) and r no earlier (descendant), so every
//     b in S(n) has first <= pos(n) <= last: all of S(n) is live at pos(n).
//  3. Buffers live at one position have overlapping lifetimes, so a verified placement gives
//     them disjoint byte ranges. Their offsets are multiples of 64, so the ranges stay disjoint
//     when each size is rounded up to 64, and all end within arena_bytes (itself the largest
//     offset + align_up(size)). Hence arena_bytes >= sum_{b in S(n), b in the arena}
//     align_up(size_b), and dynamic_bytes >= the same sum over the dynamic b in S(n) (all live at
//     pos(n)), so arena_bytes + dynamic_bytes >= sum_{b in S(n)} align_up(size_b) for every n.
//  4. persistent depends on the graph only. Adding 1-3 gives the bound.
// The same argument with S(n) replaced by every buffer live at pos(n) in the chosen order proves
// LB_sched = persistent + escaping + lower_bound_bytes(lives) <= peak_bytes() for that order.
// Every order's live set at pos(n) contains S(n), so LB_graph <= LB_sched of any order.
//
// The ancestor/descendant bitsets take n^2/4 bytes. Beyond `max_exact_nodes` call nodes, S(n)
// shrinks to the buffers n produces or reads (a subset, so still a bound, and weaker).
int64_t graph_lower_bound(const ir::Graph& g, bool donate, size_t max_exact_nodes) {
  const std::vector<const ir::Node*> order = call_order(g);  // a topological order
  const Analysis a = analyze(g, order, donate, /*assume_all_aliases=*/true);
  const size_t n = order.size(), words = (n + 63) / 64;
  std::unordered_map<const ir::Node*, size_t> idx;
  for (size_t i = 0; i < n; ++i) idx[order[i]] = i;
  if (n > max_exact_nodes) {
    std::vector<int64_t> local(n, 0);
    for (size_t b = 0; b < a.buffers.size(); ++b) {
      const int64_t bytes = ir::align_up(a.buffers[b].life.size);
      std::vector<size_t> at{idx.at(a.buffers[b].node)};
      for (const ir::Node* r : a.readers[b]) at.push_back(idx.at(r));
      std::sort(at.begin(), at.end());
      at.erase(std::unique(at.begin(), at.end()), at.end());
      for (size_t i : at) local[i] += bytes;
    }
    return a.persistent + a.escaping + (n ? *std::max_element(local.begin(), local.end()) : 0);
  }
  // anc[i]: i and its ancestors; desc[i]: i and its descendants (call nodes only), as bitsets.
  std::vector<std::vector<uint64_t>> anc(n, std::vector<uint64_t>(words, 0)), desc = anc;
  auto set = [](std::vector<uint64_t>& b, size_t i) { b[i / 64] |= uint64_t{1} << (i % 64); };
  auto merge = [](std::vector<uint64_t>& into, const std::vector<uint64_t>& from) {
    for (size_t w = 0; w < into.size(); ++w) into[w] |= from[w];
  };
  for (size_t i = 0; i < n; ++i) {
    set(anc[i], i);
    for (const ir::Node* in : order[i]->inputs())
      if (in->kind() == ir::NodeKind::Call) merge(anc[i], anc[idx.at(in)]);
  }
  for (size_t i = n; i-- > 0;) {
    set(desc[i], i);
    for (const ir::Node* u : order[i]->users())
      if (u->kind() == ir::NodeKind::Call) merge(desc[i], desc[idx.at(u)]);
  }
  std::vector<int64_t> must_live(n, 0);
  std::vector<uint64_t> reach(words);
  for (size_t b = 0; b < a.buffers.size(); ++b) {
    const size_t p = idx.at(a.buffers[b].node);
    std::fill(reach.begin(), reach.end(), 0);
    set(reach, p);
    for (const ir::Node* r : a.readers[b]) merge(reach, anc[idx.at(r)]);
    const int64_t bytes = ir::align_up(a.buffers[b].life.size);
    for (size_t w = 0; w < words; ++w) {
      uint64_t bits = reach[w] & desc[p][w];
      while (bits) {
        const int bit = __builtin_ctzll(bits);
        bits &= bits - 1;
        must_live[w * 64 + bit] += bytes;
      }
    }
  }
  const int64_t arena = n ? *std::max_element(must_live.begin(), must_live.end()) : 0;
  return a.persistent + a.escaping + arena;
}

ir::MemoryPlan plan_memory(const ir::Graph& g, bool donate, bool with_lb_graph) {
  for (const auto& n : g.nodes()) {
    if (n->kind() != ir::NodeKind::Call || n->target().is_builtin() || ir::is_higher_order(n->target())) continue;
    const c10::FunctionSchema* s = ir::find_schema(n->target());
    TORCH_CHECK(s != nullptr && !s->is_mutable(), "plan_memory: node %", n->name(), " (", n->target().str(),
                ") mutates its inputs; plan a pure graph (make_train_step output)");
  }
  ir::MemoryPlan plan;
  plan.order = call_order(g);
  plan.phases = step_phases(g, plan.order);
  Analysis a = analyze(g, plan.order, donate, /*assume_all_aliases=*/false, /*record_views=*/true);
  plan.aliases = std::move(a.aliases);
  plan.persistent_bytes = a.persistent;
  plan.escaping_bytes = a.escaping;
  plan.lower_bound = a.lower_bound;
  plan.lb_graph = with_lb_graph ? graph_lower_bound(g, donate) : 0;
  // A node writes into the arena when it has an out= overload with a kernel of its own and every
  // one of its results is an arena buffer; the other buffers are allocated by their kernels.
  std::unordered_map<const ir::Node*, size_t> arena_elems;
  for (const auto& b : a.buffers) ++arena_elems[b.node];
  std::unordered_map<const ir::Node*, bool> writes_arena;
  for (const auto& [node, count] : arena_elems) {
    const size_t results = node->type().kind == ir::Type::Kind::Tuple ? node->type().elems.size() : 1;
    writes_arena[node] = count == results && ir::find_out_variant(*node).has_value();
  }
  // The arena is held for the whole step, the kernel-allocated buffers only while live, so a
  // buffer the allocator can hold under the kernel-allocated peak costs nothing outside the
  // arena. Largest first, move such nodes (all their results together) out of the arena: the
  // dynamic peak stays, and the arena can only shrink.
  const size_t positions = plan.order.size() + 1;
  std::vector<int64_t> dyn_live(positions, 0);
  auto add_life = [&](const ir::BufferLife& l, int64_t sign) {
    for (int64_t t = l.first; t <= l.last; ++t) dyn_live[t] += sign * ir::align_up(l.size);
  };
  for (const auto& b : a.buffers)
    if (!writes_arena.at(b.node)) add_life(b.life, 1);
  const int64_t dyn_peak = *std::max_element(dyn_live.begin(), dyn_live.end());
  std::vector<const ir::Node*> by_size;
  std::unordered_map<const ir::Node*, int64_t> node_bytes;
  for (const auto& b : a.buffers)
    if (writes_arena.at(b.node) && (node_bytes[b.node] += b.life.size) == b.life.size) by_size.push_back(b.node);
  std::stable_sort(by_size.begin(), by_size.end(),
                   [&](const ir::Node* x, const ir::Node* y) { return node_bytes.at(x) > node_bytes.at(y); });
  for (const ir::Node* n : by_size) {
    for (const auto& b : a.buffers)
      if (b.node == n) add_life(b.life, 1);
    if (*std::max_element(dyn_live.begin(), dyn_live.end()) <= dyn_peak) {
      writes_arena[n] = false;
      continue;
    }
    for (const auto& b : a.buffers)
      if (b.node == n) add_life(b.life, -1);
  }
  std::vector<ir::BufferLife> lives, dynamic_lives;
  std::vector<int64_t> arena_index(a.buffers.size(), -1);
  for (size_t i = 0; i < a.buffers.size(); ++i) {
    ir::PlannedBuffer& b = a.buffers[i];
    if (writes_arena.at(b.node)) {
      arena_index[i] = static_cast<int64_t>(plan.buffers.size());
      lives.push_back(b.life);
      plan.buffers.push_back(std::move(b));
    } else {
      dynamic_lives.push_back(b.life);
      plan.dynamic.push_back(std::move(b));
    }
  }
  plan.dynamic_bytes = ir::lower_bound_bytes(dynamic_lives);
  plan.arena = lives.empty() ? ir::ArenaPlan{"empty", {}, 0} : plan_best(lives);
  // Two pools peak apart: when that costs more than leaving every buffer to the allocator (whose
  // peak is then the largest live sum, a.lower_bound), do that instead (no arena).
  if (!lives.empty() && plan.arena.arena_bytes + plan.dynamic_bytes > a.lower_bound) {
    for (auto& b : plan.buffers) plan.dynamic.push_back(std::move(b));
    plan.buffers.clear();
    std::stable_sort(plan.dynamic.begin(), plan.dynamic.end(), [](const ir::PlannedBuffer& x, const ir::PlannedBuffer& y) {
      return x.life.first < y.life.first;
    });
    plan.dynamic_bytes = a.lower_bound;
    lives.clear();
    plan.arena = ir::ArenaPlan{"none (allocator)", {}, 0};
  }
  // Views of buffers left to the allocator need no checking: only arena bytes are reused.
  for (ir::PlannedView& v : a.views) {
    if (plan.buffers.empty() || arena_index[v.buffer] < 0) continue;
    v.buffer = static_cast<size_t>(arena_index[v.buffer]);
    plan.views.push_back(v);
  }
  ir::verify_plan(lives, plan.arena);
  return plan;
}

std::vector<ir::StepPhase> step_phases(const ir::Graph& g, const std::vector<const ir::Node*>& order) {
  std::unordered_map<const ir::Node*, ir::StepPhase> phase;
  const ir::Node* out = g.output();
  std::vector<const ir::Node*> work;
  if (out && !out->args().empty() && !out->args()[0].list.empty() && out->args()[0].list[0].kind == ir::Arg::Kind::Node)
    work.push_back(out->args()[0].list[0].node);
  while (!work.empty()) {
    const ir::Node* n = work.back();
    work.pop_back();
    if (n->kind() != ir::NodeKind::Call || !phase.emplace(n, ir::StepPhase::Forward).second) continue;
    for (const ir::Node* in : n->inputs()) work.push_back(in);
  }
  std::vector<ir::StepPhase> out_phases;
  for (const ir::Node* n : order) {
    auto it = phase.find(n);
    if (it == phase.end()) {
      const bool update = ir::is_update_op(*n) || (n->target().is_getitem() && n->args()[0].kind == ir::Arg::Kind::Node &&
                                                   ir::is_update_op(*n->args()[0].node));
      it = phase.emplace(n, update ? ir::StepPhase::Update : ir::StepPhase::Backward).first;
    }
    out_phases.push_back(it->second);
  }
  return out_phases;
}

}  // namespace torch_ext::passes
