#include "passes/rematerialize.h"

#include "ir/schema.h"
#include "passes/plan_memory.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/enum_tag.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <functional>
#include <set>
#include <unordered_map>
#include <unordered_set>

namespace torch_ext::passes {
namespace {

using ir::Node;

// Shares its input's storage: getitems, schema views, and aten::_unsafe_view (see plan_memory.cpp).
bool is_alias(const Node& n) {
  return n.target().is_getitem() || ir::is_view_op(n) || (n.target().ns == "aten" && n.target().name == "_unsafe_view");
}

// The node owning `v`'s storage: through getitems and views to the first non-alias.
const Node* owner(const Node* v) {
  while (v->kind() == ir::NodeKind::Call && is_alias(*v) && !v->args().empty() &&
         v->args()[0].kind == ir::Arg::Kind::Node)
    v = v->args()[0].node;
  return v;
}

// Dropout with its generator state as an argument (thread_rng): the same input and state give the
// same mask and output, so a clone draws exactly what the original drew. Its third result, the
// advanced state, is left unread in the clone. Other torch_ext ops (updates, collectives) are not
// forward activations or must not run twice.
bool is_seeded_dropout(const Node& n) {
  return n.target().ns == "torch_ext" && n.target().name == "native_dropout_rng";
}

// getitem(<seeded dropout>, 2): the advanced generator state, which no backward node reads.
bool is_state_of_seeded_dropout(const Node& n) {
  return n.kind() == ir::NodeKind::Call && n.target().is_getitem() && n.args().size() == 2 &&
         n.args()[0].kind == ir::Arg::Kind::Node && is_seeded_dropout(*n.args()[0].node) &&
         n.args()[1].kind == ir::Arg::Kind::Int && n.args()[1].i == 2;
}

struct Forward {
  std::unordered_set<const Node*> nodes;  // call nodes the loss depends on
  std::unordered_set<const Node*> saved;  // forward owners whose storage a backward node reads
  std::unordered_set<const Node*> outputs;  // owners of graph outputs
};

Forward find_forward(const ir::Graph& g) {
  Forward f;
  const auto& outs = g.output()->args()[0];
  TORCH_CHECK(outs.kind == ir::Arg::Kind::List && !outs.list.empty() && outs.list[0].kind == ir::Arg::Kind::Node,
              "rematerialize: output 0 must be the loss node");
  std::vector<const Node*> work{outs.list[0].node};
  while (!work.empty()) {
    const Node* n = work.back();
    work.pop_back();
    if (n->kind() != ir::NodeKind::Call || !f.nodes.insert(n).second) continue;
    for (const Node* in : n->inputs()) work.push_back(in);
  }
  for (const auto& n : g.nodes()) {
    if (n->kind() != ir::NodeKind::Call || f.nodes.count(n.get())) continue;
    for (const Node* in : n->inputs())
      if (in->kind() == ir::NodeKind::Call && f.nodes.count(in)) f.saved.insert(owner(in));
  }
  // The advanced generator state a seeded dropout returns is a graph output (the step's new rng state), but
  // its output and mask are not: the clone's draw is the same, and the original keeps returning the state.
  outs.for_each_node([&](Node* n) {
    if (!is_state_of_seeded_dropout(*n)) f.outputs.insert(owner(n));
  });
  return f;
}

// A functional, deterministic aten/prims op with tensor results: rerunning it gives the same bits.
bool recomputable(const Node& n) {
  if (n.kind() != ir::NodeKind::Call || is_alias(n) || !n.regions().empty()) return false;
  if (n.target().ns != "aten" && n.target().ns != "prims" && !is_seeded_dropout(n)) return false;
  auto op = ir::find_op(n.target());
  if (!op || op->schema().is_mutable() || op->hasTag(at::Tag::nondeterministic_seeded)) return false;
  if (n.type().is_tensor()) return true;
  if (n.type().kind != ir::Type::Kind::Tuple) return false;
  return std::all_of(n.type().elems.begin(), n.type().elems.end(), [](const ir::Type& t) { return t.is_tensor(); });
}

bool is_candidate(const Forward& f, const Node& n) {
  return f.nodes.count(&n) && f.saved.count(&n) && !f.outputs.count(&n) && recomputable(n);
}

ir::Arg map_arg(const ir::Arg& a, const std::function<Node*(Node*)>& fn) {
  ir::Arg b = a;
  if (b.kind == ir::Arg::Kind::Node) b.node = fn(a.node);
  for (ir::Arg& e : b.list) e = map_arg(e, fn);
  return b;
}

int64_t numel_of(const ir::Type& t) {
  if (t.is_tensor()) return t.tensor.numel();
  int64_t n = 0;
  for (const auto& e : t.elems) n += numel_of(e);
  return n;
}

const ir::TensorMeta* arg_meta(const Node& n, size_t i) {
  if (i >= n.args().size() || n.args()[i].kind != ir::Arg::Kind::Node) return nullptr;
  const ir::Type& t = n.args()[i].node->type();
  return t.is_tensor() ? &t.tensor : nullptr;
}

int64_t bytes_of(const ir::Type& t) {
  if (t.is_tensor()) return t.tensor.nbytes();
  int64_t b = 0;
  for (const auto& e : t.elems) b += bytes_of(e);
  return b;
}

// Checkpoint-style sets, tried when adding groups one at a time stalls above the budget (recomputing
// one value of a block lowers nothing while its neighbours stay saved). A cut is a forward value that
// is the only large value (>= 1/16 of the largest activation) crossing its position in the forward:
// every later forward node reads, among large values, only it and what comes after it (the residual
// stream between blocks, every link of a chain). Keeping every k-th cut and recomputing every other
// large recomputable forward value replays each segment from its cut inside the backward, as
// torch.utils.checkpoint does per block. Small values (layer-norm statistics) are kept.
std::vector<std::set<std::string>> segment_sets(const ir::Graph& g, const Forward& f) {
  std::vector<const Node*> fwd;
  std::unordered_map<const Node*, size_t> pos;
  for (const auto& n : g.nodes())
    if (n->kind() == ir::NodeKind::Call && f.nodes.count(n.get())) {
      pos[n.get()] = fwd.size();
      fwd.push_back(n.get());
    }
  int64_t largest = 0;
  std::unordered_map<const Node*, size_t> last;  // an owner's last forward reader
  for (const Node* n : fwd) {
    if (!is_alias(*n)) largest = std::max(largest, bytes_of(n->type()));
    for (const Node* in : n->inputs()) {
      if (is_state_of_seeded_dropout(*in)) continue;  // the next dropout reads only the small state
      const Node* o = owner(in);
      if (pos.count(o)) last[o] = std::max(last[o], pos.at(n));
    }
  }
  // Values that no parameter reaches (an attention mask built from the input, position ids) are read by
  // every block and kept: they neither break a cut nor get recomputed.
  std::unordered_set<const Node*> from_params;
  for (const Node* n : fwd)
    for (const Node* in : n->inputs())
      if ((in->kind() == ir::NodeKind::Placeholder && in->role() == ir::InputRole::Parameter) || from_params.count(in)) {
        from_params.insert(n);
        break;
      }
  const int64_t small = largest / 16;
  auto large = [&](const Node* n) {
    return !is_alias(*n) && bytes_of(n->type()) >= small && small > 0 && from_params.count(n);
  };
  // crossing[i]: large owners produced at or before i and read by a forward node after i.
  std::vector<int64_t> delta(fwd.size() + 1, 0);
  for (const auto& [o, l] : last)
    if (large(o) && l > pos.at(o)) {
      ++delta[pos.at(o)];
      --delta[l];
    }
  std::vector<const Node*> cuts;
  int64_t crossing = 0;
  for (size_t i = 0; i < fwd.size(); ++i) {
    crossing += delta[i];
    const auto l = last.find(fwd[i]);
    if (large(fwd[i]) && crossing == 1 && l != last.end() && l->second > i) cuts.push_back(fwd[i]);
  }
  std::vector<std::set<std::string>> sets;
  for (size_t k = 1; k <= 4 && k <= std::max<size_t>(cuts.size(), 1); ++k) {
    std::unordered_set<const Node*> kept;
    for (size_t c = k - 1; c < cuts.size(); c += k) kept.insert(cuts[c]);
    std::set<std::string> names;
    for (const Node* n : fwd)
      if (large(n) && !kept.count(n) && !f.outputs.count(n) && recomputable(*n)) names.insert(n->name());
    if (!names.empty() && (sets.empty() || sets.back() != names)) sets.push_back(std::move(names));
  }
  return sets;
}

}  // namespace

int64_t estimated_flops(const Node& n) {
  if (n.kind() != ir::NodeKind::Call || is_alias(n)) return 0;
  const std::string& name = n.target().name;
  const int64_t out = numel_of(n.type());
  // Contractions: 2 * output elements * contracted length.
  const ir::TensorMeta* a = nullptr;
  if (name == "mm" || name == "bmm") a = arg_meta(n, 0);
  if (name == "addmm" || name == "baddbmm") a = arg_meta(n, 1);
  if (a && !a->sizes.empty()) return 2 * out * a->sizes.back();
  if (name == "convolution" || name == "_convolution") {
    const ir::TensorMeta* w = arg_meta(n, 1);
    if (w && !w->sizes.empty() && w->sizes[0] > 0) return 2 * out * (w->numel() / w->sizes[0]);
  }
  if (name.rfind("_scaled_dot_product", 0) == 0 || name == "scaled_dot_product_attention") {
    const ir::TensorMeta* q = arg_meta(n, 0);
    const ir::TensorMeta* k = arg_meta(n, 1);
    if (q && k && q->sizes.size() >= 2 && k->sizes.size() >= 2)
      return 4 * q->numel() * k->sizes[k->sizes.size() - 2];
  }
  // Everything else: about one operation per element read or written.
  int64_t in = 0;
  for (const Node* i : n.inputs()) in += numel_of(i->type());
  return out + in;
}

RematResult rematerialize(ir::Graph& g, const std::vector<std::string>& names) {
  const Forward f = find_forward(g);
  std::unordered_set<const Node*> chosen;
  RematResult r;
  for (const std::string& name : names) {
    const Node* n = g.find(name);
    TORCH_CHECK(n != nullptr, "rematerialize: no node %", name);
    TORCH_CHECK(f.nodes.count(n), "rematerialize: %", name, " is not in the forward (the loss does not depend on it)");
    TORCH_CHECK(recomputable(*n), "rematerialize: %", name, " (", n->target().str(),
                ") cannot be recomputed (a view, mutating, random without an explicit generator state, or not an "
                "aten/prims op)");
    TORCH_CHECK(!f.outputs.count(n), "rematerialize: %", name, " is a graph output");
    if (chosen.insert(n).second) r.recomputed.push_back(name);
  }
  // Every check passed: now edit. First, backward nodes that read a chosen value and otherwise only
  // forward values (the 3x^2 of gelu's backward, a detach) may sit in the forward part of the order,
  // where a scheduler put them because their inputs were live anyway. A clone goes just before its
  // first backward reader, so such a reader, and the backward nodes between it and the gradient that
  // read only it, sink to just before their first user; otherwise the clone would run in the forward
  // and free nothing. Sinking keeps topological order (each moves before its first user, users first).
  {
    // The gradient: backward nodes that depend on the loss (the seed reads it).
    const Node* loss = g.output()->args()[0].list[0].node;
    std::unordered_set<const Node*> gradient, sink;
    std::vector<Node*> sink_order;
    for (const auto& n : g.nodes()) {
      if (n->kind() != ir::NodeKind::Call || f.nodes.count(n.get())) continue;
      bool on_gradient = false, reads_chosen = false;
      for (const Node* in : n->inputs()) {
        if (in == loss || gradient.count(in)) on_gradient = true;
        if (in->kind() == ir::NodeKind::Call &&
            (sink.count(in) || (chosen.count(owner(in)) && f.nodes.count(owner(in)))))
          reads_chosen = true;
      }
      if (on_gradient) {
        gradient.insert(n.get());
        continue;
      }
      if (reads_chosen) {
        sink.insert(n.get());
        sink_order.push_back(n.get());
      }
    }
    for (auto it = sink_order.rbegin(); it != sink_order.rend(); ++it) {
      Node* u = *it;
      Node* first = nullptr;
      for (Node* user : u->users())
        if (user->kind() == ir::NodeKind::Call && (!first || user->index() < first->index())) first = user;
      if (first && first->index() > u->index() + 1) g.move_before(u, first);
    }
  }
  // Backward nodes in their current order (a snapshot: clones are inserted as we go).
  std::vector<Node*> backward;
  for (const auto& n : g.nodes())
    if (n->kind() == ir::NodeKind::Call && !f.nodes.count(n.get())) backward.push_back(n.get());
  std::unordered_map<const Node*, Node*> clone;
  std::function<Node*(Node*, Node*)> get = [&](Node* v, Node* before) -> Node* {
    // Forward values owned by a chosen node, and backward views of them (a detach the backward
    // takes of an activation): cloned at the first real reader, not where the view happened to run.
    if (v->kind() != ir::NodeKind::Call || !chosen.count(owner(v)) || !(f.nodes.count(v) || is_alias(*v))) return v;
    // A clone of a seeded dropout reads the generator state the forward handed the original (small, and
    // the original stays for its other readers): cloning the dropout that produced it would replay the
    // forward back to the first dropout.
    if (is_state_of_seeded_dropout(*v)) return v;
    auto it = clone.find(v);
    if (it != clone.end()) return it->second;
    const auto sub = [&](Node* in) { return get(in, before); };
    std::vector<ir::Arg> args;
    for (const ir::Arg& a : v->args()) args.push_back(map_arg(a, sub));
    ir::Kwargs kwargs;
    for (const auto& [k, a] : v->kwargs()) kwargs.emplace_back(k, map_arg(a, sub));
    Node* c = g.create_call(g.unique_name(v->name() + "_recomp"), v->target(), std::move(args), std::move(kwargs),
                            v->type(), before);
    c->set_module_path(v->module_path());
    clone[v] = c;
    ++r.clones;
    return c;
  };
  for (Node* u : backward) {
    if (is_alias(*u) && chosen.count(owner(u))) continue;  // cloned on demand instead
    for (Node* v : u->inputs()) {
      Node* c = get(v, u);
      if (c != v) g.replace_input_of(u, v, c);
    }
  }
  // The backward views replaced by clones now have no readers.
  for (auto it = backward.rbegin(); it != backward.rend(); ++it)
    if (is_alias(**it) && chosen.count(owner(*it)) && (*it)->users().empty()) g.erase(*it);
  g.index();
  return r;
}

BudgetResult rematerialize_for_budget(ir::Graph& g, int64_t budget, bool donate, bool prune_by_bound) {
  TORCH_CHECK(budget > 0, "rematerialize_for_budget: the budget must be positive, got ", budget, " bytes");
  BudgetResult res;
  res.budget = budget;
  for (const auto& n : g.nodes()) res.forward_flops += estimated_flops(*n);
  // The planned peak of recomputing `names`, or, when the liveness bound of that order (lb_sched:
  // persistent + escaping + the largest live sum, which no placement beats; plan_memory.h) already
  // reaches `at_least`, that bound: the caller only asks whether the peak falls below `at_least`, and
  // the answer is the same, without running the arena planners (most trials lower nothing).
  auto peak_of = [&](const std::set<std::string>& names, int64_t at_least = -1) {
    ++res.evaluations;
    auto c = g.clone();
    if (!names.empty()) rematerialize(*c, std::vector<std::string>(names.begin(), names.end()));
    if (prune_by_bound && at_least >= 0) {
      std::vector<const Node*> order;
      for (const auto& n : c->nodes())
        if (n->kind() == ir::NodeKind::Call) order.push_back(n.get());
      const int64_t bound = simulate_peak(*c, order, donate);
      if (bound >= at_least) {
        ++res.pruned;
        return bound;
      }
    }
    return plan_memory(*c, donate, /*with_lb_graph=*/false).peak_bytes();
  };
  res.peak_before = res.peak = res.min_peak = peak_of({});
  if (res.peak_before <= budget) {
    res.feasible = true;
    return res;
  }
  // Groups: a saved activation and the forward producers its clone alone would keep alive; and
  // the activation alone.
  const Forward f = find_forward(g);
  struct Group {
    std::set<std::string> names;
    int64_t bytes = 0, flops = 0;
  };
  std::vector<Group> groups;
  for (const auto& n : g.nodes()) {
    if (!is_candidate(f, *n)) continue;
    Group grp;
    grp.bytes = bytes_of(n->type());
    std::vector<const Node*> work{n.get()};
    while (!work.empty()) {
      const Node* v = work.back();
      work.pop_back();
      if (!grp.names.insert(v->name()).second) continue;
      grp.flops += estimated_flops(*v);
      for (const Node* in : v->inputs()) {
        const Node* o = owner(in);
        if (o->kind() == ir::NodeKind::Call && f.nodes.count(o) && !f.saved.count(o) && !f.outputs.count(o) &&
            recomputable(*o) && grp.names.size() < 8)
          work.push_back(o);
      }
    }
    if (grp.names.size() > 1) {  // the activation alone too: its input may be saved anyway
      Group alone;
      alone.bytes = grp.bytes;
      alone.names = {n->name()};
      alone.flops = estimated_flops(*n);
      groups.push_back(std::move(grp));
      groups.push_back(std::move(alone));
      continue;
    }
    groups.push_back(std::move(grp));
  }
  // Most bytes per FLOP first (cheap pointwise recomputation before matmuls); ties in graph order.
  std::stable_sort(groups.begin(), groups.end(), [](const Group& a, const Group& b) {
    return static_cast<double>(a.bytes) / static_cast<double>(std::max<int64_t>(a.flops, 1)) >
           static_cast<double>(b.bytes) / static_cast<double>(std::max<int64_t>(b.flops, 1));
  });
  // Each round tries groups in that order, up to kLookahead that lower the peak, and keeps the one
  // that lowers it most per added FLOP (a first-improvement rule let an expensive group win by a
  // few bytes of alignment). A group that lowered nothing twice is dropped.
  constexpr size_t kLookahead = 4;
  std::set<std::string> chosen;
  std::vector<int> fails(groups.size(), 0);
  while (res.peak > budget) {
    size_t best = groups.size(), helped = 0;
    int64_t best_peak = res.peak;
    double best_ratio = -1.0;
    std::set<std::string> best_set;
    for (size_t i = 0; i < groups.size() && helped < kLookahead; ++i) {
      const Group& grp = groups[i];
      if (fails[i] >= 2 || std::includes(chosen.begin(), chosen.end(), grp.names.begin(), grp.names.end())) continue;
      std::set<std::string> trial = chosen;
      trial.insert(grp.names.begin(), grp.names.end());
      const int64_t p = peak_of(trial, res.peak);
      if (p >= res.peak) {
        ++fails[i];
        continue;
      }
      ++helped;
      const double ratio = static_cast<double>(res.peak - p) / static_cast<double>(std::max<int64_t>(grp.flops, 1));
      // A group that meets the budget beats any that does not (the search stops there); among
      // those that do, the fewest FLOPs.
      const bool fits = p <= budget, best_fits = best_peak <= budget;
      const bool better = fits ? (!best_fits || grp.flops < groups[best].flops) : (!best_fits && ratio > best_ratio);
      if (best == groups.size() || better) {
        best = i;
        best_ratio = ratio;
        best_peak = p;
        best_set = std::move(trial);
      }
    }
    if (best == groups.size()) break;
    chosen = std::move(best_set);
    res.peak = best_peak;
  }
  if (res.peak > budget) {
    // Stalled above the budget: segment recomputation, fewest recomputed segments first.
    for (std::set<std::string>& names : segment_sets(g, f)) {
      const int64_t p = peak_of(names, res.peak);
      if (p < res.peak) {
        res.peak = p;
        chosen = std::move(names);
        if (p <= budget) break;
      }
    }
  }
  res.min_peak = res.peak;
  res.feasible = res.peak <= budget;
  if (!chosen.empty()) {
    auto r = rematerialize(g, std::vector<std::string>(chosen.begin(), chosen.end()));
    res.recomputed = r.recomputed;
    int64_t after = 0;
    for (const auto& n : g.nodes()) after += estimated_flops(*n);
    res.added_flops = after - res.forward_flops;
  }
  return res;
}

}  // namespace torch_ext::passes
