#include "reactive/engine.h"

#include "ir/printer.h"
#include "ir/verifier.h"
#include "passes/eliminate_dead_code.h"
#include "runtime/executor.h"

#include <ATen/core/Tensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <c10/util/Exception.h>

#include <algorithm>

namespace torch_ext::reactive {
namespace {

int64_t numel_of(const ir::Type& t) {
  if (t.kind == ir::Type::Kind::Tensor) return t.tensor.numel();
  int64_t n = 0;
  for (const auto& e : t.elems) n += numel_of(e);
  return n;
}

const ir::TensorMeta* arg_meta(const ir::Node& n, size_t i) {
  if (i >= n.args().size() || n.args()[i].kind != ir::Arg::Kind::Node) return nullptr;
  const ir::Type& t = n.args()[i].node->type();
  return t.kind == ir::Type::Kind::Tensor ? &t.tensor : nullptr;
}

bool values_equal(const c10::IValue& a, const c10::IValue& b) {
  if (a.isTensor() && b.isTensor()) {
    const at::Tensor& x = a.toTensor();
    const at::Tensor& y = b.toTensor();
    return x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type() && x.equal(y);
  }
  const bool seq_a = a.isTuple() || a.isList();
  const bool seq_b = b.isTuple() || b.isList();
  if (seq_a || seq_b) {
    if (!(seq_a && seq_b)) return false;
    const auto xs = a.isTuple() ? a.toTupleRef().elements().vec() : a.toListRef().vec();
    const auto ys = b.isTuple() ? b.toTupleRef().elements().vec() : b.toListRef().vec();
    if (xs.size() != ys.size()) return false;
    for (size_t i = 0; i < xs.size(); ++i)
      if (!values_equal(xs[i], ys[i])) return false;
    return true;
  }
  if (a.isTensor() || b.isTensor()) return false;
  if (a.isInt() || a.isDouble() || a.isBool() || a.isNone() || a.isString()) return a == b;
  return false;  // unknown kinds never count as unchanged
}

// The version counter of a tensor value, or -1 when it is not tracked (non-tensors, inference tensors).
int64_t version_of(const c10::IValue& v) {
  if (!v.isTensor()) return -1;
  const at::Tensor& t = v.toTensor();
  if (!t.defined() || t.is_inference()) return -1;
  return static_cast<int64_t>(t.unsafeGetTensorImpl()->version_counter().current_version());
}

// Every call node must reach the output: demand() evaluates the whole dirty set.
void check_no_dead_code(const ir::Graph& g, const std::string& what) {
  std::vector<bool> live(g.size(), false);
  const auto& nodes = g.nodes();
  for (size_t i = nodes.size(); i-- > 0;) {
    const ir::Node& n = *nodes[i];
    if (n.kind() == ir::NodeKind::Output) live[i] = true;
    if (!live[i]) {
      TORCH_CHECK(n.kind() != ir::NodeKind::Call, what, ": node %", n.name(), " (", n.target().str(),
                  ") does not reach an output; remove dead code first");
      continue;
    }
    for (ir::Node* in : n.inputs()) live[in->index()] = true;
  }
}

}  // namespace

double node_cost(const ir::Node& n) {
  const double out = static_cast<double>(std::max<int64_t>(numel_of(n.type()), 1));
  if (n.kind() != ir::NodeKind::Call || n.target().is_builtin()) return out;
  const std::string& op = n.target().name;
  if (op == "mm" || op == "bmm" || op == "matmul" || op == "linear") {
    if (const auto* a = arg_meta(n, 0); a && !a->sizes.empty()) return 2.0 * out * static_cast<double>(a->sizes.back());
  }
  if (op == "addmm" || op == "baddbmm") {
    if (const auto* a = arg_meta(n, 1); a && !a->sizes.empty()) return 2.0 * out * static_cast<double>(a->sizes.back());
  }
  if (op == "convolution" || op == "conv1d" || op == "conv2d" || op == "conv3d") {
    if (const auto* w = arg_meta(n, 1); w && w->sizes.size() > 1) {
      double k = 1;
      for (size_t d = 1; d < w->sizes.size(); ++d) k *= static_cast<double>(w->sizes[d]);
      return 2.0 * out * k;
    }
  }
  if (op.find("scaled_dot_product") != std::string::npos) {
    const auto* q = arg_meta(n, 0);
    const auto* k = arg_meta(n, 1);
    if (q && k && q->sizes.size() >= 2 && k->sizes.size() >= 2) {
      double bhl = 1;
      for (size_t d = 0; d + 1 < q->sizes.size(); ++d) bhl *= static_cast<double>(q->sizes[d]);
      return 4.0 * bhl * static_cast<double>(k->sizes[k->sizes.size() - 2]) * static_cast<double>(q->sizes.back());
    }
  }
  return out;
}

Engine::Engine(const ir::Graph& graph) : graph_(graph.clone()) {
  ir::verify(*graph_);
  // Side-effect-free nodes that reach no output (export's _assert_tensor_metadata for every .to(),
  // _assert_scalar, unused views) can never matter to a demand: drop them from the private copy.
  passes::eliminate_dead_code(*graph_);
  check_no_dead_code(*graph_, "reactive engine");
  for (const auto& n : graph_->nodes()) add_state(n.get());
  for (size_t id = 0; id < states_.size(); ++id) {
    if (!states_[id].countable) continue;
    bind(static_cast<int64_t>(id));
    const ir::Node& n = *states_[id].node;
    TORCH_CHECK(!states_[id].kernel->mutates(), "reactive engine: node %", n.name(), " (", n.target().str(),
                ") mutates its inputs; cached values need a functional graph "
                "(export, then ExportedProgram.run_decompositions())");
    dirty_.insert({n.index(), static_cast<int64_t>(id)});
  }
}

int64_t Engine::add_state(ir::Node* node) {
  NodeState st;
  st.node = node;
  st.countable = node->kind() == ir::NodeKind::Call;
  st.cost = st.countable ? node_cost(*node) : 0.0;
  st.valid = node->kind() != ir::NodeKind::Call;
  states_.push_back(std::move(st));
  values_.emplace_back();
  versions_.push_back(-1);
  const auto id = static_cast<int64_t>(states_.size()) - 1;
  ids_[node] = id;
  if (states_.back().countable) ++num_countable_;
  return id;
}

void Engine::bind(int64_t id) {
  states_[id].kernel = runtime::BoundKernel::bind(*states_[id].node, [this](const ir::Node* n) { return ids_.at(n); });
}

int64_t Engine::id_of(const std::string& name) const {
  const ir::Node* n = graph_->find(name);
  TORCH_CHECK(n != nullptr && n->kind() != ir::NodeKind::Output, "unknown node '", name, "'");
  return ids_.at(n);
}

void Engine::mark_invalid(int64_t id) {
  NodeState& st = states_[id];
  if (!st.countable || !st.valid || st.pinned) return;
  journal(id);
  st.valid = false;
  dirty_.insert({st.node->index(), id});
  ++stats_.invalidated;
}

void Engine::invalidate_users(int64_t seed) {
  std::vector<int64_t> work{seed};
  while (!work.empty()) {
    const int64_t v = work.back();
    work.pop_back();
    for (const ir::Node* user : states_[v].node->users()) {
      if (user->kind() == ir::NodeKind::Output) continue;
      const int64_t u = ids_.at(user);
      const NodeState& st = states_[u];
      if (!st.valid || st.pinned) continue;  // I3: an invalid node's cone is already invalid
      mark_invalid(u);
      work.push_back(u);
    }
  }
}

void Engine::save_baseline(int64_t id) {
  if (pinned_.empty() || overlay_.count(id)) return;
  overlay_.emplace(id, Baseline{values_[id], states_[id].changed_at, versions_[id]});
  if (txn_) txn_->overlay_added.push_back(id);
}

void Engine::store(int64_t id, c10::IValue value) {
  values_[id] = std::move(value);
  versions_[id] = version_of(values_[id]);
}

void Engine::journal(int64_t id) {
  if (!txn_ || txn_->journal.count(id)) return;
  const NodeState& st = states_[id];
  txn_->journal.emplace(id, JournalEntry{values_[id], st.changed_at, st.verified_at, versions_[id], st.valid, st.pinned});
}

void Engine::refuse_in_transaction(const char* what) const {
  TORCH_CHECK(!txn_, what, " is not allowed inside a sweep transaction; rollback() first");
}

void Engine::check_intact(int64_t id) {
  const int64_t recorded = versions_[id];
  if (recorded < 0) return;
  const int64_t now = version_of(values_[id]);
  if (now == recorded) return;
  NodeState& st = states_[id];
  const char* next = "";
  if (st.countable && !st.pinned) {
    // Recompute it (and, since its consumers may have read the written value, its cone); restore()
    // must not revive it either, so it is also structurally dirty.
    mark_invalid(id);
    st.verified_at = 0;
    structural_dirty_.insert(id);
    invalidate_users(id);
    next = "the engine marked it stale, so the next demand recomputes it";
  } else if (st.pinned) {
    next = "patch it again with a fresh tensor, or restore()";
  } else {
    next = "it is an input of the graph, so call run() again with fresh inputs";
  }
  TORCH_CHECK(false, "cached value of %", st.node->name(), " was modified in place after the engine handed it out ",
              "(tensor version ", now, ", stored at version ", recorded,
              "): a patch function, metric or other caller wrote into it. Return a new tensor instead ",
              "(e.g. x = x.clone() first); ", next);
}

void Engine::check_intact(const std::string& name) {
  const int64_t id = id_of(name);
  auto it = overlay_.find(id);
  if (it != overlay_.end() && it->second.version >= 0 && version_of(it->second.value) != it->second.version) {
    baseline_stale_.insert(id);  // restore() recomputes it instead of putting the written tensor back
    TORCH_CHECK(false, "baseline value of %", name, " was modified in place after the engine handed it out: ",
                "a patch function, metric or other caller wrote into it. Return a new tensor instead ",
                "(e.g. x = x.clone() first); restore() recomputes it");
  }
  check_intact(id);
}

const Engine::PatchPlan& Engine::plan_for(int64_t id) {
  auto it = plans_.find(id);
  if (it != plans_.end() && it->second.pins_version == pins_version_) return it->second;
  PatchPlan plan;
  plan.pins_version = pins_version_;
  // The cone that invalidate_users would mark: users reached without passing a pinned node.
  const std::set<int64_t> seen = downstream(id, /*stop_at_pins=*/true);
  plan.order.assign(seen.begin(), seen.end());
  std::sort(plan.order.begin(), plan.order.end(),
            [this](int64_t a, int64_t b) { return states_[a].node->index() < states_[b].node->index(); });
  std::unordered_map<int64_t, size_t> last_read;  // cone value -> position of its last reader
  std::set<int64_t> external;
  for (size_t i = 0; i < plan.order.size(); ++i)
    for (int64_t in : states_[plan.order[i]].kernel->input_slots()) {
      if (seen.count(in))
        last_read[in] = i;
      else if (in != id)
        external.insert(in);
    }
  std::set<int64_t> outputs;
  for (const ir::Arg& a : graph_->output()->args()[0].list)
    if (a.kind == ir::Arg::Kind::Node) outputs.insert(ids_.at(a.node));
  plan.release.resize(plan.order.size());
  for (const auto& [v, i] : last_read)
    if (!outputs.count(v)) plan.release[i].push_back(v);
  for (size_t i = 0; i < plan.order.size(); ++i)  // computed but never read: dead within the plan
    if (!last_read.count(plan.order[i]) && !outputs.count(plan.order[i])) plan.release[i].push_back(plan.order[i]);
  plan.external.assign(external.begin(), external.end());
  return plans_[id] = std::move(plan);
}

std::vector<c10::IValue> Engine::evaluate_patched(const std::string& name, c10::IValue value) {
  const int64_t id = id_of(name);
  TORCH_CHECK(has_run_, "evaluate_patched %", name, ": call run() first");
  TORCH_CHECK(dirty_.empty(), "evaluate_patched %", name, ": ", dirty_.size(),
              " nodes are stale; demand() first, so that only the patch's cone is evaluated");
  TORCH_CHECK(!txn_, "evaluate_patched %", name, ": a transaction is open");
  TORCH_CHECK(!cutoff_, "evaluate_patched %", name, ": not available with early cutoff on");
  TORCH_CHECK(!states_[id].pinned, "evaluate_patched %", name, ": the node is pinned by a standing patch; ",
              "use patch()/demand() with a transaction instead");
  check_value_type(*states_[id].node, value);
  const PatchPlan& plan = plan_for(id);
  for (int64_t in : plan.external) check_intact(in);  // I8: never compute from a written value
  at::AutoDispatchBelowAutograd no_autograd;
  // The cone's current (valid) values, put back at the end: the state afterwards is exactly the state before.
  std::vector<c10::IValue> saved;
  saved.reserve(plan.order.size());
  for (int64_t n : plan.order) saved.push_back(values_[n]);
  c10::IValue saved_site = std::move(values_[id]);
  values_[id] = std::move(value);
  auto put_back = [&]() {
    for (size_t i = 0; i < plan.order.size(); ++i) values_[plan.order[i]] = std::move(saved[i]);
    values_[id] = std::move(saved_site);
  };
  try {
    for (size_t i = 0; i < plan.order.size(); ++i) {
      const int64_t n = plan.order[i];
      NodeState& st = states_[n];
      try {
        values_[n] = st.kernel->invoke(values_, stack_);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, "while evaluating node %", st.node->name(), ": ",
                    dynamic_cast<const c10::Error*>(&e) ? static_cast<const c10::Error&>(e).what_without_backtrace()
                                                        : e.what());
      }
      ++st.evaluations;
      ++stats_.evaluations;
      stats_.cost += st.cost;
      stats_.row_evaluations += 1.0;
      for (int64_t r : plan.release[i]) values_[r] = c10::IValue();  // last use: free, as the executor does
    }
  } catch (...) {
    put_back();
    throw;
  }
  auto outs = runtime::output_values(graph_->output()->args()[0].list,
                                     [&](const ir::Node* n) -> const c10::IValue& { return values_[ids_.at(n)]; });
  put_back();
  return outs;
}

void Engine::begin_transaction() {
  TORCH_CHECK(has_run_, "begin_transaction: call run() first");
  TORCH_CHECK(!txn_, "begin_transaction: a transaction is already open (transactions do not nest)");
  Transaction t;
  t.pinned_before = pinned_;
  txn_.emplace(std::move(t));
  txn_structural_ = structural_dirty_;
  txn_baseline_stale_ = baseline_stale_;
}

void Engine::rollback() {
  TORCH_CHECK(txn_, "rollback: no transaction is open");
  Transaction t = std::move(*txn_);
  txn_.reset();
  std::vector<int64_t> written;  // entries whose saved value was written in place meanwhile (I8)
  for (auto& [id, e] : t.journal) {
    NodeState& st = states_[id];
    if (st.countable && !st.valid) dirty_.erase({st.node->index(), id});
    values_[id] = std::move(e.value);
    versions_[id] = e.version;
    st.changed_at = e.changed_at;
    st.verified_at = e.verified_at;
    st.valid = e.valid;
    st.pinned = e.pinned;
    if (st.countable && !st.valid) dirty_.insert({st.node->index(), id});
    if (st.valid && st.countable && !st.pinned && e.version >= 0 && version_of(values_[id]) != e.version)
      written.push_back(id);
  }
  if (pinned_ != t.pinned_before) ++pins_version_;
  pinned_ = std::move(t.pinned_before);
  for (int64_t id : t.overlay_added) overlay_.erase(id);
  std::set<int64_t> structural = std::move(txn_structural_);
  for (int64_t id : structural_dirty_)
    if (!states_[id].valid) structural.insert(id);  // found written in place during the transaction
  structural_dirty_ = std::move(structural);
  baseline_stale_ = std::move(txn_baseline_stale_);
  for (int64_t id : written) {
    mark_invalid(id);
    states_[id].verified_at = 0;
    structural_dirty_.insert(id);
    invalidate_users(id);
  }
}

void Engine::evaluate(int64_t id) {
  // Graph values are data, never autograd history: skip the autograd kernels.
  at::AutoDispatchBelowAutograd no_autograd;
  NodeState& st = states_[id];
  TORCH_INTERNAL_ASSERT(st.countable && !st.valid && !st.pinned);
  journal(id);
  try {
    for (int64_t in : st.kernel->input_slots()) check_intact(in);  // I8: never compute from a written value
  } catch (...) {
    dirty_.insert({st.node->index(), id});  // still invalid: keep I2
    throw;
  }
  // A graft changed this node's inputs: its pre-graft value is no baseline; if a patch is active,
  // restore() must recompute it.
  if (!structural_dirty_.empty() && structural_dirty_.erase(id) && !pinned_.empty()) baseline_stale_.insert(id);
  if (cutoff_ && !values_[id].isNone()) {
    bool inputs_changed = false;
    for (int64_t in : st.kernel->input_slots())
      if (states_[in].changed_at > st.verified_at) inputs_changed = true;
    if (!inputs_changed) {
      st.valid = true;
      st.verified_at = revision_;
      ++stats_.cutoffs;
      return;
    }
  }
  c10::IValue out;
  try {
    out = st.kernel->invoke(values_, stack_);
  } catch (const std::exception& e) {
    dirty_.insert({st.node->index(), id});  // still invalid: keep I2
    TORCH_CHECK(false, "while evaluating node %", st.node->name(), ": ",
                dynamic_cast<const c10::Error*>(&e) ? static_cast<const c10::Error&>(e).what_without_backtrace()
                                                    : e.what());
  }
  ++st.evaluations;
  ++stats_.evaluations;
  stats_.cost += st.cost;
  stats_.row_evaluations += 1.0;
  save_baseline(id);
  const bool unchanged = cutoff_ && values_equal(out, values_[id]);
  store(id, std::move(out));
  st.valid = true;
  st.verified_at = revision_;
  if (!unchanged) st.changed_at = revision_;
}

void Engine::evaluate_set(std::vector<int64_t> ids) {
  std::sort(ids.begin(), ids.end(),
            [this](int64_t a, int64_t b) { return states_[a].node->index() < states_[b].node->index(); });
  for (int64_t id : ids) {
    dirty_.erase({states_[id].node->index(), id});
    evaluate(id);
  }
}

void Engine::rekey_dirty() {
  std::set<std::pair<int64_t, int64_t>> rekeyed;
  for (const auto& entry : dirty_) rekeyed.insert({states_[entry.second].node->index(), entry.second});
  dirty_.swap(rekeyed);
}

void Engine::run(std::vector<c10::IValue> inputs) {
  const auto placeholders = graph_->placeholders();
  refuse_in_transaction("run");
  TORCH_CHECK(inputs.size() == placeholders.size(), "run: expected ", placeholders.size(), " inputs, got ",
              inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) runtime::check_input(*placeholders[i], inputs[i], i);
  for (int64_t id : pinned_) states_[id].pinned = false;
  pinned_.clear();
  ++pins_version_;
  overlay_.clear();
  baseline_stale_.clear();
  structural_dirty_.clear();
  ++revision_;
  for (size_t i = 0; i < inputs.size(); ++i) {
    NodeState& st = states_[ids_.at(placeholders[i])];
    store(ids_.at(placeholders[i]), std::move(inputs[i]));
    st.changed_at = st.verified_at = revision_;
  }
  for (size_t id = 0; id < states_.size(); ++id) {
    mark_invalid(static_cast<int64_t>(id));
    states_[id].verified_at = 0;  // a full evaluation: early cutoff must not skip anything
  }
  has_run_ = true;
  try {
    demand();
  } catch (...) {
    has_run_ = false;
    throw;
  }
}

std::vector<c10::IValue> Engine::demand() {
  TORCH_CHECK(has_run_, "demand: the engine has no values yet; call run(inputs) first");
  while (!dirty_.empty()) {
    const int64_t id = dirty_.begin()->second;
    dirty_.erase(dirty_.begin());
    evaluate(id);
  }
  for (const ir::Arg& a : graph_->output()->args()[0].list)
    if (a.kind == ir::Arg::Kind::Node) check_intact(ids_.at(a.node));
  return runtime::output_values(graph_->output()->args()[0].list,
                                [&](const ir::Node* n) -> const c10::IValue& { return values_[ids_.at(n)]; });
}

c10::IValue Engine::value(const std::string& name) {
  const int64_t target = id_of(name);
  TORCH_CHECK(has_run_, "value %", name, ": the engine has no values yet; call run(inputs) first");
  std::vector<int64_t> needed;
  std::vector<int64_t> work{target};
  std::set<int64_t> seen{target};
  while (!work.empty()) {
    const int64_t v = work.back();
    work.pop_back();
    const NodeState& st = states_[v];
    if (st.valid) continue;  // I3: a valid node's ancestors are valid
    needed.push_back(v);
    for (int64_t in : st.kernel->input_slots())
      if (seen.insert(in).second) work.push_back(in);
  }
  evaluate_set(std::move(needed));
  check_intact(target);
  return values_[target];
}

c10::IValue Engine::baseline(const std::string& name) {
  const int64_t id = id_of(name);
  TORCH_CHECK(has_run_, "baseline %", name, ": the engine has no values yet; call run(inputs) first");
  auto it = overlay_.find(id);
  if (it != overlay_.end() && !baseline_stale_.count(id)) {
    check_intact(name);
    return it->second.value;
  }
  TORCH_CHECK(pinned_.empty() || (!baseline_stale_.count(id) && states_[id].valid),
              "baseline of %", name, " is not cached while patches are active; restore() first");
  return value(name);
}

void Engine::check_value_type(const ir::Node& node, const c10::IValue& v) const {
  const ir::Type& t = node.type();
  TORCH_CHECK(t.kind == ir::Type::Kind::Tensor, "patch %", node.name(), ": only tensor-valued nodes can be patched (",
              "node type ", ir::print_type(t), ")");
  TORCH_CHECK(v.isTensor(), "patch %", node.name(), ": expected a tensor, got ", v.tagKind());
  const at::Tensor& x = v.toTensor();
  TORCH_CHECK(x.scalar_type() == t.tensor.dtype, "patch %", node.name(), ": expected dtype ",
              ir::dtype_torch_name(t.tensor.dtype), ", got ", x.scalar_type());
  TORCH_CHECK(x.sizes() == c10::IntArrayRef(t.tensor.sizes), "patch %", node.name(), ": expected shape ",
              c10::IntArrayRef(t.tensor.sizes), ", got ", x.sizes());
  TORCH_CHECK(x.device() == t.tensor.device, "patch %", node.name(), ": expected device ", t.tensor.device,
              ", got ", x.device());
}

void Engine::patch(const std::string& name, c10::IValue value) {
  const int64_t id = id_of(name);
  NodeState& st = states_[id];
  check_value_type(*st.node, value);
  TORCH_CHECK(has_run_, "patch %", name, ": call run() first, so there is a baseline to patch");
  if (st.valid) check_intact(id);  // the baseline saved below must be the computed value
  journal(id);
  if (!st.pinned) {
    pinned_.push_back(id);
    st.pinned = true;
    ++pins_version_;
  }
  save_baseline(id);
  if (!st.valid) {
    dirty_.erase({st.node->index(), id});
    st.valid = true;
  }
  store(id, std::move(value));
  st.changed_at = st.verified_at = ++revision_;
  invalidate_users(id);
}

void Engine::restore() {
  refuse_in_transaction("restore");
  if (pinned_.empty() && overlay_.empty()) return;
  ++pins_version_;
  ++revision_;
  for (int64_t id : pinned_) states_[id].pinned = false;
  std::vector<int64_t> written;  // baselines written in place since they were saved (I8): recompute
  for (auto& entry : overlay_) {
    NodeState& st = states_[entry.first];
    Baseline& b = entry.second;
    if (b.version >= 0 && version_of(b.value) != b.version) written.push_back(entry.first);
    values_[entry.first] = std::move(b.value);
    versions_[entry.first] = b.version;
    if (!st.valid) dirty_.erase({st.node->index(), entry.first});
    st.valid = true;
    st.changed_at = b.changed_at;  // the baseline's revision: consumers stay consistent (I4)
    st.verified_at = revision_;
    ++stats_.restored;
  }
  // Invalid nodes that were never recomputed still hold their baseline value.
  for (auto it = dirty_.begin(); it != dirty_.end();) {
    const int64_t id = it->second;
    if (structural_dirty_.count(id)) {
      ++it;
      continue;
    }
    NodeState& st = states_[id];
    st.valid = true;
    st.verified_at = revision_;
    ++stats_.restored;
    it = dirty_.erase(it);
  }
  overlay_.clear();
  pinned_.clear();
  // Baselines a graft displaced (or never computed) must be recomputed.
  std::set<int64_t> stale;
  stale.swap(baseline_stale_);
  stale.insert(structural_dirty_.begin(), structural_dirty_.end());
  stale.insert(written.begin(), written.end());
  for (int64_t id : stale) {
    mark_invalid(id);
    states_[id].verified_at = 0;  // its cached value was computed under a patch: recompute, no cutoff
    if (!states_[id].valid) structural_dirty_.insert(id);
  }
  for (int64_t id : stale) invalidate_users(id);
}

void Engine::restore(const std::string& name) {
  refuse_in_transaction("restore");
  const int64_t id = id_of(name);
  NodeState& st = states_[id];
  TORCH_CHECK(st.pinned, "restore %", name, ": node is not patched");
  if (pinned_.size() == 1) {
    restore();
    return;
  }
  // Other patches stay active: this node's inputs may differ from baseline, so recompute D(node).
  st.pinned = false;
  ++pins_version_;
  pinned_.erase(std::find(pinned_.begin(), pinned_.end(), id));
  ++revision_;
  if (st.countable) {
    mark_invalid(id);
    st.verified_at = 0;  // its inputs may differ from when it was pinned: recompute, no cutoff
  } else {
    values_[id] = overlay_.at(id).value;
    versions_[id] = overlay_.at(id).version;
    st.changed_at = st.verified_at = revision_;
  }
  invalidate_users(id);
}

void Engine::end_batch() {
  TORCH_CHECK(batch_depth_ > 0, "end_batch without begin_batch");
  --batch_depth_;
}

std::vector<std::string> Engine::graft(const std::string& src_name, const std::string& dst_name,
                                       const ir::Graph& given_block, std::vector<c10::IValue> block_params) {
  // Export leaves side-effect-free dead nodes (_assert_tensor_metadata for a .to()) in a block: drop them
  // first, so that a block of the wrong type is refused for its type, not for dead code.
  const std::unique_ptr<ir::Graph> block_copy = given_block.clone();
  passes::eliminate_dead_code(*block_copy);
  const ir::Graph& block = *block_copy;
  // ---- validate everything first: a refused graft changes nothing.
  refuse_in_transaction("graft");
  const int64_t src = id_of(src_name);
  ir::Node* src_node = states_[src].node;
  TORCH_CHECK(src_node->type().kind == ir::Type::Kind::Tensor, "graft: source %", src_name,
              " must be tensor-valued, got ", ir::print_type(src_node->type()));
  std::vector<ir::Node*> consumers;
  if (!dst_name.empty()) {
    ir::Node* dst_node = graph_->find(dst_name);
    TORCH_CHECK(dst_node != nullptr && dst_node->kind() == ir::NodeKind::Call, "graft: unknown node '", dst_name,
                "'");
    // dst upstream of src (or src itself) would close a cycle through the block.
    std::vector<const ir::Node*> work{src_node};
    std::set<const ir::Node*> seen{src_node};
    while (!work.empty()) {
      const ir::Node* v = work.back();
      work.pop_back();
      TORCH_CHECK(v != dst_node, "graft %", src_name, " -> %", dst_name, ": would create a cycle (%", dst_name,
                  " is upstream of %", src_name, ")");
      for (const ir::Node* in : v->inputs())
        if (seen.insert(in).second) work.push_back(in);
    }
    const auto& users = src_node->users();
    TORCH_CHECK(std::find(users.begin(), users.end(), dst_node) != users.end(), "graft: no edge %", src_name,
                " -> %", dst_name, " (%", dst_name, " does not read %", src_name, ")");
    consumers.push_back(dst_node);
  } else {
    consumers = src_node->users();
    TORCH_CHECK(!consumers.empty(), "graft: %", src_name, " has no consumers to reroute");
  }
  ir::verify(block);
  check_no_dead_code(block, "graft block");
  const auto block_inputs = block.placeholders();
  const ir::Node* block_in = nullptr;
  std::vector<const ir::Node*> block_param_nodes;
  for (const ir::Node* p : block_inputs) {
    if (p->role() == ir::InputRole::UserInput) {
      TORCH_CHECK(block_in == nullptr, "graft: the block must have exactly one user input, found %",
                  block_in->name(), " and %", p->name());
      block_in = p;
    } else {
      block_param_nodes.push_back(p);
    }
  }
  TORCH_CHECK(block_in != nullptr, "graft: the block has no user input");
  TORCH_CHECK(block_in->type() == src_node->type(), "graft: block input type ", ir::print_type(block_in->type()),
              " differs from %", src_name, " : ", ir::print_type(src_node->type()));
  const auto& block_outs = block.output()->args()[0].list;
  TORCH_CHECK(block_outs.size() == 1 && block_outs[0].kind == ir::Arg::Kind::Node &&
                  block_outs[0].node->kind() == ir::NodeKind::Call,
              "graft: the block must return exactly one computed value");
  TORCH_CHECK(block_outs[0].node->type() == src_node->type(), "graft: block output type ",
              ir::print_type(block_outs[0].node->type()), " differs from %", src_name, " : ",
              ir::print_type(src_node->type()));
  TORCH_CHECK(block_params.size() == block_param_nodes.size(), "graft: the block has ", block_param_nodes.size(),
              " parameter inputs, got ", block_params.size(), " values");
  for (size_t i = 0; i < block_params.size(); ++i) runtime::check_input(*block_param_nodes[i], block_params[i], i);
  for (const auto& n : block.nodes()) {
    if (n->kind() != ir::NodeKind::Call) continue;
    auto k = runtime::BoundKernel::bind(*n);
    TORCH_CHECK(!k.mutates(), "graft: block node %", n->name(), " (", n->target().str(), ") mutates its inputs");
  }

  // ---- splice.
  ++revision_;
  plans_.clear();  // cones change
  row_plans_.clear();
  seq_.reset();
  const std::string prefix = "graft" + std::to_string(graft_counter_++) + "_";
  ir::ValueMap map;
  map[block_in] = src_node;
  for (size_t i = 0; i < block_param_nodes.size(); ++i) {
    const ir::Node* p = block_param_nodes[i];
    ir::Node* copy = graph_->create_placeholder(graph_->unique_name(prefix + p->name()), ir::InputRole::Constant,
                                                p->type(), p->state_name());
    const int64_t id = add_state(copy);
    store(id, std::move(block_params[i]));
    states_[id].changed_at = states_[id].verified_at = revision_;
    map[p] = copy;
  }
  ir::Node* insert_before = consumers.front();
  for (ir::Node* c : consumers)
    if (c->index() < insert_before->index()) insert_before = c;
  std::vector<std::string> names;
  std::vector<int64_t> fresh;
  for (const auto& n : block.nodes()) {
    if (n->kind() != ir::NodeKind::Call) continue;
    ir::Node* copy = graph_->copy_call(*n, map, graph_->unique_name(prefix + n->name()), insert_before);
    fresh.push_back(add_state(copy));
    names.push_back(copy->name());
  }
  ir::Node* block_out = map.at(block_outs[0].node);
  for (ir::Node* c : consumers) graph_->replace_input_of(c, src_node, block_out);
  rekey_dirty();  // insertions shifted topological indices

  for (int64_t id : fresh) {
    bind(id);
    dirty_.insert({states_[id].node->index(), id});
    ++stats_.invalidated;
    structural_dirty_.insert(id);
    if (!pinned_.empty()) baseline_stale_.insert(id);  // its first value is computed under the patch
  }
  for (ir::Node* c : consumers) {
    if (c->kind() != ir::NodeKind::Call) continue;
    const int64_t w = ids_.at(c);
    bind(w);
    mark_invalid(w);
    states_[w].verified_at = 0;  // an input was rerouted: recompute, no cutoff
    invalidate_users(w);
    // Every node of D(w), pinned or already invalid included, now has a new baseline.
    for (int64_t d : structural_cone(w)) {
      if (!states_[d].valid) structural_dirty_.insert(d);
      if (!pinned_.empty()) baseline_stale_.insert(d);
    }
  }
  return names;
}

std::vector<int64_t> Engine::structural_cone(int64_t seed) const {
  std::vector<int64_t> out{seed};
  std::set<int64_t> seen{seed};
  for (size_t i = 0; i < out.size(); ++i) {
    for (const ir::Node* user : states_[out[i]].node->users()) {
      if (user->kind() == ir::NodeKind::Output) continue;
      const int64_t u = ids_.at(user);
      if (seen.insert(u).second) out.push_back(u);
    }
  }
  return out;
}

std::set<int64_t> Engine::downstream(int64_t seed, bool stop_at_pins) const {
  std::vector<int64_t> work{seed};
  std::set<int64_t> seen;
  while (!work.empty()) {
    const int64_t v = work.back();
    work.pop_back();
    for (const ir::Node* user : states_[v].node->users()) {
      if (user->kind() == ir::NodeKind::Output) continue;
      const int64_t u = ids_.at(user);
      if (stop_at_pins && (states_[u].pinned || !states_[u].countable)) continue;
      if (seen.insert(u).second) work.push_back(u);
    }
  }
  return seen;
}

std::vector<std::string> Engine::cone(const std::string& name) const {
  const std::set<int64_t> seen = downstream(id_of(name), /*stop_at_pins=*/false);
  std::vector<const ir::Node*> nodes;
  for (int64_t id : seen) nodes.push_back(states_[id].node);
  std::sort(nodes.begin(), nodes.end(), [](const ir::Node* a, const ir::Node* b) { return a->index() < b->index(); });
  std::vector<std::string> out;
  for (const ir::Node* n : nodes) out.push_back(n->name());
  return out;
}

double Engine::cone_cost(const std::string& name) const {
  double total = 0.0;
  for (int64_t id : downstream(id_of(name), /*stop_at_pins=*/false)) total += states_[id].cost;
  return total;
}

bool Engine::is_valid(const std::string& name) const { return states_[id_of(name)].valid; }

std::vector<std::string> Engine::pinned() const {
  std::vector<std::string> out;
  for (int64_t id : pinned_) out.push_back(states_[id].node->name());
  return out;
}

void Engine::reset_stats() {
  stats_ = Stats{};
  for (auto& st : states_) st.evaluations = 0;
}

void Engine::check_invariants() const {
  int64_t evaluations = 0;
  size_t dirty_count = 0;
  size_t pinned_count = 0;
  for (size_t id = 0; id < states_.size(); ++id) {
    const NodeState& st = states_[id];
    const ir::Node& n = *st.node;
    const std::string where = "invariant violated at %" + n.name() + ": ";
    TORCH_CHECK(ids_.at(&n) == static_cast<int64_t>(id), where, "id map out of sync");
    for (const ir::Node* in : n.inputs())
      TORCH_CHECK(in->index() < n.index(), "I1 ", where, "input %", in->name(), " comes later");
    const bool in_dirty = dirty_.count({n.index(), static_cast<int64_t>(id)}) > 0;
    TORCH_CHECK(in_dirty == (st.countable && !st.valid), "I2 ", where, "valid=", st.valid, " but in_dirty=", in_dirty);
    dirty_count += in_dirty;
    if (!st.countable) TORCH_CHECK(st.valid, "I4 ", where, "placeholders are always valid");
    if (st.pinned) {
      ++pinned_count;
      TORCH_CHECK(st.valid, "I4 ", where, "pinned nodes are valid");
    }
    if (!st.valid) {
      for (const ir::Node* user : n.users()) {
        if (user->kind() == ir::NodeKind::Output) continue;
        const NodeState& us = states_[ids_.at(user)];
        TORCH_CHECK(!us.valid || us.pinned, "I3 ", where, "invalid, but its user %", user->name(), " is valid");
      }
    } else if (has_run_) {
      TORCH_CHECK(!values_[id].isNone() || n.type().kind == ir::Type::Kind::None, "I5 ", where, "valid without value");
      TORCH_CHECK(versions_[id] < 0 || version_of(values_[id]) == versions_[id], "I8 ", where,
                  "cached tensor was modified in place (version ", version_of(values_[id]), ", stored at ",
                  versions_[id], ")");
      if (st.countable && !st.pinned)
        for (int64_t in : st.kernel->input_slots())
          TORCH_CHECK(st.verified_at >= states_[in].changed_at, "I4 ", where, "verified at ", st.verified_at,
                      " but input %", states_[in].node->name(), " changed at ", states_[in].changed_at);
    }
    evaluations += st.evaluations;
  }
  for (int64_t id : structural_dirty_)
    TORCH_CHECK(!states_[id].valid || states_[id].pinned, "structural-dirty node %", states_[id].node->name(),
                " is valid");
  TORCH_CHECK(dirty_count == dirty_.size(), "I2 dirty set holds stale entries: ", dirty_.size(), " vs ", dirty_count);
  TORCH_CHECK(pinned_count == pinned_.size(), "pinned list out of sync");
  TORCH_CHECK(!pinned_.empty() || overlay_.empty(), "I6 overlay is non-empty with no patch active");
  for (const auto& [id, b] : overlay_)
    TORCH_CHECK(baseline_stale_.count(id) || b.version < 0 || version_of(b.value) == b.version,
                "I8 invariant violated at %", states_[id].node->name(), ": overlay baseline was modified in place");
  TORCH_CHECK(evaluations == stats_.evaluations, "I7 ledger drift: per-node sum ", evaluations, " vs ",
              stats_.evaluations);
}

}  // namespace torch_ext::reactive
