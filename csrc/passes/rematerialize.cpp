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
  // Every check passed: now edit. Backward nodes in their current order (a snapshot: clones are
  // inserted as we go).
  std::vector<Node*> backward;
  for (const auto& n : g.nodes())
    if (n->kind() == ir::NodeKind::Call && !f.nodes.count(n.get())) backward.push_back(n.get());
  std::unordered_map<const Node*, Node*> clone;
  std::function<Node*(Node*, Node*)> get = [&](Node* v, Node* before) -> Node* {
    // Forward values owned by a chosen node, and backward views of them (a detach the backward
    // takes of an activation): cloned at the first real reader, not where the view happened to run.
    if (v->kind() != ir::NodeKind::Call || !chosen.count(owner(v)) || !(f.nodes.count(v) || is_alias(*v))) return v;
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

BudgetResult rematerialize_for_budget(ir::Graph& g, int64_t budget, bool donate) {
  TORCH_CHECK(budget > 0, "rematerialize_for_budget: the budget must be positive, got ", budget, " bytes");
  BudgetResult res;
  res.budget = budget;
  for (const auto& n : g.nodes()) res.forward_flops += estimated_flops(*n);
  auto peak_of = [&](const std::set<std::string>& names) {
    ++res.evaluations;
    auto c = g.clone();
    if (!names.empty()) rematerialize(*c, std::vector<std::string>(names.begin(), names.end()));
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
      const int64_t p = peak_of(trial);
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
